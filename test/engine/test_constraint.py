"""Grammar constraints inside the speculative loop (engine/loop/constraint.py,
engine/inputs/grammar.py).

The contract: constrained speculative greedy decoding publishes exactly the tokens of
constrained greedy decoding, one masked argmax per token. The reference here is written
independently of the loop: xgrammar's own matcher and its own `apply_token_bitmask_inplace`,
one target forward per token, no jump-forward. The schema has only enums and bounded
integers, so even a random model finishes its answer well inside the token budget.
"""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from qwen3_tokenizer import DEMO

from flash_planner.engine.generate import GenerationSettings, generate, prefill
from flash_planner.engine.inputs.grammar import (
    GrammarError,
    JsonGrammarCompiler,
    JsonSchemaGrammar,
)
from flash_planner.engine.loop.acceptance import think_token_ids
from flash_planner.engine.loop.constraint import GrammarViolation, masked, unpack_bitmask
from flash_planner.engine.loop.proposer import ReplayProposer
from flash_planner.train.tiny import write_tiny_drafter
from flash_planner.train.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object", "required": ["steps"], "additionalProperties": False,
    "properties": {"steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "required": ["name", "count"], "additionalProperties": False,
        "properties": {"name": {"enum": ["pick", "place", "open_the_door"]},
                       "count": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
}
PROMPT = "open the top drawer, take the blue screwdriver"
MAX_NEW = 96


def _grammar(engine) -> JsonSchemaGrammar:
    return JsonGrammarCompiler.for_engine(engine).compile(SCHEMA)


def reference(engine, grammar: JsonSchemaGrammar, prompt: list[int]) -> list[int]:
    """Constrained greedy decoding, one token per forward, with xgrammar's own masking."""
    matcher = xgr.GrammarMatcher(grammar.compiled)
    vocab = engine.model_config.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    engine.state.reset()
    logits, _ = prefill(engine, prompt)
    out: list[int] = []
    while len(out) < MAX_NEW:
        matcher.fill_next_token_bitmask(bitmask)
        row = logits.clone()[None]
        xgr.apply_token_bitmask_inplace(row, bitmask, vocab_size=vocab)
        tok = int(row.argmax())
        out.append(tok)
        assert matcher.accept_token(tok)
        if tok in engine.eos_ids():
            break
        logits = engine.model(torch.tensor([[tok]]), engine.state).logits[0, -1]
        engine.state.commit(1)
    return out


@pytest.fixture(scope="module")
def targets(checkpoints, tmp_path_factory, make_engine):
    """kind -> (engine with a random DFlash drafter (+ MTP head on the hybrid), prompt,
    grammar, reference tokens)."""
    cache = {}

    def get(kind: str, kv: str = "fp32"):
        if (kind, kv) not in cache:
            path = checkpoints(kind, **({"mtp": True} if kind == "hybrid" else {}))
            drafter = write_tiny_drafter(tmp_path_factory.mktemp(f"cdrafter-{kind}"), path,
                                         num_layers=2, block_size=8)
            engine = make_engine(path, kv_dtype=kv, drafter_path=str(drafter))
            grammar = _grammar(engine)
            prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
            cache[kind, kv] = engine, prompt, grammar, reference(engine, grammar, prompt)
        return cache[kind, kv]

    return get


def _run(engine, prompt, grammar, method, proposer=None):
    settings = GenerationSettings(MAX_NEW, method=method)
    return generate(engine, prompt, settings, proposer=proposer,
                    constraint=grammar.constraint())


@pytest.mark.parametrize("kind,method,kv", [
    ("hybrid", "none", "fp32"), ("hybrid", "dflash", "fp32"), ("hybrid", "mtp", "fp32"),
    ("hybrid", "auto", "fp32"), ("hybrid", "dflash", "fp8"), ("hybrid", "mtp", "fp8"),
    ("dense", "none", "fp32"), ("dense", "dflash", "fp32"),
])
def test_constrained_speculative_equals_constrained_greedy(targets, kind, method, kv):
    engine, prompt, grammar, ref = targets(kind, kv)
    out = _run(engine, prompt, grammar, method)
    assert out.token_ids == ref
    assert out.finish_reason == "eos"
    xgr_check = xgr.GrammarMatcher(grammar.compiled)
    assert all(xgr_check.accept_token(t) for t in ref) and xgr_check.is_terminated()
    if method == "dflash":   # random drafts: the grammar cuts most of them from the blocks
        assert out.stats.grammar_cut_drafts > 0


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_replayed_drafts_at_every_offset_are_lossless(targets, kind):
    """Drafts of the true continuation with one wrong token per cycle at every offset: the
    wrong one is either outside the grammar (the block ends there) or rejected by verify."""
    engine, prompt, grammar, ref = targets(kind)
    for block in (4, 8, 16):
        replay = ReplayProposer(ref, engine.model_config.vocab_size, block_size=block,
                                error_at=range(block))
        out = _run(engine, prompt, grammar, None, proposer=replay)
        assert out.token_ids == ref, block
        assert len(set(replay.accept_lengths)) > 2


def test_jump_forward_publishes_several_tokens_per_forward_without_a_proposer(targets):
    engine, prompt, grammar, ref = targets("hybrid")
    out = _run(engine, prompt, grammar, "none")
    stats = out.stats
    assert out.token_ids == ref
    assert stats.forced_tokens > 0
    # every cycle publishes its forced tokens and a bonus token: fewer forwards than tokens
    assert stats.cycles == len(ref) - 1 - stats.accepted
    assert stats.accepted >= stats.forced_tokens > 0
    assert stats.method_cycles == {"none": stats.cycles}
    unconstrained = generate(engine, prompt, GenerationSettings(MAX_NEW, method="none"))
    assert unconstrained.stats.forced_tokens is None
    assert "forced_tokens" not in unconstrained.stats.as_dict()


def test_the_block_ends_at_the_first_forbidden_draft_then_takes_forced_tokens(targets):
    engine, prompt, grammar, ref = targets("hybrid")
    c = grammar.constraint()
    c.reset(prompt)
    tok = engine.tokenizer
    head = tok.encode('{"steps": [{"name": "pick", "count": 1', add_special_tokens=False)
    forbidden = tok.encode("xyz", add_special_tokens=False)[0]
    drafts = head[:3] + [forbidden] + head[3:]
    block = c.block(drafts, room=len(drafts) + 8)
    assert block[:3] == head[:3] and block[3:4] != [forbidden]
    assert c.stats.cut == len(head) - 2           # the forbidden draft and all after it
    # what follows the kept drafts is what the grammar forces there, nothing else
    m = xgr.GrammarMatcher(grammar.compiled)
    assert all(m.accept_token(t) for t in head[:3])
    assert tok.decode(block[3:]) == m.find_jump_forward_string()[:len(tok.decode(block[3:]))]
    # the matcher is left where it was: the full head is still accepted from the start
    c.commit(head)
    assert c.matcher.terminated() is False


def test_masks_follow_the_drafts_and_match_xgrammar(targets):
    engine, prompt, grammar, _ = targets("hybrid")
    vocab = engine.model_config.vocab_size
    tok = engine.tokenizer
    drafts = tok.encode('{"steps": [{"name": "open', add_special_tokens=False)
    c = grammar.constraint()
    c.reset(prompt + [think_token_ids(tok)[1]])   # after </think>: the grammar alone
    bits = c.masks(drafts)
    allowed = unpack_bitmask(bits, vocab)
    assert allowed.shape == (len(drafts) + 1, vocab)
    m = xgr.GrammarMatcher(grammar.compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.randn(len(drafts) + 1, vocab)
    got = masked(logits, bits)
    for row, draft in enumerate([*drafts, None]):
        m.fill_next_token_bitmask(bitmask)
        want = logits[row:row + 1].clone()
        xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab)
        assert torch.equal(got[row:row + 1], want), row
        assert torch.equal(unpack_bitmask(bitmask, vocab)[0], allowed[row])
        if draft is not None:
            assert m.accept_token(draft)


def test_publishing_a_forbidden_token_is_a_bug_that_is_named(targets):
    engine, prompt, grammar, _ = targets("hybrid")
    c = grammar.constraint()
    c.reset(prompt)
    with pytest.raises(GrammarViolation, match="grammar forbids"):
        c.commit(engine.tokenizer.encode("hello", add_special_tokens=False))


def test_ignore_eos_cannot_be_constrained(targets):
    engine, prompt, grammar, _ = targets("hybrid")
    with pytest.raises(ValueError, match="ignore_eos"):
        generate(engine, prompt, GenerationSettings(8, ignore_eos=True),
                 constraint=grammar.constraint())


def test_a_schema_xgrammar_cannot_compile_is_a_clear_error(targets):
    engine, *_ = targets("hybrid")
    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5,
                                                  "maximum": 1}}}
    with pytest.raises(GrammarError, match="minimum greater than maximum") as info:
        JsonGrammarCompiler.for_engine(engine).compile(bad)
    assert ".cc:" not in str(info.value)       # xgrammar's source path is not the message


@pytest.fixture(scope="module")
def demo_grammar():
    tok = load_tokenizer(DEMO)
    return tok, JsonGrammarCompiler(tok, 1024, [tok.eos_token_id],
                                    think_token_ids(tok)).compile(SCHEMA)


def test_thinking_is_free_but_cannot_end_the_output_and_the_answer_is_constrained(
        demo_grammar):
    tok, grammar = demo_grammar
    think_open, think_close = think_token_ids(tok)
    brace = tok.encode("{", add_special_tokens=False)
    assert len(brace) == 1
    words = tok.encode(" the cup is on the table", add_special_tokens=False)
    answer = tok.encode('\n\n{"steps"', add_special_tokens=False)
    block = [think_open, *words, think_close, *answer]
    c = grammar.constraint()
    c.reset(tok.encode("<|im_start|>assistant\n", add_special_tokens=False))  # no marker
    allowed = unpack_bitmask(c.masks(block), 1024)
    start = allowed[0]
    assert start[think_open] and start[brace[0]] and not start[words[0]]
    eos = tok.eos_token_id
    for row in range(1, len(words) + 2):   # inside <think> ... </think>: all but a stop
        assert not allowed[row, eos] and allowed[row].sum() == allowed.shape[1] - 1, row
    answer_row = allowed[len(words) + 2]                # right after </think>
    assert answer_row[brace[0]] and answer_row[answer[0]]
    assert not answer_row[think_open] and not answer_row[words[0]]
    assert c.block(block, room=len(block)) == block   # every draft is allowed
    # ending the output inside thinking would leave no answer: the block ends there
    assert c.block([think_open, *words, eos, think_close], room=16) == [think_open, *words]

    # thinking off: the template's </think> in the prompt starts the grammar at once
    c.reset(tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    first = unpack_bitmask(c.masks([]), 1024)[0]
    assert first[brace[0]] and not first[think_open]


def test_a_spent_thinking_budget_forces_the_close_and_keeps_the_rest_free(demo_grammar):
    tok, grammar = demo_grammar
    think_open, think_close = think_token_ids(tok)
    words = tok.encode(" the cup is on the kitchen table now", add_special_tokens=False)
    assert len(words) > 5
    c = grammar.constraint(think_budget=4)
    c.reset(tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
    # positions 0..3: <think> and three words; from position 4 only </think>
    block = c.block([think_open, *words], room=12)
    assert block == [think_open, *words[:3], think_close]
    allowed = unpack_bitmask(c.masks(block), 1024)
    assert allowed[3].sum() == 1023                       # still thinking: all but EOS
    assert allowed[4].sum() == 1 and allowed[4, think_close]
    assert not allowed[5, think_open] and allowed[5].sum() < 1023   # the answer's grammar
    c.commit([think_open, *words[:3], think_close], 5)
    assert c.stats.think_closed and c.stats.forced == 1
    with pytest.raises(GrammarViolation):             # a thought past the budget is refused
        d = grammar.constraint(think_budget=2)
        d.reset([])
        d.commit([think_open, *words[:3]])


def test_a_batch_decides_its_blocks_as_each_request_alone(targets):
    """`decide_strict_together` (a batch's greedy strict requests at once, padded to the
    longest block) gives each request the cycle `decide` gives it alone: its own grammar's
    masks, accepted count, bonus token; a non-finite row fails its request only where it
    decides a published token."""
    from flash_planner.engine.loop.acceptance import StrictAcceptance
    from flash_planner.engine.loop.speculative import (
        Block,
        NonFiniteLogits,
        cycle_from_row,
        decide,
        decide_strict_together,
    )
    from flash_planner.engine.telemetry import PhaseTimer

    engine, prompt, grammar, _ = targets("hybrid")
    vocab = engine.model_config.vocab_size
    after_think = prompt + [think_token_ids(engine.tokenizer)[1]]
    head = engine.tokenizer.encode('{"steps": [{"name": "open', add_special_tokens=False)
    gen = torch.Generator().manual_seed(0)
    # (drafts, drafts the logits favour, constrained, a NaN row)
    cases = [(head[:6], 3, True, None), (head[:2], 2, True, None), ([], 0, True, None),
             (head[:5], 5, False, None), (head[:5], 2, False, None),
             (head[:4], 1, False, 3), (head[:4], 3, False, 1)]
    t = max(len(d) for d, *_ in cases) + 1
    raw = torch.randn(len(cases), t, vocab, generator=gen)
    blocks, constraints = [], []
    for i, (drafts, favoured, constrained, nan_row) in enumerate(cases):
        for row in range(favoured):
            raw[i, row, drafts[row]] = 50.0
        if nan_row is not None:
            raw[i, nan_row, 7] = float("nan")
        c = grammar.constraint() if constrained else None
        if c is not None:
            c.reset(after_think)
        listed = list(drafts) if constrained else None
        d = torch.tensor(drafts, dtype=torch.long)
        blocks.append(Block(0, prompt[-1], torch.cat((torch.tensor([prompt[-1]]), d)), d,
                            listed, 0))
        constraints.append(c)
    rows = decide_strict_together(blocks, raw, None, constraints,
                                  [PhaseTimer() for _ in cases])
    for i, (block, c, row) in enumerate(zip(blocks, constraints, rows)):
        alone = batched = None
        try:
            alone = decide(block, raw[i, :block.k + 1], None, None, None, StrictAcceptance(),
                           PhaseTimer(), c)
        except NonFiniteLogits as exc:
            with pytest.raises(NonFiniteLogits, match=f"position {exc.position}"):
                cycle_from_row(block, row, None, None)
            continue
        batched = cycle_from_row(block, row, None, None)
        assert (batched.tokens, batched.accepted, batched.drafted) == \
            (alone.tokens, alone.accepted, alone.drafted), i
    # the cases reach what they are for: drafts accepted in full and in part (the grammar
    # forces some: they are accepted whatever the logits), a NaN row past the accepted rows
    # that fails nothing and one that fails its request
    cycles = [cycle_from_row(b, r, None, None) for b, r in zip(blocks[:6], rows[:6])]
    assert [c.accepted for c in cycles[2:]] == [0, 5, 2, 1]
    assert cycles[0].accepted >= 3 and cycles[1].accepted == 2
    with pytest.raises(NonFiniteLogits):
        cycle_from_row(blocks[6], rows[6], None, None)
