"""Synthetic training corpus and tokenizer: determinism, valid plans, held-out split, masks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from flash_planner.planning.grounding import RequestWords
from flash_planner.planning.parse import PlanRefused, parse_plan
from flash_planner.planning.prompt import REFUSAL_HINT
from flash_planner.train import corpus, names, refusals
from flash_planner.train.corpus import (
    FAMILIES,
    REFUSE,
    answer_text,
    encode,
    heldout_combos,
    heldout_sets,
    make_corpus,
    prompt_text,
    render,
)
from flash_planner.train.evaluate import grounded
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
def sets():
    return heldout_sets(seed=0, n=N_HELDOUT)


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


def test_every_answer_is_a_valid_plan_or_a_refusal(splits, sets, catalog):
    for ex in splits[0] + splits[1] + sets["unseen"] + sets["inexpressible"]:
        if ex.refusal:
            with pytest.raises(PlanRefused) as refused:
                parse_plan(answer_text(ex), catalog)
            assert refused.value.reason == ex.refusal and ex.plan == []
            continue
        # the catalog's grounded arguments: what the planner's grammar admits for the task
        steps, thinking = parse_plan(answer_text(ex), catalog,
                                     words=RequestWords.of(ex.task, ex.context))
        assert steps == ex.plan
        assert 1 <= len(steps) <= corpus.MAX_STEPS
        assert thinking == (ex.thinking or "")


def test_string_arguments_are_written_in_the_task_or_scene(splits, sets):
    for ex in splits[0] + splits[1] + sets["unseen"]:
        for step in ex.plan:
            for value in step["args"].values():
                if isinstance(value, str):
                    assert value in ex.task or value in ex.context, (value, ex)
        assert grounded(ex.plan, ex.task, ex.context), ex


def test_grounded_needs_every_name_written_in_the_request():
    plan = [{"skill": "navigate_to", "args": {"target": "shelf 2"}},
            {"skill": "pick", "args": {"object": "green box"}},
            {"skill": "wait", "args": {"seconds": 5}}]
    assert grounded(plan, "Take the Green Box from shelf 2, then wait 5 s")
    assert grounded(plan, "Take the green box", "It is on shelf 2.")
    assert not grounded(plan, "Take the green bin from shelf 2")       # a swapped name
    assert not grounded(plan, "Take the green box from shelf 24")      # words, not substrings
    assert not grounded([{"skill": "pick", "args": {"object": "the"}}], "take the box")


def test_families_and_step_counts_in_both_splits(splits):
    train, heldout = splits
    for split in (train, heldout):
        families = Counter(ex.family for ex in split)
        assert set(families) - {REFUSE} == set(FAMILIES)
        assert min(families[f] for f in FAMILIES) >= (
            0.4 * len(split) / sum(corpus.WEIGHTS.values()) * (1 - corpus.REFUSE_SHARE
                                                               if split is train else 1))
        steps = Counter(len(ex.plan) for ex in split if not ex.refusal)
        assert set(steps) == {1, 2, 3, 4, 5}
        assert steps[1] >= 0.15 * len(split)  # short plans are not starved
    assert families[REFUSE] == 0
    refused = sum(ex.family == REFUSE for ex in train)
    assert refused == round(corpus.REFUSE_SHARE * len(train))
    hinted = sum(ex.hint for ex in train)
    assert 0.4 * len(train) < hinted < 0.6 * len(train)     # both prompts are trained
    assert not any(ex.hint for ex in heldout)


def test_the_hint_reaches_the_training_prompt(splits):
    with_hint = next(ex for ex in splits[0] if ex.hint)
    without = next(ex for ex in splits[0] if not ex.hint)
    assert REFUSAL_HINT in prompt_text(with_hint)
    assert REFUSAL_HINT not in prompt_text(without)


def _words(examples, with_answers=True):
    out = set()
    for ex in examples:
        text = " ".join((ex.task, ex.context, answer_text(ex) if with_answers else ""))
        out |= set(re.findall(r"\b[a-z]+\b", text.lower()))
    return out


def test_unseen_names_never_occur_in_training(splits, sets):
    train_words = _words(splits[0])
    unseen = sets["unseen"]
    names_used = {v for ex in unseen for s in ex.plan for v in s["args"].values()
                  if isinstance(v, str) and s["skill"] != "say"}
    assert len(names_used) > 0.8 * len(unseen)          # mostly fresh names per task
    train_text = " ".join(f" {ex.task} {ex.context} {answer_text(ex)} " for ex in splits[0])
    for name in names_used:
        assert not re.search(rf"\b{re.escape(name)}\b", train_text), name
        words = re.findall(r"\b[a-z]+\b", name)           # not the "c" of "locker 27c"
        assert [w for w in words if w not in train_words], f"all of {name!r} was trained"
        # only a door may keep the common word "door" ("east door")
        assert all(w not in train_words for w in words if w != "door"), name
    # the words of the closed worlds and of the templates are never held out
    assert not {w for w in names.train_only_words() if names.is_heldout(w)}
    open_train = [ex for ex in splits[0] if ex.family != REFUSE
                  and not set(ex.combo[1:]) & names.closed_names()]
    assert len(open_train) > 0.3 * len(splits[0])


def test_open_names_are_compositional_numbered_and_made_up(sets):
    names_used = [v for ex in sets["unseen"] for s in ex.plan for v in s["args"].values()
                  if isinstance(v, str) and s["skill"] != "say"]
    assert any(re.search(r" \d+[a-d]?$", n) for n in names_used)       # "cell 14", "row 3b"
    assert sum(len(n.split()) >= 2 for n in names_used) > 0.4 * len(names_used)
    assert any(len(n.split()) >= 3 for n in names_used)


def test_training_names_put_made_up_words_in_every_slot(splits):
    """Not only the nouns: the heads of numbered names ("kryndfir 12") and the adjectives of
    three-word names are made up too, where held-out names bring words never trained."""
    list_words = {w for words in (names.OBJECT_NOUNS, names.HOLDER_NOUNS, names.DOOR_NOUNS,
                                  names.ADJECTIVES, names.PLACE_MODIFIERS,
                                  names.NUMBERED_PLACES, names.NUMBERED_OBJECTS)
                  for w in words} | {p for p, _ in names.PLACE_NOUNS}
    used = {v for ex in splits[0] if ex.plan for s in ex.plan for v in s["args"].values()
            if isinstance(v, str) and s["skill"] != "say"} - names.closed_names()
    numbered = [n.split()[0] for n in used if re.fullmatch(r"[a-z]+ \d+[a-d]?", n)]
    three = [w for n in used if len(n.split()) == 3 for w in n.split()[:2]]
    for words in (numbered, three):
        made_up = sum(w not in list_words for w in words)
        assert len(words) > 100 and 0.15 < made_up / len(words) < 0.7


def test_refusals_use_actions_never_refused_in_training(splits, sets):
    trained = {ex.refusal for ex in splits[0] if ex.refusal}
    held = sets["inexpressible"]
    assert all(ex.refusal and ex.family == REFUSE for ex in held)
    reasons = Counter(ex.refusal for ex in held)
    assert reasons[refusals.VAGUE_REASON] >= 0.1 * len(held)
    action_reasons = set(reasons) - {refusals.VAGUE_REASON}
    assert len(action_reasons) >= 10 and not action_reasons & trained
    assert set(refusals.side(refusals.ACTIONS, "train")).isdisjoint(
        refusals.side(refusals.ACTIONS, "heldout"))
    # a clause the catalog can do does not make a task with one it cannot expressible
    assert any(" to " in ex.task.lower() and ex.refusal != refusals.VAGUE_REASON
               for ex in held)


def test_vague_tasks_refused_in_training_are_never_the_heldout_ones(splits, sets):
    held = set(refusals.vague("heldout"))
    assert held and held.isdisjoint(refusals.vague("train"))
    trained_tasks = " ".join(ex.task.lower() for ex in splits[0] if ex.refusal)
    assert any(v in trained_tasks for v in refusals.TRAIN_VAGUE)
    held_vague = [ex.task.lower() for ex in sets["inexpressible"]
                  if ex.refusal == refusals.VAGUE_REASON]
    assert held_vague and all(any(v in task for v in held) for task in held_vague)


def test_some_training_say_texts_are_unquoted_and_the_heldout_ones_quoted(splits, sets):
    def quoted(ex):
        return all(f'"{s["args"]["text"]}"' in ex.task or f"'{s['args']['text']}'" in ex.task
                   for s in ex.plan if s["skill"] == "say")

    says = [ex for ex in splits[0] if any(s["skill"] == "say" for s in ex.plan)]
    bare = [ex for ex in says if not quoted(ex)]
    assert 0.2 * len(says) < len(bare) < 0.4 * len(says)       # UNQUOTED_SAY of them
    assert all(s["args"]["text"] in ex.task for ex in bare for s in ex.plan
               if s["skill"] == "say")
    held = [ex for name in ("world", "unseen") for ex in sets[name]]
    assert all(quoted(ex) for ex in held)


def test_heldout_combinations_never_occur_in_training(splits):
    train, heldout = splits
    train_keys = {ex.combo for ex in train}     # open-vocabulary ones included
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
    off = next(ex for ex in splits[0] if ex.thinking is None and not ex.refusal)
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


def test_the_corpus_does_not_depend_on_string_hashing():
    """`make demo-model` is reproducible bit for bit: no set order leaks into the corpus."""
    code = ("import hashlib; from flash_planner.train.corpus import heldout_sets, make_corpus, "
            "render; h = hashlib.sha256(); "
            "[h.update(render(e).encode()) for e in make_corpus(0, 400, 40)[0]]; "
            "[h.update(render(e).encode()) for s in heldout_sets(0, 40).values() for e in s]; "
            "print(h.hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2")}
    assert len(digests) == 1
