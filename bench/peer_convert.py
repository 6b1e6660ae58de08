"""Run llama.cpp's own HF -> GGUF converter on a checkpoint whose tokenizer it does not know.

The converter names each byte-level BPE by a hash of how it splits a test text and refuses
a tokenizer it has no entry for, such as our tiny checkpoints' small trained one. The peer
benchmark feeds token ids and never llama.cpp's tokenizer, so this script lets the converter
call such a tokenizer "qwen2" (Qwen's pre-tokenizer, also byte-level) and otherwise runs it
unchanged; a small vocabulary makes the output head cheap, so the per-token floor of each
engine shows.

    python bench/peer_convert.py LLAMA_CPP_TREE CHECKPOINT --outtype f32 --outfile X.gguf
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    tree, *converter_args = sys.argv[1:]
    sys.path[:0] = [tree, f"{tree}/gguf-py"]
    from conversion import base  # llama.cpp's converter package, from `tree`

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    script = f"{tree}/convert_hf_to_gguf.py"
    sys.argv = [script, *converter_args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
