"""JSON-Schema grammars for constrained decoding, compiled with xgrammar for one tokenizer.

The JSON is compact, in `json.dumps`' layout (`, ` and `: `, no newlines): a fixed layout
leaves no whitespace choice between keys, so the grammar forces those spans (jump-forward).
Up to `leading_whitespace` blanks or newlines may come before the object (the `\\n\\n` a
model writes after `</think>`). After the object only a stop token (EOS) is allowed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from .acceptance import think_token_ids
from .constraint import Constraint
from .engine import Engine

SEPARATORS = (", ", ": ")


class GrammarError(ValueError):
    """A schema xgrammar cannot compile; the message is xgrammar's, without its source path."""


def _reason(exc: Exception) -> str:
    # xgrammar's messages start with "[time] /path/file.cc:line: "
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip()).strip()


class XGrammarMatcher:
    """`constraint.TokenMatcher` over an xgrammar matcher."""

    def __init__(self, compiled: xgr.CompiledGrammar, tokenizer, vocab_size: int,
                 refused: frozenset[int]):
        self._matcher = xgr.GrammarMatcher(compiled)
        self._tokenizer = tokenizer
        self._refused = refused
        self.vocab_size = vocab_size

    def accept(self, token: int) -> bool:
        # xgrammar logs a warning for each special token it refuses: drafts can be any token
        return token not in self._refused and self._matcher.accept_token(token)

    def rollback(self, count: int) -> None:
        if count:
            self._matcher.rollback(count)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def forced_tokens(self) -> list[int]:
        text = self._matcher.find_jump_forward_string()
        return self._tokenizer.encode(text, add_special_tokens=False) if text else []

    def terminated(self) -> bool:
        return self._matcher.is_terminated()


class JsonSchemaGrammar:
    """A schema compiled once for one tokenizer; `constraint()` per request."""

    def __init__(self, compiled: xgr.CompiledGrammar, tokenizer, vocab_size: int,
                 think_ids: tuple[int, int] | None):
        self.compiled = compiled
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.think_ids = think_ids
        info = compiled.tokenizer_info
        # special tokens other than the stop tokens are never part of an answer
        self.refused = frozenset(info.special_token_ids) - frozenset(info.stop_token_ids)

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled, self.tokenizer, self.vocab_size, self.refused)

    def constraint(self, think_budget: int | None = None) -> Constraint:
        """A fresh per-request constraint; `think_budget`: generated tokens after which
        thinking must close (None: no limit)."""
        return Constraint(self.matcher(), self.think_ids,
                          self.compiled.tokenizer_info.stop_token_ids, think_budget)


class JsonGrammarCompiler:
    """Compiles JSON-Schemas for one tokenizer. xgrammar's view of the vocabulary is built
    once, here (about 0.7 s at 150k tokens), and serves every schema compiled after."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int],
                 think_ids: tuple[int, int] | None = None, leading_whitespace: int = 4):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._lead = xgr.Grammar.from_ebnf(f"root ::= [ \\n]{{0,{leading_whitespace}}}")
        self.tokenizer, self.vocab_size, self.think_ids = tokenizer, vocab_size, think_ids

    @classmethod
    def for_engine(cls, engine: Engine) -> JsonGrammarCompiler:
        """A compiler for the engine's model: its tokenizer, vocabulary, EOS and think ids."""
        tok = engine.tokenizer
        if tok is None:
            raise ValueError(f"{engine.config.model_path} has no tokenizer: grammars are "
                             "compiled for the model's tokenizer")
        return cls(tok, engine.model_config.vocab_size, engine.eos_ids(), think_token_ids(tok))

    def compile(self, schema: dict[str, Any]) -> JsonSchemaGrammar:
        try:
            body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=SEPARATORS)
            compiled = self._compiler.compile_grammar(xgr.Grammar.concat(self._lead, body))
        except RuntimeError as exc:
            raise GrammarError(_reason(exc)) from None
        return JsonSchemaGrammar(compiled, self.tokenizer, self.vocab_size, self.think_ids)
