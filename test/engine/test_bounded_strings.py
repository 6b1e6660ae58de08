"""A string of a constrained answer closes after `max_string_tokens` tokens
(engine/inputs/grammar.py `BoundedStrings`), over xgrammar's real matcher and the demo's
tokenizer; and through the planner service, a spoken text that would run past the bound
still gives a valid plan."""

from __future__ import annotations

import torch
from qwen3_tokenizer import DEMO

from flash_planner.engine.inputs.grammar import BoundedStrings, JsonGrammarCompiler
from flash_planner.engine.loop.acceptance import think_token_ids
from flash_planner.engine.loop.constraint import mask_words, unpack_bitmask
from flash_planner.planning.parse import REFUSAL_SCHEMA
from flash_planner.train.tokenizer import load_tokenizer

VOCAB = 1024
BOUND = 6


def _grammar():
    tok = load_tokenizer(DEMO)
    compiler = JsonGrammarCompiler(tok, VOCAB, [tok.convert_tokens_to_ids("<|im_end|>")],
                                   think_token_ids(tok))
    return tok, compiler.compile(REFUSAL_SCHEMA)


def _allowed(matcher) -> list[int]:
    bitmask = torch.zeros(1, mask_words(VOCAB), dtype=torch.int32)
    matcher.fill_mask(bitmask, 0)
    return unpack_bitmask(bitmask, VOCAB)[0].nonzero().flatten().tolist()


def test_a_string_closes_at_the_bound_and_rollback_restores_it():
    tok, grammar = _grammar()
    matcher = grammar.matcher(BOUND)
    assert isinstance(matcher, BoundedStrings)
    opening = tok.encode('{"refusal": "no skill', add_special_tokens=False)
    word = tok.encode(" an", add_special_tokens=False)
    assert len(word) == 1
    assert all(matcher.accept(t) for t in opening)
    words = 0
    while words < 3 * BOUND and matcher.accept(word[0]):
        words += 1
    inside = matcher._states[-1][2]         # tokens inside the reason
    assert 0 < words < BOUND and inside == BOUND
    # the bound: the reason may only close now; a word more is refused
    allowed = _allowed(matcher)
    texts, quotes, _ = grammar.compiler.quotes()
    assert allowed and all(texts[t].startswith(b'"') for t in allowed)
    assert word[0] not in allowed and not matcher.accept(word[0])
    assert matcher.forced_tokens() == [] and matcher.cut == 0
    # one token back: a word is allowed again, and the bound comes back with it
    matcher.rollback(1)
    assert word[0] in _allowed(matcher)
    assert matcher.accept(word[0])
    close = next(t for t in allowed if texts[t] in (b'"', b'"}'))
    assert matcher.accept(close) and matcher.cut == 1
    rest = tok.encode("}", add_special_tokens=False) if texts[close] == b'"' else []
    assert all(matcher.accept(t) for t in rest)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert matcher.accept(eos) and matcher.terminated()
    matcher.rollback(2 + len(rest))
    assert matcher.cut == 0


def test_a_string_the_grammar_cannot_close_yet_goes_on_past_the_bound():
    tok, _ = _grammar()
    compiler = JsonGrammarCompiler(
        tok, VOCAB, [tok.convert_tokens_to_ids("<|im_end|>")], think_token_ids(tok))
    grammar = compiler.compile({"type": "object", "required": ["note"],
                                "additionalProperties": False,
                                "properties": {"note": {"type": "string", "minLength": 24}}})
    matcher = grammar.matcher(2)
    assert all(matcher.accept(t) for t in tok.encode('{"note": "', add_special_tokens=False))
    word = tok.encode(" an", add_special_tokens=False)[0]
    for _ in range(8):             # 8 x " an": 24 characters, 4 times the bound in tokens
        assert matcher.accept(word)
    texts, _, _ = compiler.quotes()
    allowed = _allowed(matcher)    # now it may close, and it must
    assert allowed and all(texts[t].startswith(b'"') for t in allowed)


def test_an_enum_value_past_the_bound_ends_where_it_ends_and_is_no_cut():
    tok, _ = _grammar()
    compiler = JsonGrammarCompiler(
        tok, VOCAB, [tok.convert_tokens_to_ids("<|im_end|>")], think_token_ids(tok))
    value = "an an an an an an an an an an"
    grammar = compiler.compile({"type": "object", "required": ["say"],
                                "additionalProperties": False,
                                "properties": {"say": {"enum": [value, "an"]}}})
    matcher = grammar.matcher(2)
    ids = tok.encode(f'{{"say": "{value}"}}', add_special_tokens=False)
    assert len(ids) > 12 and all(matcher.accept(t) for t in ids)
    assert matcher.accept(tok.convert_tokens_to_ids("<|im_end|>")) and matcher.terminated()
    assert matcher.cut == 0
    # the other value ends before the bound: closing it is no cut either
    matcher = grammar.matcher(2)
    assert all(matcher.accept(t) for t in tok.encode('{"say": "an"}', add_special_tokens=False))
    assert matcher.cut == 0


def test_an_escaped_quote_does_not_close_the_string_and_no_bound_is_plain_xgrammar():
    tok, grammar = _grammar()
    matcher = grammar.matcher(BOUND)
    ids = tok.encode('{"refusal": "say \\"hi', add_special_tokens=False)
    assert all(matcher.accept(t) for t in ids)
    assert matcher._states[-1][0]           # still inside the reason after \"
    assert not isinstance(grammar.matcher(None), BoundedStrings)


def test_the_planner_closes_a_long_spoken_text_and_still_plans():
    from flash_planner.engine.engine import Engine
    from flash_planner.planning.presets import ModelPreset, default_skills_path
    from flash_planner.planning.request import PlanRequest
    from flash_planner.planning.service import PlannerConfig, PlannerService
    from flash_planner.planning.skills import SkillCatalog

    preset = ModelPreset.load("demo")
    engine = Engine.load(preset.engine_config(device="cpu", dtype="fp32"))
    catalog = SkillCatalog.from_yaml(default_skills_path())
    text = "the red cup is on the kitchen table next to the big blue plate"
    # unquoted, the text is the model's to write; quoted, it is the task's (`grounded: quote`)
    results = {}
    for task in (f"say {text}", f'say "{text}"'):
        for bound in (64, 4):
            service = PlannerService(engine, catalog, PlannerConfig(
                max_string_tokens=bound, refusal_hint=preset.refusal_hint))
            service.start()
            try:
                results[task, bound] = service.plan(PlanRequest(task, enable_thinking=False),
                                                    timeout=300)
            finally:
                service.stop()

    def spoken(result) -> list[str]:
        assert result.success, result.error
        return [s["args"]["text"] for s in result.plan if s["skill"] == "say"]

    full, cut = results[f"say {text}", 64], results[f"say {text}", 4]
    assert full.telemetry["strings_cut"] == 0
    assert spoken(full) and len(spoken(full)[0].split()) > 4
    # bound to 4 tokens: the spoken text closes early, and the answer is still a valid plan
    assert cut.telemetry["strings_cut"] >= 1
    assert spoken(cut) and len(spoken(cut)[0]) < len(spoken(full)[0]), (cut.plan, full.plan)
    # a quoted text is said whole past the bound, and that is no cut
    for bound in (64, 4):
        quoted = results[f'say "{text}"', bound]
        assert spoken(quoted) == [text] and quoted.telemetry["strings_cut"] == 0, bound


SAY = [{"type": "function", "function": {"name": "say", "parameters": {
    "type": "object", "required": ["text"], "additionalProperties": False,
    "properties": {"text": {"type": "string"},
                   "where": {"type": "object", "required": ["room"],
                             "properties": {"room": {"type": "string"}}}}}}}]


def _tool_grammar(fmt: str):
    from flash_planner.engine.inputs.tool_calls import structural_tag

    tok = load_tokenizer(DEMO)
    compiler = JsonGrammarCompiler(tok, VOCAB, [tok.convert_tokens_to_ids("<|im_end|>")],
                                   think_token_ids(tok))
    return tok, compiler.compile_tag(structural_tag(fmt, SAY, "required", False))


def _write_until_refused(matcher, token: int, most: int) -> int:
    written = 0
    while written < most and matcher.accept(token):
        written += 1
    return written


def test_a_raw_parameter_value_closes_at_the_bound_and_the_call_completes():
    """Qwen3.5/3.6's `<parameter=text>` value is raw text (no quotes): at the bound only
    tokens that go on writing `</parameter>` are allowed, the call closes, a cut counted."""
    from flash_planner.engine.inputs.tool_calls import QWEN35, split_calls

    tok, grammar = _tool_grammar(QWEN35)
    matcher = grammar.matcher(BOUND, raw_values=True)
    opening = '<tool_call>\n<function=say>\n<parameter=text>\nno skill'
    assert all(matcher.accept(t) for t in tok.encode(opening, add_special_tokens=False))
    word = tok.encode(" an", add_special_tokens=False)[0]
    written = _write_until_refused(matcher, word, 4 * BOUND)
    assert 0 < written < BOUND and matcher._states[-1][5] == BOUND
    texts = grammar.compiler.quotes()[0]
    allowed = _allowed(matcher)
    assert allowed and all(b"</parameter>".startswith(texts[t]) or
                           texts[t].startswith(b"</parameter>") for t in allowed)
    text = opening + " an" * written
    # the closing, one allowed token at a time (the first piece is the cut), then the rest
    while True:
        closing = [t for t in _allowed(matcher) if texts[t]]
        if not closing or matcher._states[-1][5] < 0:
            break
        piece = max(closing, key=lambda t: len(texts[t]))
        assert matcher.accept(piece)
        text += texts[piece].decode()
    assert matcher.cut == 1 and text.endswith("</parameter>")
    rest = "\n</function>\n</tool_call>"
    assert all(matcher.accept(t) for t in tok.encode(rest, add_special_tokens=False))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert matcher.accept(eos) and matcher.terminated()
    _, calls, open_call = split_calls(QWEN35, text + rest, SAY)
    assert not open_call and calls[0].name == "say"
    assert calls[0].arguments["text"] == "no skill" + " an" * written


def test_a_json_object_as_a_raw_value_closes_its_strings_first():
    """An object-valued parameter is JSON inside the raw value: its strings close at the
    bound by a quote, and the value only once the object is closed."""
    from flash_planner.engine.inputs.tool_calls import QWEN35

    tok, grammar = _tool_grammar(QWEN35)
    matcher = grammar.matcher(BOUND, raw_values=True)
    opening = ('<tool_call>\n<function=say>\n<parameter=text>\nhi\n</parameter>\n'
               '<parameter=where>\n{"room": "the')
    assert all(matcher.accept(t) for t in tok.encode(opening, add_special_tokens=False))
    assert matcher._states[-1][0] and matcher._states[-1][5] >= 0   # a string in a value
    word = tok.encode(" an", add_special_tokens=False)[0]
    _write_until_refused(matcher, word, 4 * BOUND)
    texts = grammar.compiler.quotes()[0]
    allowed = _allowed(matcher)
    assert allowed and all(texts[t].startswith(b'"') for t in allowed)


def test_a_quote_inside_a_raw_string_value_is_text_not_a_json_string():
    from flash_planner.engine.inputs.tool_calls import QWEN35

    tok, grammar = _tool_grammar(QWEN35)
    matcher = grammar.matcher(BOUND, raw_values=True)
    text = '<tool_call>\n<function=say>\n<parameter=text>\nsay "hi'
    assert all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False))
    assert not matcher._states[-1][0] and matcher._states[-1][5] >= 0
    ids = tok.encode('\n</parameter>\n', add_special_tokens=False)
    assert all(matcher.accept(t) for t in ids)
    assert matcher._states[-1][5] == -1 and not matcher._states[-1][0]
