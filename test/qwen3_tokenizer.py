"""Qwen3-shaped tokenizers for tests: Qwen3's 26 added tokens with Qwen3's special flags and a
ChatML template with Qwen3's thinking switch (`flash_planner/train/qwen_vocab.py`), over
either the demo's byte-level BPE (`qwen3_shaped_tokenizer`: what these tests check, added
tokens in text, think markers, special tokens under a grammar, depends on the flags and
contents, not on the merges) or the real Qwen vocabulary (`qwen_tokenizer_dir`, fetched
once from a registry package and cached).
"""

from __future__ import annotations

import json
from pathlib import Path

from flash_planner.train.qwen_vocab import (  # noqa: F401 (re-exported for the tests)
    QWEN3_ADDED,
    QWEN3_TEMPLATE,
    qwen_tokenizer_dir,
    write_qwen3_tokenizer,
)
from flash_planner.train.tokenizer import load_tokenizer

DEMO = "flash_planner/assets/demo/target"


def qwen3_shaped_tokenizer(demo_tok, path: Path):
    """Write the tokenizer to `path` and load it through transformers' ordinary path."""
    write_qwen3_tokenizer(json.loads(demo_tok.backend_tokenizer.to_str()), path)
    return load_tokenizer(path)
