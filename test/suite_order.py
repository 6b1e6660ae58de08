"""The order in which `make test` hands out the suite's files."""

from __future__ import annotations

# The files whose first run on a fresh machine is longest (a llama.cpp build, the compiled
# forwards' cold graphs, every kernel spec compiled, the soaks), longest first. They are
# collected first, and `make test` keeps that order (--no-loadscope-reorder: pytest-xdist
# would otherwise hand out files by their number of tests, these few-test files last), so
# the two workers start on them and finish on the many short files, not one worker alone
# on a three-minute file at the end.
SLOW_FIRST = ("engine/test_compiled.py", "test_peer.py", "ros/test_node_soak.py",
              "kernels/test_compile.py", "test_bench_gpu.py",
              "kernels/test_engine_on_kernels.py", "test_soak.py", "test_thor_deps.py",
              "ros/test_colcon_build.py", "test_bench_batch.py", "engine/test_batch.py",
              "engine/test_flash_next.py",
              "ros/test_node_batch.py",
              "engine/test_prefix.py", "engine/test_segments.py")


def slow_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0].removeprefix("test/")
    return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)
