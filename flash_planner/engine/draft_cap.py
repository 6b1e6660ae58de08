"""How many drafts an `auto` request may make per cycle in a batch, chosen by measurement.

Alone, a request's `auto` routing weighs each proposer's drafts against plain decoding by
its own cycles. In a batch the cost of a cycle is shared: every running request's drafting
runs one after another and the verify grows with the longest block, so what is worth it for
one request may not be for eight (on a CPU a verify of 8 x 16 rows costs about twice one of
8 x 1; on a GPU about the same). `DraftCap` measures the whole batch's tokens per second
under each cap, per number of running requests (a request's drafting that is not batched,
such as the MTP head's, costs the cycle once per request: seven running requests are not
four), takes the best and probes the others now and then as `auto` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# None: no cap (each request drafts what its own routing chooses); 0: plain decoding
CAPS: tuple[int | None, ...] = (None, 4, 0)
SETTLED = 2          # samples before a cap's estimate is trusted


@dataclass
class _Rate:
    tokens_per_ms: float
    samples: int
    last_cycle: int


class DraftCap:
    def __init__(self, caps: tuple[int | None, ...] = CAPS, probe_every: int = 16,
                 smoothing: float = 0.3, clock: Callable[[], float] = time.perf_counter):
        if not caps:
            raise ValueError("DraftCap needs at least one cap to choose")
        self.caps = caps
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.clock = clock                 # seconds; tests pass a virtual one
        self.rates: dict[tuple[int, int | None], _Rate] = {}
        self.cycles = 0

    def choose(self, running: int) -> int | None:
        known = {c: self.rates.get((running, c)) for c in self.caps}
        for cap, rate in known.items():
            if rate is None or rate.samples < SETTLED:
                return cap
        best = max(known, key=lambda c: known[c].tokens_per_ms)
        top = known[best].tokens_per_ms
        for cap, rate in known.items():
            due = min(8 * self.probe_every,
                      self.probe_every * (top / max(rate.tokens_per_ms, 1e-9)) ** 2)
            if cap != best and self.cycles - rate.last_cycle >= due:
                return cap
        return best

    def record(self, running: int, cap: int | None, tokens: int, seconds: float) -> None:
        """A cycle of `running` requests under `cap` published `tokens` in `seconds`."""
        self.cycles += 1
        key = (running, cap)
        value = tokens / max(seconds * 1000.0, 1e-6)
        rate = self.rates.get(key)
        if rate is None:
            self.rates[key] = _Rate(value, 1, self.cycles)
            return
        rate.tokens_per_ms += self.smoothing * (value - rate.tokens_per_ms)
        rate.samples += 1
        rate.last_cycle = self.cycles
