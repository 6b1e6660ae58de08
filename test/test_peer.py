"""bench/peer.py's llama.cpp side: the build, the conversion of our checkpoints by llama.cpp's
own converter, and the agreement check that gates its timings.

The first run on a machine fetches the pinned llama-cpp-python source distribution (77 MB,
shared with the Qwen vocabulary fixture) and builds llama.cpp's library at -O1
(`peer.CHECK_FLAGS`, about 2 minutes on 2 cores) into ~/.cache/flash_planner/llama_cpp; later
runs reuse both. No timing is asserted.
"""

from __future__ import annotations

import shutil

import peer  # bench/peer.py (conftest puts bench/ on the path)
import pytest
import torch

from flash_planner.train.tiny import write_tiny_checkpoint

PROMPT = peer.PROMPTS["qwen"][0]
pytestmark = pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("g++")),
                                reason="cmake and g++ are needed to build llama.cpp")


@pytest.fixture(scope="module")
def tool():
    return peer.build(progress=print, flags=peer.CHECK_FLAGS)


@pytest.fixture(scope="module", params=["hybrid", "hybrid_moe"])
def pair(request, tmp_path_factory, tool):
    """A Qwen-vocabulary checkpoint, its GGUF, and our engine on it (fp32, eager)."""
    workdir = tmp_path_factory.mktemp(request.param)
    path = write_tiny_checkpoint(workdir / "hf", kind=request.param, layers=4,
                                 attention_every=4, init=0.25, qwen_vocab=True)
    gguf = peer.convert(path, workdir / "model.gguf", progress=print)
    return path, gguf, peer.load_engine(path, "off")


def test_llama_cpp_and_our_engine_decode_the_same_greedy_tokens(tool, pair):
    _, gguf, engine = pair
    torch.set_num_threads(1)
    theirs = peer.theirs(tool, gguf, PROMPT, 24, repeats=1, threads=1)
    ours = peer.ours(engine, PROMPT, 24, repeats=1)
    assert len(theirs["tokens"]) == len(theirs["margins"]) == 24
    assert ours["tokens"] == theirs["tokens"]
    check = peer.agreement(engine, PROMPT, ours["tokens"], theirs)
    assert check == {"agree": True, "tokens": 24, "min_margin": min(theirs["margins"])}


def test_a_divergence_is_reported_where_it_happens_with_both_margins(tool, pair):
    _, gguf, engine = pair
    theirs = peer.theirs(tool, gguf, PROMPT, 12, repeats=1, threads=1)
    mine = peer.ours(engine, PROMPT, 12, repeats=1)["tokens"]
    other = (mine[5] + 1) % 151643
    doctored = dict(theirs, tokens=theirs["tokens"][:5] + [other] + theirs["tokens"][6:])
    check = peer.agreement(engine, PROMPT, mine, doctored)
    assert (check["agree"], check["at"], check["ours"], check["theirs"]) == \
        (False, 5, mine[5], other)
    # our own token is our argmax, so our logit margin over the other token is positive
    assert check["our_margin"] > 0
    assert check["their_margin"] == theirs["margins"][5]


def test_the_converter_keeps_an_mtp_head_and_refuses_an_unknown_vocabulary(tmp_path, tool):
    from gguf import GGUFReader

    with_head = write_tiny_checkpoint(tmp_path / "mtp", kind="hybrid", layers=4,
                                      attention_every=4, mtp=True, qwen_vocab=True)
    fields = GGUFReader(peer.convert(with_head, tmp_path / "mtp.gguf")).fields
    assert int(fields["qwen35.block_count"].contents()) == 5          # 4 layers + the head
    assert int(fields["qwen35.nextn_predict_layers"].contents()) == 1
    assert len(fields["tokenizer.ggml.tokens"].contents()) == 151936
    # our small trained BPE is not a tokenizer llama.cpp's converter knows: a clear failure
    small = write_tiny_checkpoint(tmp_path / "small", kind="hybrid", layers=4,
                                  attention_every=4)
    with pytest.raises(peer.PeerError, match="convert small failed"):
        peer.convert(small, tmp_path / "small.gguf")


def test_a_small_vocabulary_checkpoint_converts_and_decodes_the_same_tokens(tool,
                                                                            tmp_path):
    """The small-vocabulary rows: our tiny tokenizer is unknown to llama.cpp's converter,
    which `peer_convert.py` lets through as Qwen's pre-tokenizer; ids are fed directly."""
    path = write_tiny_checkpoint(tmp_path / "hf", kind="hybrid", layers=4, attention_every=4,
                                 init=0.25)
    gguf = peer.convert(path, tmp_path / "small.gguf", progress=print, known_tokenizer=False)
    prompt = peer.PROMPTS["small"][0]
    theirs = peer.theirs(tool, gguf, prompt, 24, repeats=1, threads=1)
    engine = peer.load_engine(path, "off")
    assert engine.model_config.vocab_size == 384
    assert peer.ours(engine, prompt, 24, repeats=1)["tokens"] == theirs["tokens"]
