"""The proposers' forwards as compiled graphs: the MTP head's rows and the DFlash drafter's
block, on the same footing as the target's (compiled.py: buckets, padding, warm-up, the
on-disk cache, CUDA-graph capture)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from ..cache import InferenceState
from .compiled import (
    CapturedGraph,
    CompileReport,
    StaticGraphs,
    batch_rows,
    compile_cache_dir,
    compile_graph,
    key_mask,
    layer_cache,
    run_graph,
    span_forward,
    warm_up_report,
)
from .direct import check_direct
from .layers import rope_cos_sin


class StaticHead(StaticGraphs):
    """Runs `MTPHead.forward` for up to max_block rows as one compiled graph per bucket on
    the head's own state: the MTP proposer's drafting steps and its per-cycle catch-up. Or
    on a batch's head slots (`MTPProposer.head_slots`), whose drafts go through the head
    together over every slot (`propose_together`): `batches` (the slots' count,)."""

    part = "MTP head"

    def __init__(self, head: nn.Module, state: InferenceState, max_block: int,
                 cache_dir: str | None = None, batches: tuple[int, ...] = (1,)):
        weight = head.pre_fc_norm_hidden.weight
        super().__init__(state, max_block, cache_dir, weight.device, batches)
        if batches != (1,):
            self.part = f"batch of {batches[-1]}'s MTP head"
        self.head = head
        self.caches = {bb: (batch_rows(layer_cache(state, 0, False), bb,
                                       state.kv.k.shape[1]),) for bb in batches}
        self.graph = self._compile(_mtp_head)
        hidden, dtype = head.cfg.hidden_size, head.fc.weight.dtype
        self.inputs = {key: (torch.zeros(*key, hidden, dtype=dtype, device=self.device),
                             torch.zeros(*key, hidden, dtype=dtype, device=self.device))
                       for key in self.keys}

    def accepts(self, embedded: torch.Tensor, state: InferenceState) -> bool:
        return self.fits(state, embedded.shape[0], embedded.shape[1])

    def run(self, embedded: torch.Tensor, hidden: torch.Tensor, state: object
            ) -> torch.Tensor:
        """`MTPHead.forward` of rows `accepts` took -> normed outputs [B, T, H]."""
        b, t = embedded.shape[:2]
        key, valid, window_rows = self._begin(state, t, False)
        for buffer, rows in zip(self.inputs[key], (embedded, hidden)):
            buffer[:b, :t].copy_(rows)
        out = self._run(key, valid, window_rows)[:b, :t]
        return out.clone() if self.cuda_graphs else out

    def _forward(self, key: tuple[int, int], valid: torch.Tensor, window_rows: torch.Tensor):
        rope = self.head.cfg.rope
        return self.graph.call(key, self.head, self.caches[key[0]], *self.inputs[key],
                               self.positions[key], self.key_positions, rope.rotary_dim,
                               rope.theta, valid, window_rows)


def _mtp_head(head: nn.Module, caches: tuple[tuple[torch.Tensor, ...], ...],
              embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              key_positions: torch.Tensor, rotary_dim: int, theta: float,
              valid: torch.Tensor, window_rows: torch.Tensor) -> torch.Tensor:
    x = head.fuse(embedded, hidden)
    cos, sin = rope_cos_sin(positions, rotary_dim, theta, x.dtype)
    outs, _ = span_forward(tuple(head.layers), caches, x, cos, sin, positions,
                           key_mask(key_positions, positions), valid, window_rows)
    return head.norm(outs[-1])


class StaticDrafter:
    """The DFlash drafter's proposal (block forward and logits, or a DFlash2 selector's
    candidates and pair scores) as one compiled graph:
    the block is the proposer's fixed block size and the context window is padded to its
    capacity, its empty rows at a position no block precedes (so the drafter's own mask
    hides them)."""

    part = "DFlash drafter"

    def __init__(self, drafter: nn.Module, embed: nn.Embedding, lm_head_weight: torch.Tensor,
                 block_size: int, window: int, cache_dir: str | None = None):
        self.drafter, self.embed, self.lm_head_weight = drafter, embed, lm_head_weight
        self.block_size, self.window = block_size, window
        self.cache_dir = compile_cache_dir(cache_dir)
        device, dtype = lm_head_weight.device, lm_head_weight.dtype
        self.cuda_graphs = device.type == "cuda"
        cfg = drafter.cfg
        shape = (1, window, cfg.num_kv_heads, cfg.head_dim)
        self.ctx_kv = [(torch.zeros(shape, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(cfg.num_layers)]
        self.ctx_pos = torch.full((window,), EMPTY_POSITION, device=device)
        self.ids = torch.zeros(block_size, dtype=torch.long, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.graph = compile_graph(_dflash_drafts, self.cuda_graphs, 2, block_size)
        self.captured: CapturedGraph | None = None
        self.report: CompileReport | None = None
        self.calls = 0

    def accepts(self, ids: torch.Tensor, window_rows: int) -> bool:
        return (self.report is not None and ids.shape[0] == self.block_size
                and window_rows <= self.window)

    def propose(self, ids: torch.Tensor, start: int, ctx_kv, ctx_pos: torch.Tensor):
        """`draft_output` of the block ids [block_size] at `start` (logits [block_size - 1,
        V], or a selector's candidates and pair scores), over the window's per-layer (k, v)
        [1, n, Hkv, D] at positions ctx_pos [n] (the proposer picks the drafts)."""
        self.calls += 1
        n = ctx_pos.shape[0]
        for (k, v), (ck, cv) in zip(self.ctx_kv, ctx_kv):
            k[:, :n].copy_(ck)
            v[:, :n].copy_(cv)
        self.ctx_pos[:n].copy_(ctx_pos)
        self.ctx_pos[n:].fill_(EMPTY_POSITION)
        self.ids.copy_(ids)
        self.start.fill_(start)
        if self.graph.direct:
            return self._forward()
        out = run_graph(self.captured, self._forward)
        if self.captured is None:
            return out
        return out.clone() if isinstance(out, torch.Tensor) else tuple(t.clone() for t in out)

    def _forward(self):
        return self.graph.call(0, self.drafter, self.embed, self.lm_head_weight, self.ids,
                               self.start, self.ctx_kv, self.ctx_pos)

    def warm_up(self, progress: Callable[[str], None] | None = None) -> CompileReport:
        def once() -> None:
            t0 = time.perf_counter()
            if self.cuda_graphs:
                self.captured = CapturedGraph(self._forward)
            elif self.graph.direct:   # a block twice: through dynamo, then directly
                check_direct([self.graph], self.part, self._forward(), self._forward)
            else:
                self._forward()
            if progress is not None:
                progress(f"compiled the {self.part}'s {self.block_size}-row block "
                         f"({time.perf_counter() - t0:.1f} s)")

        self.report = warm_up_report(once, self.part, self.cuda_graphs, (self.block_size,), 1,
                                     self.cache_dir)
        return self.report


# A context row at this position follows every block, so the drafter's mask hides it.
EMPTY_POSITION = 1 << 40


def _dflash_drafts(drafter: nn.Module, embed: nn.Embedding, lm_head_weight: torch.Tensor,
                   ids: torch.Tensor, start: torch.Tensor, ctx_kv, ctx_pos: torch.Tensor):
    hidden = drafter(embed(ids)[None], start, ctx_kv, ctx_pos)          # [1, B, H]
    return drafter.draft_output(hidden[0, 1:], lm_head_weight, ids[:1])
