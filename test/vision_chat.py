"""A tiny vision-language checkpoint a planner can chat with: a copy of a tiny `hybrid_vl`
checkpoint whose chat template renders image parts as Qwen's vision tokens (added to its
tokenizer) and whose image token is the added `<|image_pad|>`; optionally its tower's
weights widened (std 0.2), so that an image's embeddings depend clearly on its pixels."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

VISION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def widen_tower(path: Path, seed: int = 1) -> None:
    """Rewrite the checkpoint's `model.visual.*` weights with std 0.2 (norm weights near 1)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.startswith("model.visual."):
            tensors[name] = torch.randn(t.shape, generator=gen) * 0.2 + (t.dim() == 1)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def vision_chat_copy(source: Path, path: Path, widen: bool = False) -> tuple[Path, int]:
    """Copy `source` into `path` with the vision chat template; (path, image token id)."""
    from transformers import AutoTokenizer

    for item in Path(source).iterdir():
        if item.is_file():
            shutil.copy(item, path / item.name)
    if widen:
        widen_tower(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
    tok.chat_template = VISION_TEMPLATE
    tok.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["image_token_id"] = tok.convert_tokens_to_ids("<|image_pad|>")
    assert config["image_token_id"] < config["text_config"]["vocab_size"]
    (path / "config.json").write_text(json.dumps(config))
    return path, config["image_token_id"]
