"""A DFlash2 drafter for the demo, against the shipped DFlash drafter and MTP head.

Grows the shipped DFlash drafter into a DFlash2 drafter (train/drafter2.py: the same
weights, identity convs, a fresh candidate selector), trains it against the frozen demo
target on the demo's training corpus, then runs the held-out plan tasks through plain,
dflash (the shipped drafter), dflash+N (the control: the shipped drafter trained the same
N steps more, block loss only), dflash2 (the grown one) and mtp in turn per prompt, greedy, no
grammar, and prints valid / exact plans, decode tok/s, the ratio to plain and tokens per
cycle (inside the thinking and in the answer). Every row is lossless: each gives plain
decoding's tokens, so valid and exact agree across rows. The trained drafter is kept under
--out (default: the cache) and reused when its settings match. No timing is asserted.

    python bench/dflash2.py [--steps 600] [--n 100] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from plan import MAX_NEW, Tally, plan_prompt, print_rows, run_one

from flash_planner.engine.config import cache_home
from flash_planner.engine.engine import Engine
from flash_planner.planning.presets import ModelPreset, asset_path, default_skills_path
from flash_planner.planning.skills import SkillCatalog
from flash_planner.train.corpus import encode, make_corpus
from flash_planner.train.drafter2 import SelectorSpec, train_dflash2
from flash_planner.train.target import TrainSettings
from flash_planner.train.tokenizer import load_tokenizer

TRAIN_EXAMPLES = 30000


def trained_drafters(out: Path, steps: int, seed: int, threads: int, catalog
                     ) -> dict[bool, Path]:
    """control -> the drafter trained with those settings, trained now unless kept under
    `out`; the corpus is encoded once, and only when something is trained."""
    spec = SelectorSpec()
    keys = {False: out / f"steps{steps}-seed{seed}-r{spec.selector_rank}-k{spec.selector_top_k}",
            True: out / f"control-steps{steps}-seed{seed}"}
    target_dir = asset_path("@assets/demo/target")
    data = tok = None
    for control, key in keys.items():
        if (key / "model.safetensors").is_file():
            print(f"[dflash2] reusing {key}", flush=True)
            continue
        if data is None:
            tok = load_tokenizer(target_dir)
            train, _ = make_corpus(seed, n_train=TRAIN_EXAMPLES, n_heldout=0)
            data = [encode(ex, tok, catalog) for ex in train]
        t0 = time.perf_counter()
        train_dflash2(data, target_dir, asset_path("@assets/demo/drafter"), tok.pad_token_id,
                      key, spec, TrainSettings(steps=steps, batch_size=16, lr=1e-3, seed=seed,
                                               threads=threads),
                      log=lambda msg: print(msg, flush=True), control=control)
        print(f"[dflash2] trained in {(time.perf_counter() - t0) / 60:.1f} min -> {key}",
              flush=True)
    return keys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="training steps of 16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=100, help="held-out tasks (of 500)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=cache_home() / "bench_dflash2")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    catalog = SkillCatalog.from_yaml(default_skills_path())
    preset = ModelPreset.load("demo")
    shipped = Engine.load(preset.engine_config(device="cpu", dtype="fp32"))
    trained = {control: Engine.load(preset.engine_config(device="cpu", dtype="fp32",
                                                         drafter_path=str(path),
                                                         method="dflash"))
               for control, path in trained_drafters(args.out, args.steps, args.seed,
                                                     args.threads, catalog).items()}
    close = shipped.tokenizer.convert_tokens_to_ids("</think>")
    heldout = make_corpus(0, n_train=0)[1][:args.n]
    plans = [plan_prompt(ex, catalog) for ex in heldout]
    # row -> (engine, mode of bench/plan.py)
    rows = {"plain": (shipped, "plain"), "dflash": (shipped, "dflash"),
            f"dflash+{args.steps}": (trained[True], "dflash"),
            "dflash2": (trained[False], "dflash"), "mtp": (shipped, "mtp")}
    tallies = {name: Tally(name) for name in rows}
    t0 = time.perf_counter()
    for p in plans:
        for name, (engine, mode) in rows.items():
            run_one(engine, p, mode, tallies[name], close, catalog)
    plain_tps = tallies["plain"].tokens / tallies["plain"].decode_s
    out = [t.row(plain_tps) for t in tallies.values()]
    if args.json:
        print(json.dumps({"n": len(plans), "steps": args.steps, "rows": out}))
        return 0
    print(f"demo planner on {len(plans)} held-out tasks, {torch.get_num_threads()} thread(s), "
          f"fp32 CPU, max {MAX_NEW} new tokens; dflash2 grown from the shipped drafter and "
          f"trained {args.steps} steps")
    print_rows(out, 12)
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
