"""Train the demo target: a tiny Qwen3.5-style hybrid (2 GDN + 2 gated attention layers).

Training runs transformers' own Qwen3.5 implementation (its torch fallbacks have a backward
pass); the result is a standard Hugging Face checkpoint that both transformers and our
engine load. The loss covers answer tokens only. A fixed number of steps (not a time budget)
keeps a run reproducible from its seed.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import random
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# A batch's rows run in this many length-sorted slices (see `answer_loss`).
LOSS_GROUPS = 4
# steps between the writes of a resumable run's state (`optimise`)
RESUME_EVERY = 50


@dataclass(frozen=True)
class TargetSpec:
    hidden_size: int = 192
    intermediate_size: int = 768
    # two attention layers: copying names and numbers from the task is attention's job
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention") * 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 48
    linear_key_heads: int = 4
    linear_key_dim: int = 32
    linear_value_heads: int = 4
    linear_value_dim: int = 48
    partial_rotary: float = 0.5

    def hf_config(self, vocab_size: int, eos_id: int, pad_id: int):
        from transformers import Qwen3_5TextConfig

        pairs = int(self.head_dim * self.partial_rotary) // 2
        third = pairs // 3
        return Qwen3_5TextConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=len(self.layer_types), layer_types=list(self.layer_types),
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim, linear_num_key_heads=self.linear_key_heads,
            linear_key_head_dim=self.linear_key_dim,
            linear_num_value_heads=self.linear_value_heads,
            linear_value_head_dim=self.linear_value_dim, linear_conv_kernel_dim=4,
            tie_word_embeddings=True, eos_token_id=eos_id, pad_token_id=pad_id,
            max_position_embeddings=4096, initializer_range=0.02, rms_norm_eps=1e-6,
            # Qwen3.5's default mrope_section assumes head_dim 256: give one that fits.
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": self.partial_rotary,
                             "mrope_section": [pairs - 2 * third, third, third]})


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1200
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 60
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 1
    log_every: int = 25
    # batches from length-sorted pools (less padding, ~28% cheaper steps on the demo corpus)
    # or plain random batches; the demo target keeps random ones: trained bucketed for 1400
    # steps it planned 93.2% of 500 held-out tasks exactly, vs 95.4% after 1000 random ones
    length_buckets: bool = True


def pad_batch(examples: Sequence[tuple[list[int], list[int]]], pad_id: int):
    """[(ids, loss_mask)] -> ids [N, S], loss_mask [N, S] (right-padded)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for i, (row, row_mask) in enumerate(examples):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = torch.tensor(row_mask, dtype=torch.bool)
    return ids, mask


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warmup, then cosine decay to 10%."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def progress_line(name: str, step: int, total: int, loss: float, t0: float,
                  first: int = 0) -> str:
    """A progress line; `first`: the step this process began at (a resumed run)."""
    elapsed = time.perf_counter() - t0
    eta = elapsed / max(step - first, 1) * (total - step)
    return (f"[{name}] step {step}/{total}  loss {loss:.4f}  "
            f"{elapsed / 60:.1f} min elapsed, ~{eta / 60:.1f} min left")


def length_bucketed_batches(lengths: Sequence[int], batch_size: int, rng: random.Random,
                            pool: int = 16) -> list[list[int]]:
    """One epoch of batches in random order, each cut from a length-sorted pool of
    `pool` random batches' worth of examples, so a batch pads to a near-uniform length
    (random batches of the demo corpus pad ~40% of their tokens). The < batch_size
    examples left over at the end of the epoch wait for the next one."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    span = batch_size * pool
    batches = []
    for p in range(0, len(order), span):
        chunk = sorted(order[p:p + span], key=lengths.__getitem__)
        batches += [chunk[i:i + batch_size]
                    for i in range(0, len(chunk) - batch_size + 1, batch_size)]
    rng.shuffle(batches)
    return batches


def optimise(name: str, model: torch.nn.Module, examples, pad_id: int,
             settings: TrainSettings, loss_fn, log, resume: Path | None = None,
             groups: Sequence[int] | None = None) -> list[float]:
    """The loop both trainers share: shuffled (length-bucketed) batches, warmup + cosine LR,
    AdamW, gradient clipping, progress lines. loss_fn(ids, mask, rng) -> loss; rng is the
    loop's own generator (seeded from settings.seed), so a run is reproducible end to end.

    resume: a file the loop's whole state is written to every RESUME_EVERY steps (weights,
    optimizer, generators, the epoch's batches left, losses) and read back from when it holds
    a run of the same settings and data, so a stopped run goes on where it stopped and ends
    with the bytes an unstopped one writes; the caller removes it once the result is saved.

    groups: a group per example (the skill catalog its prompt lists); each batch then holds
    one group's examples, so its rows share their system prompt (`answer_loss` runs it once),
    drawn in proportion to the groups' sizes (length buckets: each epoch's every batch)."""
    rng = random.Random(settings.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95),
                            weight_decay=settings.weight_decay)
    if len(examples) < settings.batch_size:
        raise ValueError(f"{name}: {len(examples)} examples, fewer than one batch of "
                         f"{settings.batch_size}")
    lengths = [len(ids) for ids, _ in examples]
    batches: list[list[int]] = []
    order: list[int] = []
    losses, t0, first = [], time.perf_counter(), 0
    # hashing the whole corpus is only worth it for a run that keeps its state
    key = _run_key(name, settings, examples, groups) if resume is not None else None
    if resume is not None and resume.is_file():
        saved = torch.load(resume, weights_only=False)
        if saved["key"] == key:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            rng.setstate(saved["rng"])
            torch.set_rng_state(saved["torch_rng"])
            batches, order, losses, first = (saved["batches"], saved["order"],
                                             saved["losses"], saved["step"])
            log(f"[{name}] resumed at step {first} from {resume}")
    members = _members(groups) if groups is not None else []
    if any(len(m) < settings.batch_size for m in members):
        raise ValueError(f"{name}: a group has fewer examples than one batch of "
                         f"{settings.batch_size}")
    for step in range(first, settings.steps):
        if settings.length_buckets:
            if not batches:
                batches = [[m[i] for i in batch] for m in (members or [range(len(lengths))])
                           for batch in length_bucketed_batches([lengths[i] for i in m],
                                                                settings.batch_size, rng)]
                if members:         # each group's batches come in random order already
                    rng.shuffle(batches)
            batch = batches.pop()
        elif members:
            batch = _group_batch(members, order, settings.batch_size, rng)
        else:
            if len(order) < settings.batch_size:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch = [order.pop() for _ in range(settings.batch_size)]
        ids, mask = pad_batch([examples[i] for i in batch], pad_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, settings)
        loss = loss_fn(ids, mask, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"{name} loss is {loss.item()} at step {step}")
        if step % settings.log_every == 0 or step == settings.steps - 1:
            losses.append(loss.item())
            log(progress_line(name, step + 1, settings.steps, losses[-1], t0, first))
        if resume is not None and (step + 1) % RESUME_EVERY == 0:
            resume.parent.mkdir(parents=True, exist_ok=True)
            partial = resume.with_suffix(".tmp")     # a stop mid-write keeps the last state
            torch.save({"key": key, "step": step + 1, "model": model.state_dict(),
                        "opt": opt.state_dict(), "rng": rng.getstate(),
                        "torch_rng": torch.get_rng_state(), "batches": batches,
                        "order": order, "losses": losses}, partial)
            partial.replace(resume)
    return losses


def _members(groups: Sequence[int]) -> list[list[int]]:
    """The examples of each group, groups in order of their first example."""
    found: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        found.setdefault(group, []).append(i)
    return list(found.values())


def _group_batch(members: list[list[int]], orders: list, size: int,
                 rng: random.Random) -> list[int]:
    """A batch of one group, the group drawn in proportion to its size; `orders` holds each
    group's shuffled examples not yet drawn this epoch (refilled as a group runs short)."""
    if not orders:
        orders.extend([] for _ in members)
    g = rng.choices(range(len(members)), weights=[len(m) for m in members])[0]
    if len(orders[g]) < size:
        orders[g] = list(members[g])
        rng.shuffle(orders[g])
    return [orders[g].pop() for _ in range(size)]


def _run_key(name: str, settings: TrainSettings, examples, groups=None) -> str:
    """What a resumed run must share with the stopped one: the stage, settings, data."""
    what = (name, settings) if groups is None else (name, settings, tuple(groups))
    digest = hashlib.sha256(repr(what).encode())
    for ids, mask in examples:
        digest.update(array("i", [*ids, -1, *mask, -2]).tobytes())
    return f"{name} {digest.hexdigest()}"


def frozen_target(target_dir: str | Path, settings: TrainSettings):
    """The trained target for a later stage (drafter, MTP head): threads and seed set from
    `settings` first, then loaded with transformers in fp32, eval mode, no gradients."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def shared_prefix(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """How many leading tokens every row holds alike, ending before the first token the loss
    reads (the system prompt, in the demo's corpus ~116 of ~250 tokens)."""
    same = (ids == ids[:1]).all(dim=0).long().cumprod(dim=0).sum().item()
    first = mask.any(dim=0).nonzero()
    return int(min(same, (first[0].item() if len(first) else ids.shape[1]) - 1))


def cache_kwarg(model: torch.nn.Module, cache) -> dict:
    """The cache as the installed transformers' forward names it: `cache` from 5.24 on, where
    `past_key_values` still works but warns that it goes in 5.40; `past_key_values` before."""
    params = inspect.signature(type(model).forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def prefix_states(model: torch.nn.Module, prefix: torch.Tensor, rows: int,
                  hidden_states: bool = False):
    """(cache, output): the model's cache after `prefix` [1, P], repeated for `rows` rows,
    such that gradients reach the prefix's states, and the prefix pass's output (its last
    logits; every layer's hidden states if `hidden_states`). The cache is None where it is
    not laid out as transformers 5.2x lays it out (the caller then runs the whole rows). Each
    GDN layer's recurrent state is reassigned, not copied in place as the cache does at
    inference (that copy would overwrite a tensor backward reads)."""
    output = model(input_ids=prefix, use_cache=True, logits_to_keep=1,
                   output_hidden_states=hidden_states)
    # the cache the model's own forward made (transformers 5.2's Qwen3.5 has a class of its
    # own, laid out otherwise: then None below); the output names it `cache` from 5.24 on
    cache = output.get("cache", output.get("past_key_values"))
    linear = attention = 0
    for layer in getattr(cache, "layers", ()):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys.expand(rows, -1, -1, -1)
            layer.values = layer.values.expand(rows, -1, -1, -1)
            attention += 1
        conv, recurrent = (getattr(layer, "conv_states", None) or {},
                           getattr(layer, "recurrent_states", None) or {})
        for states in (conv, recurrent):
            for i, state in states.items():
                if state is not None:
                    states[i] = state.repeat(rows, *[1] * (state.dim() - 1))
        if recurrent.get(0) is not None and conv.get(0) is not None:
            def assign(new, state_idx=0, _states=recurrent, **_):
                _states[state_idx] = new
                return new
            layer.update_recurrent_state = assign
            linear += 1
    types = model.config.layer_types
    if (linear, attention) != (types.count("linear_attention"), types.count("full_attention")):
        return None, output
    return cache, output


def _loss_sum(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy on the tokens the mask marks; the rows' shared prompt
    runs once (one row) and its states are repeated for the rest."""
    k = shared_prefix(ids, mask)
    cache = prefix_states(model, ids[:1, :k], len(ids))[0] if k >= 2 else None
    k = k if cache is not None else 0
    logits = model(input_ids=ids[:, k:], **cache_kwarg(model, cache),
                   use_cache=cache is not None).logits[:, :-1]
    target = ids[:, k + 1:].masked_fill(~mask[:, k + 1:], -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                           ignore_index=-100, reduction="sum")


def answer_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                groups: int = 1) -> torch.Tensor:
    """Next-token cross-entropy on the tokens the mask marks (the answer), averaged over them.

    The batch runs as `groups` slices of rows sorted by length, each cut to its longest row,
    and the prompt the rows share runs once per slice: the same loss and gradient as one pass
    over the padded batch (up to rounding), in about a third of its time on the demo corpus.
    """
    total = mask[:, 1:].sum().clamp(min=1)
    loss = ids.new_zeros((), dtype=torch.float32)
    for rows, width in length_slices(mask, groups):
        loss = loss + _loss_sum(model, ids[rows, :width], mask[rows, :width])
    return loss / total


def length_slices(mask: torch.Tensor, groups: int) -> list[tuple[torch.Tensor, int]]:
    """The batch's rows sorted by length (to past their last marked token) in `groups`
    slices, each with the width of its longest row."""
    lengths = mask.long().cumsum(dim=1).argmax(dim=1) + 1
    return [(rows, int(lengths[rows].max()))
            for rows in torch.argsort(lengths, stable=True).chunk(groups)]


@torch.no_grad()
def frozen_outputs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                   layers: Sequence[int], groups: int = LOSS_GROUPS):
    """What later stages read of the frozen target, run as `answer_loss` runs a batch
    (length-sorted slices, the shared prompt once per slice): (hidden, greedy) with hidden
    [N, S, len(layers) * H] its `hidden_states[l]` for l in `layers` side by side, and greedy
    [N, S] its greedy token at each position (the argmax after the position before). Only
    what the callers read is computed: a row's positions past its last marked token hold
    padding's values or zeros, and greedy holds the row's own ids over its shared prompt."""
    n, s = ids.shape
    hidden = torch.zeros(n, s, len(layers) * model.config.hidden_size)
    greedy = ids.clone()
    for rows, width in length_slices(mask, groups):
        sub = ids[rows, :width]
        k = shared_prefix(sub, mask[rows, :width])
        cache, head = prefix_states(model, sub[:1, :k], len(rows), True) if k >= 2 else (None,) * 2
        k = k if cache is not None else 0
        out = model(input_ids=sub[:, k:], **cache_kwarg(model, cache),
                    use_cache=cache is not None, output_hidden_states=True)
        taps = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)
        tokens = out.logits[:, :-1].argmax(dim=-1)
        if k:
            shared = torch.cat([head.hidden_states[layer] for layer in layers], dim=-1)
            taps = torch.cat((shared.expand(len(rows), -1, -1), taps), dim=1)
            tokens = torch.cat((head.logits[:, -1].argmax(dim=-1).expand(len(rows), 1), tokens),
                               dim=1)
        hidden[rows, :width] = taps
        greedy[rows, max(k, 1):width] = tokens
    return hidden, greedy


def train_target(examples: Sequence[tuple[list[int], list[int]]], vocab_size: int,
                 eos_id: int, pad_id: int, out_dir: str | Path,
                 spec: TargetSpec | None = None, settings: TrainSettings | None = None,
                 log=print, resume: Path | None = None, init: str | Path | None = None,
                 groups: Sequence[int] | None = None) -> list[float]:
    """Train from scratch (or go on training the checkpoint in `init`; `spec` then unused)
    and `save_pretrained` to out_dir; returns the logged losses.

    examples: (input_ids, loss_mask) pairs; loss_mask[t] marks tokens to predict. resume:
    where a stopped run's state waits; groups: batches of one group each (`optimise`).
    """
    from transformers import Qwen3_5ForCausalLM

    spec, settings = spec or TargetSpec(), settings or TrainSettings()
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    if init is None:
        model = Qwen3_5ForCausalLM(spec.hf_config(vocab_size, eos_id, pad_id)).train()
    else:   # an MTP head stored beside the weights (mtp.*) is not the model's: left out
        model = Qwen3_5ForCausalLM.from_pretrained(str(init), dtype=torch.float32).train()
    params = sum(p.numel() for p in model.parameters())
    log(f"[target] {params / 1e6:.2f}M parameters, {settings.steps} steps of "
        f"{settings.batch_size}, {torch.get_num_threads()} thread(s)")
    losses = optimise("target", model, examples, pad_id, settings,
                      lambda ids, mask, _rng: answer_loss(model, ids, mask, groups=LOSS_GROUPS),
                      log, resume, groups)
    model.eval().save_pretrained(str(out_dir))
    if resume is not None:      # only once the weights it would rebuild are written
        resume.unlink(missing_ok=True)
    return losses
