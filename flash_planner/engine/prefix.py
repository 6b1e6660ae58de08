"""Prefix state snapshots: a fixed prompt prefix is prefilled once and restored per request.

A snapshot holds everything the prefill of the prefix leaves behind: the KV rows of its
positions (FP8 bytes with their per-head scales and calibration flags), every GDN recurrent
state and conv window, the proposers' taps of the prefix rows they seed from (the DFlash
window's seed) and the MTP head's cache entries of the prefix (`Proposer.prefix_state`).
Restoring copies them back, in time proportional to their bytes, and the request prefills
only its own suffix.

A prompt with a declared prefix is always prefilled in two parts, the prefix then the rest,
with or without a snapshot: both paths run the same chunks, so restoring gives the very bits
a fresh prefill gives (FP8 scales included, which are calibrated on the first chunk).

`PrefixCache` keeps the most recently used `entries` snapshots (two catalogs, or thinking on
and off when a template puts the flag before the task, both hit).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache import InferenceState


@dataclass
class PrefixSnapshot:
    ids: tuple[int, ...]
    k: torch.Tensor                    # [n_attn, B, L, Hkv, D] (uint8 for FP8)
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    calibrated: list[bool]
    gdn_state: torch.Tensor
    gdn_conv: torch.Tensor
    taps: dict[int, torch.Tensor]      # layer -> [1, m, hidden] taps of the last m rows
    proposer_states: dict[str, object]   # method -> its own prefix state (the MTP head's)

    @property
    def nbytes(self) -> int:
        tensors = [self.k, self.v, self.k_scale, self.v_scale, self.gdn_state, self.gdn_conv,
                   *self.taps.values()]
        for state in self.proposer_states.values():
            tensors += [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
        return sum(t.nbytes for t in tensors)


def take(state: InferenceState, ids: Sequence[int], taps: dict[int, torch.Tensor],
         proposer_states: dict[str, object]) -> PrefixSnapshot:
    """Copy what the prefill of `ids` left in `state` (it holds exactly those rows)."""
    if state.length != len(ids) or state.pending:
        raise RuntimeError(f"snapshot of {len(ids)} prefix rows from a state holding "
                           f"{state.length} (+{state.pending} pending)")
    kv, gdn, n = state.kv, state.gdn, len(ids)
    return PrefixSnapshot(tuple(ids), kv.k[:, :, :n].clone(), kv.v[:, :, :n].clone(),
                          kv.k_scale.clone(), kv.v_scale.clone(), list(kv.calibrated),
                          gdn.state.clone(), gdn.conv.clone(),
                          {t: x.clone() for t, x in taps.items()}, dict(proposer_states))


def restore(state: InferenceState, snap: PrefixSnapshot) -> None:
    """Make `state` hold the prefix, as if it had just been prefilled."""
    state.reset()
    kv, gdn, n = state.kv, state.gdn, len(snap.ids)
    kv.k[:, :, :n].copy_(snap.k)
    kv.v[:, :, :n].copy_(snap.v)
    kv.k_scale.copy_(snap.k_scale)
    kv.v_scale.copy_(snap.v_scale)
    kv.calibrated = list(snap.calibrated)
    gdn.state.copy_(snap.gdn_state)
    gdn.conv.copy_(snap.gdn_conv)
    state.length = n


class PrefixCache:
    """The most recently used snapshots, by prefix ids."""

    def __init__(self, entries: int):
        if entries < 1:
            raise ValueError(f"prefix cache entries must be >= 1, got {entries}")
        self.entries = entries
        self._snaps: collections.OrderedDict[tuple[int, ...], PrefixSnapshot] = \
            collections.OrderedDict()

    def get(self, ids: Sequence[int]) -> PrefixSnapshot | None:
        snap = self._snaps.get(tuple(ids))
        if snap is not None:
            self._snaps.move_to_end(snap.ids)
        return snap

    def put(self, snap: PrefixSnapshot) -> None:
        self._snaps[snap.ids] = snap
        self._snaps.move_to_end(snap.ids)
        while len(self._snaps) > self.entries:
            self._snaps.popitem(last=False)

    def clear(self) -> None:
        self._snaps.clear()

    def __len__(self) -> int:
        return len(self._snaps)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._snaps.values())
