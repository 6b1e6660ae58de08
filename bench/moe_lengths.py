"""Which draft lengths `auto` picks on a mixture-of-experts target, from measured cost.

A tiny random-weight Qwen3.5-MoE with the 35B-A3B's routing shape (256 experts, 8 per
token, a shared expert; written by transformers) verifies blocks drafted by a replay of its
own greedy text in which each draft is right with probability p (errors drawn per position,
the same whatever the length, as a real drafter's). The verify block of n rows reads the
union of its rows' experts, so its cost grows with n; `auto` measures each length's cost and
tokens per cycle and picks. Printed, from one run: cycles per verify size, the distinct
experts per layer each size touched, and tokens/s of auto against fixed lengths and plain
decoding. CPU figures (the torch reference path): the per-expert work is what grows.

    python bench/moe_lengths.py [--accept 0.8] [--tokens 300]
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch

from flash_planner.engine.config import EngineConfig
from flash_planner.engine.engine import Engine
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.loop.auto_proposer import AutoProposer
from flash_planner.engine.loop.proposer import ReplayProposer
from flash_planner.train.tiny import write_tiny_checkpoint

LENGTHS = (1, 2, 4, 8, 15)
PROMPT = "pick up the red cup and place it on the kitchen table"


def error_offsets(p: float, count: int, seed: int = 0) -> list[int]:
    """Per cycle, the offset of the first wrong draft: geometric with success p."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        k = 0
        while rng.random() < p and k < 64:
            k += 1
        out.append(k)
    return out


def run(engine: Engine, prompt: list[int], tokens: int, proposer) -> tuple[list[int], object]:
    result = generate(engine, prompt, GenerationSettings(tokens, ignore_eos=True),
                      proposer=proposer)
    return result.token_ids, result.stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--accept", type=float, default=0.8, help="per-draft acceptance p")
    ap.add_argument("--tokens", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(tmp, "hybrid_moe", experts=(256, 8), init=0.25)
        engine = Engine.load(EngineConfig(str(path), device="cpu", dtype="fp32",
                                          max_context=args.tokens + 64, method="none"))
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref, plain = run(engine, prompt, args.tokens, None)
    offsets = error_offsets(args.accept, 4 * args.tokens)

    def replay():
        return ReplayProposer(ref, engine.model_config.vocab_size, block_size=16,
                              error_at=offsets)

    rows = [("plain", plain)]
    for k in LENGTHS:
        fixed = AutoProposer({"replay": replay()}, None, lengths={"replay": (k,)})
        fixed.candidates.pop("none")           # always draft k: a fixed-length baseline
        got, stats = run(engine, prompt, args.tokens, fixed)
        assert got == ref, "speculative output differs from plain decoding"
        rows.append((f"fixed {k}", stats))
    auto = AutoProposer({"replay": replay()}, None, lengths={"replay": LENGTHS})
    got, stats = run(engine, prompt, args.tokens, auto)
    assert got == ref, "speculative output differs from plain decoding"
    rows.append(("auto", stats))

    base = plain.decode_tokens_per_s
    print(f"MoE target: 256 experts, 8 per token, hidden 64, 4 layers; replay drafts right "
          f"with p = {args.accept}; {args.tokens} tokens; 1 CPU thread")
    print(f"{'drafting':<9} {'tok/cycle':>9} {'tok/s':>8} {'vs plain':>8}  "
          "cycles by verify rows (distinct experts per layer)")
    for label, s in rows:
        per = ", ".join(f"{n}: {s.verify_cycles[n]} ({e:.1f})"
                        for n, e in s.experts_per_verify.items())
        print(f"{label:<9} {s.tokens_per_cycle:9.2f} {s.decode_tokens_per_s:8.1f} "
              f"{s.decode_tokens_per_s / base:7.2f}x  {per}")


if __name__ == "__main__":
    main()
