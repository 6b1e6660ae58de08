"""bench/gpu.py's tables, printed from its report."""

from __future__ import annotations

from gpu_common import (
    THOR_GBPS,
)


def print_tables(report: dict) -> None:
    c = report.get("ceilings")
    if c:
        print(f"ceilings: copy {c['copy_gbps']:.0f} GB/s (read + write), {c['matmul_dtype']} "
              f"matmul {c['matmul_n']}^3 {c['matmul_tflops']:.1f} TFLOP/s")
    if report.get("gemm"):
        print(f"weight-only GEMMs (graph ms: device time of the engine's launch, CUDA-graph "
              f"replays over weights beyond L2, and of copy bw from it; eager ms: one launch "
              f"with its host cost; tiled: the M > 16 kernel, counted: the skinny kernel's "
              f"counted configuration, both eager; x bf16: bf16 graph ms / graph ms)\n"
              f"{'shape':<20}{'format':<8}{'rows':>5}{'graph ms':>10}{'eager ms':>10}"
              f"{'tiled':>9}{'counted':>9}{'weight MB':>11}{'of copy bw':>12}{'x bf16':>8}")
        for r in report["gemm"]:
            extra = ("" if "tiled_ms" not in r else
                     f"{r['tiled_ms']:>9.4f}{r['counted_ms']:>9.4f}")
            ratio = f"{r['over_bf16']:>8.2f}" if "over_bf16" in r else ""
            print(f"{r['shape']:<20}{r['format']:<8}{r['rows']:>5}{r['graph_ms']:>10.4f}"
                  f"{r['ms']:>10.4f}{extra:>18}{r['weight_bytes'] / 1e6:>11.2f}"
                  f"{100 * r['of_copy_bw']:>11.1f}%{ratio}")
            for v in r.get("vendor", ()):
                what = (f"unavailable: {v['unavailable']}" if "unavailable" in v else
                        f"{v['graph_ms']:.4f} graph ms, {100 * v['of_copy_bw']:.1f}% of copy "
                        f"bw, {v['graph_ms'] / r['graph_ms']:.2f}x ours, max diff "
                        f"{v['rel_diff']:.1e} of |y|")
                print(f"{'':28}vendor {v['name']} ({v['numerics']}): {what}")
            if "serves" in r:
                print(f"{'':28}--tune chose: {r['serves']} serves this shape at this bucket")
    if report.get("gate_up"):
        print(f"MLP gate + up, {report['gate_up'][0]['i']} x {report['gate_up'][0]['k']} each:"
              f" fused (one GEMM, SwiGLU in its epilogue) against apart (two GEMMs, silu, "
              f"multiply)\n{'format':<8}{'rows':>5}{'fused ms':>10}{'apart ms':>10}"
              f"{'apart/fused':>13}")
        for r in report["gate_up"]:
            print(f"{r['format']:<8}{r['rows']:>5}{r['fused_ms']:>10.4f}{r['apart_ms']:>10.4f}"
                  f"{r['apart_ms'] / r['fused_ms']:>13.2f}")
    if report.get("moe"):
        print(f"MoE grouped GEMMs (random routing; weight MB: the distinct experts chosen; "
              f"graph ms: device time over other routings in turn; eager ms and tiled, the "
              f"M > 16 kernel: one launch)\n{'shape':<16}{'format':<8}{'rows':>5}"
              f"{'graph ms':>10}{'eager ms':>10}{'tiled':>9}{'weight MB':>11}{'of copy bw':>12}")
        for r in report["moe"]:
            print(f"{r['shape']:<16}{r['format']:<8}{r['rows']:>5}{r['graph_ms']:>10.4f}"
                  f"{r['ms']:>10.4f}{r['tiled_ms']:>9.4f}{r['weight_bytes'] / 1e6:>11.2f}"
                  f"{100 * r['of_copy_bw']:>11.1f}%")
    if report.get("slices"):
        print(f"engine slices, 4 layers ({'fp32' if report['small'] else 'bf16'} compute; "
              f"verify = 16 rows with its rollback; GB read per forward, experts at top-k "
              f"per row):\n{'slice':<9}{'weights':<8}{'forward':<8}{'rows':>5}{'ms':>9}"
              f"{'GB':>8}{'of copy bw':>12}{'x decode':>10}")
        for r in report["slices"]:
            print(f"{r['slice']:<9}{r['weights']:<8}{r['forward']:<8}{r['rows']:>5}"
                  f"{r['ms']:>9.3f}{r['gb_per_forward']:>8.3f}{100 * r['of_copy_bw']:>11.1f}%"
                  f"{r['over_decode']:>10.2f}")
    if report.get("demo"):
        print(f"demo through the planner service (greedy; medians; plans equal to fp32 "
              f"eager's):\n{'dtype':<6}{'forward':<10}{'method':<8}{'TTFT ms':>9}{'tok/s':>8}"
              f"{'tok/cyc':>9}{'equal':>7}{'first TTFT':>12}{'next':>8}{'load s':>8}"
              f"{'2nd start s':>13}")
        for r in report["demo"]:
            first = ("" if r["first_ttft_ms"] is None else
                     f"{r['first_ttft_ms']:>12.1f}{r['next_ttft_ms']:>8.1f}")
            print(f"{r['dtype']:<6}{r['forward']:<10}{r['method']:<8}{r['ttft_ms']:>9.1f}"
                  f"{r['tok_s']:>8.0f}{r['tokens_per_cycle']:>9.2f}"
                  f"{r['plans_equal']:>4}/{r['tasks']:<2}{first:>20}{r['load_s']:>8.1f}"
                  f"{r.get('second_load_s', float('nan')):>13.1f}")
    if report.get("profile"):
        for r in report["profile"]:
            print(f"profile, {r['dtype']} eager auto: {r['plan_ms']:.1f} ms a plan over "
                  f"{r['plans']} plans (profiler on); top ops by host time\n"
                  f"  {'op':<48}{'calls':>8}{'self CPU ms':>13}{'device ms':>11}")
            for op in r["ops"]:
                print(f"  {op['op'][:47]:<48}{op['calls']:>8}{op['self_cpu_ms']:>13.2f}"
                      f"{op['device_ms']:>11.2f}")
    if report.get("sdpa"):
        s = report["sdpa"][0]
        print(f"SDPA as eager attention calls it ({s['heads']} heads, {s['kv_heads']} kv, dim "
              f"{s['head_dim']}, 16 rows, boolean mask, a new key length every call):")
        for r in report["sdpa"]:
            got = f"{r['ms']:.3f} ms" if r["ms"] is not None else f"refused: {r['error']}"
            print(f"  {r['dtype']:<9}{r['backend']:<10}{got}")
    if report.get("batch"):
        n = report["batch"][0]["batch"]
        print(f"{n} requests at once against one, the 27B's width (4 layers), slots of one "
              f"batch state\n{'forward':<9}{'rows':>5}{'ms, one':>10}{f'ms, {n}':>10}"
              f"{'aggregate':>11}")
        for r in report["batch"]:
            print(f"{r['forward']:<9}{r['rows']:>5}{r['ms_one']:>10.3f}{r['ms_batch']:>10.3f}"
                  f"{r['aggregate']:>10.2f}x")
    if report.get("vision"):
        import vision

        vision.print_vision(report["vision"])
    if report.get("thor"):
        print(f"Thor line: {THOR_GBPS:.0f} GB/s at the nvfp4 GEMMs' measured fraction "
              f"({100 * report['thor'][0]['fraction']:.0f}%, 1 row)")
        for r in report["thor"]:
            print(f"  {r['model']:<18}{r['gb_per_forward']:>7.2f} GB  {r['ms_per_token']:>8.1f} "
                  f"ms/token  {r['tok_s']:>7.1f} tok/s")


