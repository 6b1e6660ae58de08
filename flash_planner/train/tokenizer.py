"""The planner's tokenizer: a byte-level BPE trained on the rendered corpus, ChatML template.

Saved as a transformers tokenizer directory (tokenizer.json + tokenizer_config.json). Special
tokens: `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos) and `<|mask|>` (the DFlash
drafter's mask token). `<think>` and `</think>` are added but not special, as in Qwen's
tokenizers: decoded text keeps them, so the planner can find the end of the thinking block.
The chat template has an `enable_thinking=False` branch that closes an empty thinking block
in the prompt. The tiny test checkpoints (`train/tiny.py`) use this same tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

PAD, IM_START, EOS, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [PAD, IM_START, EOS, MASK]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINK_TOKENS = [THINK_OPEN, THINK_CLOSE]
IDS_FILE = "planner_tokens.json"
# Turns in ChatML; given `tools` (OpenAI's function shape), a system turn lists them and the
# calls are Qwen3's JSON inside <tool_call></tool_call>, results <tool_response> blocks of a
# user turn. Without tools it renders what `chat_prompt` writes. No newline follows a block
# tag: transformers renders templates with trim_blocks.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}{{ '\n\n' }}{% endif %}"
    "# Tools{{ '\n' }}To call a function, answer <tool_call>{{ '\n' }}"
    "{\"name\": NAME, \"arguments\": {...}}{{ '\n' }}</tool_call> with one of:"
    "{% for t in tools %}{{ '\n' }}{{ t | tojson }}{% endfor %}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ 'user' if m['role'] == 'tool' else m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>{{ '\n' }}{{ m['content'] }}{{ '\n' }}"
    "</tool_response>{% else %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}{% if m['content'] or not loop.first %}{{ '\n' }}"
    "{% endif %}<tool_call>{{ '\n' }}{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}{{ '\n' }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
_SPLIT = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + THINK_TOKENS))


def chat_prompt(messages: list[dict], add_generation_prompt: bool = True,
                enable_thinking: bool = True) -> str:
    """CHAT_TEMPLATE rendered in plain Python (for texts needed before a tokenizer exists)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{EOS}\n" for m in messages)
    if add_generation_prompt:
        text += f"{IM_START}assistant\n"
        if not enable_thinking:
            text += f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"
    return text


def _pieces(texts: Iterable[str]) -> Iterable[str]:
    """The texts cut at special and think tokens: merges never learn those markers."""
    for text in texts:
        yield from (p for p in _SPLIT.split(text) if p)


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 900) -> dict:
    """Train a byte-level BPE on `texts` and save it to `out_dir` as a transformers tokenizer.

    vocab_size counts the 256 byte symbols, the merges and the special tokens; the two think
    tokens come on top. Returns the token ids (see `token_ids`), also written to
    `out_dir/planner_tokens.json`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_pieces(texts), trainer=trainer)
    tok.add_tokens(THINK_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   mask_token=MASK, additional_special_tokens=[IM_START],
                                   clean_up_tokenization_spaces=False, model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    ids = token_ids(fast)
    (out / IDS_FILE).write_text(json.dumps(ids, indent=2) + "\n")
    return ids


def load_tokenizer(path: str | Path):
    """The saved tokenizer, through transformers' ordinary loading path."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def token_ids(tokenizer) -> dict:
    """Ids the models need: vocabulary size, pad, eos, im_start, mask and the think tokens."""
    def one(token: str) -> int:
        ids = tokenizer.convert_tokens_to_ids([token])
        if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id:
            raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary")
        return int(ids[0])

    return {"vocab_size": len(tokenizer), "pad_id": one(PAD), "eos_id": one(EOS),
            "im_start_id": one(IM_START), "mask_id": one(MASK),
            "think_open_id": one(THINK_OPEN), "think_close_id": one(THINK_CLOSE)}
