"""The drafter's per-token context window.

One entry per committed token: its context feature (fc-projected taps) and, per draft layer,
the key/value that feature injects. Capacity W (default 128), oldest dropped first, so each
cycle projects only the N+1 newly committed rows. At prefill it is seeded from the last
min(W, prompt length) prompt tokens; seeding can be turned off (on prompts that repeat text
verbatim the seed can steer the drafter into repeating the prompt).

Rows are kept in commit order; the attention itself does not depend on the order (RoPE is
baked into the keys and masks use the stored positions), but the order is part of the
contract and tested.
"""

from __future__ import annotations

import torch

from ..models.drafters.dflash import DFlashDrafter


class ContextWindow:
    def __init__(self, drafter: DFlashDrafter, capacity: int = 128):
        if capacity <= 0:
            raise ValueError(f"window capacity must be positive, got {capacity}")
        self.drafter = drafter
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        self.features: torch.Tensor | None = None      # [1, n, hidden]
        self.positions: torch.Tensor | None = None     # [n]
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[0])

    def append(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Add committed rows: concatenated taps [1, T, n*hidden] at positions [T], in order."""
        taps, positions = taps[:, -self.capacity:], positions[-self.capacity:]
        features = self.drafter.context_features(taps)                 # [1, T, hidden]
        kv = self.drafter.context_kv(features, positions[None])
        if self.positions is None:
            self.features, self.positions, self.kv = features, positions, kv
            return
        drop = max(0, len(self) + positions.shape[0] - self.capacity)  # oldest rows out
        self.features = torch.cat((self.features[:, drop:], features), dim=1)
        self.positions = torch.cat((self.positions[drop:], positions))
        self.kv = [(torch.cat((k0[:, drop:], k1), dim=1), torch.cat((v0[:, drop:], v1), dim=1))
                   for (k0, v0), (k1, v1) in zip(self.kv, kv)]

    def context(self, device: torch.device, dtype: torch.dtype):
        """(per-layer (k, v), positions) of the window; empty tensors when nothing is in it."""
        if self.positions is None:
            cfg = self.drafter.cfg
            empty = torch.zeros(1, 0, cfg.num_kv_heads, cfg.head_dim, device=device,
                                dtype=dtype)
            return ([(empty, empty)] * cfg.num_layers,
                    torch.zeros(0, dtype=torch.long, device=device))
        return self.kv, self.positions
