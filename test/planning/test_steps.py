"""The step boundary (planning/steps.py): each plan step as its object closes in the stream."""

from __future__ import annotations

import pytest

from flash_planner.engine.engine import Engine
from flash_planner.planning.parse import PlanError
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog
from flash_planner.planning.steps import StepStream

STEPS = [{"skill": "navigate_to", "args": {"target": 'the "red} [cup\\'}},
         {"skill": "say", "args": {"text": "{\"plan\": [{}]}"}},
         {"skill": "wait", "args": {"seconds": 5}}]
TEXT = ('<think>\nA plan {"plan": [{"skill": "x"}]} in thought.\n</think>\n\n'
        '{"plan": [{"skill": "navigate_to", "args": {"target": "the \\"red} [cup\\\\"}}, '
        '{"skill": "say", "args": {"text": "{\\"plan\\": [{}]}"}}, '
        '{"skill": "wait", "args": {"seconds": 5}}]}')


@pytest.fixture(scope="module")
def catalog():
    return SkillCatalog.from_yaml(default_skills_path())


def _closing_points(text: str, catalog, cut: int) -> list[tuple[int, dict]]:
    stream, got = StepStream(catalog), []
    for at in range(0, len(text), cut):
        got += [(at + cut, step) for step in stream.feed(text[at:at + cut])]
    return got


@pytest.mark.parametrize("cut", [1, 2, 5, 17, 10_000])
def test_each_step_is_found_as_its_object_closes_wherever_the_text_is_cut(catalog, cut):
    got = _closing_points(TEXT, catalog, cut)
    assert [step for _, step in got] == STEPS
    if cut == 1:      # the very character that closes each step object
        ends = [i + 1 for i, ch in enumerate(TEXT) if ch == "}"]
        assert all(TEXT[at - 1] == "}" and at in ends for at, _ in got)
        assert TEXT[got[0][0]:].startswith(", {\"skill\": \"say\"")


def test_steps_close_at_their_token_in_the_real_qwen_vocabulary(catalog, qwen_tok):
    """Token by token through the engine's incremental detokenizer, as the service streams:
    multi-byte characters cut across tokens and Qwen's think markers included."""
    from flash_planner.engine.generate import TextStream

    say = {"skill": "say", "args": {"text": "杯子 🤖 done"}}
    text = TEXT[:-2] + ', {"skill": "say", "args": {"text": "杯子 🤖 done"}}]}'
    ids = qwen_tok.encode(text, add_special_tokens=False)
    assert qwen_tok.convert_tokens_to_ids("</think>") in ids
    stream, published, found = StepStream(catalog), [], []
    text_stream = TextStream(qwen_tok, published)
    for at, token in enumerate(ids):
        published.append(token)
        found += [(at, step) for step in stream.feed(text_stream.delta(at == len(ids) - 1))]
    assert [step for _, step in found] == STEPS + [say]
    assert qwen_tok.decode(ids) == text
    # each step is found at the token holding its closing brace (Qwen merges "}}," into
    # one token), never later
    closes = [end for end, _ in _closing_points(text, catalog, 1)]
    for (at, _), end in zip(found, closes, strict=True):
        assert len(qwen_tok.decode(ids[:at])) < end <= len(qwen_tok.decode(ids[:at + 1]))


def test_no_thinking_a_refusal_and_an_invalid_step(catalog):
    plain = TEXT[TEXT.index("\n\n{") + 2:]
    assert [s for _, s in _closing_points(plain, catalog, 3)] == STEPS
    assert _closing_points('{"refusal": "no {skill} for that"}', catalog, 4) == []
    stream = StepStream(catalog)
    assert stream.feed('{"plan": [{"skill": "pick", "args": {"object": "cup"}}, ') != []
    with pytest.raises(PlanError, match="step 2: unknown skill 'fly'"):
        stream.feed('{"skill": "fly", "args": {}}]}')


def test_the_service_streams_each_validated_step_before_the_result(catalog):
    engine = Engine.load(ModelPreset.load("demo").engine_config(device="cpu", dtype="fp32"))
    service = PlannerService(engine, catalog, PlannerConfig(refusal_hint=False))
    service.start()
    try:
        for task in ("bring the red cup from the kitchen table to the sink",
                               "open the fridge, take the milk and say done"):
            events = []
            result = service.plan(PlanRequest(task), on_feedback=events.append,
                                  timeout=300)
            assert result.success
            streamed = [pair for e in events for pair in e.steps]
            assert streamed == list(enumerate(result.plan))
            # the first step closes before the text ends: it is sent while decoding goes on
            first = next(i for i, e in enumerate(events) if e.steps)
            assert first < len(events) - 1
            t = result.telemetry
            assert 0 < t["first_step_ms"] <= t["total_ms"]
    finally:
        service.stop()
