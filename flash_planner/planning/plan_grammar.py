"""The plan grammar: what a constrained answer may be, built from the skill catalog.

An answer is either a plan, `{"plan": [{"skill": NAME, "args": {...}}, ...]}` with only the
catalog's skills, each with exactly its own arguments, of their types and within their
enums and ranges, or a refusal, `{"refusal": REASON}`, when the catalog cannot express the
task. The catalog's grammar is compiled once (at configure); a catalog it cannot compile is a
`CatalogError` naming the skill. A catalog with grounded arguments (`grounding.py`) also gets
a grammar per request, whose grounded arguments admit only runs of the request's words:
compiled when the request starts (tens of ms) and kept for the next few requests.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from ..engine.inputs.grammar import (
    MAX_STRING_TOKENS,
    GrammarError,
    JsonGrammarCompiler,
    JsonSchemaGrammar,
)
from ..engine.loop.constraint import Constraint
from .grounding import RequestWords
from .parse import REFUSAL_SCHEMA
from .plan_tree import tree_schema
from .skills import CatalogError, SkillCatalog

# a request's words -> its compiled grammar; a robot repeats its tasks
CACHED_REQUESTS = 32
# words a grounded catalog is compiled with at configure, so a schema xgrammar cannot take
# fails there and not at a robot's first request
SAMPLE_WORDS = RequestWords.of("the cup on shelf 2")


def answer_schema(catalog: SkillCatalog, words: RequestWords | None = None,
                  recovery: bool = False) -> dict[str, Any]:
    """JSON-Schema of a constrained answer: a plan or a refusal (grounded arguments limited
    to the runs of `words` when given: the request's schema); with `recovery`, the plan's
    nodes may be retries and fallbacks too (plan_tree.py)."""
    plan = catalog.plan_schema(words)
    if plan is None:
        return REFUSAL_SCHEMA
    if not recovery:
        return {"anyOf": [plan, REFUSAL_SCHEMA]}
    plan = tree_schema(plan)
    # the step's definition at the root, where its reference "#/$defs/step" resolves
    return {"$defs": plan.pop("$defs"), "anyOf": [plan, REFUSAL_SCHEMA]}


class PlanGrammar:
    """The catalog's plan grammar, and with grounded arguments one per request."""

    def __init__(self, catalog: SkillCatalog, compiler: JsonGrammarCompiler,
                 recovery: bool = False):
        self.catalog, self.compiler, self.recovery = catalog, compiler, recovery
        try:
            self.base = compiler.compile(answer_schema(catalog, recovery=recovery))
            if catalog.has_grounded:
                compiler.compile(answer_schema(catalog, SAMPLE_WORDS, recovery))
        except GrammarError as exc:
            raise _catalog_error(catalog, compiler, exc) from None
        # (the request's words or None, the skills left out) -> its compiled grammar
        self._cache: collections.OrderedDict[tuple, JsonSchemaGrammar] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    def for_request(self, words: RequestWords | None,
                    without: frozenset[str] = frozenset()) -> JsonSchemaGrammar:
        """The grammar of a request with these words (the catalog's when it has no grounded
        arguments or `words` is None), less the skills `without` (their servers are away)."""
        grounded = words is not None and self.catalog.has_grounded
        if not grounded and not without:
            return self.base
        key = (words if grounded else None, without)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            grammar = self.compiler.compile(answer_schema(self.catalog.without(without),
                                                           key[0], self.recovery))
        except GrammarError as exc:
            raise ValueError(f"the request's words cannot be compiled into its plan grammar: "
                             f"{exc}") from None
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHED_REQUESTS:
                self._cache.popitem(last=False)
        return grammar

    def constraint(self, think_budget: int | None = None, words: RequestWords | None = None,
                   max_string_tokens: int | None = MAX_STRING_TOKENS,
                   without: frozenset[str] = frozenset()) -> Constraint:
        """A fresh per-request constraint (`JsonSchemaGrammar.constraint`)."""
        return self.for_request(words, without).constraint(
            think_budget=think_budget, max_string_tokens=max_string_tokens)


def _catalog_error(catalog: SkillCatalog, compiler: JsonGrammarCompiler,
                   exc: GrammarError) -> CatalogError:
    words = SAMPLE_WORDS if catalog.has_grounded else None
    for skill in catalog.skills:   # name the skill that breaks it
        try:
            compiler.compile(SkillCatalog((skill,)).plan_schema(words))
        except GrammarError as one:
            return CatalogError(f"skill '{skill.name}' cannot be turned into a plan grammar: "
                                f"{one}")
    return CatalogError(f"the skill catalog cannot be turned into a plan grammar: {exc}")
