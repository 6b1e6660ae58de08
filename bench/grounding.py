"""Does the demo plan what it was asked? The three held-out sets, with and without the hint.

Sets (`train/corpus.heldout_sets`): (a) world: tasks of the training worlds, combinations
never trained on; (b) unseen: open-vocabulary tasks whose object, place and container names
(and every word of them) never occur in training; (c) inexpressible: tasks the skill catalog
cannot express, with actions never refused in training. Columns: valid (a catalog-valid plan
or a refusal), exact (the reference plan; for (c) a refusal), grounded (a plan whose string
arguments are all written in the task or scene, modulo case and articles), refused, tokens
per cycle and decode tok/s of the preset's speculative method (auto). Each model runs every
set with the prompt as trained before the hint (`refusal_hint` off) and with the refusal
shape named (on); `--before DIR` adds a second demo pair (DIR/target, DIR/drafter) run the
same way, in turn per task, so both models see the machine alike. `--grammar` runs each task
in turn under each of the grammars named: `off` (free decoding), `catalog` (the catalog's
plan grammar, any string in any argument) and `request` (the request's own grammar, whose
grounded arguments admit only runs of the task's and scene's words, as the planner service
decodes by default). The misses follow the table: each task with what the model answered.
`--sets replan` (default catalog) scores replans (`train/replans.py`): held-out set (a)'s
tasks after one of their steps failed, the progress section in the prompt; exact is the rest
of the plan from the failed step, sensible a plan that retries the failed step first and
ends as the task's plan does.

    python bench/grounding.py [--n 200] [--before DIR] [--grammar off,catalog,request]
                              [--catalog default|example] [--hint off|on|both]
                              [--threads 1] [--json]

`--catalog example` runs the same three sets in the example catalog
(config/catalogs/mobile_manipulator.yaml, `train/mobile.py`): each task with its scene list.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from flash_planner.engine.engine import Engine
from flash_planner.engine.inputs.grammar import JsonGrammarCompiler
from flash_planner.planning.plan_grammar import PlanGrammar
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.skills import SkillCatalog
from flash_planner.train import mobile, replans
from flash_planner.train.corpus import HELDOUT_SETS, heldout_sets
from flash_planner.train.evaluate import Score, evaluate

COLUMNS = ("valid", "exact", "grounded", "refused")
SETS = (*HELDOUT_SETS, "replan")


def load(preset: ModelPreset, root: Path | None) -> Engine:
    paths = {} if root is None else dict(model_path=str(root / "target"),
                                         drafter_path=str(root / "drafter"))
    return Engine.load(preset.engine_config(device="cpu", dtype="fp32", **paths))


GRAMMARS = ("off", "catalog", "request")


def run(engines: dict[str, Engine], sets: dict, catalog, grammars: list[str],
        hints: tuple[bool, ...] = (False, True)) -> list[dict]:
    compiled = {m: PlanGrammar(catalog, JsonGrammarCompiler.for_engine(e))
                for m, e in engines.items() if grammars != ["off"]}
    keys = [(m, s, h, g) for s in sets for h in hints for g in grammars
            for m in engines]
    scores = {key: Score() for key in keys}
    for name, examples in sets.items():
        for ex in examples:
            for model, _, hint, grammar in (k for k in keys if k[1] == name):
                texts: list[str] = []
                one = evaluate(engines[model], [ex], catalog, refusal_hint=hint,
                               grammar=None if grammar == "off" else compiled[model],
                               ground=grammar == "request",
                               on_result=lambda _ex, out, t=texts: t.append(out.text))
                total = scores[(model, name, hint, grammar)]
                for f in ("n", "valid", "exact", "grounded", "refused", "sensible",
                          "new_tokens", "cycles", "decode_ms", "ttft_ms"):
                    setattr(total, f, getattr(total, f) + getattr(one, f))
                if not one.exact:  # the misses, with what the model answered
                    answer = texts[0].split("</think>")[-1].strip()
                    listed = f", objects {list(ex.scene)}" if ex.scene else ""
                    total.errors.append(f"{ex.task!r} (scene {ex.context!r}{listed}) -> "
                                        f"{answer}")
    return [{"model": m, "set": s, "hint": h, "grammar": g, "n": sc.n,
             **{f"{c}_pct": sc.percent(c) for c in (*COLUMNS, "sensible")},
             "tokens_per_cycle": sc.tokens_per_cycle, "tok_s": sc.tokens_per_s,
             "misses": sc.errors} for (m, s, h, g), sc in scores.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="tasks per held-out set")
    parser.add_argument("--demo", type=Path, default=None,
                        help="a demo pair (DIR/target, DIR/drafter) to score instead of the "
                             "shipped one (a build's --out)")
    parser.add_argument("--before", type=Path, default=None,
                        help="another demo pair (DIR/target, DIR/drafter) to compare")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--grammar", default="off",
                        help="comma-separated, each in turn per task: off (free decoding), "
                             "catalog (the catalog's plan grammar), request (the request's "
                             "grammar with grounded arguments, as the planner service runs)")
    parser.add_argument("--catalog", choices=("default", "example"), default="default",
                        help="the default catalog's held-out sets, or the example catalog's "
                             "(config/catalogs/mobile_manipulator.yaml, with scene lists)")
    parser.add_argument("--sets", default=",".join(HELDOUT_SETS),
                        help=f"comma-separated, of {', '.join(SETS)} (replan: the default "
                             "catalog's)")
    parser.add_argument("--hint", choices=("off", "on", "both"), default="both",
                        help="the refusal shape named in the prompt")
    parser.add_argument("--misses", type=int, default=8,
                        help="misses of the (new) model listed per set and hint")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    grammars = [g.strip() for g in args.grammar.split(",") if g.strip()]
    if not grammars or any(g not in GRAMMARS for g in grammars):
        parser.error(f"--grammar takes a comma-separated list of {', '.join(GRAMMARS)}; "
                     f"got {args.grammar!r}")
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.catalog == "example":
        catalog, sets = mobile.catalog(), mobile.heldout_examples(0, args.n)
    else:
        catalog = SkillCatalog.from_yaml(default_skills_path())
        sets = {**heldout_sets(0, args.n), "replan": replans.heldout_examples(0, args.n)}
    hints = {"off": (False,), "on": (True,), "both": (False, True)}[args.hint]
    chosen = [name.strip() for name in args.sets.split(",") if name.strip()]
    if not chosen or any(name not in sets for name in chosen):
        parser.error(f"--sets takes a comma-separated list of {', '.join(sets)}; "
                     f"got {args.sets!r}")
    sets = {name: sets[name] for name in chosen}
    preset = ModelPreset.load("demo")
    engines = {"shipped" if args.demo is None else "built": load(preset, args.demo)}
    if args.before is not None:
        engines = {"before": load(preset, args.before), "after": next(iter(engines.values()))}
    t0 = time.perf_counter()
    rows = run(engines, sets, catalog, grammars, hints)
    if args.json:
        print(json.dumps({"n": args.n, "rows": rows}))
        return 0
    print(f"{args.catalog} catalog's held-out sets, {args.n} tasks each, "
          f"{torch.get_num_threads()} thread(s), fp32 CPU, "
          f"method {preset.method}; hint = the refusal shape named in the prompt; grammar = "
          "off, the catalog's, or the request's (grounded arguments)")
    head = (f"{'set':<15}{'model':<9}{'hint':<6}{'grammar':<9}"
            + "".join(f"{c + ' %':>11}" for c in COLUMNS) + f"{'sensible %':>11}"
            + f"{'tok/cyc':>9}{'tok/s':>7}")
    print(head + "\n" + "-" * len(head))
    for name in SETS:
        for r in (r for r in rows if r["set"] == name):
            sensible = f"{r['sensible_pct']:>11.1f}" if name == "replan" else f"{'-':>11}"
            print(f"{name:<15}{r['model']:<9}{'on' if r['hint'] else 'off':<6}{r['grammar']:<9}"
                  + "".join(f"{r[c + '_pct']:>11.1f}" for c in COLUMNS) + sensible
                  + f"{r['tokens_per_cycle']:>9.2f}{r['tok_s']:>7.0f}")
    for r in rows:
        if r["model"] != "before":
            for miss in r["misses"][:args.misses]:
                print(f"  [{r['set']}, hint {'on' if r['hint'] else 'off'}, grammar "
                      f"{r['grammar']}] {miss}")
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
