"""Build the embedded demo planner: corpus -> tokenizer -> the default catalog's target,
drafter and MTP head -> the target on both catalogs -> drafter and head on -> check.

    python -m flash_planner.train.build_demo [--out DIR] [--seed N] [--threads N]

Everything is trained from scratch on the CPU with fixed seeds (`make demo-model`) and
written to flash_planner/assets/demo/{target,drafter}: a standard Hugging Face checkpoint
(with the tokenizer and an MTP head under `mtp.*`, as Qwen3.5/3.6 releases ship it) and a
DFlash drafter in its upstream format. The first stage learns the default catalog (kept in
the resume directory as `default/`); the target then goes on in rounds with the default
catalog's tasks and the example catalog's (`mobile.py`), half and half, each batch of one
catalog; the first stage's drafter and head go on against the final target. Each stage
after the target trains against the frozen target alone, so `--drafter-only` /
`--mtp-only` retrain one stage bit for bit; `--default-dir`, `--from-round` and
`--round-target` start from what an earlier build kept.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from ..planning.presets import default_skills_path
from ..planning.skills import SkillCatalog
from . import mobile, replans
from .corpus import encode, heldout_sets, make_corpus, render
from .drafter import DrafterSpec, train_drafter
from .mtp import train_mtp
from .target import TargetSpec, TrainSettings, train_target
from .tokenizer import load_tokenizer, train_tokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "assets" / "demo"
MTP_TRAIN_STEPS = 1000
TRAIN_EXAMPLES = 30000
MTP_DEPTH = 3           # chain steps trained: the engine's default mtp_steps
# The target's second stage, in rounds (each a warmup and cosine decay of its own, on fresh
# examples): as many default-catalog examples as example-catalog ones, each batch of one.
CATALOG_EXAMPLES = 12000            # of each catalog, per round
CATALOG_STEPS = (1000, 1200, 800)   # per round
CATALOG_LR = (1e-3, 1e-3, 7e-4)     # per round
# The last round adds replans (`replans.py`: the prompt's progress section after a failed
# step) beside the default catalog's and the example catalog's tasks, so that neither is
# forgotten: examples of each (against the pair before: 600 steps with 5000 of the example
# catalog's lost 3.5 points on its unseen names on 200 tasks, 800 with 6000 1.0, and on 1000
# tasks none: 87.9% against 87.2%, 88.6 against 88.0 with say texts held to the task's
# quotes (`grounded: quote`); tried and not kept: 900 steps with 7500 lost 2.0, this
# round at lr 5e-4 1.0 with 0.5% of them invalid, and the weights interpolated towards the
# pair before, which trades replans for those names: on 500 tasks 0.85 of this round's lost
# 0.6, 0.7 0.4 with replans 95.5% exact, 0.5 gained 0.4 with replans 47.0% exact).
REPLAN_ROUND = 2
REPLAN_MIX = {"replans": 3000, "default": 4000, "example": 6000}
# The first stage's drafter and MTP head, trained on against the final target
DRAFTER_TUNE_STEPS, MTP_TUNE_STEPS = 800, 400


def build(out: Path, seed: int, target_steps: int, drafter_steps: int, mtp_train_steps: int,
          threads: int, check: int, only: str | None = None, resume: Path | None = None,
          default_dir: Path | None = None, from_round: int = 0,
          round_target: Path | None = None) -> None:
    t0 = time.perf_counter()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    catalog = SkillCatalog.from_yaml(default_skills_path())
    train, _ = make_corpus(seed, n_train=TRAIN_EXAMPLES, n_heldout=0)
    log(f"[corpus] {len(train)} training examples")
    target_dir, drafter_dir = out / "target", out / "drafter"
    ids = train_tokenizer((render(ex, catalog=catalog) for ex in train[:5000]), target_dir)
    tok = load_tokenizer(target_dir)
    data = [encode(ex, tok, catalog) for ex in train]
    log(f"[tokenizer] {ids['vocab_size']} tokens; mean example "
        f"{sum(len(i) for i, _ in data) / len(data):.0f} tokens")
    # only the rounds this run trains on (the drafter and the head read the last one)
    last = len(CATALOG_STEPS) - 1
    rounds = {r: _catalog_round(r, seed, data, tok)
              for r in (range(from_round, last + 1) if only is None else [last])}
    mixed, groups = rounds[min(rounds)]
    first = [ids for (ids, _), own in zip(mixed, groups) if own]
    log(f"[corpus] round(s) {', '.join(str(r + 1) for r in rounds)} of both catalogs, "
        f"{len(mixed)} examples in round {min(rounds) + 1}; example catalog's mean "
        f"{sum(len(i) for i in first) / len(first):.0f} tokens")
    with tempfile.TemporaryDirectory() as scratch:
        work = resume or Path(scratch)
        base = default_dir or work / "default"
        settings = dict(seed=seed, threads=threads)
        if default_dir is None and only is None:      # the first stage: the default catalog
            train_target(data, ids["vocab_size"], ids["eos_id"], ids["pad_id"], base / "target",
                         TargetSpec(), TrainSettings(steps=target_steps, length_buckets=False,
                                                     **settings),
                         log=log, resume=resume and resume / "target.pt")
            train_drafter(data, base / "target", ids["mask_id"], ids["pad_id"], base / "drafter",
                          DrafterSpec(), TrainSettings(steps=drafter_steps, batch_size=16,
                                                       lr=1e-3, **settings), log=log)
            train_mtp(data, base / "target", ids["pad_id"], MTP_DEPTH,
                      TrainSettings(steps=mtp_train_steps, batch_size=16, lr=1e-3, **settings),
                      log=log)
        missing = [p for p in (base / "target", base / "drafter") if not p.is_dir()]
        if missing:
            raise SystemExit(f"the default catalog's stage is missing: {missing[0]} (build "
                             "without --drafter-only/--mtp-only first, or give --default-dir)")
        if only is None:
            previous = round_target or (work / f"round{from_round - 1}" if from_round
                                        else base / "target")
            if not previous.is_dir():
                raise SystemExit(f"no target to start round {from_round + 1} from: {previous}")
            for r in range(from_round, last + 1):
                dest = target_dir if r == last else work / f"round{r}"
                mixed, groups = rounds[r]
                log(f"[target] round {r + 1} of both catalogs, from {previous}")
                train_target(mixed, ids["vocab_size"], ids["eos_id"], ids["pad_id"], dest,
                             settings=TrainSettings(steps=CATALOG_STEPS[r], lr=CATALOG_LR[r],
                                                    warmup=30, length_buckets=False,
                                                    **settings),
                             log=log, resume=resume and resume / f"round{r}.pt", init=previous,
                             groups=groups)
                previous = dest
        elif not (target_dir / "model.safetensors").is_file():
            raise SystemExit(f"--{only}-only: no trained target in {target_dir}")
        else:
            log(f"[target] kept: {target_dir}")
        mixed, groups = rounds[last]
        if only in (None, "drafter"):
            train_drafter(mixed, target_dir, ids["mask_id"], ids["pad_id"], drafter_dir,
                          DrafterSpec(), TrainSettings(steps=DRAFTER_TUNE_STEPS, batch_size=16,
                                                       lr=1e-3, **settings), log=log,
                          groups=groups, init=base / "drafter")
        if only in (None, "mtp"):
            train_mtp(mixed, target_dir, ids["pad_id"], MTP_DEPTH,
                      TrainSettings(steps=MTP_TUNE_STEPS, batch_size=16, lr=1e-3, **settings),
                      log=log, init=base / "target")
    log(f"[build] trained in {(time.perf_counter() - t0) / 60:.1f} min -> {out}")
    if check:
        check_heldout(target_dir, drafter_dir, seed, check, catalog, log)


def _catalog_round(r: int, seed: int, data: list, tok) -> tuple[list, list[bool]]:
    """Round r's examples of both catalogs, encoded, and which are the example catalog's."""
    if r == REPLAN_ROUND:
        own = data[:REPLAN_MIX["default"]] + [
            encode(ex, tok) for ex in replans.training_examples(seed, REPLAN_MIX["replans"])]
        extra = mobile.training_examples(seed, REPLAN_MIX["example"], r)
        return (own + [encode(ex, tok, mobile.catalog()) for ex in extra],
                [False] * len(own) + [True] * len(extra))
    n = CATALOG_EXAMPLES
    extra = mobile.training_examples(seed, n, r)
    mixed = data[r * n:(r + 1) * n] + [encode(ex, tok, mobile.catalog()) for ex in extra]
    return mixed, [False] * n + [True] * n


def check_heldout(target_dir: Path, drafter_dir: Path, seed: int, n: int, catalog, log):
    """Plan n tasks of each held-out set of both catalogs and log the scores."""
    from ..engine.engine import Engine, EngineConfig
    from .evaluate import evaluate

    engine = Engine.load(EngineConfig(str(target_dir), drafter_path=str(drafter_dir),
                                      device="cpu", dtype="fp32", max_context=1024))
    default = {**heldout_sets(seed, n), "replan": replans.heldout_examples(seed, n)}
    for which, sets, cat in (("default", default, catalog),
                             ("example", mobile.heldout_examples(seed, n), mobile.catalog())):
        for name, examples in sets.items():
            score = evaluate(engine, examples, cat, refusal_hint=True)
            log(f"[check] {which} catalog, {name}, {n} held-out tasks: {score.summary()}")
            for err in score.errors[:3]:
                log(f"[check]   {err}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=2200,
                        help="the target's first stage (the default catalog)")
    parser.add_argument("--drafter-steps", type=int, default=2400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check", type=int, default=40,
                        help="tasks to check of each held-out set")
    parser.add_argument("--default-dir", type=Path, default=None,
                        help="the first stage's target and drafter (RESUME_DIR/default of an "
                             "earlier build): only the rounds of both catalogs train")
    parser.add_argument("--from-round", type=int, default=0,
                        help="start at this round of both catalogs (with --round-target)")
    parser.add_argument("--round-target", type=Path, default=None,
                        help="the target the round before --from-round left (default: "
                             "RESUME_DIR/roundN of an earlier build)")
    # training steps of the head (not `flash-planner --mtp-steps`, its drafts per cycle)
    parser.add_argument("--mtp-train-steps", type=int, default=MTP_TRAIN_STEPS)
    parser.add_argument("--resume-dir", type=lambda arg: Path(arg) if arg else None,
                        default="build/demo_model",
                        help="where the target's training state is kept every 50 steps, so "
                             "a stopped build goes on where it stopped ('' to keep none)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--drafter-only", action="store_const", const="drafter", dest="only",
                      help="keep the target in OUT/target, train only the drafter")
    only.add_argument("--mtp-only", action="store_const", const="mtp", dest="only",
                      help="keep the target (and drafter), train only the target's MTP head")
    args = parser.parse_args(argv)
    if not 0 <= args.from_round < len(CATALOG_STEPS):
        parser.error(f"--from-round takes 0 to {len(CATALOG_STEPS) - 1}, got {args.from_round}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    build(args.out, args.seed, args.target_steps, args.drafter_steps, args.mtp_train_steps,
          args.threads, args.check, args.only, args.resume_dir, args.default_dir,
          args.from_round, args.round_target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
