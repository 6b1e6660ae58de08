"""A Qwen3-shaped tokenizer for tests: Qwen3's 26 added tokens (ids 151643-151668 there)
with Qwen3's special flags and a ChatML template with Qwen3's thinking switch, over the demo's
byte-level BPE. The real tokenizer.json cannot be downloaded on this machine; what these tests
check (added tokens in text, think markers, special tokens under a grammar) depends on the
flags and contents, not on the BPE merges.
"""

from __future__ import annotations

import json
from pathlib import Path

from flash_planner.train.tokenizer import load_tokenizer

DEMO = "flash_planner/assets/demo/target"
# Qwen3's added tokens in id order, with their "special" flag.
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
QWEN3_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def qwen3_shaped_tokenizer(demo_tok, path: Path):
    """Write the tokenizer to `path` and load it through transformers' ordinary path."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(demo_tok.backend_tokenizer.to_str())
    spec["added_tokens"] = []
    backend = Tokenizer.from_str(json.dumps(spec))
    for content, special in QWEN3_ADDED:
        token = AddedToken(content, special=special, normalized=not special)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = QWEN3_TEMPLATE
    fast.save_pretrained(str(path))
    return load_tokenizer(path)
