"""Flash-Next's per-sequence state beside the KV cache and the GDN state (cache.py).

- Each PLE layer's conv window: the last (K-1) n normed rows [B, W, hc * H], float32.
- The n-gram history: the last n-1 token ids [B, n-1] (EOS at a sequence's start), one for
  every PLE layer (they hash the same ids).
- Each full-attention layer's raw indexer keys [B, capacity, D], by position like the KV
  cache: the indexer pools complete blocks of them afresh every forward, so no pooled block
  is kept that a rollback would have to undo.

A forward keeps its block's rows (the window and history before it, then the block), so that
committing n of its rows puts back exactly the window and history after row n: a rollback
in O(1), with no per-step copies.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class FlashState:
    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype,
                 device: torch.device):
        fn = cfg.flash_next
        wide = fn.hc_count * cfg.hidden_size
        self.eos, self.context = fn.eos_id, fn.ngram_size - 1
        self.ple_window = {i: torch.zeros(batch, fn.ple_conv_window, wide, device=device)
                           for i in fn.ple_layers}
        self.history = torch.full((batch, self.context), fn.eos_id, dtype=torch.long,
                                  device=device)
        dim = fn.indexer.head_dim if fn.indexer else 0
        self.index_keys = {i: torch.zeros(batch, capacity, dim, dtype=dtype, device=device)
                           for i in (cfg.full_attention_layers if fn.indexer else ())}
        self._rows: dict[int, torch.Tensor] = {}       # the last forward's [window, block]
        self._ids: torch.Tensor | None = None           # its [history, block ids]

    @property
    def nbytes(self) -> int:
        return (sum(t.nbytes for t in self.ple_window.values()) + self.history.nbytes
                + sum(t.nbytes for t in self.index_keys.values()))

    def open(self, ids: torch.Tensor) -> torch.Tensor:
        """A forward over ids [B, T]: returns the history before them and moves it past
        them (`commit` moves it back when fewer rows are kept)."""
        before = self.history.clone()
        self._ids = torch.cat([before, ids.long()], dim=1)
        self.history.copy_(self._ids[:, -self.context:])
        return before

    def keep_rows(self, layer: int, rows: torch.Tensor) -> None:
        """A PLE layer's [window, block] rows of this forward (for `commit`)."""
        self._rows[layer] = rows

    def commit(self, n: int, pending: int) -> None:
        """Keep the first n of the last forward's `pending` rows."""
        if n < pending:
            for layer, window in self.ple_window.items():
                window.copy_(self._rows[layer][:, n:n + window.shape[1]])
            self.history.copy_(self._ids[:, n:n + self.context])
        self._rows.clear()
        self._ids = None

    def reset(self) -> None:
        for window in self.ple_window.values():
            window.zero_()
        self.history.fill_(self.eos)
        self._rows.clear()
        self._ids = None

    def save(self, length: int) -> tuple:
        return ({i: w.clone() for i, w in self.ple_window.items()}, self.history.clone(),
                {i: k[:, :length].clone() for i, k in self.index_keys.items()})

    def load(self, copy: tuple) -> None:
        windows, history, keys = copy
        for i, w in windows.items():
            self.ple_window[i].copy_(w)
        self.history.copy_(history)
        for i, k in keys.items():
            self.index_keys[i][:, :k.shape[1]].copy_(k)
