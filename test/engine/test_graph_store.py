"""Compiled graphs on disk (engine/models/graphs/graph_store.py) through DirectGraph: a graph
compiled once is read back by a new DirectGraph without compiling; an entry that is
corrupt or was written for another key is compiled again and replaced, with one log line,
never a crash.

The graph here is a small function with a module and an in-place state update, compiled
with inductor's Python wrapper (a few seconds each); test_compiled.py reads the engine's
own graphs back.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from flash_planner.engine.models.graphs import graph_store
from flash_planner.engine.models.graphs.direct import DirectGraph
from flash_planner.engine.models.graphs.graph_store import (
    MAGIC,
    GraphStore,
    arguments_description,
)


class Scale(nn.Module):
    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return x * self.weight + self.eps


def step(scale: Scale, x: torch.Tensor, state: torch.Tensor):
    """A state kept in place, as the engine's KV rows and GDN state are."""
    state.add_(x)
    return scale(state).sum(dim=-1), state * 2


def _graph(store: GraphStore) -> DirectGraph:
    return DirectGraph(step, {}, direct=True, store=store, name="toy step")


def _expected(scale: Scale, x: torch.Tensor, state: torch.Tensor):
    with torch.no_grad():
        return step(scale, x, state.clone())


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return GraphStore(tmp_path)


def _run(graph: DirectGraph, scale: Scale, x: torch.Tensor, state: torch.Tensor):
    with torch.inference_mode():
        return graph.call("site", scale, x, state)


def _check(out, expected) -> None:
    torch.testing.assert_close(out[0], expected[0])
    torch.testing.assert_close(out[1], expected[1])


def test_a_graph_is_read_back_without_compiling_and_called_directly(store, monkeypatch):
    scale, state = Scale(), torch.zeros(2, 8)
    first = _graph(store)
    x = torch.ones(2, 8)
    expected = _expected(scale, x, state)
    _check(_run(first, scale, x, state), expected)
    assert (first.compiled_now, first.read) == (1, 0)
    assert len(list(store.root.glob("*.aot"))) == 1

    def no_compile(*args, **kwargs):
        raise AssertionError("a stored graph was compiled again")

    monkeypatch.setattr(torch, "compile", no_compile)
    again = _graph(store)
    state.zero_()
    _check(_run(again, scale, x, state), expected)
    assert (again.compiled_now, again.read) == (0, 1)
    # the site's later calls hand the new top-level tensors to the compiled code directly
    y = torch.arange(16.0).view(2, 8)
    expected = _expected(scale, y, state)
    monkeypatch.setattr(DirectGraph, "__call__", no_compile)
    _check(_run(again, scale, y, state), expected)


def _corrupt_and_rerun(store, damage, caplog) -> DirectGraph:
    scale, state, x = Scale(), torch.zeros(2, 8), torch.ones(2, 8)
    _run(_graph(store), scale, x, state)
    path, = store.root.glob("*.aot")
    damage(path)
    state.zero_()
    expected = _expected(scale, x, state)
    with caplog.at_level(logging.WARNING, logger=graph_store.log.name):
        graph = _graph(store)
        _check(_run(graph, scale, x, state), expected)
    records = [r for r in caplog.records if r.name == graph_store.log.name]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert str(path) in records[0].getMessage()
    assert "compiling it again" in records[0].getMessage()
    assert (graph.compiled_now, graph.read) == (1, 0)
    assert list(store.root.glob("*.aot")) == [path]      # replaced where it was
    reread = _graph(store)           # the entry compiled again was stored whole
    state.zero_()
    _check(_run(reread, scale, x, state), expected)
    assert reread.read == 1
    return records[0].getMessage()


def test_a_truncated_entry_is_compiled_again_with_one_log_line(store, caplog):
    def truncate(path):
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])

    assert "could not be read" in _corrupt_and_rerun(store, truncate, caplog)


def test_an_entry_written_for_another_torch_is_compiled_again(store, caplog):
    def other_torch(path):
        header, _, payload = path.read_bytes()[len(MAGIC):].partition(b"\n")
        key = json.loads(header)
        key["torch"] = "1.0.0"
        path.write_bytes(MAGIC + json.dumps(key).encode() + b"\n" + payload)

    assert "written for another torch" in _corrupt_and_rerun(store, other_torch, caplog)


def test_an_entry_that_is_not_a_graph_is_compiled_again(store, caplog):
    assert "could not be read" in _corrupt_and_rerun(
        store, lambda path: path.write_bytes(b"not a graph"), caplog)


def test_the_key_tells_apart_what_changes_the_code():
    from torch.utils import _pytree as pytree

    def described(*args):
        return arguments_description(*pytree.tree_flatten(args))

    x = torch.zeros(2, 8)
    base = described(Scale(), x, x)
    assert described(Scale(), torch.ones(2, 8), x) != base     # two tensors, not one twice
    assert described(Scale(), x, x) == base                    # values are not the key
    assert described(Scale(1e-5), x, x) != base                # a module's eps is baked in
    assert described(Scale(), torch.zeros(4, 8), torch.zeros(4, 8)) != base
    assert described(Scale(), x.double(), x.double()) != base
