"""Build the embedded demo planner: corpus -> tokenizer -> target -> drafter -> MTP -> check.

    python -m flash_planner.train.build_demo [--out DIR] [--seed N] [--threads N]

Everything is trained from scratch on the CPU with fixed seeds (`make demo-model`) and
written to flash_planner/assets/demo/{target,drafter}: a standard Hugging Face checkpoint
(with the tokenizer and an MTP head under `mtp.*`, as Qwen3.5/3.6 releases ship it) and a
DFlash drafter in its upstream format. Each stage after the target trains against the
frozen target alone, so `--drafter-only` / `--mtp-only` retrain one stage bit for bit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..planning.presets import default_skills_path
from ..planning.skills import SkillCatalog
from .corpus import encode, heldout_sets, make_corpus, render
from .drafter import DrafterSpec, train_drafter
from .mtp import train_mtp
from .target import TargetSpec, TrainSettings, train_target
from .tokenizer import load_tokenizer, train_tokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "assets" / "demo"
MTP_TRAIN_STEPS = 1000
TRAIN_EXAMPLES = 30000
MTP_DEPTH = 3           # chain steps trained: the engine's default mtp_steps


def build(out: Path, seed: int, target_steps: int, drafter_steps: int, mtp_train_steps: int,
          threads: int, check: int, only: str | None = None,
          resume: Path | None = None) -> None:
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
    if only is not None:
        if not (target_dir / "model.safetensors").is_file():
            raise SystemExit(f"--{only}-only: no trained target in {target_dir}")
        log(f"[target] kept: {target_dir}")
    else:
        train_target(data, ids["vocab_size"], ids["eos_id"], ids["pad_id"], target_dir,
                     TargetSpec(), TrainSettings(steps=target_steps, seed=seed,
                                                 threads=threads, length_buckets=False),
                     log=log, resume=resume and resume / "target.pt")
    if only in (None, "drafter"):
        train_drafter(data, target_dir, ids["mask_id"], ids["pad_id"], drafter_dir,
                      DrafterSpec(), TrainSettings(steps=drafter_steps, batch_size=16, lr=1e-3,
                                                   seed=seed, threads=threads), log=log)
    if only in (None, "mtp"):
        train_mtp(data, target_dir, ids["pad_id"], MTP_DEPTH,
                  TrainSettings(steps=mtp_train_steps, batch_size=16, lr=1e-3, seed=seed,
                                threads=threads), log=log)
    log(f"[build] trained in {(time.perf_counter() - t0) / 60:.1f} min -> {out}")
    if check:
        from ..engine.engine import Engine, EngineConfig
        from .evaluate import evaluate

        engine = Engine.load(EngineConfig(str(target_dir), drafter_path=str(drafter_dir),
                                          device="cpu", dtype="fp32", max_context=1024))
        for name, examples in heldout_sets(seed, check).items():
            score = evaluate(engine, examples, catalog, refusal_hint=True)
            log(f"[check] {name}, {check} held-out tasks: {score.summary()}")
            for err in score.errors[:3]:
                log(f"[check]   {err}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=2200)
    parser.add_argument("--drafter-steps", type=int, default=2400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check", type=int, default=40,
                        help="tasks to check of each held-out set")
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
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    build(args.out, args.seed, args.target_steps, args.drafter_steps, args.mtp_train_steps,
          args.threads, args.check, args.only, args.resume_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
