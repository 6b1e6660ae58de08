"""Triton acceptance per draft row, the vocabulary split over programs.

A row's verdict needs three reductions over its logits: the maximum, the maximum's first
index, and how many logits beat the draft's own. One program per row left a 15-draft verify
at 15 programs reading 1 MB each (248k vocabulary): too few to load at the memory's speed.
Grid (rows, splits): each program reduces one chunk of its row's vocabulary and stores its
partial (max, first index, count); the last program of the row to arrive (a counter per row,
kernels/gemm/skinny.py's) combines the partials in split order, so ties go to the earlier index
as in torch.argmax, writes the verdict and resets the counter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemm.configs import COUNTERS
from ..gemm.context import context
from ..specs import Spec, launch

BLOCK_V = 1024
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4


@triton.jit
def _accept_kernel(drafts, logits, relaxed, ok, part_max, part_first, part_above, counts, k,
                   vocab, chunk, splits, topk, delta, BLOCK_V: tl.constexpr,
                   SPLITS: tl.constexpr):
    r = tl.program_id(0)                      # b * k + i
    s = tl.program_id(1)
    b = r // k
    i = r % k
    row = logits + (b.to(tl.int64) * (k + 1) + i) * vocab
    d = tl.load(drafts + r)
    own = tl.load(row + d).to(tl.float32)
    best = -float("inf")
    first = vocab
    above = 0
    lo = s * chunk
    hi = tl.minimum(vocab, lo + chunk)
    for off in range(lo, hi, BLOCK_V):
        idx = off + tl.arange(0, BLOCK_V)
        x = tl.load(row + idx, mask=idx < hi, other=-float("inf")).to(tl.float32)
        above += tl.sum((x > own).to(tl.int32), axis=0)
        chunk_max = tl.max(x, axis=0)
        chunk_first = tl.min(tl.where(x == chunk_max, idx, vocab), axis=0)
        first = tl.where(chunk_max > best, chunk_first, first)   # ties keep the earlier
        best = tl.maximum(best, chunk_max)
    last = True
    if SPLITS > 1:
        tl.store(part_max + r * splits + s, best)
        tl.store(part_first + r * splits + s, first)
        tl.store(part_above + r * splits + s, above)
        tl.debug_barrier()
        last = tl.atomic_add(counts + r, 1, sem="acq_rel") == splits - 1
        if last:                              # combine in split order: the earlier tie wins
            rs = tl.arange(0, SPLITS)
            valid = rs < splits
            m = tl.load(part_max + r * splits + rs, mask=valid, other=-float("inf"),
                        cache_modifier=".cg")
            f = tl.load(part_first + r * splits + rs, mask=valid, other=vocab,
                        cache_modifier=".cg")
            a = tl.load(part_above + r * splits + rs, mask=valid, other=0,
                        cache_modifier=".cg")
            best = tl.max(m, axis=0)
            first = tl.min(tl.where(m == best, f, vocab), axis=0)
            above = tl.sum(a, axis=0)
            tl.store(counts + r, 0)
    if last:
        rel = tl.load(relaxed + r) != 0
        accept = (first == d) | (rel & (above < topk) & (best - own <= delta))
        tl.store(ok + r, accept.to(tl.int8))


def split(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(chunk, splits): enough programs for PROGRAMS_PER_SM per SM, whole BLOCK_V steps per
    chunk, at most MAX_SPLITS (and none where the rows outnumber the counters)."""
    want = min(MAX_SPLITS, -(-PROGRAMS_PER_SM * context(device).sms // rows))
    if rows > COUNTERS:
        want = 1
    chunk = -(-max(1, -(-vocab // want)) // BLOCK_V) * BLOCK_V
    return chunk, -(-vocab // chunk)


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
        vocab = logits.shape[-1]
        chunk, splits = split(b * k, vocab, drafts.device)
        part = [torch.empty(b * k * splits, dtype=dtype, device=drafts.device)
                for dtype in (torch.float32, torch.int32, torch.int32)]
        args = dict(drafts=drafts.to(torch.int64).contiguous(), logits=logits.contiguous(),
                    relaxed=relaxed.to(torch.int8).contiguous(), ok=ok, part_max=part[0],
                    part_first=part[1], part_above=part[2],
                    counts=context(drafts.device).counters(b * k), k=k, vocab=vocab,
                    chunk=chunk, splits=splits, topk=topk, delta=float(delta))
        launch(_accept_kernel, (b * k, splits), args, meta(splits))
    return ok.bool()


def meta(splits: int) -> dict:
    """Constexprs and launch options (the vocabulary is walked in BLOCK_V steps; SPLITS: the
    power of two at or above the splits, the width of the combining step, 1 for none)."""
    return {"BLOCK_V": BLOCK_V, "SPLITS": 1 if splits == 1 else triton.next_power_of_2(splits),
            "num_warps": 4, "num_stages": 3}


# The engine hands the verify logits over in float32, whatever the model's dtype. Split: a
# 15-draft verify over the 27B's vocabulary on Thor (20 SMs: 6 splits) and an H100 (132: 36)
TYPES = {"drafts": "*i64", "logits": "*fp32", "relaxed": "*i8", "ok": "*i8",
         "part_max": "*fp32", "part_first": "*i32", "part_above": "*i32", "counts": "*i32",
         **dict.fromkeys(("k", "vocab", "chunk", "splits", "topk"), "i32"), "delta": "fp32"}
# (248320 = 16 x 15520: rows start 16-byte aligned, as Triton specializes such a launch)
ALIGNED = (*(name for name, kind in TYPES.items() if kind.startswith("*")), "vocab", "chunk")
SPECS = tuple(Spec.from_meta(_accept_kernel, label, TYPES, meta(splits),
                             shape_constexprs=("SPLITS",), aligned=ALIGNED)
              for label, splits in (("fp32 logits", 1), ("fp32 logits, split 6 (Thor)", 6),
                                    ("fp32 logits, split 36 (H100)", 36)))
