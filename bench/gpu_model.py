"""bench/gpu.py's model parts: the Thor line, engine slices, batched verifies, the demo
planner through the service, a profile of one forward and the attention backends."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from gpu_common import (
    DEMO_METHODS,
    SLICES,
    THOR_GBPS,
    timed_ms,
)
from slices import TINY, slice_model


def thor_rows(fraction: float) -> list[dict]:
    """Bytes per forward of the full models (analytic) at `fraction` of Thor's bandwidth."""
    from weight_bytes import MODELS, analytic_bytes

    out = []
    for model, raw in MODELS.items():
        if "4B" in model:
            continue
        gb = analytic_bytes(raw, "nvfp4") / 1e9
        ms = gb / (THOR_GBPS * fraction) * 1000
        out.append({"model": model, "format": "nvfp4", "gb_per_forward": gb,
                    "fraction": fraction, "ms_per_token": ms, "tok_s": 1000 / ms})
    return out


def slice_rows(device: str, small: bool, bw: float, repeats: int,
               names: tuple[str, ...] = SLICES) -> list[dict]:
    from weight_bytes import QWEN3_6_27B, QWEN3_6_35B_A3B

    from flash_planner.engine.weights.bytes import bytes_per_forward
    from flash_planner.kernels import dispatch

    if small:   # the torch references: interpreted kernels would take seconds a forward
        dispatch.set_backend("auto")

    dtype = torch.float32 if small else torch.bfloat16
    four = {"num_hidden_layers": 4, **(TINY if small else {})}
    slices = [(name, dict(raw, **four), ("bf16", "nvfp4"))
              for name, raw in (("27B", QWEN3_6_27B), ("35B-A3B", QWEN3_6_35B_A3B))
              if name in names]
    out = []
    for name, raw, formats in slices:
        for weights in formats:
            cfg, model = slice_model(raw, weights, dtype, device)
            top_k = cfg.moe.top_k if cfg.moe else None
            blocks = (1, 16)
            times = _time_slice(cfg, model, dtype, device, repeats, compiled=not small)
            for rows in blocks:
                nbytes = bytes_per_forward(model, None if top_k is None else
                                           min(cfg.moe.num_experts, top_k * rows))
                for forward, by_rows in times.items():
                    ms = by_rows[rows]
                    out.append({"slice": name, "weights": weights, "forward": forward,
                                "rows": rows, "ms": ms, "gb_per_forward": nbytes / 1e9,
                                "of_copy_bw": nbytes / (ms / 1000) / bw,
                                "over_decode": ms / by_rows[1]})
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
    return out


def _time_slice(cfg, model, dtype: torch.dtype, device: str, repeats: int, compiled: bool
                ) -> dict[str, dict[int, float]]:
    """ms of a 1-row decode and a 16-row verify after a 64-token prompt: eager, and (when
    `compiled`) through StaticForward's graphs; every forward commits one row."""
    from flash_planner.engine.models.graphs.compiled import StaticForward
    from flash_planner.engine.state.cache import InferenceState

    context = 64
    state = InferenceState(cfg, capacity=context + 4 * (repeats + 2) * 16, max_steps=16,
                           kv_dtype=dtype, compute_dtype=dtype, device=torch.device(device))
    gen = torch.Generator(device="cpu").manual_seed(0)
    model(torch.randint(0, cfg.vocab_size, (1, context), generator=gen).to(device), state)
    state.commit(context)

    def step(rows: int) -> None:
        ids = torch.randint(0, cfg.vocab_size, (1, rows), generator=gen).to(device)
        model(ids, state, record_steps=rows > 1, all_logits=rows > 1)
        state.commit(1)                  # a verify keeps one row: its rollback runs too

    times = {"eager": {t: timed_ms(lambda t=t: step(t), repeats) for t in (1, 16)}}
    if compiled:
        static = StaticForward(model, state, 16)
        static.warm_up()
        model.set_static(static)
        times["graphs"] = {t: timed_ms(lambda t=t: step(t), repeats) for t in (1, 16)}
        model.set_static(None)
    return times


def batch_rows(device: str, small: bool, repeats: int, batch: int = 8,
               forwards: tuple[str, ...] | None = None) -> list[dict]:
    """The `batch` part: ms of `batch` requests' decode step and verify over slots of one
    batch state against one request's, eager and (default: not --small) through the
    compiled graphs of batch buckets 1 and `batch`; every step commits one row per slot."""
    from weight_bytes import QWEN3_6_27B

    from flash_planner.engine.models.graphs.compiled import StaticForward
    from flash_planner.engine.state.slots import SlotStates
    from flash_planner.kernels import dispatch

    if small:   # the torch references: interpreted kernels would take seconds a forward
        dispatch.set_backend("auto")
    dtype = torch.float32 if small else torch.bfloat16
    cfg, model = slice_model(dict(QWEN3_6_27B, num_hidden_layers=4, **(TINY if small else {})),
                             "bf16", dtype, device)
    context, max_block = 64, 16
    slots = SlotStates(cfg, batch + 1, 4096 + max_block, max_block, dtype, dtype,
                       torch.device(device))
    gen = torch.Generator(device="cpu").manual_seed(0)

    def ids(m: int, rows: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (m, rows), generator=gen).to(device)

    def step(m: int, rows: int) -> None:
        model(ids(m, rows), slots.rows(m), record_steps=rows > 1, all_logits=rows > 1)
        for view in slots.views[:m]:
            view.commit(1)          # a verify keeps one row: its rollback runs too

    out = []
    with torch.inference_mode():
        for view in slots.views[:batch]:
            model(ids(1, context), view)
            view.commit(context)
        for forward in forwards or (("eager",) if small else ("eager", "graphs")):
            if forward == "graphs":
                model.batch_static = StaticForward(model, slots.whole, max_block,
                                                   batches=(1, batch))
                model.batch_static.warm_up()
            for rows in (1, max_block):
                ms = {m: timed_ms(lambda m=m, t=rows: step(m, t), repeats) for m in (1, batch)}
                out.append({"slice": "27B", "forward": forward, "rows": rows, "batch": batch,
                            "ms_one": ms[1], "ms_batch": ms[batch],
                            "aggregate": batch * ms[1] / ms[batch]})
        model.batch_static = None
    return out


def demo_service(device: str, dtype: str, compile_: str, small: bool):
    """(the demo's planner service over a freshly loaded engine, its load seconds); --small
    keeps the torch references (interpreted kernels would take minutes a plan)."""
    from flash_planner.engine.engine import Engine
    from flash_planner.kernels import dispatch
    from flash_planner.planning.presets import ModelPreset, default_skills_path
    from flash_planner.planning.service import PlannerConfig, PlannerService
    from flash_planner.planning.skills import SkillCatalog

    if small:
        dispatch.set_backend("auto")
    preset = ModelPreset.load("demo")
    t0 = time.perf_counter()
    # one request at a time (max_batch 1): the single-request decode this part measures,
    # and no batch buckets to compile at load
    engine = Engine.load(preset.engine_config(device=device, dtype=dtype, compile=compile_,
                                              max_batch=1))
    load_s = time.perf_counter() - t0
    return PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()), PlannerConfig(
        refusal_hint=preset.refusal_hint, sampling="greedy")), load_s


def held_out(n: int) -> list:
    from flash_planner.train.corpus import heldout_sets

    return heldout_sets(0, 40)["world"][:n]


def demo_rows(device: str, small: bool, methods: tuple[str, ...] = DEMO_METHODS,
              forwards: tuple[str, ...] = ("eager", "compiled"), tasks: int = 12
              ) -> list[dict]:
    """The demo through the planner service per (dtype, forward, method); see the module's
    docstring. --small: fp32 and bf16 eager, auto and none, 2 tasks, on the torch references
    (interpreted kernels would take minutes a plan)."""

    from flash_planner.planning.request import PlanRequest

    tasks = held_out(2 if small else tasks)
    forwards = ("off",) if small else tuple({"eager": "off", "compiled": "on"}[f]
                                            for f in forwards)
    methods = ("auto", "none") if small else methods
    rows, reference = [], {}
    for dtype in ("fp32", "bf16"):
        for compile_ in forwards:
            service, load_s = demo_service(device, dtype, compile_, small)
            service.start()
            warm_ms = service.warm_up()
            first = True
            for method in methods:
                results = [service.plan(PlanRequest(ex.task, ex.context, method=method),
                                        timeout=600) for ex in tasks]
                t = [r.telemetry for r in results]
                plans = [r.plan if r.success else None for r in results]
                reference.setdefault(method, plans)      # fp32 eager comes first
                ttft = [x["ttft_ms"] for x in t]
                rows.append({
                    "dtype": dtype, "forward": "compiled" if compile_ == "on" else "eager",
                    "method": method, "ttft_ms": statistics.median(ttft),
                    "tok_s": statistics.median(x["decode_tokens_per_s"] for x in t),
                    "tokens_per_cycle": statistics.mean(x["tokens_per_cycle"] for x in t),
                    "plans_equal": sum(a == b for a, b in zip(plans, reference[method])),
                    "tasks": len(tasks), "load_s": load_s, "warm_up_ms": warm_ms,
                    # the engine's first request after warm-up against the rest of its method
                    "first_ttft_ms": ttft[0] if first else None,
                    "next_ttft_ms": statistics.median(ttft[1:]) if first else None})
                first = False
            service.stop()
            del service
            if device == "cuda":
                torch.cuda.empty_cache()
            if compile_ == "on":   # a second start: a new process, the compiled graphs on disk
                second = second_start_s(device, dtype)
                for row in rows[-len(methods):]:
                    row["second_load_s"] = second
    return rows


def second_start_s(device: str, dtype: str) -> float:
    """Seconds a new process takes to load the demo engine compiled (imports excluded), with
    what the first start left in the on-disk caches."""
    import subprocess

    script = ("import json, time; from flash_planner.engine.engine import Engine; "
              "from flash_planner.planning.presets import ModelPreset; t0 = time.perf_counter(); "
              f"Engine.load(ModelPreset.load('demo').engine_config(device={device!r}, "
              f"dtype={dtype!r}, compile='on', max_batch=1)); "
              "print(json.dumps(time.perf_counter() - t0))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=900).stdout
    return float(out.strip().splitlines()[-1])


def profile_rows(device: str, small: bool) -> list[dict]:
    """Where a plan's time goes, fp32 against bf16: the demo through the planner service
    (eager, auto), three held-out plans under torch.profiler after warm-up; per dtype the
    ops with the most host time (self CPU) and their device time. The first GPU run found
    bf16 5x slower than fp32 when eager and in TTFT: this names the ops that differ."""
    from torch.profiler import ProfilerActivity, profile

    from flash_planner.planning.request import PlanRequest
    tasks = held_out(1 if small else 3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    rows = []
    for dtype in ("fp32", "bf16"):
        service, _ = demo_service(device, dtype, "off", small)
        service.warm_up()
        # each request runs in this thread, not the service's worker: the profiler records
        # the ops of the thread that started it
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            for ex in tasks:
                result = service.plan_in_this_thread(PlanRequest(ex.task, ex.context,
                                                                 method="auto"))
                assert result.success, result.error
        wall_ms = (time.perf_counter() - t0) * 1000 / len(tasks)
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        ops = [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1000,
                "device_ms": getattr(e, "self_device_time_total",
                                     getattr(e, "self_cuda_time_total", 0)) / 1000}
               for e in events]
        rows.append({"dtype": dtype, "plan_ms": wall_ms, "plans": len(tasks), "ops": ops})
        del service
    return rows


def sdpa_rows(device: str) -> list[dict]:
    """SDPA as eager attention calls it: the demo's heads, a 16-row verify block under a
    boolean mask, a key length new at every call (as a growing context makes it), per dtype
    and backend: ms per call (mean of 16 lengths, synchronized), or why the backend refused.
    A backend that builds a plan per shape (cuDNN's graphs) pays it on every call here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flash_planner.planning.presets import ModelPreset, asset_path

    target = Path(asset_path(ModelPreset.load("demo").target_path))
    raw = json.loads((target / "config.json").read_text())
    raw = raw.get("text_config", raw)
    heads, kv, dim = (raw["num_attention_heads"], raw["num_key_value_heads"],
                      raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"]))
    from flash_planner.engine.models.qwen.layers import attention

    backends = {"default": None, "math": SDPBackend.MATH,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "engine": "engine"}       # models/layers.attention, as an eager forward calls it
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, backend in backends.items():
            times, error = [], None
            for length in range(200, 216):
                q = torch.randn(1, 16, heads, dim, device=device, dtype=dtype)
                k = torch.randn(1, length, kv, dim, device=device, dtype=dtype)
                v = torch.randn(1, length, kv, dim, device=device, dtype=dtype)
                mask = torch.ones(16, length, device=device, dtype=torch.bool).tril(length - 16)
                try:
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if backend == "engine":
                        attention(q, k, v, mask, dim ** -0.5)
                    else:
                        with sdpa_kernel([backend] if backend else list(backends.values())[1:5]):
                            torch.nn.functional.scaled_dot_product_attention(
                                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                attn_mask=mask, enable_gqa=heads != kv)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1000)
                except RuntimeError as exc:
                    error = str(exc).splitlines()[0][:60]
                    break
            rows.append({"dtype": str(dtype).removeprefix("torch."), "backend": name,
                         "ms": sum(times) / len(times) if times else None, "error": error,
                         "heads": heads, "kv_heads": kv, "head_dim": dim})
    return rows


