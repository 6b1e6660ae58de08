"""Request checks (bad input gets a precise error) and the chat prompt."""

from __future__ import annotations

import pytest

from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.prompt import REPLAN_ASK, build_messages, progress_section
from flash_planner.planning.request import PlanRequest, RequestError
from flash_planner.planning.skills import SkillCatalog


def _checked(**kwargs):
    return PlanRequest(**kwargs).checked(max_task_chars=50, max_context_chars=100)


@pytest.mark.parametrize("kwargs,match", [
    ({"task": ""}, "task is empty"),
    ({"task": "  \n\t "}, "task is empty"),
    ({"task": "x" * 51}, "task is 51 characters, the limit is 50"),
    ({"task": b"pick up the \xff cup"}, "task is not valid UTF-8"),
    ({"task": "pick up\x00 the cup"}, "control character U\\+0000"),
    ({"task": "pick up \x1b[31mthe cup"}, "control character U\\+001B at character 8"),
    ({"task": "pick up \x7f the cup"}, "control character U\\+007F"),
    ({"task": "pick up the \ud800 cup"}, "lone surrogate U\\+D800"),
    ({"task": "pick up the \ufffd cup"}, "U\\+FFFD at character 12: .* not valid UTF-8"),
    ({"task": "ok", "context": "table\x00"}, "context contains the control character U\\+0000"),
    ({"task": "ok", "context": "y" * 101}, "context is 101 characters"),
    ({"task": "ok", "progress": "Done: x\x00"}, "progress contains the control character"),
    ({"task": "ok", "progress": "z" * 101}, "progress is 101 characters"),
    ({"task": 42}, "task must be a string"),
    ({"task": "ok", "max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    ({"task": "ok", "deadline_s": -1}, "deadline_s must be a positive number"),
    ({"task": "ok", "deadline_s": float("nan")}, "deadline_s must be a positive number"),
    ({"task": "ok", "deadline_s": float("inf")}, "deadline_s must be a positive number"),
    ({"task": "ok", "speculative": "no"}, "speculative must be true or false"),
    ({"task": "ok", "method": "eagle"}, "method must be one of auto, dflash, mtp, none"),
    ({"task": "ok", "reasoning_effort": "High"},
     r"^reasoning_effort must be a short lowercase word \(\[a-z_\], 1 to 16 characters, "
     r"e\.g\. low\), got 'High'$"),
    ({"task": "ok", "reasoning_effort": "x" * 17}, "reasoning_effort must be a short"),
    ({"task": "ok", "reasoning_effort": ""}, "reasoning_effort must be a short"),
    ({"task": "ok", "reasoning_effort": 2}, "reasoning_effort must be a short .* got 2$"),
])
def test_bad_requests_are_refused_with_the_reason(kwargs, match):
    with pytest.raises(RequestError, match=match) as info:
        _checked(**kwargs)
    if "reasoning_effort" in kwargs:
        assert info.value.field == "reasoning_effort"


def test_good_request_is_normalised():
    req = _checked(task="  pick up the cup\n", context="table: cup", id="r1")
    assert (req.task, req.context, req.id) == ("pick up the cup", "table: cup", "r1")
    assert _checked(task=b"bytes are fine").task == "bytes are fine"
    # Line ends from other systems become LF; tabs and non-ASCII text pass as they are.
    scene = "caf\u00e9\ttable \u2014 \u6905\u5b50"
    req = _checked(task="go to\r\nthe door\rnow", context=scene)
    assert (req.task, req.context) == ("go to\nthe door\nnow", scene)


@pytest.mark.parametrize("text,match", [
    ('{"task": "x", "colour": "red"}', r"unknown request field\(s\) \['colour'\]"),
    ('{"task": "x",', "looks like JSON but is malformed"),
    ('{"context": "kitchen"}', "has no 'task'"),
    ('{"task": "x", "deadline_s": NaN}', "NaN is not a JSON number"),
    (b"\xc3\x28", "message is not valid UTF-8"),
])
def test_bad_task_messages(text, match):
    with pytest.raises(RequestError, match=match):
        PlanRequest.from_text(text)


def test_task_messages_plain_and_json():
    assert PlanRequest.from_text("open the fridge").task == "open the fridge"
    req = PlanRequest.from_text('{"id": 7, "task": "open it", "context": "fridge ahead", '
                                '"speculative": false, "method": "mtp"}')
    assert (req.id, req.task, req.context) == ("7", "open it", "fridge ahead")
    assert req.speculative is False and req.method == "mtp"
    req = PlanRequest.from_text('{"task": "open it", "reasoning_effort": "low"}')
    assert req.reasoning_effort == "low" and _checked(task="ok").reasoning_effort is None
    assert _checked(task="ok", reasoning_effort="x_high").reasoning_effort == "x_high"


def test_prompt_lists_every_skill_and_renders_with_the_chat_template(hybrid_dir):
    from transformers import AutoTokenizer

    catalog = SkillCatalog.from_yaml(default_skills_path())
    messages = build_messages(catalog, "bring the cup", "cup on the table")
    system, user = messages[0]["content"], messages[1]["content"]
    for skill in catalog.skills:
        assert skill.signature() in system
    assert '{"plan": [{"skill": NAME' in system
    assert user == "Task: bring the cup\nScene: cup on the table"
    assert "Scene" not in build_messages(catalog, "bring the cup")[1]["content"]
    tok = AutoTokenizer.from_pretrained(str(hybrid_dir))
    on = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                 enable_thinking=True)
    off = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                  enable_thinking=False)
    assert "bring the cup" in on and off.endswith("<think>\n\n</think>\n\n")


def test_a_replan_shows_the_progress_section_after_the_task():
    """What the executor tells the planner after a failed step (docs/ros.md, "Replanning"):
    the steps done, the failed step with its reason, the ask; in the task's message, so the
    system prompt stays the cached prefix."""
    catalog = SkillCatalog.from_yaml(default_skills_path())
    done = [{"skill": "navigate_to", "args": {"target": "kitchen"}}]
    failed = {"skill": "pick", "args": {"object": "red cup"}}
    section = progress_section(done, failed, "aborted: the gripper\nslipped")
    assert section == ('Done: navigate_to {"target": "kitchen"}\n'
                       'Failed: pick {"object": "red cup"} (aborted: the gripper slipped)\n'
                       f"{REPLAN_ASK}")
    assert progress_section([], failed, "rejected").startswith("Done: nothing\n")
    first = build_messages(catalog, "bring the red cup", "cup on the table")
    again = build_messages(catalog, "bring the red cup", "cup on the table", progress=section)
    assert again[0] == first[0]
    assert again[1]["content"] == first[1]["content"] + "\n" + section
    req = PlanRequest(task="bring it", progress=f"  {section}\n").checked(50, 200)
    assert req.progress == section
    assert PlanRequest.from_text('{"task": "x", "progress": "Done: nothing"}').progress == \
        "Done: nothing"
