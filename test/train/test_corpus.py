"""Synthetic training corpus and tokenizer: determinism, valid plans, held-out split, masks."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from flash_planner.planning.parse import parse_plan
from flash_planner.train import corpus
from flash_planner.train.corpus import (
    FAMILIES,
    answer_text,
    encode,
    heldout_combos,
    make_corpus,
    prompt_text,
    render,
)
from flash_planner.train.tokenizer import (
    EOS,
    MASK,
    THINK_CLOSE,
    THINK_OPEN,
    load_tokenizer,
    train_tokenizer,
)

N_TRAIN, N_HELDOUT = 3000, 300


@pytest.fixture(scope="module")
def splits():
    return make_corpus(seed=0, n_train=N_TRAIN, n_heldout=N_HELDOUT)


@pytest.fixture(scope="module")
def catalog():
    return corpus.default_catalog()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, splits):
    out = tmp_path_factory.mktemp("tok")
    ids = train_tokenizer([render(e) for e in splits[0][:1000]], out, vocab_size=500)
    tok = load_tokenizer(out)
    return tok, ids


def test_same_seed_same_corpus(splits):
    again = make_corpus(seed=0, n_train=N_TRAIN, n_heldout=N_HELDOUT)
    assert again == splits
    other = make_corpus(seed=1, n_train=200, n_heldout=50)
    assert other[0] != splits[0][:200]


def test_every_answer_is_a_valid_plan(splits, catalog):
    for ex in splits[0] + splits[1]:
        steps, thinking = parse_plan(answer_text(ex), catalog)
        assert steps == ex.plan
        assert 1 <= len(steps) <= corpus.MAX_STEPS
        assert thinking == (ex.thinking or "")


def test_string_arguments_are_written_in_the_task_or_scene(splits):
    for ex in splits[0] + splits[1]:
        for step in ex.plan:
            for value in step["args"].values():
                if isinstance(value, str):
                    assert value in ex.task or value in ex.context, (value, ex)


def test_families_and_step_counts_in_both_splits(splits):
    train, heldout = splits
    for split in (train, heldout):
        families = Counter(ex.family for ex in split)
        assert set(families) == set(FAMILIES)
        assert min(families.values()) >= 0.4 * len(split) / sum(corpus.WEIGHTS.values())
        steps = Counter(len(ex.plan) for ex in split)
        assert set(steps) == {1, 2, 3, 4, 5}
        assert steps[1] >= 0.15 * len(split)  # short plans are not starved


def test_heldout_combinations_never_occur_in_training(splits):
    train, heldout = splits
    train_keys = {ex.combo for ex in train}
    assert not train_keys & {ex.combo for ex in heldout}
    for ex in heldout:
        assert ex.combo in heldout_combos(ex.family)
    for family in FAMILIES:
        held, space = heldout_combos(family), corpus.combo_space(family)
        assert 2 <= len(held) <= 0.2 * len(space) + 2
        # the training split draws only outside the held-out set (streaming too)
    stream = corpus.iter_examples(seed=0)
    for _ in range(300):
        ex = next(stream)
        assert ex.combo not in heldout_combos(ex.family)


def test_scene_changes_the_plan(splits):
    moved = [ex for ex in splits[0] if ex.family == "fetch" and ex.context
             and ex.plan[0]["args"].get("target") not in (None, ex.combo[1])]
    assert moved, "no fetch example starts at a place given by the scene"
    assert any(len(ex.plan) == 1 for ex in splits[0] if ex.family in ("open", "close"))


def test_thinking_off_renders_empty_think_block_and_json_answer(splits, tokenizer):
    tok, _ = tokenizer
    off = next(ex for ex in splits[0] if ex.thinking is None)
    on = next(ex for ex in splits[0] if ex.thinking is not None)
    assert prompt_text(off, tok).endswith(f"<|im_start|>assistant\n{THINK_OPEN}\n\n"
                                          f"{THINK_CLOSE}\n\n")
    assert answer_text(off) == json.dumps({"plan": off.plan})
    assert prompt_text(on, tok).endswith("<|im_start|>assistant\n")
    assert answer_text(on).startswith(f"{THINK_OPEN}\n{on.thinking}\n{THINK_CLOSE}\n\n")
    for ex in (off, on):  # the plain-Python template mirror renders the same text
        assert render(ex, tok) == render(ex)
        assert render(ex, tok).endswith(answer_text(ex) + EOS)


def test_loss_mask_covers_exactly_answer_and_end_of_turn(splits, tokenizer):
    tok, ids = tokenizer
    for ex in splits[0][:40] + splits[1][:20]:
        input_ids, mask = encode(ex, tok)
        assert len(input_ids) == len(mask)
        start = mask.index(1)
        assert mask == [0] * start + [1] * (len(mask) - start)
        assert input_ids[-1] == ids["eos_id"]
        assert tok.decode(input_ids[start:]) == answer_text(ex) + EOS
        assert tok.decode(input_ids[:start]) == prompt_text(ex, tok)
        if ex.thinking is not None:  # no token straddles the prompt/answer seam
            assert input_ids == tok.encode(render(ex, tok), add_special_tokens=False)


def test_tokenizer_round_trips_and_keeps_think_tokens(splits, tokenizer):
    tok, ids = tokenizer
    for ex in splits[0][:50] + splits[1][:50]:
        text = render(ex, tok)
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    thought = next(ex for ex in splits[1] if ex.thinking is not None)
    answer_ids = tok.encode(answer_text(thought), add_special_tokens=False)
    assert answer_ids[0] == ids["think_open_id"]
    assert ids["think_close_id"] in answer_ids
    decoded = tok.decode(answer_ids, skip_special_tokens=True)
    assert THINK_OPEN in decoded and THINK_CLOSE in decoded
    assert THINK_OPEN not in tok.all_special_tokens


def test_mask_token_is_special_and_in_vocab(tokenizer):
    tok, ids = tokenizer
    assert MASK in tok.all_special_tokens
    assert tok.convert_tokens_to_ids(MASK) == ids["mask_id"] == tok.mask_token_id
    assert tok.eos_token == EOS and tok.eos_token_id == ids["eos_id"]
    assert tok.pad_token_id == ids["pad_id"]
    assert ids["mask_id"] < ids["vocab_size"] == len(tok)
    assert tok.encode(f"a{MASK}b", add_special_tokens=False).count(ids["mask_id"]) == 1
