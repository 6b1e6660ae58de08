"""The demo planner as a tool caller: held-out tasks answered as OpenAI tool calls of the
catalog's skills (`planning/skill_tools.py`, grounded to each task's words) under the tool
grammar (`tool_choice: required`, parallel calls), beside the same tasks planned as plans
under the plan grammar, from one run.

Printed per route and method: the share of tasks answered with at least one call, the share
that ended inside a call (cut by the token limit: that call is not returned), the share
whose every call validates against its tool's schema (the grammar's promise: 100%), the
share whose calls pass the plan validator with grounding (`check_calls`), the share equal
to the reference plan, decode tokens/s and mean accepted tokens per verify. The demo was
trained on plans, never on tool calls (its prompt here is the planner's, with the tools
added by its chat template), so the tool route's exactness shows what the grammar alone
holds, not what a tool-trained model does.

Then tools of a user's own, which the demo never saw (announce, grasp, move_to), on the
same tasks at max_tokens 128 as the server answers them, `tool_choice: required` and a named
function, with the server's string bound (`tool_string_tokens`) and without it (before and
after, from one run): the share of tasks given a schema-valid call, the share left inside
an open call, and the strings and raw values closed at the bound.

    python bench/tool_calls.py [--n 50] [--methods none,dflash] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jsonschema

from flash_planner.engine.engine import Engine, EngineConfig
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.inputs.chat import encode_chat
from flash_planner.engine.inputs.grammar import JsonGrammarCompiler
from flash_planner.engine.inputs.tool_calls import (
    QWEN35,
    split_calls,
    structural_tag,
    tool_call_format,
)
from flash_planner.planning.parse import PlanError
from flash_planner.planning.planner_config import PlannerConfig
from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.prompt import build_messages
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerService
from flash_planner.planning.skill_tools import check_calls, skill_tools
from flash_planner.planning.skills import SkillCatalog
from flash_planner.server.tool_api import tool_string_tokens
from flash_planner.train.corpus import heldout_sets

ROOT = Path(__file__).resolve().parents[1] / "flash_planner/assets/demo"
MAX_NEW = 160
USER_MAX_NEW = 128
USER_TOOLS = [
    {"type": "function", "function": {
        "name": "announce", "description": "Say one sentence out loud.",
        "parameters": {"type": "object", "required": ["text"],
                       "properties": {"text": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "grasp", "description": "Grasp an object with a force in newtons.",
        "parameters": {"type": "object", "required": ["object"],
                       "properties": {"object": {"type": "string"},
                                      "force": {"type": "number", "minimum": 0,
                                                "maximum": 50}}}}},
    {"type": "function", "function": {
        "name": "move_to", "description": "Drive to a place at a speed in m/s.",
        "parameters": {"type": "object", "required": ["place", "speed"],
                       "properties": {"place": {"type": "string"},
                                      "speed": {"type": "number", "minimum": 0.1,
                                                "maximum": 1.0}}}}},
]


def _steps(steps) -> list[tuple[str, str]]:
    return [(s["skill"], json.dumps(s["args"], sort_keys=True)) for s in steps]


def tool_route(engine, compiler, catalog, tasks, method: str) -> dict:
    fmt = tool_call_format(engine.tokenizer)
    counts = {"called": 0, "cut": 0, "schema_valid": 0, "plan_valid": 0, "exact": 0}
    tokens = seconds = accepted = 0.0
    for ex in tasks:
        tools = skill_tools(catalog, task=ex.task)
        grammar = compiler.compile_tag(structural_tag(fmt, tools, "required", True))
        messages = build_messages(catalog, ex.task, ex.context, False)
        ids = encode_chat(engine.tokenizer, messages, False, None, tools)
        bound = tool_string_tokens(PlannerConfig().max_string_tokens, MAX_NEW, tools)
        out = generate(engine, ids, GenerationSettings(MAX_NEW, method=method),
                       constraint=grammar.constraint(max_string_tokens=bound,
                                                     raw_values=fmt == QWEN35))
        stats = out.stats.as_dict()
        tokens += stats["new_tokens"]
        seconds += stats["new_tokens"] / max(stats["decode_tokens_per_s"], 1e-9)
        accepted += stats["mean_accepted"]
        _, calls, cut = split_calls(fmt, out.text, tools)
        counts["cut"] += cut
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        counts["called"] += bool(calls)
        try:
            for call in calls:
                jsonschema.validate(call.arguments, schemas[call.name])
            counts["schema_valid"] += bool(calls)
            steps = check_calls(catalog, [(c.name, c.arguments) for c in calls], ex.task)
            counts["plan_valid"] += 1
            counts["exact"] += _steps(steps) == _steps(ex.plan)
        except (jsonschema.ValidationError, PlanError, KeyError):
            pass
    n = len(tasks)
    return {**{k: round(100 * v / n, 1) for k, v in counts.items()},
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
            "mean_accepted": round(accepted / n, 2)}


def user_tool_route(engine, compiler, tasks, choice: str, bounded: bool) -> dict:
    """The user's tools under `choice` ("required", or "named": each task names one of
    them in turn), bounded as the server bounds them or not at all."""
    fmt = tool_call_format(engine.tokenizer)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in USER_TOOLS}
    bound = tool_string_tokens(PlannerConfig().max_string_tokens, USER_MAX_NEW, USER_TOOLS)
    counts = {"valid_call": 0, "left_open": 0}
    cuts = tokens = seconds = 0.0
    for i, ex in enumerate(tasks):
        tool_choice: str | dict = choice
        if choice == "named":
            name = USER_TOOLS[i % len(USER_TOOLS)]["function"]["name"]
            tool_choice = {"type": "function", "function": {"name": name}}
        grammar = compiler.compile_tag(structural_tag(fmt, USER_TOOLS, tool_choice, True))
        constraint = grammar.constraint(max_string_tokens=bound if bounded else None,
                                        raw_values=bounded and fmt == QWEN35)
        ids = encode_chat(engine.tokenizer, [{"role": "user", "content": ex.task}], False,
                          None, USER_TOOLS)
        out = generate(engine, ids, GenerationSettings(USER_MAX_NEW), constraint=constraint)
        stats = out.stats.as_dict()
        tokens += stats["new_tokens"]
        seconds += stats["new_tokens"] / max(stats["decode_tokens_per_s"], 1e-9)
        cuts += getattr(constraint.matcher, "cut", 0)
        _, calls, left_open = split_calls(fmt, out.text, USER_TOOLS)
        counts["left_open"] += left_open
        try:
            for call in calls:
                jsonschema.validate(call.arguments, schemas[call.name])
            counts["valid_call"] += bool(calls)
        except (jsonschema.ValidationError, KeyError):
            pass
    n = len(tasks)
    return {**{k: round(100 * v / n, 1) for k, v in counts.items()},
            "strings_cut": int(cuts), "bound": bound if bounded else None,
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}


def plan_route(service, tasks, method: str) -> dict:
    exact = valid = 0
    tokens = seconds = accepted = 0.0
    for ex in tasks:
        result = service.plan_in_this_thread(PlanRequest(task=ex.task, context=ex.context,
                                                         method=method,
                                                         enable_thinking=False))
        t = result.telemetry
        tokens += t.get("new_tokens", 0)
        seconds += t.get("new_tokens", 0) / max(t.get("decode_tokens_per_s", 0), 1e-9)
        accepted += t.get("mean_accepted", 0)
        valid += result.success
        exact += result.success and _steps(result.plan) == _steps(ex.plan)
    n = len(tasks)
    return {"called": None, "cut": None, "schema_valid": None,
            "plan_valid": round(100 * valid / n, 1), "exact": round(100 * exact / n, 1),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
            "mean_accepted": round(accepted / n, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=50, help="held-out tasks (the world set)")
    parser.add_argument("--methods", default="none,dflash")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    engine = Engine.load(EngineConfig(str(ROOT / "target"), drafter_path=str(ROOT / "drafter"),
                                      device="cpu", dtype="fp32", max_context=2048))
    catalog = SkillCatalog.from_yaml(default_skills_path())
    tasks = [ex for ex in heldout_sets(0, args.n * 2)["world"] if ex.plan][:args.n]
    compiler = JsonGrammarCompiler.for_engine(engine)
    service = PlannerService(engine, catalog, PlannerConfig())
    rows = {}
    for method in args.methods.split(","):
        rows[f"tool calls, {method}"] = tool_route(engine, compiler, catalog, tasks, method)
        rows[f"plans, {method}"] = plan_route(service, tasks, method)
    user = {f"{choice}, {'bounded' if bounded else 'unbounded'}":
            user_tool_route(engine, compiler, tasks, choice, bounded)
            for choice in ("required", "named") for bounded in (True, False)}
    if args.json:
        print(json.dumps({"skills": rows, "user_tools": user}, indent=1))
        return 0
    print(f"{len(tasks)} held-out tasks (world set), demo planner, thinking off, CPU")
    keys = ["called", "cut", "schema_valid", "plan_valid", "exact", "tokens_per_s",
            "mean_accepted"]
    print(f"{'route':<22}" + "".join(f"{k:>14}" for k in keys))
    for name, row in rows.items():
        print(f"{name:<22}" + "".join(f"{'-' if row[k] is None else row[k]!s:>14}"
                                      for k in keys))
    print(f"\nthe user's own tools (announce, grasp, move_to), max_tokens {USER_MAX_NEW}")
    keys = ["valid_call", "left_open", "strings_cut", "bound", "tokens_per_s"]
    print(f"{'choice':<22}" + "".join(f"{k:>14}" for k in keys))
    for name, row in user.items():
        print(f"{name:<22}" + "".join(f"{'-' if row[k] is None else row[k]!s:>14}"
                                      for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
