"""The planner's health on /diagnostics: a rolling latency window, a status from budgets, and
the publisher of diagnostic_msgs/DiagnosticArray.

The node feeds every finished `PlanResult` into a `LatencyWindow`; on each period,
`DiagnosticsPublisher` turns the window into `(level, message, key_values)` with
`node_status` and publishes it, beside the planner's load (`load_values`: requests running
and queued, the batch's slots, and its tokens per second since the last publish from
`BatchRate`). Levels are the ints 0/1/2 of DiagnosticStatus OK/WARN/ERROR (sent as one
byte). The publisher is our own small code instead of diagnostic_updater, which
has no PyPI wheel: one timer, one status named ``<node>: planner`` (diagnostic_updater's
naming, so rqt_robot_monitor and diagnostic_aggregator group it the same way), a hardware
id. Everything but `DiagnosticsPublisher` is pure Python; it imports rclpy when built.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..planning.request import PlanResult

OK, WARN, ERROR = 0, 1, 2
KeyValues = list[tuple[str, str]]


@dataclass(frozen=True)
class Budgets:
    """p95 budgets in milliseconds: WARN above a budget, ERROR above twice it."""

    ttft_ms: float
    latency_ms: float

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "latency_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"budget {name} must be positive, got {getattr(self, name)!r}")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); 0 if empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class Sample:
    """What the window keeps of one request that reached the engine."""

    ttft_ms: float
    latency_ms: float
    tokens_per_s: float
    mean_accepted: float
    tokens_per_cycle: float
    cycles: int
    first_step_ms: float | None = None     # None: no plan step closed
    prefix_hit: bool | None = None         # None: no prompt prefix
    prefix_restore_ms: float = 0.0
    # bytes a cycle moved besides the weights (KV, GDN state, conv; engine/state/traffic.py)
    state_read: float = 0.0
    state_written: float = 0.0


@dataclass(frozen=True)
class Summary:
    """A snapshot of the window: percentiles over its samples, counters since start."""

    samples: int
    ok: int
    failed: int
    cancelled: int
    last_error: str
    ttft_p50: float
    ttft_p95: float
    latency_p50: float
    latency_p95: float
    tokens_per_s: float
    mean_accepted: float
    tokens_per_cycle: float
    first_step_p50: float = 0.0
    first_step_p95: float = 0.0
    prefix_hits: int = 0            # samples whose prefix state was restored
    prefix_requests: int = 0        # samples with a prompt prefix
    restore_p50: float = 0.0
    restore_p95: float = 0.0
    state_read_mb: float = 0.0       # per cycle, mean over the samples that cycled
    state_written_mb: float = 0.0

    @property
    def requests(self) -> int:
        return self.ok + self.failed + self.cancelled


class LatencyWindow:
    """The last `size` requests that ran on the engine, plus outcome counters (thread-safe).

    Requests refused before generation (invalid, queue full, cancelled while queued) count
    as failed/cancelled but add no latency sample: they would only drag percentiles down.
    """

    def __init__(self, size: int):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"window size must be a positive integer, got {size!r}")
        self._lock = threading.Lock()
        self._samples: collections.deque[Sample] = collections.deque(maxlen=size)
        self._ok = self._failed = self._cancelled = 0
        self._last_error = ""

    def add(self, result: PlanResult) -> None:
        """Fold one finished request into the window."""
        t = result.telemetry
        with self._lock:
            if result.success:
                self._ok += 1
            elif result.finish_reason == "cancelled":
                self._cancelled += 1
            else:
                self._failed += 1
                self._last_error = result.error
            if "ttft_ms" in t:
                step = t.get("first_step_ms")
                traffic = t.get("state_bytes_per_cycle") or {}
                self._samples.append(Sample(
                    float(t["ttft_ms"]), float(t.get("total_latency_ms", t.get("total_ms", 0))),
                    float(t.get("decode_tokens_per_s", 0.0)), float(t.get("mean_accepted", 0.0)),
                    float(t.get("tokens_per_cycle", 0.0)), int(t.get("cycles", 0)),
                    None if step is None else float(step), t.get("prefix_hit"),
                    float(t.get("prefix_restore_ms", 0.0)), float(traffic.get("read", 0)),
                    float(traffic.get("written", 0))))

    def summary(self) -> Summary:
        """Percentiles and means over the window's samples, and the counters."""
        with self._lock:
            samples = list(self._samples)
            counts = (self._ok, self._failed, self._cancelled, self._last_error)
        ttft = [s.ttft_ms for s in samples]
        latency = [s.latency_ms for s in samples]
        steps = [s.first_step_ms for s in samples if s.first_step_ms is not None]
        prefixed = [s for s in samples if s.prefix_hit is not None]
        restores = [s.prefix_restore_ms for s in prefixed if s.prefix_hit]
        return Summary(
            len(samples), *counts, percentile(ttft, 50), percentile(ttft, 95),
            percentile(latency, 50), percentile(latency, 95),
            _mean([s.tokens_per_s for s in samples if s.tokens_per_s > 0]),
            _mean([s.mean_accepted for s in samples if s.cycles > 0]),
            _mean([s.tokens_per_cycle for s in samples if s.cycles > 0]),
            percentile(steps, 50), percentile(steps, 95), len(restores), len(prefixed),
            percentile(restores, 50), percentile(restores, 95),
            _mean([s.state_read for s in samples if s.cycles > 0]) / 1e6,
            _mean([s.state_written for s in samples if s.cycles > 0]) / 1e6)


def _grade(name: str, value: float, budget: float) -> tuple[int, str]:
    if value > 2 * budget:
        return ERROR, f"p95 {name} {value:.0f} ms over twice the {budget:.0f} ms budget"
    if value > budget:
        return WARN, f"p95 {name} {value:.0f} ms over the {budget:.0f} ms budget"
    return OK, ""


def status(window: LatencyWindow | Summary, budgets: Budgets, queue_depth: int
           ) -> tuple[int, str, KeyValues]:
    """(level, message, key_values) of the planner from its window and the budgets."""
    s = window.summary() if isinstance(window, LatencyWindow) else window
    values = [
        ("requests ok", str(s.ok)), ("requests failed", str(s.failed)),
        ("requests cancelled", str(s.cancelled)), ("window samples", str(s.samples)),
        ("ttft p50 ms", f"{s.ttft_p50:.1f}"), ("ttft p95 ms", f"{s.ttft_p95:.1f}"),
        ("latency p50 ms", f"{s.latency_p50:.1f}"), ("latency p95 ms", f"{s.latency_p95:.1f}"),
        ("first step p50 ms", f"{s.first_step_p50:.1f}"),
        ("first step p95 ms", f"{s.first_step_p95:.1f}"),
        ("prefix cache hits", f"{s.prefix_hits}/{s.prefix_requests}"),
        ("prefix restore p50 ms", f"{s.restore_p50:.2f}"),
        ("prefix restore p95 ms", f"{s.restore_p95:.2f}"),
        ("tokens per s", f"{s.tokens_per_s:.1f}"),
        ("mean accepted length", f"{s.mean_accepted:.2f}"),
        ("tokens per cycle", f"{s.tokens_per_cycle:.2f}"),
        ("state read per cycle MB", f"{s.state_read_mb:.2f}"),
        ("state written per cycle MB", f"{s.state_written_mb:.2f}"),
        ("queue depth", str(queue_depth)), ("last error", s.last_error),
        ("ttft budget ms", f"{budgets.ttft_ms:.0f}"),
        ("latency budget ms", f"{budgets.latency_ms:.0f}"),
    ]
    if s.samples == 0:
        message = "no requests yet" if s.requests == 0 else \
            f"no request reached the engine yet ({s.failed} failed, {s.cancelled} cancelled)"
        return OK, message, values
    grades = [_grade("latency", s.latency_p95, budgets.latency_ms),
              _grade("TTFT", s.ttft_p95, budgets.ttft_ms)]
    level = max(g[0] for g in grades)
    if level == OK:
        message = (f"ok: p95 latency {s.latency_p95:.0f} ms, p95 TTFT {s.ttft_p95:.0f} ms, "
                   f"{s.tokens_per_s:.1f} tokens/s")
    else:
        message = "; ".join(text for lvl, text in grades if lvl > OK)
    return level, message, values


def remote_values(backend: str, health) -> KeyValues:
    """What /diagnostics says of a remote backend: which backend plans, whether the remote
    answered last time, its latency and last error, and how often it answered or failed."""
    if health is None:
        return [("backend", backend)]
    last = "never tried" if health.ok is None else ("ok" if health.ok else "failed")
    return [("backend", backend), ("remote", last),
            ("remote latency ms", f"{health.last_latency_ms:.1f}"),
            ("remote answered", str(health.answered)), ("remote failed", str(health.failed)),
            ("remote last error", health.last_error or "-")]


class BatchRate:
    """The decoding batch's tokens per second between two calls, from the planner service's
    cumulative token count (`PlannerService.load_report`). `tokens`: the count now (the
    first call then measures from here); without it the first call gives 0, and so does a
    count that went down (another service). Thread-safe."""

    def __init__(self, tokens: int | None = None, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._last = None if tokens is None else (clock(), tokens)

    def update(self, tokens: int) -> float:
        """Tokens per second since the previous call, which `tokens` becomes."""
        with self._lock:
            now = self._clock()
            last, self._last = self._last, (now, tokens)
        if last is None or tokens < last[1] or now <= last[0]:
            return 0.0
        return (tokens - last[1]) / (now - last[0])


def load_values(report: dict[str, int], tokens_per_s: float) -> KeyValues:
    """What /diagnostics says of the planner's load: requests decoding (or waiting on a
    remote) and queued now, the slots (engine.max_batch resolved), and the batch's tokens
    per second since the last publish (every request's together)."""
    return [("requests running", str(report["running"])),
            ("requests queued", str(report["queued"])),
            ("max batch", str(report["max_batch"])),
            ("batch tokens per s", f"{tokens_per_s:.1f}")]


def node_status(state: str, load_error: str, window: LatencyWindow | None, budgets: Budgets,
                queue_depth: int, model: str = "", compiled: str = "",
                backend: KeyValues = (), threads: str = "", load: KeyValues = (),
                execution: KeyValues = (), startup: KeyValues = ()
                ) -> tuple[int, str, KeyValues]:
    """The node's status: ERROR after a failed model load, OK while not serving, else `status`.
    compiled: whether forwards run as compiled graphs, and what compiling them took;
    backend: `remote_values`; threads: the engine's torch threads (`Threads`); load:
    `load_values` (in every state once a model is loaded); execution: `execution_values`;
    startup: while configuring, `StartupProgress.values` (phase, steps, seconds)."""
    head = [("state", state), ("model", model)] + ([("compiled", compiled)] if compiled else [])
    head += [("threads", threads)] if threads else []
    head += list(startup) + list(backend) + list(load) + list(execution)
    if load_error:
        return ERROR, f"model failed to load: {load_error}", head
    if state != "active" or window is None:
        return OK, f"{state}: not serving requests", head
    level, message, values = status(window, budgets, queue_depth)
    return level, message, [*head, *values]


def execution_values(unavailable: dict[str, str], running: str) -> KeyValues:
    """The execution keys: the skills whose server is away (each with why) and the running
    execution's id ("idle": none)."""
    away = "; ".join(f"{skill}: {why}" for skill, why in sorted(unavailable.items()))
    return [("skills unavailable", away or "none"), ("execution", running or "idle")]


TOPIC = "/diagnostics"
StatusFn = Callable[[], tuple[int, str, KeyValues]]


def status_message(name: str, hardware_id: str, level: int, message: str,
                   values: KeyValues):
    """One DiagnosticStatus (level is 0/1/2 = OK/WARN/ERROR; it travels as a byte)."""
    from diagnostic_msgs.msg import DiagnosticStatus, KeyValue

    return DiagnosticStatus(level=bytes([level]), name=name, message=message,
                            hardware_id=hardware_id,
                            values=[KeyValue(key=k, value=v) for k, v in values])


class DiagnosticsPublisher:
    """Publishes `status()` on /diagnostics every `period_s` seconds, in every node state."""

    def __init__(self, node, status: StatusFn, period_s: float, hardware_id: str):
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.callback_groups import MutuallyExclusiveCallbackGroup

        self._node, self._status, self._array = node, status, DiagnosticArray
        self.name = f"{node.get_name()}: planner"
        self.hardware_id = hardware_id
        self._pub = node.create_publisher(DiagnosticArray, TOPIC, 10)
        self._timer = node.create_timer(period_s, self.publish,
                                        callback_group=MutuallyExclusiveCallbackGroup())

    def publish(self) -> None:
        """Publish the current status now (the timer calls this)."""
        level, message, values = self._status()
        msg = self._array(status=[status_message(self.name, self.hardware_id, level, message,
                                                 values)])
        msg.header.stamp = self._node.get_clock().now().to_msg()
        self._pub.publish(msg)

    def close(self) -> None:
        self._node.destroy_timer(self._timer)
        self._node.destroy_publisher(self._pub)
