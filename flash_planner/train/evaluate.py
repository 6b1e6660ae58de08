"""Plan held-out tasks with the engine and score them: valid (a catalog-valid plan or a
refusal), exact (the reference plan, or a refusal where one is expected), grounded (every
string argument is written in the task or scene) and refused."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..engine.engine import Engine
from ..engine.generate import GenerationSettings, generate
from ..planning.grounding import RequestWords
from ..planning.parse import PlanError, PlanRefused, parse_plan
from ..planning.plan_grammar import PlanGrammar
from ..planning.prompt import build_messages
from ..planning.service import PlannerConfig
from ..planning.skills import SkillCatalog
from .corpus import Example


def grounded(steps: list[dict], task: str, context: str = "", scene=()) -> bool:
    """Every string argument (grounded in the catalog or not) is a run of words of the task,
    the scene or a listed name, modulo case and a leading article (`RequestWords.contains`):
    a plan that names something the request never mentioned is not."""
    words = RequestWords.of(task, context, scene)
    return all(words.contains(value) for step in steps for value in step["args"].values()
               if isinstance(value, str))


@dataclass
class Score:
    n: int = 0
    valid: int = 0                 # a catalog-valid plan, or a refusal
    exact: int = 0                 # equal to the reference plan (a refusal where one is due)
    grounded: int = 0              # a plan whose string arguments all come from the request
    refused: int = 0               # answered with a refusal
    # a replan (`replans.py`) that retries the failed step first and ends as the task does
    sensible: int = 0
    new_tokens: int = 0
    cycles: int = 0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens/s over all requests (first tokens excluded)."""
        return (self.new_tokens - self.n) / (self.decode_ms / 1000) if self.decode_ms else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        return (self.new_tokens - self.n) / self.cycles if self.cycles else 0.0

    def percent(self, name: str) -> float:
        return 100 * getattr(self, name) / max(self.n, 1)

    def summary(self) -> str:
        counts = ", ".join(f"{getattr(self, k)}/{self.n} {k} ({self.percent(k):.1f}%)"
                           for k in ("valid", "exact", "grounded", "refused"))
        return (f"{counts}, {self.tokens_per_s:.0f} tok/s, "
                f"{self.tokens_per_cycle:.2f} tokens/cycle, "
                f"TTFT {self.ttft_ms / max(self.n, 1):.1f} ms")


def evaluate(engine: Engine, examples: Sequence[Example], catalog: SkillCatalog,
             speculative: bool = True, relaxed: bool = False, max_new_tokens: int = 320,
             refusal_hint: bool = False, grammar: PlanGrammar | None = None,
             ground: bool = True, on_result=None) -> Score:
    """Plan each example and score it; `grammar` (the catalog's plan grammar) constrains the
    answers as the planner service does (each request's own, with grounded arguments; the
    catalog's alone with `ground` off), with the service's default thinking budget. `valid`
    is catalog-valid: whether the names come from the request is the `grounded` score."""
    score = Score()
    reserve = PlannerConfig().answer_reserve
    for ex in examples:
        settings = GenerationSettings(max_new_tokens=max_new_tokens, speculative=speculative,
                                      relaxed_thinking=relaxed,
                                      enable_thinking=ex.thinking is not None)
        messages = build_messages(catalog, ex.task, ex.context, refusal_hint, scene=ex.scene,
                                  progress=ex.progress)
        words = RequestWords.of(ex.task, ex.context, ex.scene)
        constraint = (None if grammar is None
                      else grammar.constraint(think_budget=max(0, max_new_tokens - reserve),
                                              words=words if ground else None))
        out = generate(engine, messages, settings, constraint=constraint)
        s = out.stats
        score.n += 1
        score.new_tokens += s.new_tokens
        score.cycles += s.cycles
        score.decode_ms += s.decode_ms
        score.ttft_ms += s.ttft_ms
        try:
            # a scene list's names are checked (and written in full) as the service does
            steps, _ = parse_plan(out.text, catalog, truncated=out.finish_reason == "length",
                                  words=words if ex.scene else None)
        except PlanRefused:
            score.valid += 1
            score.refused += 1
            score.exact += bool(ex.refusal)
        except PlanError as exc:
            score.errors.append(f"{ex.task!r}: {exc}")
        else:
            score.valid += 1
            score.exact += steps == ex.plan and not ex.refusal
            score.sensible += bool(ex.progress and steps and ex.plan and steps[0] == ex.plan[0]
                                   and steps[-1] == ex.plan[-1])
            score.grounded += grounded(steps, ex.task, ex.context, ex.scene)
        if on_result is not None:
            on_result(ex, out)
    return score
