"""Tiny random Qwen3.5 checkpoints that call tools: the real Qwen vocabulary (its
`<tool_call>` tokens), a chat template that renders tools in Qwen3's JSON calls or Qwen3.5's
`<function=...>` calls (`train/qwen_vocab.py`), an MTP head and a DFlash drafter."""

from __future__ import annotations

from pathlib import Path

from flash_planner.engine.inputs.tool_calls import QWEN3, QWEN35
from flash_planner.train.qwen_vocab import QWEN3_TOOL_TEMPLATE, QWEN35_TOOL_TEMPLATE
from flash_planner.train.tiny import write_tiny_checkpoint, write_tiny_drafter

TEMPLATES = {QWEN3: QWEN3_TOOL_TEMPLATE, QWEN35: QWEN35_TOOL_TEMPLATE}
# Arguments a random model finishes: enums, a boolean and a bounded integer
TOOLS = [
    {"type": "function", "function": {
        "name": "go_to_room", "description": "Drive to a room.",
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"room": {"type": "string",
                                               "enum": ["kitchen", "hall", "lab"]},
                                      "slow": {"type": "boolean"}},
                       "required": ["room", "slow"]}}},
    {"type": "function", "function": {
        "name": "wait", "description": "Wait some seconds.",
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"seconds": {"type": "integer", "minimum": 1,
                                                  "maximum": 30}},
                       "required": ["seconds"]}}},
]


def write_tool_checkpoint(path: Path, fmt: str) -> tuple[Path, Path]:
    """(the target, its drafter) under `path`."""
    target = write_tiny_checkpoint(path / "target", kind="hybrid", mtp=True, qwen_vocab=True,
                                   init=0.25)
    (target / "chat_template.jinja").write_text(TEMPLATES[fmt])
    drafter = write_tiny_drafter(path / "drafter", target, num_layers=2, block_size=8)
    return target, drafter


def favour(target: Path, text: str) -> int:
    """Edit `target`'s weights so that it writes `text` (one token of its vocabulary) at
    every step: every token's embedding holds a large first dimension, the final norm keeps
    that dimension alone and the LM head reads the token off it (every other logit 0). A
    model that writes a tool call's opening without being asked. Returns the token's id."""
    from safetensors.torch import load_file, save_file

    from flash_planner.train.tokenizer import load_tokenizer

    ids = load_tokenizer(target).encode(text, add_special_tokens=False)
    assert len(ids) == 1, ids
    path = target / "model.safetensors"
    weights = load_file(str(path))
    weights["model.embed_tokens.weight"][:, 0] = 20.0
    norm = weights["model.norm.weight"]
    norm.fill_(-1.0)                 # Qwen3.5's norm scales by (1 + weight)
    norm[0] = 0.0
    head = weights["lm_head.weight"]
    head.zero_()
    head[ids[0], 0] = 50.0
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path),
              metadata={"format": "pt"})
    return ids[0]
