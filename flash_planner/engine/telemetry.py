"""Per-request timings and counters, reported under stable names (CLI --json, ROS, bench)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:        # the stats hold the engine's model; telemetry imports no state
    from .state.traffic import StateTraffic, TrafficModel

PHASES = ("draft", "grammar", "verify", "accept", "commit")


def now_ms() -> float:
    return time.perf_counter() * 1000.0


class PhaseTimer:
    """Wall time per loop phase. On CUDA, `sync=True` synchronizes at phase boundaries so
    the split is real (it costs a few syncs per cycle, so it is off unless profiling).

    `phase(name)` is a context manager kept per name (phases of one name never nest): a
    plain object's enter and exit cost a third of a generator-based one's, and a decode step
    of a small model on a CPU crosses five of them."""

    def __init__(self, sync: bool = False):
        self.ms = dict.fromkeys(PHASES, 0.0)
        self.sync = sync and torch.cuda.is_available()
        self._phases = {name: _Phase(self, name) for name in PHASES}

    def phase(self, name: str) -> _Phase:
        return self._phases[name]


class SharedPhase:
    """A phase several requests wait on together (a batch's verify, its drafts made in one
    forward): its wall time added to each one's timer, so that each request's phases still
    add up to the time it spent."""

    __slots__ = ("timers", "name", "t0", "sync")

    def __init__(self, timers: list[PhaseTimer], name: str):
        self.timers, self.name, self.t0 = timers, name, 0.0
        self.sync = any(t.sync for t in timers)

    def __enter__(self) -> None:
        if self.sync:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.sync:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - self.t0) * 1000.0
        for timer in self.timers:
            timer.ms[self.name] += ms


class _Phase:
    __slots__ = ("timer", "name", "t0")

    def __init__(self, timer: PhaseTimer, name: str):
        self.timer, self.name, self.t0 = timer, name, 0.0

    def __enter__(self) -> None:
        if self.timer.sync:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.timer.sync:
            torch.cuda.synchronize()
        self.timer.ms[self.name] += (time.perf_counter() - self.t0) * 1000.0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0          # request start -> first generated token known
    decode_ms: float = 0.0        # first token -> last token
    total_ms: float = 0.0
    cycles: int = 0               # decode steps after the first token (one verify each)
    drafted: int = 0              # drafts proposed over all cycles
    accepted: int = 0             # drafts accepted over all cycles
    accept_hist: list[int] = field(default_factory=list)   # cycles per accepted length
    # per drafting method (dflash, mtp; none = a cycle without drafts): cycles, accepted
    method_cycles: dict[str, int] = field(default_factory=dict)
    method_accepted: dict[str, int] = field(default_factory=dict)
    # MoE targets: per verify block size (rows), cycles and the distinct experts they touched
    # summed over sparse layers and cycles; experts_per_verify is the mean per layer
    moe_layers: int = 0
    compiled: bool = False        # decode and verify ran through compiled graphs
    verify_cycles: dict[int, int] = field(default_factory=dict)
    verify_experts: dict[int, int] = field(default_factory=dict)
    phase_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # the bytes the cycles moved besides the weights (state/traffic.py): the engine's model,
    # and per kind of cycle (verify, plain step) [cycles, rows, contexts, kept rows] summed
    traffic: TrafficModel | None = None
    traffic_sums: dict[bool, list[int]] = field(
        default_factory=lambda: {True: [0, 0, 0, 0], False: [0, 0, 0, 0]})
    # grammar-constrained requests: jump-forward tokens published, proposer drafts the
    # grammar cut from blocks, whether the thinking budget closed thinking (None:
    # unconstrained)
    # a declared prompt prefix: its tokens, whether its state came from the prefix cache
    # (None: no prefix), the restore time
    prefix_tokens: int = 0
    prefix_hit: bool | None = None
    prefix_restore_ms: float = 0.0
    prefix_cache_bytes: int = 0     # what the engine's prefix cache holds after the request
    forced_tokens: int | None = None
    grammar_cut_drafts: int | None = None
    thinking_budget_hit: bool | None = None
    seed: int | None = None         # sampled requests: the seed that reproduces them
    # a vision-language target's images: how many, their tokens in the prompt, the vision
    # tower's time for them (inside the TTFT when the tower runs at start), how many came
    # from its cache
    images: int = 0
    image_tokens: int = 0
    vision_ms: float = 0.0
    image_cache_hits: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first one, over the time spent producing them."""
        if self.new_tokens < 2 or self.decode_ms <= 0:
            return 0.0
        return (self.new_tokens - 1) / (self.decode_ms / 1000.0)

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per cycle."""
        return self.accepted / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        """Published tokens per cycle, the bonus token included."""
        return (self.new_tokens - 1) / self.cycles if self.cycles else 0.0

    @property
    def experts_per_verify(self) -> dict[int, float]:
        """Verify rows -> distinct experts one sparse layer read, on average."""
        layers = self.moe_layers or 1
        return {rows: round(self.verify_experts[rows] / (n * layers), 2)
                for rows, n in sorted(self.verify_cycles.items())}

    def record_cycle(self, drafted: int, accepted: int, method: str = "none",
                     experts: int = 0) -> None:
        self.cycles += 1
        if self.moe_layers:
            rows = drafted + 1
            self.verify_cycles[rows] = self.verify_cycles.get(rows, 0) + 1
            self.verify_experts[rows] = self.verify_experts.get(rows, 0) + experts
        self.method_cycles[method] = self.method_cycles.get(method, 0) + 1
        self.method_accepted[method] = self.method_accepted.get(method, 0) + accepted
        self.drafted += drafted
        self.accepted += accepted
        if len(self.accept_hist) <= accepted:
            self.accept_hist.extend([0] * (accepted + 1 - len(self.accept_hist)))
        self.accept_hist[accepted] += 1

    def record_traffic(self, rows: int, context: int, kept: int) -> None:
        """One cycle of `rows` rows after `context` committed tokens, `kept` committed."""
        sums = self.traffic_sums[rows > 1]
        sums[0] += 1
        sums[1] += rows
        sums[2] += context
        sums[3] += kept

    def state_traffic(self) -> StateTraffic | None:
        """What every cycle so far read and wrote besides the weights, per part."""
        if self.traffic is None:
            return None
        verify, plain = (self.traffic.cycles(*self.traffic_sums[kind], verify=kind)
                         for kind in (True, False))
        return verify.plus(plain)

    @property
    def state_bytes_per_cycle(self) -> dict[str, int]:
        """Mean bytes a cycle read and wrote besides the weights (every part together)."""
        total, per_cycle = self.state_traffic(), self.cycles or 1
        return ({"read": 0, "written": 0} if total is None else
                {"read": total.read // per_cycle, "written": total.written // per_cycle})

    def as_dict(self) -> dict[str, object]:
        per_cycle = self.cycles or 1
        other = self.decode_ms - sum(self.phase_ms.values())
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "prefill_ms": round(self.prefill_ms, 3), "ttft_ms": round(self.ttft_ms, 3),
            "prefix_tokens": self.prefix_tokens, "prefix_hit": self.prefix_hit,
            "prefix_restore_ms": round(self.prefix_restore_ms, 3),
            "prefix_cache_bytes": self.prefix_cache_bytes,
            "decode_ms": round(self.decode_ms, 3), "total_ms": round(self.total_ms, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "compiled": self.compiled,
            "cycles": self.cycles, "drafted": self.drafted, "accepted": self.accepted,
            "mean_accepted": round(self.mean_accepted, 3),
            "tokens_per_cycle": round(self.tokens_per_cycle, 3),
            "accept_hist": list(self.accept_hist),
            "method_cycles": dict(self.method_cycles),
            "method_accepted": dict(self.method_accepted),
            **({"experts_per_verify": self.experts_per_verify} if self.moe_layers else {}),
            "sampled": self.seed is not None,
            **({} if self.seed is None else {
                "seed": self.seed,
                "acceptance_rate": round(self.accepted / self.drafted, 4)
                if self.drafted else 0.0}),
            **({} if not self.images else {
                "images": self.images, "image_tokens": self.image_tokens,
                "vision_ms": round(self.vision_ms, 3),
                "image_cache_hits": self.image_cache_hits}),
            "constrained": self.forced_tokens is not None,
            **({} if self.forced_tokens is None else {
                "forced_tokens": self.forced_tokens,
                "grammar_cut_drafts": self.grammar_cut_drafts,
                "thinking_budget_hit": self.thinking_budget_hit}),
            "state_bytes_per_cycle": self.state_bytes_per_cycle,
            "state_bytes_per_cycle_by_part": {
                part: {"read": read // per_cycle, "written": written // per_cycle}
                for part, read, written in getattr(self.state_traffic(), "parts", ())},
            "phase_ms_per_cycle": {name: round(ms / per_cycle, 4)
                                   for name, ms in {**self.phase_ms, "other": other}.items()},
        }
