"""A Flash-Next target's decode and verify forwards of one sequence, compiled (compiled.py's
docstring says why and how the shapes stay static).

What a Flash-Next forward does outside the tensors is done before its graph runs: the n-gram
history moves past the block and each PLE layer's n-gram rows are read from the table's
shards (host I/O, one batched read a layer per forward) into the bucket's input buffers.
Inside: the streams, hyper-mixers, PLE gates and dilated conv (its window updated in place,
the block's [window, block] rows kept for the commit), GDN and MoE as the qwen target's
static layers run them, and the indexer's full-attention layers through one op
(flash_next/qsa_attention.py) that reads the cache's rows in use. The whole model is one
graph per (1, row bucket): Flash-Next's layers are not packed into spans.

Batches of slots run eager (a batch's forwards are the qwen target's alone), and so does
Flash-Next's MTP module.
"""

from __future__ import annotations

import torch
from torch import nn

from ...state.cache import InferenceState
from ..qwen.layers import rope_cos_sin
from ..qwen.moe import RoutingRecord
from .static_graphs import StaticGraphs, layer_cache


def flash_next_forward(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor,
                       embeddings: tuple[torch.Tensor | None, ...],
                       caches: tuple[tuple[torch.Tensor, ...], ...],
                       ples: tuple[tuple[torch.Tensor, ...] | None, ...],
                       index_keys: tuple[torch.Tensor | None, ...], key_rows: torch.Tensor,
                       valid: torch.Tensor, window_rows: torch.Tensor):
    """The model on static shapes; per layer its n-gram rows, state views, PLE views and
    indexer keys (None where it has none). -> (logits [B, T, V], each layer's mean of its
    streams but the last's, the streams after the last layer, the last mixer's output, the
    MoE ids per layer, per row 1 where its logits are finite)."""
    rope = model.cfg.rope
    x = model.embed_tokens(ids)
    cos, sin = rope_cos_sin(positions, rope.rotary_dim, rope.theta, x.dtype)
    streams = x.repeat(1, 1, model.cfg.flash_next.hc_count)
    means, routes = [], []
    for i, layer in enumerate(model.layers):
        streams, routed = layer.step_static(streams, embeddings[i], caches[i], ples[i],
                                            index_keys[i], cos, sin, positions, key_rows,
                                            valid, window_rows)
        routes.append(routed)
        if i < len(model.layers) - 1:
            means.append(streams.unflatten(-1, (-1, model.cfg.hidden_size)).mean(dim=-2))
    final, _ = model.hyper_connection_mixer(streams)
    logits = model.logits(final)
    return logits, means, streams, final, routes, logits.sum(dim=-1).isfinite().long()


class StaticFlashNext(StaticGraphs):
    """`FlashNextModel.forward` for blocks of up to max_block rows of the engine's own
    sequence, through one compiled graph per row bucket."""

    part = "target"
    records = True

    def __init__(self, model: nn.Module, state: InferenceState, max_block: int,
                 cache_dir: str | None = None):
        super().__init__(state, max_block, cache_dir, model.embed_tokens.weight.device)
        self.model = model
        self.whole = self._compile(flash_next_forward)
        fn, flash, device = model.cfg.flash_next, state.flash, self.device
        dtype = model.embed_tokens.weight.dtype
        wide = fn.hc_count * model.cfg.hidden_size
        self.ple_at = [i for i, layer in enumerate(model.layers) if layer.ple is not None]
        window = fn.ple_conv_window
        self.ids = {key: torch.zeros(key, dtype=torch.long, device=device)
                    for key in self.keys}
        self.embeddings = {key: tuple(torch.zeros(*key, fn.ple_embed_dim, dtype=dtype,
                                                  device=device) if i in self.ple_at else None
                                      for i in range(len(model.layers)))
                           for key in self.keys}
        # per bucket, each PLE layer's [window, block] rows and the rows its window keeps
        self.kept = {key: {i: torch.zeros(key[0], window + key[1], wide, device=device)
                           for i in self.ple_at} for key in self.keys}
        self.keep = {key: torch.zeros(key[0], window, dtype=torch.long, device=device)
                     for key in self.keys}
        # per bucket and layer, what its PLE reads and writes (window, kept rows, rows kept)
        self.ples = {key: tuple((flash.ple_window[i], self.kept[key][i], self.keep[key])
                                if i in self.ple_at else None for i in range(len(model.layers)))
                     for key in self.keys}
        self.caches = {rec: tuple(layer_cache(state, i, rec) for i in range(len(model.layers)))
                       for rec in (False, True)}
        self.index_keys = tuple(flash.index_keys.get(i) for i in range(len(model.layers)))

    def accepts(self, ids: torch.Tensor, state: InferenceState, record_steps: bool) -> bool:
        """Whether this forward can run compiled (`fits`): the engine's own sequence, a
        block of more than one row only when it records its steps (prefill stays eager)."""
        b, t = ids.shape
        return self.fits(state, b, t) and (t == 1 or record_steps)

    def run(self, ids: torch.Tensor, state: InferenceState, record_steps: bool,
            taps: tuple[int, ...], all_logits: bool, routing: RoutingRecord | None):
        """`FlashNextModel.forward` of a block `accepts` took -> (logits, taps, finite)."""
        model, flash = self.model, state.flash
        m, t = ids.shape
        history = flash.open(ids)
        key, valid, window_rows = self._begin(state, t, record_steps)
        padded = key != (m, t)
        (self.ids[key][:m, :t] if padded else self.ids[key]).copy_(ids)
        for i in self.ple_at:
            rows = model.layers[i].ple.embed(history, ids, self.embeddings[key][i].dtype)
            (self.embeddings[key][i][:m, :t] if padded else self.embeddings[key][i]).copy_(rows)
        self._stage_keep(key, t)
        logits, means, streams, final, routes, finite = self._run(key, valid, window_rows)
        for i in self.ple_at:
            flash.keep_rows(i, self.kept[key][i])
        rows = slice(0, t) if all_logits else slice(t - 1, t)
        h, last = model.cfg.hidden_size, len(model.layers) - 1
        tapped = []
        for tap in taps:
            if tap < last:
                tapped.append(means[tap][:m, :t])
            elif tap == last:
                tapped.append(final[:m, :t])
            else:
                s = model.mtp_taps.index(tap)
                tapped.append(streams[:m, :t, s * h:(s + 1) * h])
        return self._hand_out(key, m, t, logits[:m, rows], finite[:m, rows], tapped, routes,
                              routing)

    def _stage_keep(self, key: tuple[int, int], t: int) -> None:
        """Which rows of [window, block] each PLE window keeps: those after the t real
        rows."""
        keep = self.keep[key]
        torch.add(torch.arange(keep.shape[1], device=self.device), t, out=keep[0])

    def _warm_state(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        self._stage_keep(key, key[1])
        return super()._warm_state(key)

    def _forward(self, key: tuple[int, int], valid: torch.Tensor, window_rows: torch.Tensor):
        rec = key[1] > 1          # blocks of several rows record their steps
        return self.whole.call(key, self.model, self.ids[key], self.positions[key],
                               self.embeddings[key], self.caches[rec], self.ples[key],
                               self.index_keys, self.key_rows, valid, window_rows)
