"""Tool calls that always close, `tool_choice: none` as OpenAI means it, and values typed by
their schema (server/app.py, engine/inputs/grammar.py `BoundedStrings`, engine/inputs/
tool_calls.py `_value`), with the `openai` client against the real app on uvicorn: tiny
random Qwen3.5 checkpoints with the real Qwen vocabulary in each tool-call format (a random
model loops inside any string it opens: the case the bound is for) and the demo planner,
with tools of the user's own that no model here was taught."""

from __future__ import annotations

import json
import time
import urllib.request

import jsonschema
import pytest
from served import InProcess
from tool_models import favour, write_tool_checkpoint

from flash_planner.engine.inputs.tool_calls import OPEN, QWEN3, QWEN35, _value

USER_TOOLS = [
    {"type": "function", "function": {
        "name": "announce", "description": "Say one sentence out loud.",
        "parameters": {"type": "object", "required": ["text"],
                       "properties": {"text": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "grasp", "description": "Grasp an object with a force in newtons.",
        "parameters": {"type": "object", "required": ["object"],
                       "properties": {"object": {"type": "string"},
                                      "force": {"type": "number", "minimum": 0,
                                                "maximum": 50}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in USER_TOOLS}
NAMED = {"type": "function", "function": {"name": "grasp"}}
TASKS = ("announce that dinner is ready", "grasp the red cup gently")
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module", params=[QWEN3, QWEN35])
def tiny(request, tmp_path_factory):
    target, drafter = write_tool_checkpoint(tmp_path_factory.mktemp(request.param),
                                            request.param)
    served = InProcess(str(target), str(drafter), "tiny")
    served.fmt = request.param
    yield served
    served.stop()


@pytest.fixture(scope="module")
def demo():
    served = InProcess("flash_planner/assets/demo/target", "flash_planner/assets/demo/drafter",
                       "demo")
    yield served
    served.stop()


def _create(served, choice, task=TASKS[0], tools=USER_TOOLS, max_tokens=128, **extra):
    return served.client.chat.completions.create(
        model=served.client.models.list().data[0].id,
        messages=[{"role": "user", "content": task}], tools=tools, tool_choice=choice,
        temperature=0, max_tokens=max_tokens, extra_body={**NO_THINKING, **extra})


def _valid_calls(answer, schemas=SCHEMAS) -> list[tuple[str, dict]]:
    out = []
    for call in answer.choices[0].message.tool_calls or []:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schemas[call.function.name])
        out.append((call.function.name, args))
    return out


def _cuts(served) -> float:
    with urllib.request.urlopen(served.url + "/metrics", timeout=60) as answer:
        text = answer.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("flash_planner_strings_cut_total"))


@pytest.mark.parametrize("choice", ["required", NAMED])
@pytest.mark.parametrize("task", TASKS)
def test_required_and_named_choices_always_return_a_valid_call_at_128_tokens(tiny, choice,
                                                                            task):
    """A random model opens a string and never closes it; bounded, the call closes and is
    returned."""
    answer = _create(tiny, choice, task)
    calls = _valid_calls(answer)
    assert calls, answer
    if choice is NAMED:
        assert {name for name, _ in calls} == {"grasp"}
    # a call closed and then the token limit: the call is still returned, the reason length
    assert answer.choices[0].finish_reason in ("tool_calls", "length")


def test_without_the_bound_the_same_call_runs_to_the_limit_and_none_is_returned(tiny):
    """What the bound is for: lifted (per request), the random model's string runs on to
    max_tokens, the call is left open, and a client under `required` gets no call."""
    answer = _create(tiny, "required", max_string_tokens=10**6)
    assert answer.choices[0].finish_reason == "length"
    assert not answer.choices[0].message.tool_calls


def test_the_bound_is_per_request_and_a_bad_one_is_a_400(tiny):
    from openai import BadRequestError

    before = _cuts(tiny)
    calls = _valid_calls(_create(tiny, NAMED, max_string_tokens=2))
    assert calls
    # counted once the service hands the result on (after the answer may have gone out)
    deadline = time.monotonic() + 60
    while _cuts(tiny) == before:
        assert time.monotonic() < deadline, "no cut counted"
        time.sleep(0.05)
    with pytest.raises(BadRequestError) as caught:
        _create(tiny, NAMED, max_string_tokens=0)
    assert caught.value.body["param"] == "max_string_tokens"


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_the_demo_returns_a_call_of_tools_it_was_never_taught(demo, choice):
    for task in TASKS:
        assert _valid_calls(_create(demo, choice, task))


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    """A Qwen3.5-format model that writes `<tool_call>` wherever it can."""
    target, drafter = write_tool_checkpoint(tmp_path_factory.mktemp("eager"), QWEN35)
    favour(target, OPEN)
    served = InProcess(str(target), None, "eager")
    yield served
    served.stop()


def test_tool_choice_none_answers_text_with_no_call_in_it(eager):
    model = eager.client.models.list().data[0].id
    free = eager.client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": TASKS[0]}], temperature=0,
        max_tokens=32, extra_body=NO_THINKING)
    assert OPEN in free.choices[0].message.content        # the model writes calls unasked
    answer = _create(eager, "none", max_tokens=32)
    message = answer.choices[0].message
    assert not message.tool_calls and message.content and OPEN not in message.content
    assert answer.choices[0].finish_reason in ("stop", "length")


TYPED = [
    ("1", {"enum": ["1", "2"]}, "1"),
    ("123", {"type": ["string", "null"]}, "123"),
    ("null", {"type": ["string", "null"]}, None),
    ("true", {"anyOf": [{"type": "string"}, {"type": "boolean"}]}, "true"),
    ("true", {"type": "boolean"}, True),
    ("7", {"type": "integer"}, 7),
    ("7", {"oneOf": [{"type": "integer"}, {"type": "null"}]}, 7),
    ("2.5", {"type": "integer"}, "2.5"),
    ("2", {"type": "number"}, 2),
    ('{"a": 1}', {"type": "object"}, {"a": 1}),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("[1, 2]", {"type": "string"}, "[1, 2]"),
    ("  the kitchen \n", {"type": "string"}, "the kitchen"),
    ("3", {"const": "3"}, "3"),
    ("  ", {"enum": [" "]}, " "),           # the value's own blank, the grammar's around it
    ("3", {}, 3),
    ("three", {}, "three"),
]


@pytest.mark.parametrize("raw,schema,want", TYPED)
def test_a_raw_value_is_typed_by_its_schema_as_json_schema_reads_it(raw, schema, want):
    got = _value(raw, schema)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("tiny", [QWEN35], indirect=True)   # Qwen3's arguments are JSON
def test_string_values_stay_strings_through_the_server(tiny):
    """Qwen3.5's raw values, read back typed by the schema: an enum of digit strings, a
    nullable string and a string-or-boolean come back as the strings they are."""
    schema = {"type": "object", "required": ["level", "label", "flag"],
              "properties": {"level": {"enum": ["1", "2"]},
                             "label": {"type": ["string", "null"]},
                             "flag": {"anyOf": [{"type": "string"}, {"type": "boolean"}]}}}
    tools = [{"type": "function", "function": {"name": "mark", "parameters": schema}}]
    answer = _create(tiny, "required", tools=tools)
    calls = _valid_calls(answer, {"mark": schema})
    assert calls and isinstance(calls[0][1]["level"], str)
