"""A tiny model whose chat template takes `reasoning_effort` (ours, shaped as Qwen3.8's is
described: xhigh, medium or low, anything else refused by the template itself), for the CLI
and server tests of the parameter."""

from __future__ import annotations

from pathlib import Path

EFFORT_TEMPLATE_HEAD = (
    "{% if reasoning_effort is defined and reasoning_effort not in ['xhigh', 'medium', "
    "'low'] %}{{ raise_exception('Unexpected reasoning effort ' ~ reasoning_effort) }}"
    "{% endif %}{% if reasoning_effort is defined %}<|im_start|>system\nEffort: "
    "{{ reasoning_effort }}<|im_end|>\n{% endif %}")


def write_effort_checkpoint(path: Path) -> Path:
    """A 2-layer random hybrid checkpoint at `path` with the demo's chat template behind
    EFFORT_TEMPLATE_HEAD."""
    from transformers import AutoTokenizer

    from flash_planner.train.tiny import write_tiny_checkpoint
    from flash_planner.train.tokenizer import CHAT_TEMPLATE

    path = write_tiny_checkpoint(path, kind="hybrid", layers=2)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = EFFORT_TEMPLATE_HEAD + CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    return path
