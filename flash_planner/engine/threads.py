"""How many CPU threads the engine's torch ops use: chosen on purpose at load, not torch's
default of every core.

A robot's CPU is shared (perception, navigation, the ROS graph). With every core in torch's
intra-op pool, one descheduled worker stalls every op's barrier: beside one CPU-bound
neighbour a plan took many times as long as with half the cores (docs/server.md). So
`threads: 0` (auto) means: on a GPU one thread (the host only launches kernels); on a CPU
half of the cores this process may use, at least one; `OMP_NUM_THREADS`, when set, wins
over auto. Inter-op threads are 1: no forward of ours runs ops concurrently.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Threads:
    intra_op: int
    inter_op: int
    why: str          # where the count came from

    def as_dict(self) -> dict:
        return {"intra_op": self.intra_op, "inter_op": self.inter_op, "why": self.why}

    def __str__(self) -> str:
        return f"{self.intra_op} intra-op, {self.inter_op} inter-op ({self.why})"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:     # not on Linux
        return os.cpu_count() or 1


def choose_threads(configured: int, device: torch.device) -> tuple[int, str]:
    """The intra-op thread count for `configured` (0 = auto) on `device`, and why."""
    if configured:
        return configured, "engine.threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "auto: OMP_NUM_THREADS"
    if device.type == "cuda":
        return 1, "auto: the GPU computes, the host launches"
    cores = usable_cores()
    return max(1, cores // 2), f"auto: half of {cores} usable cores"


def apply_threads(configured: int, device: torch.device) -> Threads:
    """Set torch's intra-op and inter-op pools for this process; returns what is in effect.

    torch's thread pools are per process: the last engine loaded decides for all of them.
    The inter-op pool can only be sized before its first use; when that has passed, the
    count in effect is reported as it is."""
    intra, why = choose_threads(configured, device)
    torch.set_num_threads(intra)
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError as exc:      # already started: keep what runs
            log.debug("inter-op threads stay at %d: %s", torch.get_num_interop_threads(), exc)
    threads = Threads(torch.get_num_threads(), torch.get_num_interop_threads(), why)
    log.info("torch threads: %s", threads)
    return threads
