"""Speculative vs plain greedy decoding on the same target, in one process.

For each target config (random weights, written by transformers' save_pretrained) it runs:
  plain        no drafter: one target forward per token
  dflash       a random-weight DFlash drafter, strict acceptance (it accepts almost nothing:
               this row is the cost of drafting, not a speedup; a trained pair comes later)
  replay@L     the replay proposer drafting the true continuation with one wrong token at
               offset L of each block, so every cycle accepts exactly L drafts
  replay@all   every draft correct (an upper bound at this block size)
and prints decode tokens/s, the ratio to plain, tokens per cycle, mean accepted drafts, the
cycle time and its split by phase. "loop overhead" is everything outside the target and
drafter forwards (accept + commit + other) as a share of the cycle. Medians over --repeats
after one warm-up; fp32 on CPU. No timing is asserted anywhere.

    python bench/spec.py [--sizes tiny,bench] [--new-tokens 128] [--block 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from flash_planner.engine.engine import Engine, EngineConfig
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.loop.proposer import DFlashProposer, ReplayProposer
from flash_planner.train.tiny import write_tiny_checkpoint, write_tiny_drafter

PROMPT = ("You are a robot task planner. Skills: navigate_to(target), pick(object), "
          "place(object, location), open(object), close(object). Task: bring the red cup "
          "from the kitchen table to the sink, then close the fridge.")


def run_mode(engine, prompt, n, proposer, repeats):
    settings = GenerationSettings(n, ignore_eos=True, speculative=proposer is not None)
    make = proposer if callable(proposer) else (lambda: None)
    generate(engine, prompt, settings, proposer=make())            # warm-up
    runs = [generate(engine, prompt, settings, proposer=make()) for _ in range(repeats)]
    runs.sort(key=lambda r: r.stats.decode_tokens_per_s)
    return runs[len(runs) // 2]


def row(name, result, plain_tps):
    s = result.stats
    phases = s.as_dict()["phase_ms_per_cycle"]
    cycle = sum(phases.values())
    share = {k: 100.0 * v / cycle if cycle else 0.0 for k, v in phases.items()}
    overhead = share["accept"] + share["commit"] + share["other"]
    return {"mode": name, "tok_s": s.decode_tokens_per_s,
            "ratio": s.decode_tokens_per_s / plain_tps if plain_tps else 0.0,
            "tokens_per_cycle": s.tokens_per_cycle, "mean_accepted": s.mean_accepted,
            "cycle_ms": cycle, "share": share, "overhead_pct": overhead,
            "tokens": result.token_ids}


def bench_config(size, args, workdir):
    target = write_tiny_checkpoint(workdir / f"{size}-target", kind="hybrid", size=size)
    drafter = write_tiny_drafter(workdir / f"{size}-drafter", target,
                                 block_size=args.block)
    engine = Engine.load(EngineConfig(str(target), device="cpu", dtype="fp32",
                                      drafter_path=str(drafter), max_context=1024,
                                      max_block=max(16, args.block)))
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    vocab = engine.model_config.vocab_size
    plain = run_mode(engine, prompt, args.new_tokens, None, args.repeats)
    ref = plain.token_ids
    base = engine.proposer_for("dflash")      # the drafter the engine loaded
    modes = [("plain", plain)]
    modes.append(("dflash", run_mode(engine, prompt, args.new_tokens, lambda: DFlashProposer(
        base.drafter, base.embed, base.lm_head_weight, block_size=args.block), args.repeats)))
    for at in (args.accept, args.block - 1):
        name = "replay@all" if at == args.block - 1 else f"replay@{at}"
        modes.append((name, run_mode(engine, prompt, args.new_tokens, lambda at=at: (
            ReplayProposer(ref, vocab, block_size=args.block, error_at=at)), args.repeats)))
    rows = [row(name, r, plain.stats.decode_tokens_per_s) for name, r in modes]
    for r in rows:
        r["lossless"] = r.pop("tokens") == ref
    params = sum(p.numel() for p in engine.model.parameters()) / 1e6
    return {"config": f"{size}/hybrid", "params_m": round(params, 2),
            "prompt_tokens": len(prompt), "rows": rows}


def print_table(results, args):
    print(f"speculative vs plain greedy, {args.new_tokens} new tokens, block {args.block}, "
          f"median of {args.repeats}, fp32 CPU, {torch.get_num_threads()} thread(s)")
    print("share of a cycle: draft / verify / accept / commit / other; "
          "overhead = accept + commit + other")
    head = (f"{'config':<13}{'mode':<12}{'tok/s':>8}{'x plain':>8}{'tok/cyc':>8}"
            f"{'acc':>6}{'cyc ms':>8}  {'draft/verify/accept/commit/other %':<35}"
            f"{'ovh %':>6}{'same':>6}")
    print(head)
    print("-" * len(head))
    for res in results:
        for r in res["rows"]:
            sh = r["share"]
            split = "/".join(f"{sh[k]:.1f}" for k in
                             ("draft", "verify", "accept", "commit", "other"))
            print(f"{res['config']:<13}{r['mode']:<12}{r['tok_s']:>8.1f}{r['ratio']:>7.2f}x"
                  f"{r['tokens_per_cycle']:>8.2f}{r['mean_accepted']:>6.2f}"
                  f"{r['cycle_ms']:>8.2f}  {split:<35}{r['overhead_pct']:>6.1f}"
                  f"{'yes' if r['lossless'] else 'NO':>6}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,bench")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--accept", type=int, default=4, help="replay acceptance length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flash-planner-bench-") as tmp:
        results = []
        for size in args.sizes.split(","):
            print(f"benchmarking {size} ...", file=sys.stderr, flush=True)
            results.append(bench_config(size, args, Path(tmp)))
    if args.json:
        print(json.dumps({"results": results, "wall_s": time.perf_counter() - t0}))
    else:
        print_table(results, args)
        print(f"wall time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
