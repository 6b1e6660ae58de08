"""JSON-Schema grammars (and structural tags: tool calls) for constrained decoding, compiled
with xgrammar for one tokenizer.

The JSON is compact, in `json.dumps`' layout (`, ` and `: `, no newlines): a fixed layout
leaves no whitespace choice between keys, so the grammar forces those spans (jump-forward).
Up to `leading_whitespace` blanks or newlines may come before the object (the `\\n\\n` a
model writes after `</think>`). After the object only a stop token (EOS) is allowed. A string
of the answer closes after `max_string_tokens` tokens (`BoundedStrings`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import xgrammar as xgr

from ..config import EngineConfig, ModelConfig
from ..loop.acceptance import think_token_ids
from ..loop.constraint import Constraint, TokenMatcher, token_row

SEPARATORS = (", ", ": ")
# the most tokens one string of a constrained answer may hold (`BoundedStrings`): a spoken
# sentence or a refusal's reason fits many times over; a loop inside a string does not
MAX_STRING_TOKENS = 64


class LoadedModel(Protocol):
    """What `for_engine` reads of an engine (engine.Engine has it; the inputs never import
    the run)."""

    tokenizer: Any
    config: EngineConfig
    model_config: ModelConfig

    def eos_ids(self) -> tuple[int, ...]: ...


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


class BoundedStrings:
    """`constraint.TokenMatcher` that closes any JSON string of the answer once
    `max_tokens` tokens lie inside it: from then on only tokens that start with a quote are
    allowed (where the grammar allows one there; a grounded name closes at a word's end).

    Why: a small model can loop inside a string ("no skill to set an an an ...") until the
    token limit, and the answer is then no JSON at all. Closed, it stays a valid answer of
    its kind (a refusal stays a refusal). A bound in the schema (`maxLength`) would do it in
    the grammar, but costs seconds of compile per request at a 150k vocabulary. `cut`
    counts the strings closed this way in what was accepted: where the grammar allowed more
    than a closing quote (an enum's value, a quoted text to say, ends where it ends and is
    no cut)."""

    def __init__(self, inner: TokenMatcher, texts: Sequence[bytes], quote_ids: frozenset[int],
                 quote_row: torch.Tensor, max_tokens: int):
        self._inner, self._texts, self._quote_ids = inner, texts, quote_ids
        self._quote_row, self.max_tokens = quote_row, max_tokens
        self._other_row = ~quote_row     # tokens that do not start with a quote
        self.vocab_size = inner.vocab_size
        # after each accepted token: (inside a string, after a backslash, tokens inside, cut)
        self._states = [(False, False, 0, 0)]
        self._scratch: torch.Tensor | None = None

    @property
    def cut(self) -> int:
        return self._states[-1][3]

    def _bounded(self) -> bool:
        inside, escaped, run, _ = self._states[-1]
        return inside and not escaped and run >= self.max_tokens

    def _at_bound(self) -> tuple[bool, bool]:
        """(closing only, cutting): at the bound where the grammar allows a closing quote,
        nothing else is allowed (where it does not, e.g. under a `minLength` or inside an
        enum's value, the string goes on); that cuts the string where the grammar allowed
        more than the quote."""
        if not self._bounded():
            return False, False
        if self._scratch is None:
            self._scratch = torch.zeros(1, self._quote_row.numel(), dtype=torch.int32)
        self._inner.fill_mask(self._scratch, 0)
        allowed = self._scratch[0]
        closing = bool((allowed & self._quote_row).any())
        return closing, closing and bool((allowed & self._other_row).any())

    def accept(self, token: int) -> bool:
        bounded, cutting = self._at_bound()
        if bounded and token not in self._quote_ids or not self._inner.accept(token):
            return False
        inside, escaped, run, cut = self._states[-1]
        toggled = False
        for byte in self._texts[token] if token < len(self._texts) else b"":
            if escaped:
                escaped = False
            elif inside and byte == 0x5C:      # backslash
                escaped = True
            elif byte == 0x22:                 # quote
                inside, toggled = not inside, True
        run = (0 if toggled else run + 1) if inside else 0
        self._states.append((inside, escaped, run, cut + cutting))
        return True

    def rollback(self, count: int) -> None:
        self._inner.rollback(count)
        if count:
            del self._states[-count:]

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._inner.fill_mask(bitmask, row)
        if self._bounded():
            closing = bitmask[row] & self._quote_row.to(bitmask.device)
            if bool(closing.any()):
                bitmask[row] = closing

    def forced_tokens(self) -> list[int]:
        return [] if self._at_bound()[0] else self._inner.forced_tokens()

    def terminated(self) -> bool:
        return self._inner.terminated()


class JsonSchemaGrammar:
    """A schema compiled once for one tokenizer; `constraint()` per request."""

    def __init__(self, compiled: xgr.CompiledGrammar, compiler: JsonGrammarCompiler):
        self.compiled = compiled
        self.compiler = compiler
        self.tokenizer = compiler.tokenizer
        self.vocab_size = compiler.vocab_size
        self.think_ids = compiler.think_ids
        info = compiled.tokenizer_info
        # special tokens other than the stop tokens are never part of an answer
        self.refused = frozenset(info.special_token_ids) - frozenset(info.stop_token_ids)

    def matcher(self, max_string_tokens: int | None = None) -> TokenMatcher:
        inner = XGrammarMatcher(self.compiled, self.tokenizer, self.vocab_size, self.refused)
        if max_string_tokens is None:
            return inner
        texts, quote_ids, quote_row = self.compiler.quotes()
        return BoundedStrings(inner, texts, quote_ids, quote_row, max_string_tokens)

    def constraint(self, think_budget: int | None = None,
                   max_string_tokens: int | None = None) -> Constraint:
        """A fresh per-request constraint; `think_budget`: generated tokens after which
        thinking must close (None: no limit); `max_string_tokens`: the most tokens inside
        one string of the answer (None: no bound; plans use MAX_STRING_TOKENS, a schema a
        client sends to the server keeps its strings as it wrote them)."""
        return Constraint(self.matcher(max_string_tokens), self.think_ids,
                          self.compiled.tokenizer_info.stop_token_ids, think_budget)


class JsonGrammarCompiler:
    """Compiles JSON-Schemas for one tokenizer. xgrammar's view of the vocabulary is built
    once, here (about 0.7 s at 150k tokens), and serves every schema compiled after."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int],
                 think_ids: tuple[int, int] | None = None, leading_whitespace: int = 4):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_ids))
        self._info = info
        self._quotes: tuple[list[bytes], frozenset[int], torch.Tensor] | None = None
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._lead = xgr.Grammar.from_ebnf(f"root ::= [ \\n]{{0,{leading_whitespace}}}")
        self.tokenizer, self.vocab_size, self.think_ids = tokenizer, vocab_size, think_ids

    @classmethod
    def for_engine(cls, engine: LoadedModel) -> JsonGrammarCompiler:
        """A compiler for the engine's model: its tokenizer, vocabulary, EOS and think ids."""
        tok = engine.tokenizer
        if tok is None:
            raise ValueError(f"{engine.config.model_path} has no tokenizer: grammars are "
                             "compiled for the model's tokenizer")
        return cls(tok, engine.model_config.vocab_size, engine.eos_ids(), think_token_ids(tok))

    def quotes(self) -> tuple[list[bytes], frozenset[int], torch.Tensor]:
        """Each token's bytes, the tokens that start with a quote and their bitmask row
        (`BoundedStrings`); built on first use, once per compiler."""
        if self._quotes is None:
            texts = list(self._info.decoded_vocab)
            ids = frozenset(i for i, text in enumerate(texts) if text[:1] == b'"')
            self._quotes = texts, ids, token_row(self.vocab_size, sorted(ids), allowed=True)
        return self._quotes

    def compile(self, schema: dict[str, Any]) -> JsonSchemaGrammar:
        try:
            body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=SEPARATORS)
            compiled = self._compiler.compile_grammar(xgr.Grammar.concat(self._lead, body))
        except RuntimeError as exc:
            raise GrammarError(_reason(exc)) from None
        return JsonSchemaGrammar(compiled, self)

    def compile_tag(self, tag) -> JsonSchemaGrammar:
        """An xgrammar structural tag (`tool_calls.structural_tag`: free text and calls held
        to their schemas) compiled like a schema: the same leading blanks, a stop token
        after it."""
        try:
            body = xgr.Grammar.from_structural_tag(tag)
            compiled = self._compiler.compile_grammar(xgr.Grammar.concat(self._lead, body))
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(_reason(exc)) from None
        return JsonSchemaGrammar(compiled, self)
