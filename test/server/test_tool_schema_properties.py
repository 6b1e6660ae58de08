"""Every call a tool grammar lets through validates against its tool's schema: tool schemas
drawn by hypothesis (strings, enums of strings and digit strings, bounded integers and
numbers, booleans, nullable and anyOf types, nested objects, arrays), held under
`tool_choice: required` in both formats, with strings bounded as the server bounds them.

Two levels. The grammar's own promise, over a few hundred schemas: a writer that picks a
random token among those the bounded grammar allows (a model with no preference: the
fastest way to reach every corner of the grammar) ends its answer, and the calls read back
from it (`split_calls`, values typed by the schema) validate with jsonschema. Through the
server, fewer schemas: the demo planner (Qwen3 format) and the demo's weights under a
Qwen3.5 template answer over the `openai` client, and every call returned validates.
`FLASH_PLANNER_TOOL_EXAMPLES=N` runs N times the examples, freshly drawn.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qwen3_tokenizer import DEMO

from flash_planner.engine.inputs.grammar import JsonGrammarCompiler
from flash_planner.engine.inputs.tool_calls import QWEN3, QWEN35, split_calls, structural_tag
from flash_planner.engine.loop.acceptance import think_token_ids
from flash_planner.engine.loop.constraint import mask_words, unpack_bitmask
from flash_planner.train.qwen_vocab import QWEN35_TOOL_TEMPLATE
from flash_planner.train.tokenizer import load_tokenizer

SCALE = int(os.environ.get("FLASH_PLANNER_TOOL_EXAMPLES", "1"))
BOUND = 6               # tokens per string: what a request's max_string_tokens may set
MOST_TOKENS = 400       # a writer still inside its answer then has left a call open


def profile(examples: int):
    return settings(max_examples=examples * SCALE, deadline=None, database=None,
                    derandomize=SCALE == 1,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


WORDS = st.text("abcxyz19 ", min_size=1, max_size=6)
LEAVES = st.one_of(
    st.just({"type": "string"}),
    st.lists(WORDS, min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    st.lists(st.sampled_from(["1", "2", "10", "true", "null"]), min_size=1, max_size=3,
             unique=True).map(lambda v: {"enum": v}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(1, 100)),
    st.just({"type": "boolean"}),
    st.just({"type": ["string", "null"]}),
    st.just({"anyOf": [{"type": "string"}, {"type": "integer"}]}),
    st.just({"anyOf": [{"type": "boolean"}, {"type": "string"}]}),
)
NAMES = st.sampled_from(["a", "b", "c", "room", "speed", "text", "n"])


def _objects(children):
    return st.builds(_object, st.dictionaries(NAMES, children, min_size=1, max_size=3),
                     st.randoms(use_true_random=False))


def _object(properties: dict, rng) -> dict:
    required = sorted(name for name in properties if rng.random() < 0.6)
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


VALUES = st.recursive(
    LEAVES, lambda children: st.one_of(
        _objects(children),
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n},
                  children, st.integers(1, 3))),
    max_leaves=4)


@st.composite
def toolsets(draw, values=VALUES) -> list[dict]:
    names = draw(st.lists(st.sampled_from(["move", "grip", "say", "look"]), min_size=1,
                          max_size=2, unique=True))
    return [{"type": "function", "function": {
        "name": name, "parameters": draw(_objects(values))}} for name in names]


@pytest.fixture(scope="module")
def compiler():
    tok = load_tokenizer(DEMO)
    vocab = len(tok)
    return JsonGrammarCompiler(tok, vocab, [tok.convert_tokens_to_ids("<|im_end|>")],
                               think_token_ids(tok))


def _write(compiler, matcher, rng: random.Random) -> str | None:
    """The answer of a writer that picks any allowed token; None: still open at the end."""
    vocab = compiler.vocab_size
    bitmask = torch.zeros(1, mask_words(vocab), dtype=torch.int32)
    eos = compiler.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids: list[int] = []
    for _ in range(MOST_TOKENS):
        forced = matcher.forced_tokens()
        if forced:
            assert all(matcher.accept(t) for t in forced)
            ids += forced
            continue
        matcher.fill_mask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, vocab)[0].nonzero().flatten().tolist()
        assert allowed, compiler.tokenizer.decode(ids)
        # the end, where allowed, one time in four: answers of every length
        token = eos if eos in allowed and rng.random() < 0.25 else rng.choice(allowed)
        assert matcher.accept(token)
        if token == eos:
            return compiler.tokenizer.decode(ids)
        ids.append(token)
    return None


def _check(fmt: str, tools: list[dict], text: str) -> int:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    _, calls, left_open = split_calls(fmt, text, tools)
    assert calls and not left_open, text
    for call in calls:
        jsonschema.validate(call.arguments, schemas[call.name])
    return len(calls)


@pytest.mark.parametrize("fmt", [QWEN3, QWEN35])
@profile(300)
@given(tools=toolsets(), seed=st.integers(0, 2**32 - 1))
def test_every_call_a_bounded_tool_grammar_lets_through_validates(compiler, fmt, tools, seed):
    grammar = compiler.compile_tag(structural_tag(fmt, tools, "required", True))
    matcher = grammar.matcher(BOUND, raw_values=fmt == QWEN35)
    text = _write(compiler, matcher, random.Random(seed))
    if text is not None:
        _check(fmt, tools, text)


@pytest.fixture(scope="module", params=[QWEN3, QWEN35])
def served(request, tmp_path_factory):
    """The demo planner, as trained (Qwen3 calls) or under a Qwen3.5 template."""
    from served import InProcess

    target = "flash_planner/assets/demo/target"
    if request.param == QWEN35:
        copy = tmp_path_factory.mktemp("demo35") / "target"
        shutil.copytree(target, copy)
        (copy / "chat_template.jinja").write_text(QWEN35_TOOL_TEMPLATE)
        target = str(copy)
    server = InProcess(target, "flash_planner/assets/demo/drafter", "demo")
    server.fmt = request.param
    yield server
    server.stop()


@profile(12)      # flat schemas: the demo's 1024-token context holds their prompt
@given(tools=toolsets(LEAVES), task=st.sampled_from(["go to the kitchen", "pick up the red cup",
                                               "say hello twice", "look at the door"]))
def test_every_call_the_server_returns_under_required_validates(served, tools, task):
    answer = served.client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": task}], tools=tools,
        tool_choice="required", temperature=0, max_tokens=128,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in answer.choices[0].message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
