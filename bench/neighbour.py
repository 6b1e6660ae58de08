"""A CPU-bound neighbour for benchmarks: one busy-looping process per usable core, as a
robot's perception or navigation stack keeps the CPU busy beside the planner.

    with neighbour(on=args.neighbour):
        ...  # measured beside it
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

from flash_planner.engine.threads import usable_cores

BUSY = "while True:\n    pass\n"


@contextmanager
def neighbour(on: bool = True, processes: int | None = None):
    """Busy loops on every usable core (or `processes` of them) while the block runs."""
    if not on:
        yield 0
        return
    count = processes or usable_cores()
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(count)]
    try:
        yield count
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def label(on: bool) -> str:
    return f"beside a CPU-bound neighbour ({usable_cores()} busy loops)" if on else "alone"
