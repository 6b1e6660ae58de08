"""Sampling: the next-token distribution as transformers' `generate(do_sample=True)` builds
it, per phase (thinking, answer), and speculative sampling that keeps it exact.

Processing order (transformers' `_get_logits_processor`): the repetition penalty (every token
of the prompt and the output so far: a seen token's logit is divided by the penalty when
positive, multiplied when negative), then presence and frequency penalties (OpenAI's: minus
`presence` once and `frequency` per occurrence, output tokens only; transformers has neither,
vLLM applies them here too), then temperature, top-k, top-p and min-p. Temperature 0 is
greedy: the row is one-hot at the (penalised) argmax. A grammar's mask arrives as -inf logits
and leaves those tokens at probability 0.

Each token is drawn by the Gumbel-max trick with noise fixed per (seed, position): the token
at position j is argmax(log p_j + G_j), G_j iid Gumbel from a generator seeded by the
request's seed and j. That is an exact draw from p_j, and it makes the drafts irrelevant to
the outcome: verification is greedy acceptance against the perturbed rows (a draft is kept
iff it equals its row's perturbed argmax), so speculative sampling publishes exactly the
tokens plain sampling publishes with the same seed, for every method and draft length, as
greedy speculative decoding does for greedy. A greedy draft x_i is kept with probability
p_i(x_i), as in standard speculative sampling with q one-hot (Leviathan et al. 2023; FACTS.md
section 17), and after a rejection the token is distributed as p_i without x_i. Everything
stays on the device; the loop's one host copy per cycle reads the count and the tokens.
Greedy rows (one-hot p) accept exactly what strict acceptance accepts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ...kernels.accept.reference import accepted_prefix
from .acceptance import ThinkTracker


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    min_p: float = 0.0                # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0   # 1 = off

    def __post_init__(self) -> None:
        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value > hi or value < lo \
                    or (lo_open and value == lo):
                bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
                raise ValueError(f"{name} must be a number in {bound}, got {value!r}")

        number("temperature", 0.0, 100.0)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        number("top_p", 0.0, 1.0, lo_open=True)
        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, 10.0, lo_open=True)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "sampling") -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown setting(s) {unknown} (known: {sorted(known)})")
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    @classmethod
    def from_generation_config(cls, raw: Mapping[str, Any]) -> SamplingParams:
        """A checkpoint's generation_config.json: its sampling defaults (greedy unless it
        says do_sample)."""
        if not raw.get("do_sample"):
            return cls(repetition_penalty=float(raw.get("repetition_penalty") or 1.0))
        return cls.from_dict({
            "temperature": float(raw.get("temperature", 1.0)),
            "top_k": int(raw.get("top_k") or 0), "top_p": float(raw.get("top_p", 1.0)),
            "min_p": float(raw.get("min_p") or 0.0),
            "repetition_penalty": float(raw.get("repetition_penalty") or 1.0)},
            "generation_config.json")


GREEDY = SamplingParams()
# The Qwen3 model cards' settings (FACTS.md section 17)
QWEN3_THINKING = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
QWEN3_ANSWER = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)


@dataclass(frozen=True)
class Sampling:
    """Settings per phase (inside `<think> ... </think>`, and the rest) and the seed."""
    thinking: SamplingParams = field(default_factory=SamplingParams)
    answer: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(
                self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.thinking.greedy and self.answer.greedy

    def with_seed(self, seed: int | None) -> Sampling:
        return self if seed is None else Sampling(self.thinking, self.answer, seed)

    def as_dict(self) -> dict[str, Any]:
        phases = {name: {f.name: getattr(getattr(self, name), f.name)
                         for f in fields(SamplingParams)} for name in ("thinking", "answer")}
        return {**phases, "seed": self.seed}


SAMPLING_MODES = ("greedy", "model", "card")


def resolve_sampling(spec: Any, base: Sampling, model: SamplingParams | None = None,
                     where: str = "sampling") -> Sampling:
    """The Sampling a spec asks for, on top of `base`.

    spec: None or "" (base unchanged); "greedy"; "model" (the checkpoint's
    generation_config.json, both phases; `model`); "card" (the Qwen3 cards' thinking-mode
    values while thinking, their non-thinking values after); a Sampling; or a mapping whose
    SamplingParams keys set both phases, `thinking` / `answer` (a mapping or a mode name)
    set one phase, and `seed` sets the seed. Errors name `where` and the setting."""
    if spec is None or spec == "":
        return base
    if isinstance(spec, Sampling):
        return spec
    if isinstance(spec, str):
        if spec not in SAMPLING_MODES:
            raise ValueError(f"{where} must be one of {SAMPLING_MODES} or a mapping of "
                             f"settings, got {spec!r}")
        if spec == "model":
            defaults = model or GREEDY
            return Sampling(defaults, defaults, base.seed)
        if spec == "card":
            return Sampling(QWEN3_THINKING, QWEN3_ANSWER, base.seed)
        return Sampling(GREEDY, GREEDY, base.seed)
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where} must be a mode name or a mapping, got "
                         f"{type(spec).__name__}")
    spec = dict(spec)
    phases = {name: spec.pop(name) for name in ("thinking", "answer") if name in spec}
    seed = spec.pop("seed", base.seed)
    out = base
    if spec:                                       # flat settings: both phases
        both = SamplingParams.from_dict(spec, where)
        out = Sampling(both, both, out.seed)
    for name, value in phases.items():
        if isinstance(value, str):
            phase = getattr(resolve_sampling(value, out, model, f"{where}.{name}"), name)
        elif isinstance(value, Mapping):
            phase = SamplingParams.from_dict(value, f"{where}.{name}")
        else:
            raise ValueError(f"{where}.{name} must be a mode name or a mapping, got "
                             f"{type(value).__name__}")
        out = Sampling(**{**{"thinking": out.thinking, "answer": out.answer}, name: phase},
                       seed=out.seed)
    try:
        return Sampling(out.thinking, out.answer, seed)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def process(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
            generated: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities [R, V] (float32) from logits [R, V]; `seen` / `generated` [R, V] count
    each token in the prompt + output / in the output before each row (penalties only)."""
    x = logits.float()
    if params.repetition_penalty != 1.0 and seen is not None:
        rp = params.repetition_penalty
        x = torch.where(seen > 0, torch.where(x < 0, x * rp, x / rp), x)
    if (params.presence_penalty or params.frequency_penalty) and generated is not None:
        x = x - params.presence_penalty * (generated > 0) - params.frequency_penalty * generated
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[-1]).float()
    x = x / params.temperature
    neg_inf = float("-inf")
    if params.top_k:
        kth = torch.topk(x, min(params.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, neg_inf)
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=False, dim=-1)
        cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - params.top_p)
        drop[..., -1:] = False                                     # keep at least one
        x = x.masked_fill(drop.scatter(-1, order, drop), neg_inf)
    if params.min_p > 0.0:
        probs = x.softmax(dim=-1)
        drop = probs < params.min_p * probs.amax(dim=-1, keepdim=True)
        drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        x = x.masked_fill(drop, neg_inf)
    return x.softmax(dim=-1)


_MIX = 0x9E3779B97F4A7C15   # spreads positions over the seed space (the golden ratio, 64 bit)


class SampledAcceptance(ThinkTracker):
    """The acceptance policy of a sampled request: `decide` returns the accepted count and
    the token to publish after it, both on the device. Tracks the think phase and the token
    counts its penalties need from what the loop commits (`observe`)."""

    relaxed = False

    def __init__(self, sampling: Sampling, vocab_size: int, device: torch.device,
                 think_ids: tuple[int, int] | None = None) -> None:
        super().__init__(*(think_ids or (-1, -1)))
        self.sampling, self.vocab, self.device = sampling, vocab_size, device
        self.seed = sampling.seed if sampling.seed is not None else \
            int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator(device=device)
        self._penalised = sampling.thinking.penalised or sampling.answer.penalised
        self.seen = self.generated = None
        self._noise: tuple[int, torch.Tensor | None] = (0, None)   # the last rows drawn

    def reset(self, prompt_ids: Sequence[int]) -> None:
        super().reset(prompt_ids)
        if self._penalised:
            self.seen = self._counts(prompt_ids)
            self.generated = torch.zeros_like(self.seen)

    def _counts(self, tokens: Sequence[int]) -> torch.Tensor:
        out = torch.zeros(self.vocab, device=self.device)
        if tokens:
            ids = torch.tensor(list(tokens), device=self.device)
            out.index_add_(0, ids, torch.ones(ids.shape[0], device=self.device))
        return out

    def observe(self, tokens: Sequence[int]) -> None:
        super().observe(tokens)
        if self._penalised and tokens:
            new = self._counts(tokens)
            self.seen += new
            self.generated += new

    def _phase_rows(self, drafts: torch.Tensor) -> torch.Tensor:
        """[k+1] bool: whether row i (after the anchor and d_1..d_i) is inside thinking: the
        state before each of the drafts and one token more."""
        return self.thinking_before(torch.cat((drafts, drafts.new_full((1,), -1))))

    def distribution(self, drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """p [k+1, V]: row i's processed next-token distribution."""
        seen = generated = None
        if self._penalised:
            steps = torch.nn.functional.one_hot(drafts, self.vocab).float().cumsum(dim=0)
            steps = torch.cat((steps.new_zeros(1, self.vocab), steps))
            seen, generated = self.seen + steps, self.generated + steps
        think, answer = self.sampling.thinking, self.sampling.answer
        p_answer = process(logits, answer, seen, generated)
        if think == answer:
            return p_answer
        p_think = process(logits, think, seen, generated)
        return torch.where(self._phase_rows(drafts)[:, None], p_think, p_answer)

    def noise(self, position: int, rows: int, vocab: int, device) -> torch.Tensor:
        """[rows, vocab] Gumbel noise for positions position..position+rows-1, each row a
        function of (seed, its position) alone. Rows drawn from `position` on are kept
        (rows before it are dropped), so a cycle's verification reuses what its proposer's
        `pick` drew for the drafts, whether in one call or one position at a time."""
        start, kept = self._noise
        offset = position - start
        if kept is not None and 0 <= offset <= kept.shape[0]:
            kept = kept[offset:]                          # noise depends on (seed, position)
        else:
            kept = torch.empty(0, vocab, device=device)
        extra = torch.empty(max(0, rows - kept.shape[0]), vocab, device=device)
        for r in range(extra.shape[0]):
            at = position + kept.shape[0] + r
            self.generator.manual_seed((self.seed + at * _MIX) % 2**63)
            extra[r].uniform_(generator=self.generator)
        if extra.shape[0]:
            kept = torch.cat((kept, -torch.log(-torch.log(extra.clamp_(min=1e-20)))))
        self._noise = (position, kept)
        return kept[:rows]

    def pick(self, logits: torch.Tensor, position: int,
             among: torch.Tensor | None = None) -> torch.Tensor:
        """Drafts from a proposer's logits [n, V] for positions position..+n-1: each the
        argmax of the proposer's processed log-probabilities plus the very noise its
        verification will use, so a proposer close to the target drafts what the target
        will pick (q processed with the current phase's settings, penalties left out: q only
        sets how often drafts are kept, never which tokens are published). `among` [n, C]:
        the logits [n, C] score only these token ids (every other one is out), as a
        candidate selector's are; the draw is the one over the whole vocabulary with the
        rest at -inf, without processing rows of the vocabulary's width."""
        params = self.sampling.thinking if self.thinking else self.sampling.answer
        q = process(logits, params)
        noise = self.noise(position, q.shape[0], self.vocab, q.device)
        if among is None:
            return (torch.log(q) + noise).argmax(dim=-1)
        best = (torch.log(q) + noise.gather(1, among)).argmax(dim=-1, keepdim=True)
        return among.gather(1, best)[:, 0]

    def decide(self, drafts: torch.Tensor, logits: torch.Tensor, position: int
               ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(accepted count, None without drafts; the token each row publishes): row i is the
        token at `position` + i, drawn from p_i by its fixed noise; drafts are kept while
        they match."""
        p = self.distribution(drafts, logits)
        picks = (torch.log(p) + self.noise(position, p.shape[0], p.shape[1], p.device)
                 ).argmax(dim=-1)
        k = drafts.shape[0]
        return (accepted_prefix(drafts == picks[:k]) if k else None), picks
