"""The plan grammar's own cost: compile time and work per verify row, at two vocabulary sizes.

Three tokenizers: the demo's (1,024 tokens); the real Qwen3 vocabulary (151,643 BPE tokens
+ Qwen3's 26 added ones, built from the GGUF vocabulary in the llama-cpp-python sdist by
`train/qwen_vocab.py`; fetched once); and the stand-in used before that existed, a byte-level
BPE of Qwen's size trained here on this machine's Python sources with the demo's own trainer
(`train/tokenizer.py`; `--no-stand-in` skips it). Mask cost depends on the vocabulary's size
and on how its tokens overlap JSON; the two large ones show how far the stand-in's estimate
was from Qwen's own figure.

For each held-out plan (the answer after `</think>`) the request's grammar is compiled (its
grounded arguments admit only the task's and scene's words: `request ms`, per request, as the
planner service pays it when a request starts) and the loop's grammar work is replayed as
the speculative loop does it with blocks of `--block` rows that the target accepted whole:
`block()` over the block's tokens (the drafts' walk and jump-forward), `masks()` (one mask
row per verify row) and `commit()`. Printed per tokenizer: compile time, microseconds per
verify row, and what a full 16-row block costs next to a Thor 27B NVFP4 forward (~55 ms,
FACTS.md section 11): the share of a cycle the grammar would take if it did not overlap.

    python bench/grammar.py [--n 200] [--block 16] [--qwen-vocab 151643] [--no-stand-in]
                            [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from flash_planner.engine.inputs.grammar import JsonGrammarCompiler
from flash_planner.engine.loop.acceptance import think_token_ids
from flash_planner.planning.grounding import RequestWords
from flash_planner.planning.parse import split_answer
from flash_planner.planning.plan_grammar import PlanGrammar
from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.skills import SkillCatalog
from flash_planner.train.corpus import answer_text, make_corpus
from flash_planner.train.qwen_vocab import qwen_tokenizer_dir
from flash_planner.train.tokenizer import load_tokenizer, train_tokenizer

DEMO = Path(__file__).resolve().parents[1] / "flash_planner/assets/demo/target"
THOR_FORWARD_MS = 55.0


def python_sources(limit_bytes: int) -> list[str]:
    texts, size = [], 0
    for path in sorted(Path(sys.base_prefix, "lib").rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text)
        if size >= limit_bytes:
            break
    return texts


def measure(tokenizer, catalog, examples: list, block: int) -> dict:
    t0 = time.perf_counter()
    compiler = JsonGrammarCompiler(tokenizer, len(tokenizer),
                                   [tokenizer.convert_tokens_to_ids("<|im_end|>")],
                                   think_token_ids(tokenizer))
    grammar = PlanGrammar(catalog, compiler)
    compile_ms = (time.perf_counter() - t0) * 1000
    close = tokenizer.convert_tokens_to_ids("</think>")
    walk_s = mask_s = 0.0
    rows = forced = tokens = 0
    request_ms = []
    for ex in examples:
        ids = tokenizer.encode(split_answer(answer_text(ex))[1], add_special_tokens=False)
        t = time.perf_counter()
        c = grammar.constraint(words=RequestWords.of(ex.task, ex.context))
        request_ms.append((time.perf_counter() - t) * 1000)
        c.reset([close])
        for at in range(0, len(ids), block):
            drafts = ids[at + 1:at + block]          # ids[at] is the cycle's anchor
            t = time.perf_counter()
            c.commit([ids[at]])
            c.block(drafts, room=block - 1)
            t1 = time.perf_counter()
            c.masks(drafts)
            t2 = time.perf_counter()
            c.commit(drafts, len(drafts))
            walk_s += t1 - t + time.perf_counter() - t2
            mask_s += t2 - t1
            rows += len(drafts) + 1
        forced += c.stats.forced_drafted
        tokens += len(ids)
    per_row_us = (walk_s + mask_s) / rows * 1e6
    return {"vocab": len(tokenizer), "compile_ms": compile_ms,
            "request_ms_mean": sum(request_ms) / len(request_ms),
            "request_ms_max": max(request_ms), "rows": rows,
            "mask_us_per_row": mask_s / rows * 1e6, "walk_us_per_row": walk_s / rows * 1e6,
            "us_per_row": per_row_us, "block_ms": per_row_us * block / 1000,
            "thor_share_pct": 100 * per_row_us * block / 1000 / THOR_FORWARD_MS,
            "tokens": tokens}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="held-out plans")
    parser.add_argument("--block", type=int, default=16, help="verify rows per cycle")
    parser.add_argument("--qwen-vocab", type=int, default=151643,
                        help="tokens of the stand-in BPE to train")
    parser.add_argument("--no-stand-in", action="store_true",
                        help="skip training the Qwen-size stand-in BPE")
    parser.add_argument("--corpus-mb", type=float, default=40.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    catalog = SkillCatalog.from_yaml(default_skills_path())
    examples = make_corpus(0, n_train=0, n_heldout=args.n)[1]
    tokenizers = {"demo": load_tokenizer(DEMO),
                  "qwen3": load_tokenizer(qwen_tokenizer_dir(progress=print))}
    train_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_stand_in:
            t0 = time.perf_counter()
            train_tokenizer(python_sources(int(args.corpus_mb * 2**20)), tmp,
                            vocab_size=args.qwen_vocab)
            train_s = time.perf_counter() - t0
            tokenizers["bpe-qwen-size"] = load_tokenizer(tmp)
        results = {name: measure(tok, catalog, examples, args.block)
                   for name, tok in tokenizers.items()}
    if args.json:
        print(json.dumps({"n": len(examples), "block": args.block, "results": results}))
        return 0
    print(f"plan grammar work on {len(examples)} held-out answers in blocks of {args.block} "
          f"rows" + (f" (the Qwen-size stand-in BPE trained in {train_s:.0f} s)"
                     if train_s else ""))
    head = (f"{'tokenizer':<15}{'vocab':>8}{'compile ms':>11}{'request ms':>11}{'max':>6}"
            f"{'mask us/row':>12}{'walk us/row':>12}{'block ms':>9}{'of 55 ms':>9}")
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        print(f"{name:<15}{r['vocab']:>8}{r['compile_ms']:>11.0f}{r['request_ms_mean']:>11.1f}"
              f"{r['request_ms_max']:>6.0f}{r['mask_us_per_row']:>12.1f}"
              f"{r['walk_us_per_row']:>12.1f}{r['block_ms']:>9.2f}{r['thor_share_pct']:>8.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
