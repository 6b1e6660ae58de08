"""The planner service's settings (`PlannerConfig`): queue, limits, thinking, sampling,
grammar and backend, each checked when the config is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.inputs.chat import check_reasoning_effort
from ..engine.inputs.grammar import MAX_STRING_TOKENS
from ..engine.loop.sampling import Sampling, resolve_sampling
from .images import ImageLimits
from .remote import BACKENDS, RemoteConfig
from .request import MAX_CONTEXT_CHARS, MAX_TASK_CHARS

POLICIES = ("queue", "preempt", "reject")


@dataclass(frozen=True)
class PlannerConfig:
    queue_depth: int = 4
    policy: str = "queue"
    max_task_chars: int = MAX_TASK_CHARS
    max_context_chars: int = MAX_CONTEXT_CHARS
    # a request's images: how many, how large as sent, whether URLs are fetched
    images: ImageLimits = ImageLimits()
    max_new_tokens: int = 512
    enable_thinking: bool = True
    # passed to chat templates that take it (Qwen3.8's: xhigh, medium, low) unless a request
    # names its own; None: the template's default
    reasoning_effort: str | None = None
    deadline_s: float | None = None
    speculative: bool = True
    relaxed_thinking: bool = False
    relaxed_topk: int = 3
    relaxed_delta: float = 1.0
    constrain: bool = True          # decode the answer under the catalog's plan grammar
    # constrained: tokens kept for the answer; thinking is closed when it would eat into them
    answer_reserve: int = 160
    # constrained: the most tokens inside one string of the answer (a looping refusal reason
    # or spoken text closes there and the answer stays valid: engine/grammar.BoundedStrings)
    max_string_tokens: int = MAX_STRING_TOKENS
    # the prompt names the refusal shape (prompt.REFUSAL_HINT); the CLI and the node take the
    # model preset's choice (true but for the demo, which was trained without it)
    refusal_hint: bool = False
    # plans may retry steps and fall back to alternatives (plan_tree.py): the prompt shows
    # the forms (prompt.RECOVERY_HINT) and the plan grammar admits them; the model preset's
    # choice (on for the Qwen presets, off for the demo, which was never taught them)
    recovery: bool = False
    # how requests sample unless they say: a mode (greedy | model | card) or a mapping
    # (engine.sampling.resolve_sampling); "model" = the checkpoint's generation_config.json
    sampling: Any = "greedy"
    # where plans are made: local (this engine), remote (an OpenAI-compatible server,
    # `remote`), remote_or_local (the remote, and this engine when it fails); with a
    # deadline, remote_or_local leaves `remote_reserve_s` of it to the local engine
    backend: str = "local"
    remote: RemoteConfig | None = None
    remote_reserve_s: float = 1.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("queue_depth", "max_task_chars", "max_context_chars", "max_new_tokens",
                     "answer_reserve", "max_string_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {self.deadline_s!r}")
        check_reasoning_effort(self.reasoning_effort)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend != "local" and self.remote is None:
            raise ValueError(f"backend {self.backend!r} needs a remote (url and model)")
        if self.remote_reserve_s < 0:
            raise ValueError(f"remote_reserve_s must be >= 0, got {self.remote_reserve_s!r}")
        base = resolve_sampling(self.sampling, Sampling(), None, "planner.sampling")
        if self.relaxed_thinking and self.sampling != "model" and not base.greedy:
            raise ValueError("planner.sampling samples, and relaxed thinking acceptance is "
                             "defined for greedy decoding only: use one or the other")
