"""The real Qwen vocabulary as a Hugging Face tokenizer, built from a registry package.

Qwen's tokenizer.json cannot be downloaded on a machine that reaches only package
registries, but the llama-cpp-python source distribution carries the Qwen2/2.5/3 byte-level
BPE as `ggml-vocab-qwen2.gguf` (151,643 regular ids). transformers reads it with the `gguf`
package; we then give it what Qwen3's own tokenizer files add: NFC normalisation, the 26
added tokens at ids 151643-151668 with Qwen3's special flags, `<|im_end|>` as end of
sequence, and a ChatML template with Qwen3's thinking switch. Built once into
`cache_home()/qwen_vocab/` and never committed. Qwen3.5/3.6 checkpoints pad the embedding
to 151,936 rows (QWEN_VOCAB_SIZE); the ids past the added tokens are never produced.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..engine.config import cache_home
from . import llama_cpp_sdist

QWEN_VOCAB_SIZE = 151936
GGUF_MEMBER = f"{llama_cpp_sdist.LLAMA_CPP}/models/ggml-vocab-qwen2.gguf"
# Qwen3's added tokens in id order (from 151643), with their "special" flag.
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
FIRST_ADDED_ID = 151643
QWEN3_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Chat templates that render tools as Qwen's releases do (written here, in their shapes): the
# definitions as JSON lines inside <tools></tools> in the system turn, each call inside
# <tool_call></tool_call>, tool results as <tool_response> blocks of one user turn. Qwen3's
# calls are JSON objects; Qwen3.5/3.6's are <function=NAME> with one <parameter=KEY> each.
_TOOLS_HEAD = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.'"
    " + '\\n\\nYou are provided with function signatures within <tools></tools> XML tags:'"
    " + '\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\n' + CALL_HELP + '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
)
_TOOLS_TURNS = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' + m['content'] }}"
    "{%- for c in m['tool_calls'] or [] %}"
    "{%- if m['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set f = c['function'] %}CALL"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
_JSON_CALL = ("{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
              "{{- f['arguments'] | tojson }}{{- '}\\n</tool_call>' }}")
_XML_CALL = ("{{- '<tool_call>\\n<function=' + f['name'] + '>' }}"
             "{%- for k, v in f['arguments'] | items %}"
             "{{- '\\n<parameter=' + k + '>\\n' }}"
             "{{- v if v is string else v | tojson }}{{- '\\n</parameter>' }}{%- endfor %}"
             "{{- '\\n</function>\\n</tool_call>' }}")
QWEN3_TOOL_TEMPLATE = (
    _TOOLS_HEAD.replace("CALL_HELP", "'For each function call, return a json object with "
                        "function name and arguments within <tool_call></tool_call> XML "
                        "tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
                        "<args-json-object>}\\n</tool_call>'")
    + _TOOLS_TURNS.replace("CALL", _JSON_CALL))
QWEN35_TOOL_TEMPLATE = (
    _TOOLS_HEAD.replace("CALL_HELP", "'To call a function, reply with:\\n<tool_call>\\n"
                        "<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n"
                        "</function>\\n</tool_call>\\n'")
    + _TOOLS_TURNS.replace("CALL", _XML_CALL))
_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_qwen3_tokenizer(spec: dict, path: str | Path) -> Path:
    """Save a tokenizers-library spec (a byte-level BPE, its added tokens dropped) with
    Qwen3's added tokens, eos/pad and chat template, as transformers' own files."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = dict(spec, added_tokens=[])
    backend = Tokenizer.from_str(json.dumps(spec))
    for content, special in QWEN3_ADDED:
        token = AddedToken(content, special=special, normalized=not special)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = QWEN3_TEMPLATE
    fast.save_pretrained(str(path))
    return Path(path)


def _spec_from_gguf(gguf_path: Path) -> dict:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ImportError as exc:
        raise RuntimeError("reading the Qwen vocabulary needs the `gguf` package "
                           "(pip install gguf)") from exc
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    spec["model"]["vocab"] = {t: i for t, i in vocab.items() if i < FIRST_ADDED_ID}
    if len(spec["model"]["vocab"]) != FIRST_ADDED_ID:
        raise RuntimeError(f"{gguf_path.name}: expected {FIRST_ADDED_ID} regular tokens, "
                           f"found {len(spec['model']['vocab'])}")
    spec["normalizer"] = {"type": "NFC"}
    return spec


def qwen_tokenizer_dir(progress=None) -> Path:
    """A folder with Qwen3's tokenizer files (fetched and built on first use)."""
    out = cache_home() / "qwen_vocab" / llama_cpp_sdist.VERSION
    if all((out / name).is_file() for name in _FILES):
        return out
    root = llama_cpp_sdist.unpacked(GGUF_MEMBER, progress)
    if progress:
        progress("building the Qwen3 tokenizer from ggml-vocab-qwen2.gguf")
    staging = out.with_name(out.name + ".partial")
    write_qwen3_tokenizer(_spec_from_gguf(root / GGUF_MEMBER), staging)
    if out.exists():
        shutil.rmtree(out)
    staging.replace(out)
    return out


def copy_tokenizer(into: str | Path, progress=None) -> Path:
    """Copy the cached Qwen3 tokenizer files into a checkpoint folder."""
    source = qwen_tokenizer_dir(progress)
    for name in _FILES:
        shutil.copyfile(source / name, Path(into) / name)
    return Path(into)
