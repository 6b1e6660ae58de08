"""Build the embedded demo planner: corpus -> tokenizer -> target -> drafter -> check.

    python -m flash_planner.train.build_demo [--out DIR] [--seed N] [--threads N]

Everything is trained from scratch on the CPU with fixed seeds (`make demo-model`, about
38 minutes on 2 cores) and written to flash_planner/assets/demo/{target,drafter}: a
standard Hugging Face checkpoint (with the tokenizer) and a DFlash drafter in its upstream
format.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..planning.presets import default_skills_path
from ..planning.skills import SkillCatalog
from .corpus import encode, make_corpus, render
from .drafter import DrafterSpec, train_drafter
from .target import TargetSpec, TrainSettings, train_target
from .tokenizer import load_tokenizer, train_tokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "assets" / "demo"


def build(out: Path, seed: int, target_steps: int, drafter_steps: int, threads: int,
          check: int, drafter_only: bool = False) -> None:
    t0 = time.perf_counter()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    catalog = SkillCatalog.from_yaml(default_skills_path())
    train, heldout = make_corpus(seed)
    log(f"[corpus] {len(train)} train / {len(heldout)} held-out examples")
    target_dir, drafter_dir = out / "target", out / "drafter"
    ids = train_tokenizer((render(ex, catalog=catalog) for ex in train[:5000]), target_dir)
    tok = load_tokenizer(target_dir)
    data = [encode(ex, tok, catalog) for ex in train]
    log(f"[tokenizer] {ids['vocab_size']} tokens; mean example "
        f"{sum(len(i) for i, _ in data) / len(data):.0f} tokens")
    if drafter_only:
        if not (target_dir / "model.safetensors").is_file():
            raise SystemExit(f"--drafter-only: no trained target in {target_dir}")
        log(f"[target] kept: {target_dir}")
    else:
        train_target(data, ids["vocab_size"], ids["eos_id"], ids["pad_id"], target_dir,
                     TargetSpec(), TrainSettings(steps=target_steps, seed=seed,
                                                 threads=threads, length_buckets=False),
                     log=log)
    train_drafter(data, target_dir, ids["mask_id"], ids["pad_id"], drafter_dir,
                  DrafterSpec(), TrainSettings(steps=drafter_steps, batch_size=16, lr=1e-3,
                                               seed=seed, threads=threads), log=log)
    log(f"[build] trained in {(time.perf_counter() - t0) / 60:.1f} min -> {out}")
    if check:
        from ..engine.engine import Engine, EngineConfig
        from .evaluate import evaluate

        engine = Engine.load(EngineConfig(str(target_dir), drafter_path=str(drafter_dir),
                                          device="cpu", dtype="fp32", max_context=1024))
        score = evaluate(engine, heldout[:check], catalog)
        log(f"[check] {check} held-out tasks: {score.summary()}")
        for err in score.errors[:5]:
            log(f"[check]   {err}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=1000)
    parser.add_argument("--drafter-steps", type=int, default=1800)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check", type=int, default=50, help="held-out tasks to check")
    parser.add_argument("--drafter-only", action="store_true",
                        help="keep the target in OUT/target, train only the drafter")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    build(args.out, args.seed, args.target_steps, args.drafter_steps, args.threads,
          args.check, args.drafter_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
