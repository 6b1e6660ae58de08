"""Prefix state snapshots: a fixed prompt prefix is prefilled once and restored per request.

A snapshot holds everything the prefill of the prefix leaves behind: the KV rows of its
positions (FP8 bytes with their per-head scales and calibration flags), every GDN recurrent
state and conv window, the proposers' taps of the prefix rows they seed from (the DFlash
window's seed) and the MTP head's cache entries of the prefix (`Proposer.prefix_state`).
Restoring copies them back, in time proportional to their bytes, and the request prefills
only its own suffix.

A prompt with a declared prefix is always prefilled in two parts, the prefix then the rest,
with or without a snapshot: both paths run the same chunks, so restoring gives the very bits
a fresh prefill gives (FP8 scales included: calibrated on the first chunk, or the
checkpoint's own, kv_scales.py).

Restoring is `InferenceState.load(snapshot.state)`. `PrefixCache` keeps the most recently
used `entries` snapshots (two catalogs, or thinking on and off when a template puts the flag
before the task, both hit).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache import InferenceState, StateCopy


@dataclass(frozen=True)
class PrefixSnapshot:
    ids: tuple[int, ...]
    state: StateCopy                   # the target's state after the prefix
    taps: dict[int, torch.Tensor]      # layer -> [1, m, hidden] taps of the last m rows
    proposer_states: dict[str, object]   # method -> its own prefix state (has `nbytes`)

    @property
    def nbytes(self) -> int:
        return (self.state.nbytes + sum(t.nbytes for t in self.taps.values())
                + sum(p.nbytes for p in self.proposer_states.values()))


def take(state: InferenceState, ids: Sequence[int], taps: dict[int, torch.Tensor],
         proposer_states: dict[str, object]) -> PrefixSnapshot:
    """Copy what the prefill of `ids` left in `state` (it holds exactly those rows)."""
    if state.length != len(ids):
        raise RuntimeError(f"snapshot of {len(ids)} prefix rows from a state holding "
                           f"{state.length}")
    return PrefixSnapshot(tuple(ids), state.save(), {t: x.clone() for t, x in taps.items()},
                          dict(proposer_states))


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
