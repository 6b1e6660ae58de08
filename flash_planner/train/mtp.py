"""Train the demo's MTP head on the frozen target and write it into the target checkpoint.

The head is the engine's own `MTPHead` (upstream `mtp.*` naming). Row p of pass 1 reads the
target's normed last hidden h_p and the embedding of token p+1 and learns the target's
greedy token after p+1. Pass s > 1 unrolls the chain as inference runs it: row p reads the
head's own pass s-1 output of row p-1 and attends to the pass-1 keys of rows <= p-s+1 and to
the pass-j key of row p-s+j (j = 2..s), exactly the cache a draft step s sees. Passes are
weighted STEP_DECAY^(s-1); only answer tokens count. The target (embedding and head
included) stays frozen; the result is added to the target's model.safetensors as `mtp.*`
with `mtp_num_hidden_layers: 1` in its config.json, the layout of Qwen3.5/3.6 releases.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from ..engine.checkpoint import MTP_PREFIX, read_config
from ..engine.models.drafters.mtp import MTPHead
from ..engine.models.qwen.layers import apply_rope, rope_cos_sin
from .target import TrainSettings, frozen_target, optimise

STEP_DECAY = 0.8


def chain_mask(rows: int, step: int) -> torch.Tensor:
    """[rows, step*rows] bool: which keys of passes 1..step row p of pass `step` sees."""
    p = torch.arange(rows)[:, None]
    i = torch.arange(rows)[None, :]
    blocks = [i <= p - step + 1] + [i == p - step + j for j in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


def head_pass(head: MTPHead, embedded: torch.Tensor, hidden: torch.Tensor,
              keys: list[torch.Tensor], values: list[torch.Tensor], cos, sin,
              mask: torch.Tensor) -> torch.Tensor:
    """One pass of the head over every row (training: no cache); appends this pass's keys
    and values to `keys` / `values` and returns the normed outputs [N, S, H]."""
    layer = head.layers[0]
    attn = layer.self_attn
    x = head.fuse(embedded, hidden)
    (q, k, v), post = layer.pre_mixer(x)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys.append(k)
    values.append(v)
    n, s = q.shape[:2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), torch.cat(keys, dim=1).transpose(1, 2),
        torch.cat(values, dim=1).transpose(1, 2), attn_mask=mask,
        scale=attn.head_dim ** -0.5, enable_gqa=attn.num_heads != attn.num_kv_heads)
    core = out.transpose(1, 2).reshape(n, s, -1)
    return head.norm(layer.post_mixer(x, core, post))


def mtp_loss(head: MTPHead, target, ids: torch.Tensor, mask: torch.Tensor,
             depth: int) -> torch.Tensor:
    with torch.no_grad():
        hidden = target.model(input_ids=ids).last_hidden_state           # normed [N, S, H]
        greedy = target.lm_head(hidden).argmax(dim=-1)                   # token after each row
    embed = target.get_input_embeddings()
    n, s = ids.shape
    # Row p reads token p+1 and learns the target's token after p+1; the last row has none.
    embedded = embed(torch.cat((ids[:, 1:], ids[:, -1:]), dim=1))
    labels = torch.cat((greedy[:, 1:], greedy[:, -1:]), dim=1)
    valid = torch.zeros_like(mask)
    valid[:, :-2] = mask[:, 2:]
    positions = torch.arange(s).expand(n, s)
    cos, sin = rope_cos_sin(positions, head.cfg.rope.rotary_dim, head.cfg.rope.theta,
                            embedded.dtype)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total, weight = 0.0, 0.0
    for step in range(1, depth + 1):
        out = head_pass(head, embedded, hidden, keys, values, cos, sin, chain_mask(s, step))
        logits = out @ embed.weight.T if target.lm_head is None else target.lm_head(out)
        ok = valid.clone()
        ok[:, :step - 1] = False                 # rows with no chain this deep
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             reduction="none").view(n, s)
        w = STEP_DECAY ** (step - 1)
        total = total + w * (ce * ok).sum() / ok.sum().clamp_min(1)
        weight += w
        # the next pass reads this pass's output of the row before
        hidden = torch.cat((out[:, :1], out[:, :-1]), dim=1)
    return total / weight


def save_head(head: MTPHead, target_dir: Path) -> None:
    """Rewrite target_dir's model.safetensors with `mtp.*` (replacing any earlier head) and
    declare the head in config.json."""
    weights = target_dir / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(MTP_PREFIX)}
    tensors.update({MTP_PREFIX + k: v.detach().contiguous()
                    for k, v in head.state_dict().items()})
    save_file(tensors, str(weights), metadata={"format": "pt"})
    cfg_file = target_dir / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def train_mtp(examples: Sequence[tuple[list[int], list[int]]], target_dir: str | Path,
              pad_id: int, depth: int = 3, settings: TrainSettings | None = None,
              log=print, init: str | Path | None = None) -> list[float]:
    """Train against the frozen target in target_dir and add the head to it; init: a target
    directory whose head (`mtp.*`) to go on training."""
    target_dir = Path(target_dir)
    settings = settings or TrainSettings(steps=600, batch_size=16, lr=1e-3)
    target = frozen_target(target_dir, settings)
    cfg = replace(read_config(target_dir), mtp_layers=1, mtp_dedicated_embeddings=False)
    head = MTPHead(cfg).train()
    if init is not None:
        with safe_open(str(Path(init) / "model.safetensors"), framework="pt") as f:
            head.load_state_dict({k[len(MTP_PREFIX):]: f.get_tensor(k) for k in f.keys()
                                  if k.startswith(MTP_PREFIX)})
    log(f"[mtp] {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters, chain "
        f"depth {depth}, {settings.steps} steps of {settings.batch_size}")
    losses = optimise("mtp", head, examples, pad_id, settings,
                      lambda ids, mask, _rng: mtp_loss(head, target, ids, mask, depth), log)
    save_head(head.eval(), target_dir)
    return losses
