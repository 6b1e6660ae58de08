"""Training smoke test: tiny dimensions, a few steps; the loss falls and the outputs load."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
import transformers
from packaging.version import Version
from safetensors.torch import load_file

from flash_planner.engine.checkpoint import load_checkpoint
from flash_planner.engine.models.drafters.dflash import DFlashDrafter, load_drafter
from flash_planner.train.drafter import (
    DrafterSpec,
    drafter_loss,
    run_blocks,
    sample_anchors,
    train_drafter,
)
from flash_planner.train.drafter2 import SelectorSpec, grow, selector_loss, train_dflash2
from flash_planner.train.target import (
    TargetSpec,
    TrainSettings,
    answer_loss,
    frozen_outputs,
    frozen_target,
    length_bucketed_batches,
    optimise,
    pad_batch,
    prefix_states,
    shared_prefix,
    train_target,
)

VOCAB, PAD, EOS, MASK = 48, 0, 1, 2
SPEC = TargetSpec(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                  head_dim=16, linear_key_heads=2, linear_key_dim=8, linear_value_heads=2,
                  linear_value_dim=16)


def _examples(n=64):
    """Prompt 'a b c' then the answer: the prompt's tokens counted up by one."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(3, VOCAB - 8) for _ in range(6)]
        answer = [t + 1 for t in prompt] + [EOS]
        out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def test_target_and_drafter_training_reduce_loss_and_write_loadable_checkpoints(tmp_path):
    data = _examples()
    steps = TrainSettings(steps=40, batch_size=16, lr=5e-3, warmup=5, log_every=5)
    losses = train_target(data, VOCAB, EOS, PAD, tmp_path / "target", SPEC, steps,
                          log=lambda _: None)
    assert losses[-1] < losses[0] * 0.8
    target = load_checkpoint(tmp_path / "target", with_tokenizer=False)
    assert target.config.is_hybrid and target.config.tie_word_embeddings

    spec = DrafterSpec(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64, block_size=4, tap_ids=(1, 3),
                       anchors_per_sequence=4)
    d_losses = train_drafter(data, tmp_path / "target", MASK, PAD, tmp_path / "drafter", spec,
                             TrainSettings(steps=30, batch_size=8, lr=5e-3, warmup=5,
                                           log_every=5), log=lambda _: None)
    assert d_losses[-1] < d_losses[0]
    drafter = load_drafter(tmp_path / "drafter", target.config, torch.float32, "cpu")
    assert drafter.cfg.block_size == 4 and drafter.cfg.tap_ids == (1, 3)

    # grown into a DFlash2 drafter: trained, written in the published layout, loadable
    grown = SelectorSpec(conv_group_size=8, selector_rank=4, selector_top_k=4,
                         anchors_per_sequence=4)
    g_losses = train_dflash2(data, tmp_path / "target", tmp_path / "drafter", PAD,
                             tmp_path / "dflash2", grown,
                             TrainSettings(steps=10, batch_size=8, lr=5e-3, warmup=2,
                                           log_every=5), log=lambda _: None)
    assert all(math.isfinite(x) for x in g_losses)
    drafter2 = load_drafter(tmp_path / "dflash2", target.config, torch.float32, "cpu")
    assert drafter2.cfg.selects and drafter2.cfg.selector_top_k == 4
    assert drafter2.candidate_selector.successor_codebook.abs().sum() > 0   # it trained

    # the selector's loss carries its signal: full-batch steps on the selector alone lower it
    model = grow(tmp_path / "drafter", grown).train()
    frozen = frozen_target(tmp_path / "target", TrainSettings())
    ids, mask = pad_batch(data, PAD)
    anchors = sample_anchors(mask, 4, random.Random(1))
    opt = torch.optim.Adam(model.candidate_selector.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = selector_loss(model, run_blocks(model, frozen, ids, mask, anchors, 128))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]


def test_length_bucketed_batches_cover_the_epoch_with_little_padding():
    rng = random.Random(1)
    lengths = [rng.randrange(20, 200) for _ in range(1000)]
    batches = length_bucketed_batches(lengths, 32, random.Random(0))
    flat = [i for b in batches for i in b]
    assert all(len(b) == 32 for b in batches)
    assert len(flat) == len(set(flat)) and len(lengths) - len(flat) < 32
    waste = sum(max(lengths[i] for i in b) * 32 - sum(lengths[i] for i in b) for b in batches)
    shuffled = list(range(len(lengths)))
    random.Random(0).shuffle(shuffled)
    plain = sum(max(lengths[i] for i in shuffled[j:j + 32]) * 32
                - sum(lengths[i] for i in shuffled[j:j + 32]) for j in range(0, 992, 32))
    assert waste < plain / 4
    assert batches == length_bucketed_batches(lengths, 32, random.Random(0))   # seeded


@pytest.mark.parametrize("buckets", [False, True])
def test_batches_by_group_hold_one_group_each_and_draw_every_group(buckets):
    """Batches of one catalog each, so that their rows share the system prompt."""
    model = torch.nn.Linear(1, 1)
    examples = [([i + 3] * (1 + i % 5), [1] * (1 + i % 5)) for i in range(60)]
    groups = [i % 3 == 0 for i in range(60)]
    seen = []

    def loss_fn(ids, mask, rng):
        seen.append([int(i) - 3 for i in ids[:, 0]])
        return model(torch.ones(1, 1)).sum()
    settings = TrainSettings(steps=20, batch_size=4, warmup=1, length_buckets=buckets)
    optimise("t", model, examples, PAD, settings, loss_fn, lambda _: None, groups=groups)
    assert len(seen) == 20 and all(len(batch) == 4 for batch in seen)
    assert all(len({groups[i] for i in batch}) == 1 for batch in seen)
    assert {groups[batch[0]] for batch in seen} == {True, False}
    assert all(len(set(batch)) == 4 for batch in seen)
    with pytest.raises(ValueError, match="fewer examples than one batch"):
        optimise("t", model, examples, PAD, replace(settings, batch_size=32), loss_fn,
                 lambda _: None, groups=groups)


def test_drafter_learns_the_targets_greedy_tokens_not_the_corpus(tmp_path):
    """Target labels = the corpus exactly where the corpus is the target's own greedy text."""
    data = _examples(16)
    train_target(data, VOCAB, EOS, PAD, tmp_path / "target", SPEC,
                 TrainSettings(steps=2, batch_size=8, log_every=5), log=lambda _: None)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(tmp_path / "target")).eval()
    spec = DrafterSpec(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64, block_size=4, tap_ids=(1, 3))
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec.config(32, VOCAB, MASK, 4))
    ids, mask = pad_batch(data[:4], PAD)
    anchors = [[6, 7], [6, 8], [7, 9], [6, 6]]
    greedy = ids.clone()
    with torch.no_grad():
        for p in range(6, ids.shape[1]):            # the answer, decoded greedily
            greedy[:, p] = target(input_ids=greedy[:, :p]).logits[:, -1].argmax(-1)
        assert not torch.equal(greedy, ids)         # an untrained target: not the corpus
        losses = {(name, labels_from_target): drafter_loss(drafter, target, seq, mask, anchors,
                                                           128, labels_from_target)
                  for name, seq in (("corpus", ids), ("greedy", greedy))
                  for labels_from_target in (True, False)}
    assert torch.equal(losses["greedy", True], losses["greedy", False])
    assert not torch.isclose(losses["corpus", True], losses["corpus", False])


def _shared_prompt_batch():
    """Rows of unlike lengths that share a prompt longer than a GDN chunk (64 tokens)."""
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(70)]
    rows = []
    for n_prompt, n_answer in ((3, 5), (9, 12), (1, 30), (6, 9), (2, 21), (4, 3)):
        prompt = shared + [rng.randrange(3, VOCAB) for _ in range(n_prompt)]
        answer = [rng.randrange(3, VOCAB) for _ in range(n_answer)] + [EOS]
        rows.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return pad_batch(rows, PAD)


def test_answer_loss_runs_the_shared_prompt_once_with_the_loss_and_gradient_of_one_pass():
    """The sliced pass that runs the shared prompt once per slice gives the loss and the
    gradient of one plain pass over the padded batch."""
    from transformers import Qwen3_5ForCausalLM

    ids, mask = _shared_prompt_batch()
    rows = ids.shape[0]
    assert shared_prefix(ids, mask) == 70      # the prompts part after `shared`
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(SPEC.hf_config(VOCAB, EOS, PAD)).train()
    # not the fallback, with the cache layout of transformers 5.24 (5.2's Qwen3.5 cache is
    # laid out otherwise: the loss then runs the whole rows, checked the same below)
    if Version(transformers.__version__) >= Version("5.24"):
        assert prefix_states(model, ids[:1, :70], rows)[0] is not None

    def gradient(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    logits = model(input_ids=ids).logits[:, :-1]
    labels = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
    plain = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                              ignore_index=-100)
    want = gradient(plain)
    for groups in (1, 3):
        loss = answer_loss(model, ids, mask, groups=groups)
        assert torch.allclose(loss, plain, rtol=1e-5, atol=0)
        got = gradient(loss)
        assert (got - want).norm() <= 1e-4 * want.norm()


def test_frozen_outputs_match_one_plain_pass_where_the_loss_reads_them():
    """The drafter's view of the frozen target, run in slices with the shared prompt once:
    the tapped hidden states of every row up to its end and the greedy tokens at its answer
    are those of one plain pass over the padded batch."""
    from transformers import Qwen3_5ForCausalLM

    ids, mask = _shared_prompt_batch()
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(SPEC.hf_config(VOCAB, EOS, PAD)).eval()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    want = torch.cat([out.hidden_states[layer] for layer in (2, 4)], dim=-1)
    want_greedy = out.logits[:, :-1].argmax(dim=-1)
    for groups in (1, 4):
        hidden, greedy = frozen_outputs(model, ids, mask, (2, 4), groups=groups)
        assert hidden.shape == want.shape and not hidden.requires_grad
        for row in range(ids.shape[0]):
            end = int(mask[row].nonzero().max()) + 1
            assert torch.allclose(hidden[row, :end], want[row, :end], atol=1e-5, rtol=1e-4)
            answer = mask[row, 1:].nonzero().flatten() + 1
            assert torch.equal(greedy[row, answer], want_greedy[row, answer - 1])


def test_each_stage_retrains_bit_for_bit(tmp_path):
    """`make demo-model` rebuilds the shipped files exactly: the target, the drafter and the
    MTP head, each trained twice from the same seed, write the same bytes."""
    import shutil

    from flash_planner.train.mtp import train_mtp

    data = _examples(48)
    quiet = dict(log=lambda _: None)
    settings = TrainSettings(steps=4, batch_size=8, lr=5e-3, warmup=2, log_every=5, seed=3)
    spec = DrafterSpec(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64, block_size=4, tap_ids=(1, 3),
                       anchors_per_sequence=4)
    written = []
    for run in ("a", "b"):
        root = tmp_path / run
        train_target(data, VOCAB, EOS, PAD, root / "target", SPEC, settings, **quiet)
        train_drafter(data, root / "target", MASK, PAD, root / "drafter", spec, settings,
                      **quiet)
        shutil.copytree(root / "target", root / "with_mtp")
        train_mtp(data, root / "with_mtp", PAD, 2, settings, **quiet)
        written.append([(root / part / "model.safetensors").read_bytes()
                        for part in ("target", "drafter", "with_mtp")])
    assert written[0] == written[1]
    assert written[0][0] != written[0][2]          # the head was added to the target's file
    # each part goes on from the weights it is given (the rounds of both catalogs)
    root, on = tmp_path / "a", tmp_path / "on"
    none = replace(settings, steps=0)
    train_target(data, VOCAB, EOS, PAD, on / "target", settings=none, init=root / "target",
                 **quiet)
    train_drafter(data, root / "target", MASK, PAD, on / "drafter", spec, none,
                  init=root / "drafter", **quiet)
    shutil.copytree(root / "target", on / "with_mtp")
    train_mtp(data, on / "with_mtp", PAD, 2, none, init=root / "with_mtp", **quiet)
    for part in ("target", "drafter", "with_mtp"):
        assert (load_file(str(on / part / "model.safetensors"))
                .keys() == load_file(str(root / part / "model.safetensors")).keys())
        for name, tensor in load_file(str(on / part / "model.safetensors")).items():
            assert torch.equal(tensor, load_file(str(root / part / "model.safetensors"))[name])


def test_a_stopped_target_run_resumes_to_the_bytes_of_an_unstopped_one(tmp_path, monkeypatch):
    """`make demo-model` keeps the target's training state every RESUME_EVERY steps: a run
    stopped after some of them and started again writes the same file as a run never
    stopped, and the state file is gone at the end."""
    from flash_planner.train import target as target_mod

    monkeypatch.setattr(target_mod, "RESUME_EVERY", 3)
    data = _examples(48)
    settings = TrainSettings(steps=8, batch_size=8, lr=5e-3, warmup=2, log_every=1, seed=3)
    train_target(data, VOCAB, EOS, PAD, tmp_path / "whole", SPEC, settings, log=lambda _: None)

    class Stop(Exception):
        pass

    def stop_at_step_7(line):
        if "step 7/" in line:
            raise Stop
    state = tmp_path / "state" / "target.pt"
    with pytest.raises(Stop):
        train_target(data, VOCAB, EOS, PAD, tmp_path / "stopped", SPEC, settings,
                     log=stop_at_step_7, resume=state)
    assert state.is_file()                             # written after step 6
    lines = []
    train_target(data, VOCAB, EOS, PAD, tmp_path / "stopped", SPEC, settings,
                 log=lines.append, resume=state)
    assert any("resumed at step 6" in line for line in lines)
    assert not state.exists()
    assert ((tmp_path / "stopped" / "model.safetensors").read_bytes()
            == (tmp_path / "whole" / "model.safetensors").read_bytes())
    other = TrainSettings(steps=8, batch_size=8, lr=4e-3, warmup=2, log_every=1, seed=3)
    with pytest.raises(Stop):                          # a state of other settings is not read
        train_target(data, VOCAB, EOS, PAD, tmp_path / "x", SPEC, settings,
                     log=stop_at_step_7, resume=state)
    lines = []
    train_target(data, VOCAB, EOS, PAD, tmp_path / "x", SPEC, other, log=lines.append,
                 resume=state)
    assert not any("resumed" in line for line in lines)
