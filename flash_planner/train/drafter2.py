"""Grow a DFlash2 drafter from a trained DFlash drafter, against the same frozen target.

The DFlash weights carry over unchanged. The new parts start where they change nothing: each
conv is the identity (tap 0 of its base kernel 1, later taps 0, no deltas) and the
selector's successor codebook is zero, so the pair scores are the head's logits and the walk
drafts what the argmax drafted. Training then adds to the DFlash block loss the selector's
own: at each draft row whose goal token is among the head's top-K candidates, cross-entropy
over those candidates of the pair score after the true predecessor (the anchor at the first
row), weighted as the block loss is. The result is written in the published DFlash2 layout.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from ..engine.models.drafters.dflash import DFLASH2, DFlashDrafter, DraftConfig
from .drafter import Blocks, run_blocks, sample_anchors, save_drafter, weighted_ce
from .target import TrainSettings, frozen_target, optimise


@dataclasses.dataclass(frozen=True)
class SelectorSpec:
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 32
    selector_top_k: int = 8
    anchors_per_sequence: int = 8
    window: int = 128


def grown_config(cfg: DraftConfig, spec: SelectorSpec) -> DraftConfig:
    return dataclasses.replace(cfg, architecture=DFLASH2,
                               conv_kernel_size=spec.conv_kernel_size,
                               conv_group_size=spec.conv_group_size,
                               selector_rank=spec.selector_rank,
                               selector_top_k=spec.selector_top_k)


def grow(drafter_dir: str | Path, spec: SelectorSpec | None, seed: int = 0) -> DFlashDrafter:
    """The DFlash drafter in `drafter_dir` as a DFlash2 drafter that drafts as it does (spec
    None: the DFlash drafter itself, to train on as a control)."""
    from safetensors.torch import load_file

    drafter_dir = Path(drafter_dir)
    raw = json.loads((drafter_dir / "config.json").read_text())
    cfg = DraftConfig.from_hf_dict(raw, str(drafter_dir))
    if spec is None:
        model = DFlashDrafter(cfg)
        model.load_state_dict(load_file(str(drafter_dir / "model.safetensors")))
        return model
    cfg = grown_config(cfg, spec)
    model = DFlashDrafter(cfg)
    missing, unexpected = model.load_state_dict(
        load_file(str(drafter_dir / "model.safetensors")), strict=False)
    if unexpected or any(not ("_conv." in k or k.startswith("candidate_selector."))
                         for k in missing):
        raise ValueError(f"{drafter_dir} is not a DFlash drafter of this shape: missing "
                         f"{missing}, unexpected {unexpected}")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
        selector = model.candidate_selector
        scale = cfg.hidden_size ** -0.5
        selector.hidden_projection.weight.copy_(
            torch.randn(selector.hidden_projection.weight.shape, generator=gen) * scale)
        selector.predecessor_codebook.copy_(
            torch.randn(selector.predecessor_codebook.shape, generator=gen))
        selector.successor_codebook.zero_()
    return model


def selector_loss(drafter: DFlashDrafter, blocks: Blocks) -> torch.Tensor:
    """Cross-entropy over each row's top-K candidates of the pair score after the true
    predecessor, on rows whose goal is a candidate."""
    selector = drafter.candidate_selector
    unary, cand = blocks.logits.topk(selector.top_k, dim=-1)           # [M, B-1, K]
    preds = torch.cat((blocks.anchor[:, None], blocks.goal[:, :-1]), dim=1)
    query = selector.hidden_projection(blocks.hidden)                  # [M, B-1, r]
    a = selector.predecessor_codebook[preds] * query
    scores = unary + (a[:, :, None, :] * selector.successor_codebook[cand]).sum(-1)
    hit = cand == blocks.goal[..., None]
    return weighted_ce(scores, hit.int().argmax(-1), blocks.weight * hit.any(-1))


def train_dflash2(examples: Sequence[tuple[list[int], list[int]]], target_dir: str | Path,
                  drafter_dir: str | Path, pad_id: int, out_dir: str | Path,
                  spec: SelectorSpec | None = None, settings: TrainSettings | None = None,
                  log=print, control: bool = False) -> list[float]:
    """Grow the DFlash drafter in drafter_dir, train it against the frozen target in
    target_dir and save it to out_dir; returns the losses. control: train the DFlash
    drafter itself the same way instead (block loss only), to tell what DFlash2's parts
    add from what more training adds."""
    spec = spec or SelectorSpec()
    settings = settings or TrainSettings(steps=400, batch_size=16, lr=5e-4)
    target = frozen_target(target_dir, settings)
    drafter = grow(drafter_dir, None if control else spec, settings.seed).train()
    name = "dflash (control)" if control else "dflash2"
    new = sum(p.numel() for n, p in drafter.named_parameters()
              if "_conv." in n or n.startswith("candidate_selector."))
    log(f"[{name}] {new / 1e3:.0f}k new parameters (convs, selector), block "
        f"{drafter.cfg.block_size}, {settings.steps} steps")

    def loss_fn(ids, mask, rng):
        anchors = sample_anchors(mask, spec.anchors_per_sequence, rng)
        blocks = run_blocks(drafter, target, ids, mask, anchors, spec.window)
        loss = weighted_ce(blocks.logits, blocks.goal, blocks.weight)
        return loss if control else loss + selector_loss(drafter, blocks)

    losses = optimise(name, drafter, examples, pad_id, settings, loss_fn, log)
    save_drafter(drafter.eval(), out_dir)
    return losses
