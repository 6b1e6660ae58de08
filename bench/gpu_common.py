"""What bench/gpu.py's parts share: the timers of bench/kernel_times.py, the engine slices of
bench/slices.py, the shapes, formats and rows measured, and Thor's bandwidth."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kernel_times import copy_bandwidth, graph_ms, timed_ms  # noqa: E402,F401

PARTS = ("ceilings", "gemm", "thor", "slices", "demo", "profile", "vision", "batch")
# `batch` compiles 10 more graphs at the 27B's width (minutes cold): asked for by name
DEFAULT_PARTS = PARTS[:-1]
SLICES = ("27B", "35B-A3B")
DEMO_METHODS = ("auto", "dflash", "mtp", "none")
ROWS = (1, 2, 4, 8, 16)
THOR_GBPS = 273.0
# (name, N, K): the Linear shapes one decode step reads most of
SHAPES = {
    "big": [("27B MLP up", 17408, 5120), ("27B MLP down", 5120, 17408),
            ("27B attention q", 12288, 5120), ("27B lm_head", 248320, 5120),
            ("35B-A3B expert up", 1024, 2048), ("35B-A3B lm_head", 248320, 2048)],
    "small": [("tiny up", 256, 128), ("tiny down", 128, 256)],
}
FORMATS = ("bf16", "fp8", "nvfp4", "int4")
# the device-time columns rotate over copies of a weight (or routings of the experts) until
# one pass reads this many bytes: several times an H100's or H200's 50-60 MB L2, so a launch
# finds its weights in memory, not left in L2 by the launch before it
ROTATE_BYTES = 256 << 20
GRAPH_LAUNCHES = 16           # launches per captured graph at least

