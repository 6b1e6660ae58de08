"""The demo planner end to end: quality and speed per decoding method and prompt kind.

Methods, all on the shipped demo target (fp32, CPU), same prompts, one process:
  transformers    `generate` of the same checkpoint (greedy, stops at EOS)
  plain           our engine, no proposer
  dflash          + the shipped DFlash drafter, strict acceptance (lossless)
  mtp             + the target's own MTP head (`mtp.*`), strict acceptance (lossless)
  auto            each cycle to the proposer measured faster in its phase (lossless)
  dflash+relaxed  dflash with relaxed acceptance inside <think> (top-3, 1.0 logit)
  mtp+relaxed     mtp with the same relaxed acceptance
Table 1, the held-out tasks (plans): plans that are valid JSON and catalog-valid, exact
matches with the reference plan, decode tokens/s (tokens after each request's first, over
decode time), ratio to plain, tokens per cycle overall, in the thinking part and in the
answer, mean TTFT. The engine methods run one prompt at a time in turn, so drift in the
machine's speed hits them alike.
Table 2, prompt kinds (plain, dflash, mtp, auto): plan (the held-out tasks), navigation
(go-family tasks: mostly JSON), prose (the thinking text alone: thinking-on tasks stopped
at </think>), repeat (a raw prompt of one sentence repeated, continued for 96 tokens) and
mixed (all of them shuffled together), with auto's share of MTP cycles.
Table 3 (`--constrained`, instead of tables 1 and 2): plain, dflash, mtp and auto without and
with the plan grammar (`+grammar`) on the held-out tasks, in turn per prompt: valid and exact
plans, tokens/s, the ratio to the same method without the grammar, tokens per cycle, tokens
per plan that jump-forward published, and the grammar's share of decode time.

    python bench/plan.py [--n 500] [--kind-n 40] [--threads 1] [--png-dir DIR] [--json]
Table 4 (`--weights`, instead of the others): the demo pair quantized at load (target and
drafter) in fp8, nvfp4 and int4 beside full precision (fp32 here: bf16 on CPU is emulated),
plain and dflash in turn per prompt over one engine per format: valid and exact plans,
DFlash tokens per cycle, decode tokens/s and its ratio to full precision (on CPU the
quantized Linears run the torch reference, which dequantizes every weight per call: this
measures that path's cost, not a GPU kernel), and the weight bytes one target forward reads.

Table 5 (`--sampled`, instead of the others): plain, dflash, mtp and auto under the plan
grammar, greedy and sampled (`+sampled`: thinking at the Qwen3 card's thinking values, T 0.6,
top-p 0.95, top-k 20, the answer greedy; seed = the prompt's index), in turn per prompt:
valid and exact plans, tokens/s and its ratio to the same method greedy, tokens per cycle
overall, while thinking and in the answer, and the share of drafts accepted.

    python bench/plan.py --constrained [--n 500] [--threads 1] [--json]
    python bench/plan.py --weights [--n 500] [--threads 1] [--json]
    python bench/plan.py --sampled [--n 500] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from decode import token_clock_class

from flash_planner.engine.engine import Engine
from flash_planner.engine.generate import GenerationSettings, encode_prompt, generate
from flash_planner.engine.inputs.grammar import JsonGrammarCompiler
from flash_planner.engine.loop.sampling import GREEDY, QWEN3_THINKING, Sampling
from flash_planner.planning.grounding import RequestWords
from flash_planner.planning.parse import PlanError, parse_plan
from flash_planner.planning.plan_grammar import PlanGrammar
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.prompt import build_messages
from flash_planner.planning.skills import SkillCatalog
from flash_planner.train.corpus import make_corpus

MAX_NEW = 320
# mode -> (method, relaxed thinking)
MODES = {"plain": ("none", False), "dflash": ("dflash", False), "mtp": ("mtp", False),
         "auto": ("auto", False), "dflash+relaxed": ("dflash", True),
         "mtp+relaxed": ("mtp", True)}
KIND_MODES = ("plain", "dflash", "mtp", "auto")
GRAMMAR = "+grammar"
SAMPLED = "+sampled"
# the planner's useful pair: a sampled thought, a greedy plan under the grammar
THOUGHT_SAMPLED = Sampling(QWEN3_THINKING, GREEDY)


@dataclass
class Prompt:
    kind: str
    messages: object                    # chat messages or a raw string
    settings: dict                      # GenerationSettings fields
    example: object | None = None       # the corpus example, for scoring a plan
    thinking: bool = False              # the prompt opens a thinking block


@dataclass
class Tally:
    name: str
    n: int = 0
    valid: int = 0
    exact: int = 0
    tokens: int = 0
    decode_s: float = 0.0
    ttft_ms: float = 0.0
    phase_tokens: dict = field(default_factory=lambda: {"think": 0, "answer": 0})
    phase_cycles: dict = field(default_factory=lambda: {"think": 0, "answer": 0})
    method_cycles: dict = field(default_factory=dict)
    accept_hist: list = field(default_factory=list)
    forced: int = 0
    grammar_ms: float = 0.0
    drafted: int = 0
    accepted: int = 0

    def add(self, out, prompt: Prompt, catalog) -> None:
        s = out.stats
        self.n += 1
        self.forced += s.forced_tokens or 0
        self.grammar_ms += s.phase_ms["grammar"]
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.tokens += s.new_tokens - 1
        self.decode_s += s.decode_ms / 1000
        self.ttft_ms += s.ttft_ms
        for m, c in s.method_cycles.items():
            self.method_cycles[m] = self.method_cycles.get(m, 0) + c
        self.accept_hist += [0] * (len(s.accept_hist) - len(self.accept_hist))
        for i, c in enumerate(s.accept_hist):
            self.accept_hist[i] += c
        if prompt.example is not None:
            self.score(out.text, out.finish_reason, prompt.example, catalog)

    def score(self, text: str, finish: str, ex, catalog) -> None:
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
        total = sum(self.method_cycles.values())
        return {"mode": self.name, "valid_pct": 100.0 * self.valid / max(self.n, 1),
                "exact_pct": 100.0 * self.exact / max(self.n, 1), "tok_s": tps,
                "x_plain": tps / plain_tps if plain_tps else 0.0,
                "tokens_per_cycle": (sum(self.phase_tokens.values()) / cycles
                                     if cycles else 0.0),
                "tokens_per_cycle_think": per["think"], "tokens_per_cycle_answer": per["answer"],
                "ttft_ms": self.ttft_ms / max(self.n, 1),
                "cycle_share": {m: c / total for m, c in self.method_cycles.items()},
                "accept_hist": self.accept_hist, "forced_per_plan": self.forced / max(self.n, 1),
                "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "grammar_share": self.grammar_ms / 1000 / self.decode_s if self.decode_s else 0}


def run_one(engine, prompt: Prompt, mode: str, tally: Tally, think_close: int, catalog,
            grammar=None, seed: int = 0):
    method, relaxed = MODES[mode.removesuffix(SAMPLED).removesuffix(GRAMMAR)]
    thinking = {"on": prompt.thinking, "calls": 0}

    def on_token(ids, _delta):
        thinking["calls"] += 1
        if thinking["calls"] == 1:       # the prefill token is not a cycle
            thinking["on"] = thinking["on"] and think_close not in ids
            return
        phase = "think" if thinking["on"] else "answer"
        tally.phase_tokens[phase] += len(ids)
        tally.phase_cycles[phase] += 1
        if think_close in ids:
            thinking["on"] = False

    sampling = THOUGHT_SAMPLED.with_seed(seed) if mode.endswith(SAMPLED) else None
    settings = GenerationSettings(**prompt.settings, method=method, relaxed_thinking=relaxed,
                                  sampling=sampling)
    ex = prompt.example         # the request's own grammar, as the planner service decodes
    words = None if ex is None else RequestWords.of(ex.task, ex.context)
    constraint = grammar.constraint(words=words) if GRAMMAR in mode else None
    tally.add(generate(engine, prompt.messages, settings, on_token, constraint=constraint),
              prompt, catalog)


def paired_rows(engine, plans, catalog, close: int, modes: list[str], base_of) -> list[dict]:
    """Each mode in turn per prompt (each request's grammar compiled before its first mode,
    outside the timings; seed = the prompt's index); each row's x is against the mode
    `base_of(mode)` names."""
    grammar = PlanGrammar(catalog, JsonGrammarCompiler.for_engine(engine))
    tallies = {m: Tally(m) for m in modes}
    for i, p in enumerate(plans):
        for mode, tally in tallies.items():
            run_one(engine, p, mode, tally, close, catalog, grammar, seed=i)
    return [t.row(tallies[base_of(m)].tokens / tallies[base_of(m)].decode_s)
            for m, t in tallies.items()]


def constrained_table(engine, plans, catalog, close: int, as_json: bool) -> int:
    """Table 3: each method without and with the plan grammar, in turn per prompt."""
    rows = paired_rows(engine, plans, catalog, close,
                       [m + g for m in KIND_MODES for g in ("", GRAMMAR)],
                       lambda mode: mode.removesuffix(GRAMMAR))
    if as_json:
        print(json.dumps({"n": len(plans), "constrained": rows}))
        return 0
    print(f"demo planner on {len(plans)} held-out tasks, {torch.get_num_threads()} "
          f"thread(s), fp32 CPU, max {MAX_NEW} new tokens; x = vs the same method without "
          "the grammar")
    head = (f"{'mode':<16}{'valid %':>8}{'exact %':>8}{'tok/s':>8}{'x':>7}{'tok/cyc':>8}"
            f"{'forced/plan':>12}{'grammar %':>10}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['mode']:<16}{r['valid_pct']:>8.1f}{r['exact_pct']:>8.1f}{r['tok_s']:>8.0f}"
              f"{r['x_plain']:>6.2f}x{r['tokens_per_cycle']:>8.2f}{r['forced_per_plan']:>12.1f}"
              f"{100 * r['grammar_share']:>10.1f}")
    return 0


def sampled_table(engine, plans, catalog, close: int, as_json: bool) -> int:
    """Table 5: each method under the grammar, greedy and with a sampled thought."""
    rows = paired_rows(engine, plans, catalog, close,
                       [m + GRAMMAR + s for m in KIND_MODES for s in ("", SAMPLED)],
                       lambda mode: mode.removesuffix(SAMPLED))
    if as_json:
        print(json.dumps({"n": len(plans), "sampled": rows}))
        return 0
    print(f"demo planner on {len(plans)} held-out tasks under the plan grammar, "
          f"{torch.get_num_threads()} thread(s), fp32 CPU; +sampled = thinking at T 0.6, top-p "
          "0.95, top-k 20, the answer greedy; x = vs the same method greedy")
    head = (f"{'mode':<24}{'valid %':>8}{'exact %':>8}{'tok/s':>8}{'x':>7}{'tok/cyc':>8}"
            f"{'think':>7}{'answer':>7}{'accepted':>9}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['mode']:<24}{r['valid_pct']:>8.1f}{r['exact_pct']:>8.1f}{r['tok_s']:>8.0f}"
              f"{r['x_plain']:>6.2f}x{r['tokens_per_cycle']:>8.2f}"
              f"{r['tokens_per_cycle_think']:>7.2f}{r['tokens_per_cycle_answer']:>7.2f}"
              f"{100 * r['acceptance']:>8.1f}%")
    return 0


WEIGHTS = ("bf16", "fp8", "nvfp4", "int4")


def weights_table(plans, catalog, as_json: bool) -> int:
    """Table 4: the demo pair quantized at load, each format beside full precision."""
    preset = ModelPreset.load("demo")
    engines = {w: Engine.load(preset.engine_config(device="cpu", dtype="fp32", weights=w))
               for w in WEIGHTS}
    close = engines["bf16"].tokenizer.convert_tokens_to_ids("</think>")
    tallies = {(w, m): Tally(f"{w} {m}") for w in WEIGHTS for m in ("plain", "dflash")}
    for p in plans:
        for (w, mode), tally in tallies.items():
            run_one(engines[w], p, mode, tally, close, catalog)
    rows = []
    for (w, mode), tally in tallies.items():
        base = tallies[("bf16", mode)]
        row = tally.row(base.tokens / base.decode_s)
        row.update(weights=w, method=mode,
                   bytes_per_forward=engines[w].memory.weights_per_forward)
        rows.append(row)
    if as_json:
        print(json.dumps({"n": len(plans), "weights": rows}))
        return 0
    print(f"demo planner quantized at load, {len(plans)} held-out tasks, "
          f"{torch.get_num_threads()} thread(s), CPU (full precision = fp32); x = vs full "
          "precision, same method")
    head = (f"{'weights':<8}{'method':<8}{'valid %':>8}{'exact %':>8}{'tok/cyc':>8}"
            f"{'tok/s':>8}{'x':>7}{'KiB/forward':>12}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        name = "full" if r["weights"] == "bf16" else r["weights"]
        print(f"{name:<8}{r['method']:<8}{r['valid_pct']:>8.1f}{r['exact_pct']:>8.1f}"
              f"{r['tokens_per_cycle']:>8.2f}{r['tok_s']:>8.0f}{r['x_plain']:>6.2f}x"
              f"{r['bytes_per_forward'] / 1024:>12.0f}")
    return 0


def print_rows(rows: list[dict], width: int = 15) -> None:
    """Tally rows as the plan table prints them: plans, speed, tokens per cycle, TTFT."""
    head = (f"{'mode':<{width}}{'valid %':>8}{'exact %':>8}{'tok/s':>8}{'x plain':>8}"
            f"{'tok/cyc':>8}{'think':>7}{'answer':>7}{'TTFT ms':>8}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['mode']:<{width}}{r['valid_pct']:>8.1f}{r['exact_pct']:>8.1f}"
              f"{r['tok_s']:>8.0f}{r['x_plain']:>7.2f}x{r['tokens_per_cycle']:>8.2f}"
              f"{r['tokens_per_cycle_think']:>7.2f}{r['tokens_per_cycle_answer']:>7.2f}"
              f"{r['ttft_ms']:>8.1f}")


def run_transformers(model, engine, prompts, catalog, tally):
    from transformers import StoppingCriteriaList

    clock_cls = token_clock_class()
    eos = engine.eos_ids()
    for p in prompts:
        ids = encode_prompt(engine, p.messages, enable_thinking=p.thinking)
        prompt = torch.tensor([ids])
        clock = clock_cls()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=MAX_NEW, eos_token_id=list(eos),
                                 pad_token_id=engine.tokenizer.pad_token_id,
                                 stopping_criteria=StoppingCriteriaList([clock]))
        new = out[0, len(ids):].tolist()
        tally.n += 1
        tally.tokens += len(new) - 1
        tally.decode_s += clock.stamps[-1] - clock.stamps[0]
        tally.ttft_ms += (clock.stamps[0] - t0) * 1000
        text = engine.tokenizer.decode(new, skip_special_tokens=True)
        tally.score(text, "eos" if new[-1] in eos else "length", p.example, catalog)


def plan_prompt(ex, catalog, kind="plan", **extra) -> Prompt:
    thinking = ex.thinking is not None
    return Prompt(kind, build_messages(catalog, ex.task, ex.context),
                  dict(max_new_tokens=MAX_NEW, enable_thinking=thinking, **extra),
                  None if extra else ex, thinking)


def prompt_kinds(heldout, catalog, n: int) -> dict[str, list[Prompt]]:
    rng = random.Random(0)
    plans = [plan_prompt(ex, catalog) for ex in heldout[:n]]
    nav = [plan_prompt(ex, catalog, "navigation") for ex in heldout
           if ex.family.startswith("go")][:n]
    prose = [plan_prompt(ex, catalog, "prose", stop_strings=("</think>",))
             for ex in heldout if ex.thinking is not None][n:2 * n]
    repeat = [Prompt("repeat", " ".join([ex.task.rstrip(".") + "."] * 6),
                     dict(max_new_tokens=96, ignore_eos=True))
              for ex in heldout[2 * n:3 * n]]
    kinds = {"plan": plans, "navigation": nav, "prose": prose, "repeat": repeat}
    mixed = [p for group in kinds.values() for p in group]
    rng.shuffle(mixed)
    kinds["mixed"] = mixed
    return kinds


def write_charts(rows, kinds, n: int, out: Path) -> list[str]:
    """Tokens/s by method and prompt kind; tokens per cycle by phase per method."""
    from charts import grouped_bars

    where = f"demo planner, fp32 CPU, {torch.get_num_threads()} thread(s)"
    lines = [grouped_bars(
        out / "speed_by_kind.png", f"decode tokens/s by method and prompt kind ({where})",
        list(kinds), {m: [next(r["tok_s"] for r in data["rows"] if r["mode"] == m)
                          for data in kinds.values()] for m in KIND_MODES},
        "decode tokens/s", f"bench/plan.py: {n} held-out tasks, "
        f"{next(iter(kinds.values()))['n']} prompts per kind")]
    spec = [r for r in rows if r["mode"] not in ("transformers", "plain")]
    lines.append(grouped_bars(
        out / "tokens_per_cycle.png", f"tokens per cycle while thinking and in the answer "
        f"({n} held-out tasks)", [r["mode"] for r in spec],
        {"thinking": [r["tokens_per_cycle_think"] for r in spec],
         "answer": [r["tokens_per_cycle_answer"] for r in spec]},
        "tokens per cycle", "bench/plan.py; strict acceptance is lossless, relaxed accepts "
        "top-3 drafts inside <think>", "{:.2f}"))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=500, help="held-out tasks (of 500)")
    parser.add_argument("--kind-n", type=int, default=40, help="prompts per kind, table 2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--png-dir", type=Path, default=None,
                        help="write the charts there (make bench: docs/img)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--constrained", action="store_true",
                        help="table 3 only: each method without and with the plan grammar")
    parser.add_argument("--weights", action="store_true",
                        help="table 4 only: the demo quantized at load in fp8, nvfp4, int4")
    parser.add_argument("--sampled", action="store_true",
                        help="table 5 only: greedy against a sampled thought, grammar on")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    catalog = SkillCatalog.from_yaml(default_skills_path())
    heldout = make_corpus(0, n_train=0)[1]
    if args.weights:
        t0 = time.perf_counter()
        plans = [plan_prompt(ex, catalog) for ex in heldout[:args.n]]
        code = weights_table(plans, catalog, args.json)
        if not args.json:
            print(f"wall time {time.perf_counter() - t0:.1f} s")
        return code
    engine = Engine.load(ModelPreset.load("demo").engine_config(device="cpu", dtype="fp32"))
    close = engine.tokenizer.convert_tokens_to_ids("</think>")
    t0 = time.perf_counter()

    plans = [plan_prompt(ex, catalog) for ex in heldout[:args.n]]
    if args.constrained or args.sampled:
        table = constrained_table if args.constrained else sampled_table
        code = table(engine, plans, catalog, close, args.json)
        if not args.json:
            print(f"wall time {time.perf_counter() - t0:.1f} s")
        return code
    tallies = {m: Tally(m) for m in MODES}
    for p in plans:
        for mode, tally in tallies.items():
            run_one(engine, p, mode, tally, close, catalog)
    rows = []
    if not args.no_transformers:
        hf = AutoModelForCausalLM.from_pretrained(engine.config.model_path,
                                                  dtype=torch.float32).eval()
        hf_tally = Tally("transformers")
        run_transformers(hf, engine, plans, catalog, hf_tally)
        rows.append(hf_tally)
    rows += list(tallies.values())
    plain_tps = tallies["plain"].tokens / tallies["plain"].decode_s
    rows = [t.row(plain_tps) for t in rows]

    kinds = {}
    for kind, prompts in prompt_kinds(heldout, catalog, args.kind_n).items():
        kt = {m: Tally(m) for m in KIND_MODES}
        for p in prompts:
            for mode, tally in kt.items():
                run_one(engine, p, mode, tally, close, catalog)
        base = kt["plain"].tokens / kt["plain"].decode_s
        kinds[kind] = {"n": len(prompts), "rows": [t.row(base) for t in kt.values()]}

    if args.json:
        print(json.dumps({"n": len(plans), "rows": rows, "kinds": kinds}))
        return 0
    print(f"demo planner on {len(plans)} held-out tasks, {torch.get_num_threads()} "
          f"thread(s), fp32 CPU, max {MAX_NEW} new tokens")
    print_rows(rows)
    print(f"\nprompt kinds ({args.kind_n} prompts each; mixed = all of them shuffled): decode "
          "tok/s (x plain, tokens/cycle)")
    head = (f"{'kind':<12}" + "".join(f"{m:>22}" for m in KIND_MODES)
            + f"{'auto: dflash/mtp/plain %':>26}")
    print(head + "\n" + "-" * len(head))
    for kind, data in kinds.items():
        cells = "".join(f"{r['tok_s']:>8.0f} ({r['x_plain']:.2f}x, {r['tokens_per_cycle']:.2f})"
                        .rjust(22) for r in data["rows"])
        share = data["rows"][KIND_MODES.index("auto")]["cycle_share"]
        split = "/".join(f"{100 * share.get(m, 0):.0f}" for m in ("dflash", "mtp", "none"))
        print(f"{kind:<12}{cells}{split:>26}")
    if args.png_dir is not None:
        print("\n".join(write_charts(rows, kinds, len(plans), args.png_dir)))
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
