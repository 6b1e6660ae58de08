"""Each Triton kernel next to its torch reference at Qwen3.6-27B shapes (CUDA).

Shapes: 48 GDN layers, 48 value heads, Dk = Dv = 128, a verify block of S = 16, conv window
3 x 10240 channels; FP8 KV with 4 kv heads x 256 (a 4096-row prefill chunk, and the 16 rows
of one verify); acceptance over 15 drafts and a 248320-token vocabulary. Times are CUDA-event
medians after warm-up. For the copy/append kernels, the bytes moved over the time are also
shown as a fraction of this GPU's device-to-device copy bandwidth, measured in the same run.

    python bench/kernel_times.py            # needs a CUDA GPU
    python bench/kernel_times.py --small    # tiny shapes on CPU (TRITON_INTERPRET=1): a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

SMALL = "--small" in sys.argv
if SMALL:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flash_planner.kernels.accept import kernel as accept_k  # noqa: E402
from flash_planner.kernels.accept import reference as accept_r  # noqa: E402
from flash_planner.kernels.gdn_commit import kernel as commit_k  # noqa: E402
from flash_planner.kernels.gdn_commit import reference as commit_r  # noqa: E402
from flash_planner.kernels.gdn_steps import kernel as gdn_k  # noqa: E402
from flash_planner.kernels.gdn_steps import reference as gdn_r  # noqa: E402
from flash_planner.kernels.gemm.tune import time_ms as timed_ms  # noqa: E402
from flash_planner.kernels.kv_append import kernel as kv_k  # noqa: E402
from flash_planner.kernels.kv_append import reference as kv_r  # noqa: E402

BIG = dict(layers=48, hv=48, hk=16, d=128, steps=16, conv=10240, kv_heads=4, kv_dim=256,
           prefill=4096, vocab=248320, repeats=50)
TINY = dict(layers=2, hv=4, hk=2, d=16, steps=16, conv=64, kv_heads=2, kv_dim=32,
            prefill=64, vocab=500, repeats=2)


def graph_ms(calls: list, replays: int = 5) -> float:
    """Device ms of one of `calls` (no-argument callables, each launching work on the current
    stream), the host's launch cost left out: on CUDA the whole list captured once in a CUDA
    graph (as the engine's compiled forwards run), replayed `replays` times, the median replay
    over len(calls); elsewhere the wall clock over the list. Callers rotate over copies of
    their operands so that the list reads more than the L2 holds."""
    if not torch.cuda.is_available():           # timed_ms warms up with one call itself
        return timed_ms(lambda: [call() for call in calls], replays) / len(calls)
    for call in calls[:8]:
        call()                                         # compiles and first allocations
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                      # warmed on a side stream, as capture asks
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return timed_ms(graph.replay, replays) / len(calls)


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    n = (1 << 28) if device == "cuda" else (1 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = timed_ms(lambda: b.copy_(a), 20)
    return 2 * n / (ms / 1000)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes, CPU smoke run")
    args = parser.parse_args(argv)
    if not args.small and not torch.cuda.is_available():
        print("bench/kernel_times.py needs a CUDA GPU (use --small for a CPU smoke run)",
              file=sys.stderr)
        return 2
    device = "cpu" if args.small else "cuda"
    s = TINY if args.small else BIG
    L, hv, hk, d, S = s["layers"], s["hv"], s["hk"], s["d"], s["steps"]
    rows = []

    state = torch.randn(L, 1, hv, d, d, device=device)
    kept = (torch.randn(L, 1, S, hk, d, device=device), torch.randn(L, 1, S, hv, d, device=device),
            -torch.rand(L, 1, S, hv, device=device))
    conv = torch.randn(L, 1, 3, s["conv"], device=device)
    conv_rows = torch.randn(L, 1, 3 + S, s["conv"], device=device)
    count = torch.tensor([S // 2], dtype=torch.int32, device=device)
    # the state read and written, the kept rows read, the conv window rebuilt
    moved = 2 * (state.nbytes + conv.nbytes) + sum(t.nbytes for t in kept) // 2
    for name, fn in (("triton", commit_k.gdn_commit), ("torch", commit_r.gdn_commit)):
        ms = timed_ms(lambda fn=fn: fn(state, *kept, conv, conv_rows, count), s["repeats"])
        rows.append((f"gdn_commit ({L} layers, {S // 2} rows)", name, ms, moved))

    q, k = (torch.randn(1, S, hk, d, device=device) for _ in range(2))
    v = torch.randn(1, S, hv, d, device=device)
    g, beta = -torch.rand(1, S, hv, device=device), torch.rand(1, S, hv, device=device)
    live = torch.zeros(1, hv, d, d, device=device)
    rows_1 = tuple(t[0] for t in kept)
    for name, fn in (("triton", gdn_k.gdn_steps), ("torch", gdn_r.gdn_steps)):
        ms = timed_ms(lambda fn=fn: fn(q, k, v, g, beta, live, rows_1), s["repeats"])
        rows.append(("gdn_steps verify (S=16)", name, ms, None))

    for n_rows in (S, s["prefill"]):
        kv_rows = torch.randn(1, n_rows, s["kv_heads"], s["kv_dim"], device=device,
                              dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        cache = torch.zeros(1, n_rows, s["kv_heads"], s["kv_dim"], dtype=torch.uint8,
                            device=device)
        pos = torch.arange(n_rows, device=device)[None]
        scale = torch.full((s["kv_heads"],), 0.05, device=device)
        for name, fn in (("triton", kv_k.kv_append), ("torch", kv_r.kv_append)):
            call = (cache, kv_rows, pos, scale)
            ms = timed_ms(lambda fn=fn, call=call: fn(*call), s["repeats"])
            rows.append((f"kv_append fp8 ({n_rows} rows)", name, ms,
                         kv_rows.nbytes + cache.nbytes))

    logits = torch.randn(1, S, s["vocab"], device=device)
    drafts = logits[:, :-1].argmax(-1)
    relaxed = torch.zeros_like(drafts, dtype=torch.bool)
    for name, fn in (("triton", accept_k.accept_rows), ("torch", accept_r.accept_rows)):
        ms = timed_ms(lambda fn=fn: fn(drafts, logits, relaxed, 3, 1.0), s["repeats"])
        rows.append(("accept (15 drafts)", name, ms, logits.nbytes))

    bw = copy_bandwidth(device)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter)"
    print(f"{gpu}; copy bandwidth {bw / 1e9:.0f} GB/s; median of {s['repeats']}")
    print(f"{'kernel':<30}{'impl':<8}{'ms':>10}{'GB/s':>9}{'of copy bw':>12}{'vs torch':>10}")
    by_op = {}
    for op, impl, ms, _ in rows:
        by_op.setdefault(op, {})[impl] = ms
    for op, impl, ms, nbytes in rows:
        rate = f"{nbytes / (ms / 1000) / 1e9:>9.0f}" if nbytes else f"{'':>9}"
        frac = f"{100 * nbytes / (ms / 1000) / bw:>11.0f}%" if nbytes else f"{'':>12}"
        ratio = by_op[op]["torch"] / ms if impl == "triton" else 1.0
        print(f"{op:<30}{impl:<8}{ms:>10.4f}{rate}{frac}{ratio:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
