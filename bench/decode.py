"""Greedy decode speed of our engine against transformers `generate`, same checkpoint and prompts.

What is measured. For each (size, kind) a random-weight checkpoint is written with
`flash_planner.train.tiny.write_tiny_checkpoint` into a temporary directory and loaded twice
in this one process: by our `Engine` and by `AutoModelForCausalLM` (fp32, CPU). Both decode the
same prompts (exact token counts, cut from the checkpoint's own tokenizer's encoding of
robot-task text) greedily for exactly N new tokens: ours with `ignore_eos=True`, transformers
with `max_new_tokens=min_new_tokens=N` and the loaded model's `generation_config.eos_token_id`
set to None (in memory only). That is what ignore_eos means: EOS is emitted like any other
token but does not stop. `min_new_tokens` alone would instead mask EOS out of the logits and
change the greedy choice whenever EOS is the argmax, so the two outputs would differ.

How. The headline number is decode tokens/s measured the same way on both sides: the tokens
after the first one, (N - 1), over the wall time from the moment the first generated token is
known to the moment the last one is. Ours reports exactly that (`GenerationStats.decode_ms`);
for transformers the same two moments are taken with a no-op `StoppingCriteria` that records
`time.perf_counter()` each time `generate` has appended a token (one call per token, the first
right after prefill), so no subtraction of a separately timed prefill is needed. Prefill and
request setup are shown separately as time to first token (TTFT) and folded into the
end-to-end ratio (N tokens over the whole call). Each engine/model gets one untimed warm-up
run; every measurement is then repeated `--repeats` times, ours and transformers interleaved,
and the median is reported. `agree` counts how many leading tokens of the two outputs are equal
(a sanity check; fp32 greedy on the same weights should agree). Nothing here asserts on time.

    .venv/bin/python bench/decode.py [--sizes tiny,bench] [--kinds hybrid,dense]
        [--new-tokens 64] [--prompts 3] [--repeats 2] [--threads N] [--kv-dtype auto|fp8]
        [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

PROMPT_LENGTHS = (16, 64, 200, 512, 1024)
ROBOT_TEXT = [
    "Pick up the red cup from the counter and place it on the kitchen table next to the plate.",
    "Navigate to the charging dock, wait for five seconds, then report the battery level.",
    "Open the top drawer, take the blue screwdriver, close the drawer and hand it over.",
    'Say "hello" to the operator, then move the green box from shelf 2 to shelf 3.',
    '{"plan": [{"skill": "navigate_to", "args": {"target": "table"}}, {"skill": "grasp"}]}',
    "The robot should first find the object, then grasp it carefully and avoid the glass.",
    "If the door is closed, push the handle down, pull gently, and hold it for the person.",
    "Scan the room for the yellow ball; if it is not visible, check under the sofa first.",
]
METHOD = ("decode tok/s = (N-1) / (time from first to last generated token), both sides; "
          "transformers timed per token with a no-op StoppingCriteria; e2e = N / whole call")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` prompts of PROMPT_LENGTHS tokens, each starting at a different sentence."""
    if count > len(PROMPT_LENGTHS):
        raise SystemExit(f"--prompts must be at most {len(PROMPT_LENGTHS)}")
    prompts = []
    for i, length in enumerate(PROMPT_LENGTHS[:count]):
        ids: list[int] = []
        j = i
        while len(ids) < length:
            ids += tokenizer.encode(ROBOT_TEXT[j % len(ROBOT_TEXT)] + " ",
                                    add_special_tokens=False)
            j += 1
        prompts.append(ids[:length])
    return prompts


def token_clock_class():
    from transformers import StoppingCriteria

    class TokenClock(StoppingCriteria):
        """Never stops; records when each generated token has been appended."""

        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return TokenClock


def run_ours(engine, prompt: list[int], n: int) -> dict:
    from flash_planner.engine.generate import GenerationSettings, generate

    t0 = time.perf_counter()
    result = generate(engine, prompt, GenerationSettings(max_new_tokens=n, ignore_eos=True))
    total = time.perf_counter() - t0
    s = result.stats
    if s.new_tokens != n:
        raise RuntimeError(f"our engine produced {s.new_tokens} tokens, expected {n}")
    return {"tok_s": s.decode_tokens_per_s, "e2e_tok_s": n / total, "ttft_ms": s.ttft_ms,
            "ids": list(result.token_ids)}


def run_hf(model, prompt: list[int], n: int, clock_cls) -> dict:
    from transformers import StoppingCriteriaList

    ids = torch.tensor([prompt], dtype=torch.long)
    clock = clock_cls()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([clock]))
    total = time.perf_counter() - t0
    new = out[0, len(prompt):].tolist()
    if len(new) != n or len(clock.stamps) != n:
        raise RuntimeError(f"transformers produced {len(new)} tokens "
                           f"({len(clock.stamps)} clock ticks), expected {n}")
    decode = clock.stamps[-1] - clock.stamps[0]
    return {"tok_s": (n - 1) / decode if n > 1 and decode > 0 else 0.0,
            "e2e_tok_s": n / total, "ttft_ms": (clock.stamps[0] - t0) * 1000.0, "ids": new}


def agreement(a: list[int], b: list[int]) -> int:
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same


def spread(values: list[float]) -> float:
    """(max - min) / median, the relative scatter over repeats."""
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else 0.0


def bench_config(workdir: Path, size: str, kind: str, args, clock_cls) -> dict:
    from transformers import AutoModelForCausalLM

    from flash_planner.engine.engine import Engine, EngineConfig
    from flash_planner.train.tiny import write_tiny_checkpoint

    path = workdir / f"{size}-{kind}"
    log(f"writing {size} {kind} checkpoint to {path} ...")
    write_tiny_checkpoint(path, kind=kind, size=size, seed=0)
    n = args.new_tokens
    max_context = PROMPT_LENGTHS[args.prompts - 1] + n + 16
    log(f"loading {size} {kind} into our engine (kv_dtype={args.kv_dtype}) ...")
    engine = Engine.load(EngineConfig(model_path=str(path), device="cpu", dtype="fp32",
                                      kv_dtype=args.kv_dtype, max_context=max_context))
    log(f"loading {size} {kind} into transformers ...")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # The equivalent of our ignore_eos: no EOS at all, so EOS may be *emitted* like any token.
    # (`min_new_tokens` alone would mask EOS out of the logits and change the greedy choice.)
    model.generation_config.eos_token_id = None
    params_m = sum(p.numel() for p in engine.model.parameters()) / 1e6
    prompts = build_prompts(engine.tokenizer, args.prompts)

    log(f"warming up {size} {kind} (ours, then transformers) ...")
    run_ours(engine, prompts[0], n)
    run_hf(model, prompts[0], n, clock_cls)

    rows = []
    for prompt in prompts:
        ours, hf = [], []
        for r in range(args.repeats):
            log(f"  {size}/{kind} prompt {len(prompt)} tokens, repeat {r + 1}/{args.repeats}")
            ours.append(run_ours(engine, prompt, n))
            hf.append(run_hf(model, prompt, n, clock_cls))

        def med(runs: list[dict], key: str) -> float:
            return statistics.median(run[key] for run in runs)

        row = {"prompt_tokens": len(prompt),
               "ours_tok_s": med(ours, "tok_s"), "hf_tok_s": med(hf, "tok_s"),
               "ours_e2e_tok_s": med(ours, "e2e_tok_s"), "hf_e2e_tok_s": med(hf, "e2e_tok_s"),
               "ours_ttft_ms": med(ours, "ttft_ms"), "hf_ttft_ms": med(hf, "ttft_ms"),
               "agree_tokens": agreement(ours[-1]["ids"], hf[-1]["ids"]),
               "ours_spread": spread([run["tok_s"] for run in ours]),
               "hf_spread": spread([run["tok_s"] for run in hf])}
        row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"] if row["hf_tok_s"] else 0.0
        row["e2e_ratio"] = (row["ours_e2e_tok_s"] / row["hf_e2e_tok_s"]
                            if row["hf_e2e_tok_s"] else 0.0)
        rows.append(row)
    memory = engine.memory
    result = {"size": size, "kind": kind, "params_m": params_m, "memory": memory.as_dict(),
              "memory_text": str(memory), "rows": rows}
    del engine, model
    gc.collect()
    return result


HEADER = (f"{'config':<14} {'params M':>8} {'prompt':>6} {'ours t/s':>9} {'HF t/s':>8} "
          f"{'ratio':>6} {'e2e ratio':>9} {'TTFT ms':>8} {'HF TTFT':>8} {'agree':>7}")


def print_table(report: dict) -> None:
    n, threads = report["new_tokens"], report["threads"]
    print(f"greedy decode, {n} new tokens, median of {report['repeats']} repeat(s) after one "
          f"warm-up, fp32 CPU")
    print(f"torch {report['torch']}, {threads} thread{'s' if threads != 1 else ''}; "
          f"transformers {report['transformers']}; our kv_dtype {report['kv_dtype']}; "
          f"load avg {report['load_start']:.2f} -> {report['load_end']:.2f}")
    print("t/s: decode tokens/s = (N-1) / (first -> last generated token), same on both sides;")
    print("  transformers is timed per token by a no-op StoppingCriteria (no prefill subtraction)")
    print("ratio = ours/HF; e2e ratio: N / whole call, prefill included; TTFT: start -> 1st token")
    print(HEADER)
    print("-" * len(HEADER))
    noisy = []
    for cfg in report["configs"]:
        name = f"{cfg['size']}/{cfg['kind']}"
        for row in cfg["rows"]:
            print(f"{name:<14} {cfg['params_m']:>8.2f} {row['prompt_tokens']:>6} "
                  f"{row['ours_tok_s']:>9.1f} {row['hf_tok_s']:>8.1f} {row['ratio']:>5.2f}x "
                  f"{row['e2e_ratio']:>8.2f}x {row['ours_ttft_ms']:>8.1f} "
                  f"{row['hf_ttft_ms']:>8.1f} {row['agree_tokens']:>3}/{n}")
            worst = max(row["ours_spread"], row["hf_spread"])
            if worst > 0.10:
                noisy.append(f"{name} prompt {row['prompt_tokens']} ({worst:.0%})")
    print()
    for cfg in report["configs"]:
        print(f"memory {cfg['size']}/{cfg['kind']} (ours):")
        print(f"  {cfg['memory_text']}")
    if noisy:
        print("noisy, decode tok/s scatter over repeats > 10%:")
        print(textwrap.fill(", ".join(noisy), width=99, initial_indent="  ",
                            subsequent_indent="  "))
    print(f"wall time {report['wall_s']:.1f} s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from flash_planner.train.tiny import KINDS, SIZES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,bench", help="comma list of " + ",".join(SIZES))
    p.add_argument("--kinds", default=None,
                   help="comma list of " + ",".join(KINDS) + " (default: hybrid for every "
                   "size, plus dense for tiny)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3,
                   help=f"how many prompts, of {', '.join(map(str, PROMPT_LENGTHS))} tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--kv-dtype", default="auto", help="our engine's KV cache dtype (auto|fp8)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    kinds = None if args.kinds is None else [k for k in args.kinds.split(",") if k]
    for s in sizes:
        if s not in SIZES:
            p.error(f"unknown size {s!r}; choose from {', '.join(SIZES)}")
    for k in kinds or []:
        if k not in KINDS:
            p.error(f"unknown kind {k!r}; choose from {', '.join(KINDS)}")
    if args.new_tokens < 2 or args.repeats < 1 or args.threads < 1:
        p.error("--new-tokens must be >= 2, --repeats and --threads >= 1")
    if not 1 <= args.prompts <= len(PROMPT_LENGTHS):
        p.error(f"--prompts must be between 1 and {len(PROMPT_LENGTHS)}")
    args.configs = [(s, k) for s in sizes
                    for k in (kinds or (["hybrid", "dense"] if s == "tiny" else ["hybrid"]))]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    log(f"torch threads: {torch.get_num_threads()}")
    clock_cls = token_clock_class()
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    configs = []
    with tempfile.TemporaryDirectory(prefix="flash-planner-bench-") as tmp:
        for size, kind in args.configs:
            configs.append(bench_config(Path(tmp), size, kind, args, clock_cls))
    report = {"method": METHOD, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "transformers": transformers.__version__, "kv_dtype": args.kv_dtype,
              "device": "cpu", "dtype": "fp32", "load_start": load_start,
              "load_end": os.getloadavg()[0], "configs": configs,
              "wall_s": time.perf_counter() - t0}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
