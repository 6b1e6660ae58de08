"""JSON-Schema grammars (and structural tags: tool calls) for constrained decoding, compiled
with xgrammar for one tokenizer.

The JSON is compact, in `json.dumps`' layout (`, ` and `: `, no newlines): a fixed layout
leaves no whitespace choice between keys, so the grammar forces those spans (jump-forward).
Up to `leading_whitespace` blanks or newlines may come before the object (the `\\n\\n` a
model writes after `</think>`). After the object only a stop token (EOS) is allowed. A string
of the answer, and a raw parameter value of a Qwen3.5/3.6 tool call, closes after
`max_string_tokens` tokens (`BoundedStrings`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
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


# Qwen3.5/3.6's tool calls write a parameter's value as raw text between these
PARAMETER_OPEN, PARAMETER_CLOSE = b"<parameter=", b"</parameter>"


def _close_match(matched: int, byte: int) -> int:
    """Bytes of PARAMETER_CLOSE matched after `byte`, given `matched` before it (no proper
    prefix of it is also its suffix, so a mismatch falls back to nothing, or to its '<')."""
    if byte == PARAMETER_CLOSE[matched]:
        return matched + 1
    return 1 if byte == PARAMETER_CLOSE[0] else 0


class BoundedStrings:
    """`constraint.TokenMatcher` that closes any JSON string of the answer once
    `max_tokens` tokens lie inside it: from then on only tokens that start with a quote are
    allowed (where the grammar allows one there; a grounded name closes at a word's end).
    Given `closes` (Qwen3.5/3.6-format tool calls, whose `<parameter=NAME>` values are raw
    text up to `</parameter>`), a raw value is bounded the same way: once `max_tokens`
    tokens lie inside it, only tokens that go on writing `</parameter>` are allowed where
    the grammar allows them (a JSON object or array as the value closes its own strings
    first, then the value).

    Why: a small model can loop inside a string ("no skill to set an an an ...") until the
    token limit, and the answer is then no JSON at all (a tool call left open, which no
    client receives). Closed, it stays a valid answer of its kind (a refusal stays a
    refusal, a call a call). A bound in the schema (`maxLength`) would do it in the grammar,
    but costs seconds of compile per request at a 150k vocabulary. `cut` counts the strings
    and values closed this way in what was accepted: where the grammar allowed more than the
    closing (an enum's value, a quoted text to say, ends where it ends and is no cut)."""

    def __init__(self, inner: TokenMatcher, texts: Sequence[bytes], quote_ids: frozenset[int],
                 quote_row: torch.Tensor, max_tokens: int,
                 closes: Callable[[int], tuple[frozenset[int], torch.Tensor]] | None = None):
        self._inner, self._texts, self._quote_ids = inner, texts, quote_ids
        self._quote_row, self.max_tokens = quote_row, max_tokens
        self._closes = closes
        self.vocab_size = inner.vocab_size
        # after each accepted token: (inside a string, after a backslash, tokens inside,
        # cut, bytes of PARAMETER_OPEN matched (its length: reading the name), tokens
        # inside a raw value (-1: none open), the value is JSON (None: not begun),
        # bytes of PARAMETER_CLOSE matched at its end)
        self._states = [(False, False, 0, 0, 0, -1, None, 0)]
        self._scratch: torch.Tensor | None = None

    @property
    def cut(self) -> int:
        return self._states[-1][3]

    def _closing(self) -> tuple[frozenset[int], torch.Tensor, bool] | None:
        """(the tokens that close what is open, their row, whether they begin the closing)
        when a string or a raw value is at the bound; None when nothing is."""
        inside, escaped, run, _, _, value_run, _, close = self._states[-1]
        if inside:
            return ((self._quote_ids, self._quote_row, True)
                    if not escaped and run >= self.max_tokens else None)
        if self._closes is not None and value_run >= self.max_tokens:
            return (*self._closes(close), close == 0)
        return None

    def _at_bound(self) -> tuple[bool, bool]:
        """(closing only, cutting): at the bound where the grammar allows the closing,
        nothing else is allowed (where it does not, e.g. under a `minLength` or inside an
        enum's value, the string goes on); that cuts the string where the grammar allowed
        more than the closing."""
        closing = self._closing()
        if closing is None:
            return False, False
        _, row, begins = closing
        if self._scratch is None:
            self._scratch = torch.zeros(1, row.numel(), dtype=torch.int32)
        self._inner.fill_mask(self._scratch, 0)
        allowed = self._scratch[0]
        only = bool((allowed & row).any())
        return only, only and begins and bool((allowed & ~row).any())

    def accept(self, token: int) -> bool:
        bounded, cutting = self._at_bound()
        if bounded and token not in self._closing()[0] or not self._inner.accept(token):
            return False
        data = self._texts[token] if token < len(self._texts) else b""
        self._states.append(self._scan(self._states[-1], data, cutting))
        return True

    def _scan(self, state: tuple, data: bytes, cutting: bool) -> tuple:
        inside, escaped, run, cut, tag, value_run, json_value, close = state
        toggled, opened = False, False
        for byte in data:
            if value_run >= 0:                 # a raw value: ends at PARAMETER_CLOSE
                close = _close_match(close, byte)
                if close == len(PARAMETER_CLOSE):
                    inside, escaped, value_run, json_value, close = False, False, -1, None, 0
                    continue
                if json_value is None and byte not in b" \n\r\t":
                    json_value = byte in b"{["
                if not json_value:
                    continue
            elif self._closes is not None and not inside:
                if tag == len(PARAMETER_OPEN):            # the parameter's name
                    if byte == 0x3E:                      # '>': its value begins
                        tag, value_run, json_value, close, opened = 0, 0, None, 0, True
                    elif byte == 0x0A:
                        tag = 0
                    continue
                tag = (tag + 1 if byte == PARAMETER_OPEN[tag]
                       else int(byte == PARAMETER_OPEN[0]))
            if escaped:
                escaped = False
            elif inside and byte == 0x5C:      # backslash
                escaped = True
            elif byte == 0x22:                 # quote
                inside, toggled = not inside, True
        run = (0 if toggled else run + 1) if inside else 0
        if value_run >= 0 and not opened:
            value_run += 1
        return inside, escaped, run, cut + cutting, tag, value_run, json_value, close

    def rollback(self, count: int) -> None:
        self._inner.rollback(count)
        if count:
            del self._states[-count:]

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._inner.fill_mask(bitmask, row)
        closing = self._closing()
        if closing is not None:
            allowed = bitmask[row] & closing[1].to(bitmask.device)
            if bool(allowed.any()):
                bitmask[row] = allowed

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

    def matcher(self, max_string_tokens: int | None = None, raw_values: bool = False
                ) -> TokenMatcher:
        inner = XGrammarMatcher(self.compiled, self.tokenizer, self.vocab_size, self.refused)
        if max_string_tokens is None:
            return inner
        texts, quote_ids, quote_row = self.compiler.quotes()
        return BoundedStrings(inner, texts, quote_ids, quote_row, max_string_tokens,
                              self.compiler.parameter_closes if raw_values else None)

    def constraint(self, think_budget: int | None = None,
                   max_string_tokens: int | None = None, raw_values: bool = False
                   ) -> Constraint:
        """A fresh per-request constraint; `think_budget`: generated tokens after which
        thinking must close (None: no limit); `max_string_tokens`: the most tokens inside
        one string of the answer (None: no bound; plans and tool calls use
        MAX_STRING_TOKENS, a schema a client sends to the server keeps its strings as it
        wrote them); `raw_values`: a Qwen3.5/3.6 tool grammar, whose parameter values are
        raw text, bounded like strings."""
        return Constraint(self.matcher(max_string_tokens, raw_values), self.think_ids,
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
        self._closes: dict[int, tuple[frozenset[int], torch.Tensor]] = {}
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

    def parameter_closes(self, matched: int) -> tuple[frozenset[int], torch.Tensor]:
        """The tokens that go on writing PARAMETER_CLOSE when `matched` of its bytes are
        written (each a piece of the rest, or the rest and more) and their bitmask row;
        built on first use, once per compiler and count."""
        if matched not in self._closes:
            texts, rest = self.quotes()[0], PARAMETER_CLOSE[matched:]
            ids = frozenset(i for i, text in enumerate(texts)
                            if text and (rest.startswith(text) or text.startswith(rest)))
            self._closes[matched] = ids, token_row(self.vocab_size, sorted(ids), allowed=True)
        return self._closes[matched]

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
