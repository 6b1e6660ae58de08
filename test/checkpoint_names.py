"""A tiny checkpoint's tensor names as its file spells them: transformers 5.2's
save_pretrained writes a text-only model under `model.language_model.`, 5.24 under `model.`
(the engine reads either), so tests that edit a file by name ask it which."""

from __future__ import annotations

from collections.abc import Iterable

WRAPPED = "model.language_model."


def stored_name(names: Iterable[str], name: str) -> str:
    """`name` (spelled under `model.`) as the checkpoint whose tensor names are `names`
    stores it."""
    names = set(names)
    wrapped = WRAPPED + name.removeprefix("model.")
    return wrapped if name.startswith("model.") and name not in names and any(
        n.startswith(WRAPPED) for n in names) else name
