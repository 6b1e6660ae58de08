"""DFlash2's grouped dynamic causal convolution around each draft sublayer.

One projection of a sublayer's normed input gives per-row kernel deltas for two sides: side 0
convolves that input before the sublayer, side 1 convolves the sublayer's output before the
residual add (the residual itself is never convolved). Along the block, tap t mixes row i
with row i-t; rows before the block's first are zeros (the anchor row never sees the
context through the conv). The kernel of channel c at row i and tap t is a static
per-channel `base_kernel[side, t, c]` plus a delta shared by the group of `group` adjacent
channels c // group: y[i, c] = sum_t (base[s, t, c] + delta[i, s, t, c // group]) x[i-t, c].
Facts: z-lab's DFlash2 reference and vLLM's port (the published key layout: `base_kernel`
[2, k, H], `kernel_projection.weight` [2 * k * H / group, H]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SIDES = 2   # before the sublayer (0), after it (1)


class GroupedDynamicConv(nn.Module):
    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()        # sizes checked with the config (DraftConfig.check_target)
        self.kernel, self.group, self.groups = kernel, group, hidden // group
        self.base_kernel = nn.Parameter(torch.empty(SIDES, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, SIDES * kernel * self.groups, bias=False)

    def deltas(self, u: torch.Tensor) -> torch.Tensor:
        """The sublayer's normed input [B, T, H] -> per-row deltas [B, T, 2, k, G]."""
        return self.kernel_projection(u).unflatten(-1, (SIDES, self.kernel, self.groups))

    def mix(self, x: torch.Tensor, deltas: torch.Tensor, side: int) -> torch.Tensor:
        """Convolve rows x [B, T, H] along T with side `side` of the kernels."""
        t_len = x.shape[1]
        out = torch.zeros_like(x)
        for tap in range(min(self.kernel, t_len)):
            shifted = F.pad(x, (0, 0, tap, 0))[:, :t_len]                  # row i -> x[i-tap]
            grouped = shifted.unflatten(-1, (self.groups, self.group))
            delta = deltas[:, :, side, tap, :, None].to(x.dtype)
            out = out + shifted * self.base_kernel[side, tap] + (grouped * delta).flatten(-2)
        return out
