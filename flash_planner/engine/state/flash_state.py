"""Flash-Next's per-sequence state beside the KV cache and the GDN state (cache.py).

- Each PLE layer's conv window: the last (K-1) n normed rows [B, W, hc * H], float32.
- The n-gram history: the last n-1 token ids [B, n-1] (EOS at a sequence's start), one for
  every PLE layer (they hash the same ids).
- Each full-attention layer's raw indexer keys [B, capacity, D], by position like the KV
  cache: the indexer pools complete blocks of them afresh every forward, so no pooled block
  is kept that a rollback would have to undo.

A forward keeps its block's rows (the window and history before it, then the block), so that
committing n of its rows puts back exactly the window and history after row n: a rollback
in O(1), with no per-step copies. The rows of a batch's slots are views of one state
(`rows`), which share what the last forward kept: a batched forward keeps its rows once, and
each slot then commits its own count from its row of them (rows a slot only padded are past
its count, so they never enter its window or history).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig


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
        self.lo = 0                      # this view's first row of the whole state
        # the last forward's [window, block] rows per PLE layer and [history, block ids],
        # each with the first row it covers: shared by every view of one state
        self._kept: dict = {"rows": {}, "ids": None}

    def rows(self, lo: int, hi: int) -> FlashState:
        """Batch rows lo..hi-1 as a state of their own, sharing this one's storage."""
        view = object.__new__(FlashState)
        view.__dict__.update(self.__dict__)
        view.ple_window = {i: w[lo:hi] for i, w in self.ple_window.items()}
        view.history = self.history[lo:hi]
        view.index_keys = {i: k[lo:hi] for i, k in self.index_keys.items()}
        view.lo = self.lo + lo
        return view

    @property
    def nbytes(self) -> int:
        return (sum(t.nbytes for t in self.ple_window.values()) + self.history.nbytes
                + sum(t.nbytes for t in self.index_keys.values()))

    def open(self, ids: torch.Tensor) -> torch.Tensor:
        """A forward over ids [B, T]: returns the history before them and moves it past
        them (`commit` moves it back when fewer rows are kept)."""
        before = self.history.clone()
        block = torch.cat([before, ids.long()], dim=1)
        self._kept["ids"] = (block, self.lo)
        self.history.copy_(block[:, -self.context:])
        return before

    def keep_rows(self, layer: int, rows: torch.Tensor) -> None:
        """A PLE layer's [window, block] rows of this forward (for `commit`)."""
        self._kept["rows"][layer] = (rows, self.lo)

    def _mine(self, kept: tuple[torch.Tensor, int]) -> torch.Tensor:
        rows, lo = kept
        at = self.lo - lo
        return rows[at:at + self.history.shape[0]]

    def commit(self, n: int, pending: int) -> None:
        """Keep the first n of the last forward's `pending` rows."""
        if n < pending:
            for layer, window in self.ple_window.items():
                window.copy_(self._mine(self._kept["rows"][layer])[:, n:n + window.shape[1]])
            self.history.copy_(self._mine(self._kept["ids"])[:, n:n + self.context])

    def reset(self) -> None:
        for window in self.ple_window.values():
            window.zero_()
        self.history.fill_(self.eos)

    def save(self, length: int) -> tuple:
        return ({i: w.clone() for i, w in self.ple_window.items()}, self.history.clone(),
                {i: k[:, :length].clone() for i, k in self.index_keys.items()})

    @staticmethod
    def saved_nbytes(copy: tuple) -> int:
        """Bytes of a copy `save` returned."""
        windows, history, keys = copy
        return (sum(w.nbytes for w in windows.values()) + history.nbytes
                + sum(k.nbytes for k in keys.values()))

    def load(self, copy: tuple) -> None:
        windows, history, keys = copy
        for i, w in windows.items():
            self.ple_window[i].copy_(w)
        self.history.copy_(history)
        for i, k in keys.items():
            self.index_keys[i][:, :k.shape[1]].copy_(k)

    def move(self, src: int, dst: int, length: int) -> None:
        """Row src's committed state into row dst (a slot leaving the batch: slots.py)."""
        for window in self.ple_window.values():
            window[dst].copy_(window[src])
        self.history[dst].copy_(self.history[src])
        for keys in self.index_keys.values():
            keys[dst, :length].copy_(keys[src, :length])
