"""The plan grammar: what a constrained answer may be, built from the skill catalog.

An answer is either a plan, `{"plan": [{"skill": NAME, "args": {...}}, ...]}` with only the
catalog's skills, each with exactly its own arguments, of their types and within their
enums and ranges, or a refusal, `{"refusal": REASON}`, when the catalog cannot express the
task. The grammar is compiled once per catalog (at configure); a catalog it cannot compile is
a `CatalogError` naming the skill.
"""

from __future__ import annotations

from typing import Any

from ..engine.grammar import GrammarError, JsonGrammarCompiler, JsonSchemaGrammar
from .parse import REFUSAL_SCHEMA
from .skills import CatalogError, SkillCatalog


def answer_schema(catalog: SkillCatalog) -> dict[str, Any]:
    """JSON-Schema of a constrained answer: a plan or a refusal."""
    return {"anyOf": [catalog.plan_schema(), REFUSAL_SCHEMA]}


def compile_plan_grammar(catalog: SkillCatalog, compiler: JsonGrammarCompiler
                         ) -> JsonSchemaGrammar:
    """The catalog's plan grammar (`JsonGrammarCompiler.for_engine(engine)` gives the
    model's compiler)."""
    try:
        return compiler.compile(answer_schema(catalog))
    except GrammarError as exc:
        for skill in catalog.skills:   # name the skill that breaks it
            try:
                compiler.compile(SkillCatalog((skill,)).plan_schema())
            except GrammarError as one:
                raise CatalogError(f"skill '{skill.name}' cannot be turned into a plan "
                                   f"grammar: {one}") from None
        raise CatalogError(f"the skill catalog cannot be turned into a plan grammar: "
                           f"{exc}") from None
