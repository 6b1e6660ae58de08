"""Plan held-out tasks with the engine and score them: valid JSON, catalog-valid, exact."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..engine.engine import Engine
from ..engine.generate import GenerationSettings, generate
from ..planning.parse import PlanError, parse_plan
from ..planning.prompt import build_messages
from ..planning.skills import SkillCatalog
from .corpus import Example


@dataclass
class Score:
    n: int = 0
    valid: int = 0                 # a catalog-valid plan
    exact: int = 0                 # equal to the reference plan
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

    def summary(self) -> str:
        return (f"{self.valid}/{self.n} valid ({100 * self.valid / max(self.n, 1):.1f}%), "
                f"{self.exact}/{self.n} exact ({100 * self.exact / max(self.n, 1):.1f}%), "
                f"{self.tokens_per_s:.0f} tok/s, {self.tokens_per_cycle:.2f} tokens/cycle, "
                f"TTFT {self.ttft_ms / max(self.n, 1):.1f} ms")


def evaluate(engine: Engine, examples: Sequence[Example], catalog: SkillCatalog,
             speculative: bool = True, relaxed: bool = False, max_new_tokens: int = 320,
             on_result=None) -> Score:
    score = Score()
    for ex in examples:
        settings = GenerationSettings(max_new_tokens=max_new_tokens, speculative=speculative,
                                      relaxed_thinking=relaxed,
                                      enable_thinking=ex.thinking is not None)
        out = generate(engine, build_messages(catalog, ex.task, ex.context), settings)
        s = out.stats
        score.n += 1
        score.new_tokens += s.new_tokens
        score.cycles += s.cycles
        score.decode_ms += s.decode_ms
        score.ttft_ms += s.ttft_ms
        try:
            steps, _ = parse_plan(out.text, catalog, truncated=out.finish_reason == "length")
        except PlanError as exc:
            score.errors.append(f"{ex.task!r}: {exc}")
        else:
            score.valid += 1
            score.exact += steps == ex.plan
        if on_result is not None:
            on_result(ex, out)
    return score
