"""The decode loop's stop rules, streaming, cancellation and prompt handling."""

from __future__ import annotations

import pytest

from flash_planner.engine.generate import CancelToken, GenerationSettings, generate


@pytest.fixture(scope="module")
def engine(hybrid_dir, make_engine):
    return make_engine(hybrid_dir)


@pytest.fixture(scope="module")
def free_run(engine):
    """32 greedy tokens from a fixed prompt, ignoring EOS: the reference continuation."""
    prompt = engine.tokenizer.encode("navigate to the charging dock", add_special_tokens=False)
    return prompt, generate(engine, prompt, GenerationSettings(32, ignore_eos=True)).token_ids


def test_eos_stops_and_is_published_last(engine, free_run):
    prompt, tokens = free_run
    eos_at = 5
    engine.model_config = engine.model_config.__class__(
        **{**engine.model_config.__dict__, "eos_token_ids": (tokens[eos_at],)})
    try:
        result = generate(engine, prompt, GenerationSettings(32))
    finally:
        engine.model_config = engine.checkpoint.config
    first = tokens.index(tokens[eos_at])
    assert result.token_ids == tokens[:first + 1]
    assert result.finish_reason == "eos"


def test_max_new_tokens(engine, free_run):
    prompt, tokens = free_run
    result = generate(engine, prompt, GenerationSettings(7, ignore_eos=True))
    assert result.token_ids == tokens[:7]
    assert result.finish_reason == "length"
    assert result.stats.new_tokens == 7


def test_stop_string_publishes_up_to_the_completing_token(engine, free_run):
    prompt, tokens = free_run
    tok = engine.tokenizer
    target = tok.decode(tokens[:12], skip_special_tokens=True)
    stop = target[-3:] if len(target.strip()) >= 3 else target
    result = generate(engine, prompt, GenerationSettings(32, ignore_eos=True,
                                                         stop_strings=(stop,)))
    assert result.finish_reason == "stop"
    assert stop in tok.decode(result.token_ids, skip_special_tokens=True)
    assert stop not in tok.decode(result.token_ids[:-1], skip_special_tokens=True)
    assert result.token_ids == tokens[:len(result.token_ids)]


def test_streaming_deltas_add_up_to_the_text(engine, free_run):
    prompt, tokens = free_run
    seen_ids, deltas = [], []
    result = generate(engine, prompt, GenerationSettings(20, ignore_eos=True),
                      on_token=lambda ids, delta: (seen_ids.extend(ids), deltas.append(delta)))
    assert seen_ids == result.token_ids == tokens[:20]
    assert "".join(deltas) == result.text


def test_cancel_between_steps_publishes_what_was_decoded(engine, free_run):
    prompt, tokens = free_run
    cancel = CancelToken()
    seen = []

    def on_token(ids, _):
        seen.extend(ids)
        if len(seen) == 4:
            cancel.cancel()

    result = generate(engine, prompt, GenerationSettings(32, ignore_eos=True), on_token, cancel)
    assert result.finish_reason == "cancelled"
    assert result.token_ids == tokens[:4]
    # the state holds the prompt and all published tokens but the last (not yet run)
    assert engine.state.length == len(prompt) + 3


def test_deadline(engine, free_run):
    prompt, _ = free_run
    result = generate(engine, prompt, GenerationSettings(400, ignore_eos=True,
                                                         deadline_s=1e-6))
    assert result.finish_reason == "deadline"
    assert 1 <= len(result.token_ids) < 400


def test_chat_messages_use_the_chat_template(engine):
    messages = [{"role": "user", "content": "pick up the cup"}]
    rendered = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=False)
    ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
    a = generate(engine, messages, GenerationSettings(6, ignore_eos=True))
    b = generate(engine, ids, GenerationSettings(6, ignore_eos=True))
    assert a.token_ids == b.token_ids
    assert a.stats.prompt_tokens == len(ids)


@pytest.mark.parametrize("bad,match", [
    ([], "prompt is empty"),
    ([1, 99999], "outside the vocabulary"),
])
def test_bad_prompts(engine, bad, match):
    with pytest.raises(ValueError, match=match):
        generate(engine, bad, GenerationSettings(4))


@pytest.mark.parametrize("kwargs,match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"deadline_s": -1.0}, "deadline_s"),
    ({"stop_strings": ("",)}, "empty string"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationSettings(**kwargs)
