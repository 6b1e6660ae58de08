"""The demo planner end to end on held-out tasks: quality and speed per decoding mode.

Modes, all on the shipped demo target (fp32, CPU), same prompts, one process:
  transformers  `generate` of the same checkpoint (greedy, stops at EOS)
  plain         our engine, no drafter
  dflash        our engine + the shipped DFlash drafter, strict acceptance (lossless)
  relaxed       as dflash with relaxed acceptance inside <think> (top-3, 1.0 logit)
For each: plans that are valid JSON and catalog-valid, exact matches with the reference
plan, decode tokens/s (all tokens after each request's first, over decode time), ratio to
plain, tokens per cycle overall and split into the thinking and the answer part, mean TTFT.
Writes a PNG (tokens/s per mode, accepted-length histograms) when matplotlib is installed.

    python bench/plan.py [--n 200] [--threads 1] [--png bench/out/plan.png] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from decode import token_clock_class

from flash_planner.engine.engine import Engine
from flash_planner.engine.generate import GenerationSettings, encode_prompt, generate
from flash_planner.planning.parse import PlanError, parse_plan
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.prompt import build_messages
from flash_planner.planning.skills import SkillCatalog
from flash_planner.train.corpus import make_corpus

MAX_NEW = 320


class Tally:
    def __init__(self, name: str):
        self.name = name
        self.n = self.valid = self.exact = self.tokens = 0
        self.decode_s = self.ttft_ms = 0.0
        self.phase_tokens = {"think": 0, "answer": 0}
        self.phase_cycles = {"think": 0, "answer": 0}
        self.accept_hist: list[int] = []

    def score(self, text: str, finish: str, ex, catalog) -> None:
        self.n += 1
        try:
            steps, _ = parse_plan(text, catalog, truncated=finish == "length")
        except PlanError:
            return
        self.valid += 1
        self.exact += steps == ex.plan

    def row(self, plain_tps: float) -> dict:
        tps = self.tokens / self.decode_s if self.decode_s else 0.0
        cycles = sum(self.phase_cycles.values())
        per = {p: (self.phase_tokens[p] / self.phase_cycles[p] if self.phase_cycles[p] else 0.0)
               for p in self.phase_tokens}
        return {"mode": self.name, "valid_pct": 100.0 * self.valid / self.n,
                "exact_pct": 100.0 * self.exact / self.n, "tok_s": tps,
                "x_plain": tps / plain_tps if plain_tps else 0.0,
                "tokens_per_cycle": (sum(self.phase_tokens.values()) / cycles
                                     if cycles else 0.0),
                "tokens_per_cycle_think": per["think"], "tokens_per_cycle_answer": per["answer"],
                "ttft_ms": self.ttft_ms / self.n, "accept_hist": self.accept_hist}


def run_engine(engine, examples, catalog, tally, speculative, relaxed, think_close):
    for ex in examples:
        thinking = {"on": ex.thinking is not None, "calls": 0}

        def on_token(ids, _delta, thinking=thinking):
            thinking["calls"] += 1
            if thinking["calls"] == 1:       # the prefill token is not a cycle
                thinking["on"] = thinking["on"] and think_close not in ids
                return
            phase = "think" if thinking["on"] else "answer"
            tally.phase_tokens[phase] += len(ids)
            tally.phase_cycles[phase] += 1
            if think_close in ids:
                thinking["on"] = False

        settings = GenerationSettings(MAX_NEW, speculative=speculative, relaxed_thinking=relaxed,
                                      enable_thinking=ex.thinking is not None)
        out = generate(engine, build_messages(catalog, ex.task, ex.context), settings, on_token)
        s = out.stats
        tally.tokens += s.new_tokens - 1
        tally.decode_s += s.decode_ms / 1000
        tally.ttft_ms += s.ttft_ms
        hist = s.accept_hist
        tally.accept_hist += [0] * (len(hist) - len(tally.accept_hist))
        for i, c in enumerate(hist):
            tally.accept_hist[i] += c
        tally.score(out.text, out.finish_reason, ex, catalog)


def run_transformers(model, engine, examples, catalog, tally):
    from transformers import StoppingCriteriaList

    clock_cls = token_clock_class()
    eos = engine.eos_ids()
    for ex in examples:
        ids = encode_prompt(engine, build_messages(catalog, ex.task, ex.context),
                            enable_thinking=ex.thinking is not None)
        prompt = torch.tensor([ids])
        clock = clock_cls()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=MAX_NEW, eos_token_id=list(eos),
                                 pad_token_id=engine.tokenizer.pad_token_id,
                                 stopping_criteria=StoppingCriteriaList([clock]))
        new = out[0, len(ids):].tolist()
        tally.tokens += len(new) - 1
        tally.decode_s += clock.stamps[-1] - clock.stamps[0]
        tally.ttft_ms += (clock.stamps[0] - t0) * 1000
        text = engine.tokenizer.decode(new, skip_special_tokens=True)
        tally.score(text, "eos" if new[-1] in eos else "length", ex, catalog)


def write_png(rows, path: Path) -> str:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no chart written"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar([r["mode"] for r in rows], [r["tok_s"] for r in rows], color="#4a7ab8")
    left.set_ylabel("decode tokens/s")
    left.set_title("demo planner, held-out tasks (CPU, fp32)")
    for r in rows:
        if r["mode"] in ("dflash", "relaxed"):          # the modes that draft
            hist = r["accept_hist"]
            right.plot(range(len(hist)), [c / sum(hist) for c in hist], marker="o",
                       label=r["mode"])
    right.set_xlabel("accepted drafts per cycle")
    right.set_ylabel("share of cycles")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return f"chart written to {path}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="held-out tasks (of 500)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--png", type=Path, default=Path("bench/out/plan.png"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    catalog = SkillCatalog.from_yaml(default_skills_path())
    examples = make_corpus(0, n_train=0)[1][:args.n]
    preset = ModelPreset.load("demo")
    engine = Engine.load(preset.engine_config(device="cpu", dtype="fp32"))
    close = engine.tokenizer.convert_tokens_to_ids("</think>")
    hf = AutoModelForCausalLM.from_pretrained(engine.config.model_path,
                                              dtype=torch.float32).eval()
    t0 = time.perf_counter()
    tallies = [Tally(m) for m in ("transformers", "plain", "dflash", "relaxed")]
    run_transformers(hf, engine, examples, catalog, tallies[0])
    run_engine(engine, examples, catalog, tallies[1], False, False, close)
    run_engine(engine, examples, catalog, tallies[2], True, False, close)
    run_engine(engine, examples, catalog, tallies[3], True, True, close)
    plain_tps = tallies[1].tokens / tallies[1].decode_s
    rows = [t.row(plain_tps) for t in tallies]
    if args.json:
        print(json.dumps({"n": len(examples), "rows": rows}))
        return 0
    print(f"demo planner on {len(examples)} held-out tasks, {torch.get_num_threads()} "
          f"thread(s), fp32 CPU, max {MAX_NEW} new tokens")
    head = (f"{'mode':<13}{'valid %':>8}{'exact %':>8}{'tok/s':>8}{'x plain':>8}"
            f"{'tok/cyc':>8}{'think':>7}{'answer':>7}{'TTFT ms':>8}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['mode']:<13}{r['valid_pct']:>8.1f}{r['exact_pct']:>8.1f}{r['tok_s']:>8.0f}"
              f"{r['x_plain']:>7.2f}x{r['tokens_per_cycle']:>8.2f}"
              f"{r['tokens_per_cycle_think']:>7.2f}{r['tokens_per_cycle_answer']:>7.2f}"
              f"{r['ttft_ms']:>8.1f}")
    print(write_png(rows, args.png))
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
