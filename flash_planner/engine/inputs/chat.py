"""Chat prompts tokenized so that message text can never become a control token.

A chat template rendered to one string and encoded with added tokens parsed lets any text
that contains `<|im_end|>` or `<|im_start|>system` close its turn and write its own system
message. Here the template is rendered with a unique placeholder in place of every message's
content; the template's own text between the placeholders is encoded as usual (its markers
are the only control tokens), and each message's content is encoded by the same tokenizer
with every added token removed, so `<|im_end|>` or `</think>` inside a task is split into
ordinary text tokens. For text that holds no added token this gives the same ids as encoding
the rendered string whole (tested on the demo's held-out tasks).

Other template variables (`template_vars`, e.g. Qwen3.8's `reasoning_effort`) are passed to
the template only when its source names them: a variable the template never reads would be
dropped without a word, so asking for one is an error (`TemplateVariableError`).
"""

from __future__ import annotations

import json
import re
import secrets
import weakref
from collections.abc import Mapping
from typing import Any

_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# A reasoning effort as a request names it: a short lowercase word, passed to chat templates
# that take `reasoning_effort` (Qwen3.8's take xhigh, medium and low; the template decides)
REASONING_EFFORT = re.compile(r"[a-z_]{1,16}")
# What encode_chat_parts sets itself: never a template variable of the caller's
RESERVED_VARS = frozenset({"messages", "add_generation_prompt", "enable_thinking", "tokenize",
                           "tools", "documents", "continue_final_message", "chat_template",
                           "return_dict"})
TemplateVars = Mapping[str, str | bool | int | None]


class TemplateError(ValueError):
    """The chat template cannot render the prompt as asked: it does not carry a message's
    content through verbatim, or it refused the prompt or a variable (raise_exception)."""


class TemplateVariableError(TemplateError):
    """A template variable was given that the model's chat template does not take; `name`
    is the variable."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name


def check_reasoning_effort(value: Any, where: str = "reasoning_effort") -> str | None:
    """`value` when it is None or a short lowercase word ([a-z_]{1,16}), else ValueError
    naming `where`."""
    if value is None:
        return None
    if not isinstance(value, str) or not REASONING_EFFORT.fullmatch(value):
        raise ValueError(f"{where} must be a short lowercase word ([a-z_], 1 to 16 "
                         f"characters, e.g. low), got {value!r}")
    return value


def template_source(tokenizer) -> str:
    """The tokenizer's chat template text (every named template, when it has several)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def template_takes(tokenizer, name: str) -> bool:
    """Whether the tokenizer's chat template names the variable `name` at all."""
    return re.search(rf"(?<![\w.]){re.escape(name)}\b", template_source(tokenizer)) is not None


def _checked_vars(variables: TemplateVars | None, tokenizer) -> dict[str, Any]:
    """The variables that are set (None means unset), each checked: a plain name that is not
    one encode_chat_parts sets itself, taken by the tokenizer's chat template
    (TemplateVariableError names it otherwise)."""
    out = {}
    for name, value in (variables or {}).items():
        if value is None:
            continue
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_VARS:
            raise ValueError(f"{name!r} cannot be passed as a chat template variable")
        if not template_takes(tokenizer, name):
            raise TemplateVariableError(
                f"the model's chat template does not take {name} (its template never names "
                f"it): leave {name} unset for this model", name)
        out[name] = value
    return out


def check_template_vars(tokenizer, variables: TemplateVars | None,
                        enable_thinking: bool | None = None) -> None:
    """Raise what encode_chat would for these variables, on a one-turn probe rendered but
    not tokenized (so any thread may call it): a variable the template does not take
    (TemplateVariableError), or a value it refuses (TemplateError with the template's own
    message, e.g. Qwen3.8's for an effort it does not know)."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    _render(tokenizer, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            {**kwargs, **_checked_vars(variables, tokenizer)})


def plain_text_tokenizer(tokenizer):
    """The tokenizer's backend with no added tokens: text in, ordinary vocabulary ids out.

    Cached per tokenizer object.
    """
    plain = _PLAIN.get(tokenizer)
    if plain is None:
        from tokenizers import Tokenizer

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(tokenizer).__name__} is not backed by a tokenizer.json; "
                             "chat prompts need a fast (tokenizers) tokenizer")
        spec = json.loads(backend.to_str())
        spec["added_tokens"] = []
        plain = _PLAIN[tokenizer] = Tokenizer.from_str(json.dumps(spec))
    return plain


def encode_text(tokenizer, text: str) -> list[int]:
    """`text` as plain text: added and special tokens written in it are split, never parsed."""
    return list(plain_text_tokenizer(tokenizer).encode(text, add_special_tokens=False).ids)


def encode_chat(tokenizer, messages: list[dict[str, Any]],
                enable_thinking: bool | None = None,
                template_vars: TemplateVars | None = None,
                tools: list[dict] | None = None) -> list[int]:
    """The chat prompt's ids with a generation prompt: template markers as control tokens,
    every message's content as plain text. `template_vars`: more variables for the
    template (e.g. {"reasoning_effort": "low"}); None values are left unset. `tools`: the
    tool definitions the template renders (OpenAI's function shape); the template writes
    them, and the calls of assistant messages, as its own text, so the caller checks they
    hold no control token's text (`server/tool_api.py`)."""
    return encode_chat_parts(tokenizer, messages, enable_thinking, template_vars, tools)[0]


def encode_chat_parts(tokenizer, messages: list[dict[str, Any]],
                      enable_thinking: bool | None = None,
                      template_vars: TemplateVars | None = None,
                      tools: list[dict] | None = None
                      ) -> tuple[list[int], list[int | None]]:
    """`encode_chat`'s ids and where each message's content starts in them: a token
    boundary by construction (template text and contents are encoded apart), so the ids
    before a message are a prefix every prompt with the same messages before it shares.
    A message with empty content (an assistant turn that only calls tools) has no text to
    keep apart: it is rendered as given, and its start is None."""
    extra = _checked_vars(template_vars, tokenizer)
    texts = [[] if m.get("content") == "" else _texts(i, m.get("content"))
             for i, m in enumerate(messages)]
    nonce = secrets.token_hex(8)
    while any(nonce in t for ts in texts for t in ts):   # a task cannot guess it; stay exact
        nonce = secrets.token_hex(8)
    masked = []
    for i, m in enumerate(messages):
        content = m["content"]
        if content == "":
            masked.append(m)
            continue
        if isinstance(content, str):
            masked.append({**m, "content": _mark(nonce, i, 0)})
            continue
        parts, j = [], 0
        for part in content:          # text parts marked, image parts for the template
            if part["type"] == "text":
                parts.append({**part, "text": _mark(nonce, i, j)})
                j += 1
            else:
                parts.append(part)
        masked.append({**m, "content": parts})
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    if tools:
        kwargs["tools"] = list(tools)
    rendered = _render(tokenizer, masked, {**kwargs, **extra})
    ids: list[int] = []
    starts: list[int | None] = []
    rest = rendered
    for i, message_texts in enumerate(texts):
        if not message_texts:
            starts.append(None)
        for j, text in enumerate(message_texts):
            mark = _mark(nonce, i, j)
            before, found, rest = rest.partition(mark)
            if not found or mark in rest:
                raise TemplateError(
                    f"the chat template does not place message {i}'s content verbatim "
                    "exactly once, so its text cannot be kept apart from the template's "
                    "control tokens")
            ids += _template_ids(tokenizer, before)
            if j == 0:
                starts.append(len(ids))
            ids += encode_text(tokenizer, text)
    return ids + _template_ids(tokenizer, rest), starts


def _mark(nonce: str, message: int, part: int) -> str:
    return f"\ue000{nonce}:{message}:{part}\ue001"


def _texts(i: int, content: Any) -> list[str]:
    """A message's texts: its content, or the text parts of a list of parts (OpenAI's
    shape: {"type": "text", "text": ...} and {"type": "image"}, the images rendered by the
    template as its vision tokens)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ValueError(f"message {i} has no text content (got {type(content).__name__}); "
                         "chat prompts take text, or a list of text and image parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind != "image":
            raise ValueError(f"message {i} part {j}: expected {{'type': 'text', 'text': "
                             f"...}} or {{'type': 'image'}}, got {part!r:.80}")
    if not texts:
        raise ValueError(f"message {i} has no text part: an image needs words beside it")
    return texts


def _render(tokenizer, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    from jinja2 import TemplateError as JinjaError

    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False, **kwargs)
    except JinjaError as exc:   # raise_exception(...) in the template, or a template bug
        asked = ", ".join(f"{k}={v!r}" if k != "tools" else f"{len(v)} tool(s)"
                          for k, v in kwargs.items()) or "no variables"
        raise TemplateError(f"the chat template refused the prompt ({asked}): {exc}") from None


def _template_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
