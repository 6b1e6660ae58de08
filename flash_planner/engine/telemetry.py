"""Per-request timings and counters, reported under stable names (CLI --json, ROS, bench)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


def now_ms() -> float:
    return time.perf_counter() * 1000.0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0          # request start -> first generated token known
    decode_ms: float = 0.0        # first token -> last token
    total_ms: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first one, over the time spent producing them."""
        if self.new_tokens < 2 or self.decode_ms <= 0:
            return 0.0
        return (self.new_tokens - 1) / (self.decode_ms / 1000.0)

    def as_dict(self) -> dict[str, float | int]:
        out = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        out["decode_tokens_per_s"] = round(self.decode_tokens_per_s, 2)
        return out
