"""Train the demo DFlash drafter on the frozen target's tapped hidden states.

The block-anchor recipe: per sequence, random anchors where the answer is; each block
[x_a, mask x (B-1)] at positions a..a+B-1 attends bidirectionally inside itself and to the
context rows strictly before its anchor (at most `window` of them, as at inference), and
never to other blocks. Row k predicts x[a+k] (k = 0 is not trained), weighted by
exp(-(k-1)/gamma). The target (embeddings and lm_head included) stays frozen. The result is
written in the upstream on-disk format.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..engine.config import RopeConfig
from ..engine.models.drafters.dflash import DFlashDrafter, DraftConfig
from .target import TrainSettings, frozen_outputs, frozen_target, optimise

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass(frozen=True)
class DrafterSpec:
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 48
    intermediate_size: int = 512
    block_size: int = 16
    tap_ids: tuple[int, ...] = (1, 2, 3)
    anchors_per_sequence: int = 8
    window: int = 128

    def config(self, hidden: int, vocab: int, mask_id: int, n_target: int) -> DraftConfig:
        return DraftConfig(
            hidden_size=hidden, intermediate_size=self.intermediate_size,
            num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, vocab_size=vocab,
            rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0, rotary_dim=self.head_dim),
            block_size=self.block_size, mask_token_id=mask_id, tap_ids=self.tap_ids,
            layer_causal=(False,) * self.num_layers, layer_window=(None,) * self.num_layers,
            num_target_layers=n_target)


def sample_anchors(mask: torch.Tensor, k: int, rng: random.Random) -> list[list[int]]:
    """Per sequence, k anchor positions a whose next token is an answer token."""
    out = []
    for row in mask:
        positions = [a for a in range(row.shape[0] - 1) if row[a + 1]]
        out.append([rng.choice(positions) for _ in range(k)])
    return out


@dataclass
class Blocks:
    """A batch of training blocks through the drafter: per draft row (block rows 1..B-1)."""

    hidden: torch.Tensor     # [M, B-1, H] the drafter's normed output
    logits: torch.Tensor     # [M, B-1, V] its draft logits
    goal: torch.Tensor       # [M, B-1] the token each row should draft
    weight: torch.Tensor     # [M, B-1] exp(-(k-1)/gamma) where the goal is an answer token
    anchor: torch.Tensor     # [M] the block's anchor token


def run_blocks(drafter: DFlashDrafter, target, ids: torch.Tensor, mask: torch.Tensor,
               anchors: list[list[int]], window: int, target_labels: bool = True) -> Blocks:
    """Blocks at `anchors` of the sequences `ids` [N, S] through the drafter.

    target_labels: row k learns the frozen target's greedy next token at a+k-1 instead of
    the corpus token x[a+k]. Verification accepts what the target would emit, not what the
    corpus says: where the corpus picks one of several paraphrases at random, the target
    commits to one, and the drafter should learn that one.
    """
    cfg = drafter.cfg
    b = cfg.block_size
    # groups=1: the drafter's batches are length-bucketed, so slicing them would add passes
    # and save no padding (0.16 s against 0.26 s in four slices, a batch of 16 demo rows)
    taps, greedy = frozen_outputs(target, ids, mask, [t + 1 for t in cfg.tap_ids], groups=1)
    labels = greedy if target_labels else ids
    n, s = ids.shape
    positions = torch.arange(s)
    features = drafter.context_features(taps)                          # [N, S, H]
    ctx_kv = drafter.context_kv(features, positions.expand(n, s))      # per layer [N, S, ..]
    seq = torch.tensor([i for i, row in enumerate(anchors) for _ in row])
    start = torch.tensor([a for row in anchors for a in row])          # [N*K]
    block_ids = torch.full((len(start), b), cfg.mask_token_id, dtype=torch.long)
    block_ids[:, 0] = ids[seq, start]
    embed = target.get_input_embeddings()
    hidden = drafter(embed(block_ids), start, [(k[seq], v[seq]) for k, v in ctx_kv],
                     positions, context_window=window)[:, 1:]
    logits = drafter.draft_logits(hidden, embed.weight)                # [N*K, B-1, V]
    goal_pos = start[:, None] + torch.arange(1, b)                     # [N*K, B-1]
    valid = goal_pos < s
    goal_pos = goal_pos.clamp(max=s - 1)
    valid &= mask[seq[:, None], goal_pos]
    decay = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / GAMMA.get(b, b / 2.3))
    return Blocks(hidden, logits, labels[seq[:, None], goal_pos], decay[None, :] * valid,
                  block_ids[:, 0])


def weighted_ce(logits: torch.Tensor, goal: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits [..., C] against goal [...], averaged under weight [...]."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), goal.reshape(-1),
                         reduction="none").view_as(goal)
    return (ce * weight).sum() / weight.sum().clamp_min(1e-6)


def drafter_loss(drafter: DFlashDrafter, target, ids: torch.Tensor, mask: torch.Tensor,
                 anchors: list[list[int]], window: int,
                 target_labels: bool = True) -> torch.Tensor:
    """The weighted block cross-entropy of the blocks at `anchors` (`run_blocks`)."""
    blocks = run_blocks(drafter, target, ids, mask, anchors, window, target_labels)
    return weighted_ce(blocks.logits, blocks.goal, blocks.weight)


def save_drafter(drafter: DFlashDrafter, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(drafter.cfg.to_hf_dict(), indent=2))
    tensors = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def train_drafter(examples: Sequence[tuple[list[int], list[int]]], target_dir: str | Path,
                  mask_id: int, pad_id: int, out_dir: str | Path,
                  spec: DrafterSpec | None = None, settings: TrainSettings | None = None,
                  log=print, groups: Sequence[int] | None = None,
                  init: str | Path | None = None) -> list[float]:
    """Train against the frozen target in target_dir and save to out_dir; returns losses.
    groups: batches of one group each (`optimise`); init: a drafter directory of the same
    spec to go on training (`save_drafter`'s layout)."""
    spec = spec or DrafterSpec()
    settings = settings or TrainSettings(steps=600, batch_size=16, lr=1e-3)
    target = frozen_target(target_dir, settings)
    tcfg = target.config
    drafter = DFlashDrafter(spec.config(tcfg.hidden_size, tcfg.vocab_size, mask_id,
                                        tcfg.num_hidden_layers)).train()
    if init is not None:
        drafter.load_state_dict(load_file(str(Path(init) / "model.safetensors")))
    params = sum(p.numel() for p in drafter.parameters())
    log(f"[drafter] {params / 1e6:.2f}M parameters, block {spec.block_size}, "
        f"{settings.steps} steps of {settings.batch_size} x {spec.anchors_per_sequence} blocks")

    def loss_fn(ids, mask, rng):
        anchors = sample_anchors(mask, spec.anchors_per_sequence, rng)
        return drafter_loss(drafter, target, ids, mask, anchors, spec.window)

    losses = optimise("drafter", drafter, examples, pad_id, settings, loss_fn, log,
                      groups=groups)
    save_drafter(drafter.eval(), out_dir)
    return losses
