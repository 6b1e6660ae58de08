"""Triton acceptance per draft row: one program per verify row reduces over the vocabulary
once, tracking the maximum, its first index and how many logits beat the draft's own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..specs import Spec, launch

BLOCK_V = 1024


@triton.jit
def _accept_kernel(drafts, logits, relaxed, ok, k, vocab, topk, delta,
                   BLOCK_V: tl.constexpr):
    r = tl.program_id(0)                      # b * k + i
    b = r // k
    i = r % k
    row = logits + (b.to(tl.int64) * (k + 1) + i) * vocab
    d = tl.load(drafts + r)
    own = tl.load(row + d).to(tl.float32)
    best = -float("inf")
    first = vocab
    above = 0
    for off in range(0, vocab, BLOCK_V):
        idx = off + tl.arange(0, BLOCK_V)
        x = tl.load(row + idx, mask=idx < vocab, other=-float("inf")).to(tl.float32)
        above += tl.sum((x > own).to(tl.int32), axis=0)
        chunk_max = tl.max(x, axis=0)
        chunk_first = tl.min(tl.where(x == chunk_max, idx, vocab), axis=0)
        first = tl.where(chunk_max > best, chunk_first, first)   # ties keep the earlier
        best = tl.maximum(best, chunk_max)
    rel = tl.load(relaxed + r) != 0
    accept = (first == d) | (rel & (above < topk) & (best - own <= delta))
    tl.store(ok + r, accept.to(tl.int8))


def accept_rows(
    drafts: torch.Tensor,
    logits: torch.Tensor,
    relaxed: torch.Tensor,
    topk: int,
    delta: float,
) -> torch.Tensor:
    """Same contract as the reference: drafts [B, k], logits [B, k+1, V], relaxed [B, k]
    -> ok [B, k] bool."""
    b, k = drafts.shape
    if logits.shape[:2] != (b, k + 1):
        raise ValueError(f"accept_rows: logits {tuple(logits.shape)} do not fit drafts "
                         f"{tuple(drafts.shape)}")
    ok = torch.empty(b, k, dtype=torch.int8, device=drafts.device)
    if b * k:
        args = dict(drafts=drafts.to(torch.int64).contiguous(), logits=logits.contiguous(),
                    relaxed=relaxed.to(torch.int8).contiguous(), ok=ok, k=k,
                    vocab=logits.shape[-1], topk=topk, delta=float(delta))
        launch(_accept_kernel, (b * k,), args, meta())
    return ok.bool()


def meta() -> dict:
    """Constexprs and launch options (the vocabulary is walked in BLOCK_V chunks)."""
    return {"BLOCK_V": BLOCK_V, "num_warps": 4, "num_stages": 3}


# The engine hands the verify logits over in float32, whatever the model's dtype.
SPECS = (Spec.from_meta(_accept_kernel, "fp32 logits",
                        {"drafts": "*i64", "logits": "*fp32", "relaxed": "*i8", "ok": "*i8",
                         "k": "i32", "vocab": "i32", "topk": "i32", "delta": "fp32"}, meta()),)
