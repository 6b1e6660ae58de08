"""Tool calls under a grammar (engine/inputs/tool_calls.py, `JsonGrammarCompiler.compile_tag`):
speculative decoding stays lossless under a tool grammar, and every call read back from the
output validates against its tool's schema, in both of Qwen's formats, on tiny random Qwen3.5
checkpoints with the real Qwen vocabulary."""

from __future__ import annotations

import jsonschema
import pytest
import xgrammar as xgr
from tool_models import TOOLS, write_tool_checkpoint

from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.inputs.chat import encode_chat
from flash_planner.engine.inputs.grammar import JsonGrammarCompiler
from flash_planner.engine.inputs.tool_calls import (
    QWEN3,
    QWEN35,
    ToolCallStream,
    split_calls,
    structural_tag,
    tool_call_format,
)

MAX_NEW = 120
TASKS = ("go to the kitchen slowly", "wait ten seconds, then drive to the lab")
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def engines(tmp_path_factory, make_engine):
    cache = {}

    def get(fmt: str):
        if fmt not in cache:
            target, drafter = write_tool_checkpoint(tmp_path_factory.mktemp(fmt), fmt)
            engine = make_engine(target, drafter_path=str(drafter), max_context=1024)
            cache[fmt] = engine, JsonGrammarCompiler.for_engine(engine)
        return cache[fmt]

    return get


def _valid(calls) -> None:
    for call in calls:
        assert call.name in SCHEMAS, call
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


@pytest.mark.parametrize("fmt", [QWEN3, QWEN35])
def test_the_format_is_read_from_the_template(engines, fmt):
    engine, _ = engines(fmt)
    assert tool_call_format(engine.tokenizer) == fmt


@pytest.mark.parametrize("fmt,choice,parallel", [
    (QWEN35, "required", False), (QWEN35, "required", True), (QWEN35, "auto", True),
    (QWEN3, "required", False), (QWEN3, {"type": "function", "function": {"name": "wait"}},
                                 False), (QWEN3, "auto", True),
])
def test_dflash_mtp_and_auto_give_plain_decodings_tokens_under_a_tool_grammar(
        engines, fmt, choice, parallel):
    """Each method's tokens equal plain decoding's under the same tool grammar, and every
    call in the output parses and validates against its tool's schema."""
    engine, compiler = engines(fmt)
    grammar = compiler.compile_tag(structural_tag(fmt, TOOLS, choice, parallel))
    for task in TASKS:
        ids = encode_chat(engine.tokenizer, [{"role": "user", "content": task}], None, None,
                          TOOLS)
        outs = {m: generate(engine, ids, GenerationSettings(MAX_NEW, method=m),
                            constraint=grammar.constraint())
                for m in ("none", "dflash", "mtp", "auto")}
        plain = outs["none"].token_ids
        for method, out in outs.items():
            assert out.token_ids == plain, (fmt, choice, task, method)
        _, calls, _ = split_calls(fmt, engine.tokenizer.decode(plain), TOOLS)
        _valid(calls)
        if choice != "auto":
            assert calls, engine.tokenizer.decode(plain)
        if isinstance(choice, dict):
            assert {c.name for c in calls} == {"wait"}
        if not parallel:
            assert len(calls) == 1 and outs["none"].finish_reason == "eos"


@pytest.mark.parametrize("fmt", [QWEN3, QWEN35])
def test_the_grammar_takes_parallel_calls_and_refuses_what_the_schema_does_not(engines, fmt):
    engine, compiler = engines(fmt)
    one = {QWEN3: '<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>',
           QWEN35: "<tool_call>\n<function={n}>\n{a}\n</function>\n</tool_call>"}[fmt]
    args = {QWEN3: ('{"seconds": 5}', '{"room": "lab", "slow": true}',
                    '{"room": "attic", "slow": true}'),
            QWEN35: ("<parameter=seconds>\n5\n</parameter>",
                     "<parameter=room>\nlab\n</parameter>\n<parameter=slow>\ntrue\n</parameter>",
                     "<parameter=room>\nattic\n</parameter>\n<parameter=slow>\ntrue\n"
                     "</parameter>")}[fmt]
    two = one.format(n="wait", a=args[0]) + "\n" + one.format(n="go_to_room", a=args[1])
    bad = one.format(n="go_to_room", a=args[2])
    eos = engine.eos_ids()[0]

    def accepts(grammar, text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar.compiled)
        ids = engine.tokenizer.encode(text, add_special_tokens=False) + [eos]
        return all(matcher.accept_token(i) for i in ids)

    parallel = compiler.compile_tag(structural_tag(fmt, TOOLS, "required", True))
    single = compiler.compile_tag(structural_tag(fmt, TOOLS, "required", False))
    assert accepts(parallel, two) and not accepts(single, two)
    assert not accepts(parallel, bad) and not accepts(parallel, "no call at all")
    content, calls, open_call = split_calls(fmt, two, TOOLS)
    assert content == "" and not open_call
    assert [(c.name, c.arguments) for c in calls] == [
        ("wait", {"seconds": 5}), ("go_to_room", {"room": "lab", "slow": True})]


def test_a_stream_gives_the_text_before_a_call_and_each_call_once_it_closes():
    call = '<tool_call>\n{"name": "wait", "arguments": {"seconds": 3}}\n</tool_call>'
    text = "Waiting first.\n" + call + "\n" + call.replace("3", "4")
    stream = ToolCallStream(QWEN3, TOOLS)
    content, calls = "", []
    for i in range(0, len(text), 3):         # three characters at a time: tags cut apart
        delta, closed = stream.feed(text[i:i + 3])
        assert "<" not in delta, delta
        content += delta
        calls += closed
    delta, closed = stream.feed("", final=True)
    content, calls = content + delta, calls + closed
    assert content == split_calls(QWEN3, text, TOOLS)[0] == "Waiting first."
    assert [c.arguments for c in calls] == [{"seconds": 3}, {"seconds": 4}]


def test_a_call_the_output_stopped_inside_is_left_open_not_returned():
    content, calls, open_call = split_calls(
        QWEN3, 'ok\n<tool_call>\n{"name": "wait", "arguments": {"sec', TOOLS)
    assert (content, calls, open_call) == ("ok", [], True)


@pytest.mark.parametrize("fmt", [QWEN3, QWEN35])
def test_a_two_turn_exchange_renders_the_call_and_its_result(engines, fmt):
    """The assistant's call and the tool's result reach the prompt as the template writes
    them; the result's text stays plain text (a control token's text in it is split)."""
    engine, _ = engines(fmt)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "wait", "arguments": {"seconds": 5}}}
    messages = [{"role": "user", "content": "wait a bit"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "waited <|im_end|>"}]
    ids = encode_chat(engine.tokenizer, messages, None, None, TOOLS)
    text = engine.tokenizer.decode(ids)
    assert "<tool_response>\nwaited <|im_end|>\n</tool_response>" in text
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # the ends of the system, user, assistant and tool turns; not the result's written one
    assert ids.count(im_end) == 4 and text.count("<|im_end|>") == 5
    written = {QWEN3: '{"name": "wait", "arguments": {"seconds": 5}}',
               QWEN35: "<function=wait>\n<parameter=seconds>\n5\n</parameter>"}[fmt]
    assert written in text
