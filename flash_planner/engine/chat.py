"""Chat prompts tokenized so that message text can never become a control token.

A chat template rendered to one string and encoded with added tokens parsed lets any text
that contains `<|im_end|>` or `<|im_start|>system` close its turn and write its own system
message. Here the template is rendered with a unique placeholder in place of every message's
content; the template's own text between the placeholders is encoded as usual (its markers
are the only control tokens), and each message's content is encoded by the same tokenizer
with every added token removed, so `<|im_end|>` or `</think>` inside a task is split into
ordinary text tokens. For text that holds no added token this gives the same ids as encoding
the rendered string whole (tested on the demo's held-out tasks).
"""

from __future__ import annotations

import json
import secrets
import weakref
from typing import Any

_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class TemplateError(ValueError):
    """The chat template does not carry a message's content through verbatim."""


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
                enable_thinking: bool | None = None) -> list[int]:
    """The chat prompt's ids with a generation prompt: template markers as control tokens,
    every message's content as plain text."""
    return encode_chat_parts(tokenizer, messages, enable_thinking)[0]


def encode_chat_parts(tokenizer, messages: list[dict[str, Any]],
                      enable_thinking: bool | None = None) -> tuple[list[int], list[int]]:
    """`encode_chat`'s ids and where each message's content starts in them: a token
    boundary by construction (template text and contents are encoded apart), so the ids
    before a message are a prefix every prompt with the same messages before it shares."""
    contents = [m.get("content") for m in messages]
    for i, content in enumerate(contents):
        if not isinstance(content, str):
            raise ValueError(f"message {i} has no text content (got "
                             f"{type(content).__name__}); chat prompts take text messages")
    nonce = secrets.token_hex(8)
    while any(nonce in c for c in contents):  # a task cannot guess it; stay exact anyway
        nonce = secrets.token_hex(8)
    marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
    masked = [{**m, "content": mark} for m, mark in zip(messages, marks)]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    rendered = tokenizer.apply_chat_template(masked, add_generation_prompt=True,
                                             tokenize=False, **kwargs)
    ids: list[int] = []
    starts: list[int] = []
    rest = rendered
    for i, (mark, content) in enumerate(zip(marks, contents)):
        before, found, rest = rest.partition(mark)
        if not found or mark in rest:
            raise TemplateError(
                f"the chat template does not place message {i}'s content verbatim exactly "
                "once, so its text cannot be kept apart from the template's control tokens")
        ids += _template_ids(tokenizer, before)
        starts.append(len(ids))
        ids += encode_text(tokenizer, content)
    return ids + _template_ids(tokenizer, rest), starts


def _template_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
