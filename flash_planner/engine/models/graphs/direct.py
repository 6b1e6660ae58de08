"""Compiled graphs called without their entry's Python once their call sites are known.

Why: on a CPU a compiled function's own entry pays 35-180 us of Python before its code runs
(dynamo's frame hook and cache lookup; an AOT function's bytecode, which takes every tensor
out of the arguments again); a small model's whole decode step computes for less than that.
The static forwards call each graph from a few fixed places (a site: one bucket, one span)
with the engine's own tensors, so after the first call of a site its inputs are known. A
direct call hands those to the compiled code itself (~10 us).

How: each graph is compiled by torch's AOT compile (a fullgraph trace, inductor's code,
stored on disk by graph_store.py), one per kind of arguments. A site's first call runs the
AOT function with its compiled code wrapped to record the inputs it is handed: the graph's
tensors that the site's arguments hold (its top-level tensor arguments change from call to
call; the rest, state views and packed weights, are the same tensors at every call) and the
modules' own tensors. A direct call hands those to the compiled code itself. The caller
checks a whole forward once against the AOT function's (`check_direct`); anything
unexpected (another torch whose code is called otherwise) keeps the AOT function's entry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from .graph_store import GraphStore, entry_key

log = logging.getLogger(__name__)
_OBTAINING = threading.Lock()


def _layout(out: object, leaves: list[int]) -> object:
    """The structure of a graph's result (tuples and lists of tensors) with each tensor
    replaced by its index among the compiled code's outputs, counted in `leaves`."""
    if isinstance(out, (tuple, list)):
        return type(out), tuple(_layout(x, leaves) for x in out)
    leaves[0] += 1
    return leaves[0] - 1


def _rebuild(layout: object, flat: list[object]) -> object:
    """`_layout`'s structure filled from `flat` (pytree's unflatten costs ~10 us a call)."""
    if isinstance(layout, int):
        return flat[layout]
    kind, parts = layout
    return kind(_rebuild(part, flat) for part in parts)


def boxed(fn: Callable[..., object]) -> Callable[[list[object]], object]:
    """`fn` called with its inputs as one list. torch 2.13's compiled function carries the
    generated code's own entry as `current_callable` (a list in, the outputs out): calling it
    skips the wrappers around it (~9 us of a 4-layer decode step on a CPU), which add
    nothing for these graphs (their inputs are mutated in the generated code itself;
    `check_direct` compares a whole forward, state included, before direct calls are kept)."""
    entry = getattr(fn, "current_callable", None)
    return entry if callable(entry) else (lambda inputs: fn(*inputs))


@dataclass
class _Site:
    fn: Callable[[list[object]], object]         # `boxed`: the inputs as one list
    inputs: list[object]                         # the graph's inputs at this site
    slots: tuple[tuple[int, int], ...]           # (input index, argument index) per call
    layout: object                               # the result's structure (`_layout`)

    def __call__(self, args: tuple[object, ...]):
        inputs = self.inputs.copy()
        for i, j in self.slots:
            inputs[i] = args[j]
        return _rebuild(self.layout, self.fn(inputs))


def _signature(leaves: list[object], spec) -> tuple[object, ...]:
    """Within this process, what tells one compiled graph of a function from another: the
    arguments' structure, tensors by shape, stride, dtype and which leaves are the same
    tensor, modules by identity, other values as they are (`graph_store.entry_key` is the
    same on disk, modules by what they hold)."""
    out: list[object] = [repr(spec)]
    first: dict[int, int] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.stride(), x.dtype, first.setdefault(id(x), i)))
        elif isinstance(x, torch.nn.Module):
            out.append(("module", id(x)))
        else:
            out.append(x)
    return tuple(out)


class _Entry:
    """One compiled graph of the function: torch's AOTCompiledFunction (guards off: the
    signature chose it) and the inductor code its bytecode calls, which can record the
    inputs it is called with."""

    def __init__(self, graph):
        graph.disable_guard_check()
        self.graph = graph
        self._globals = graph.fn.__globals__
        self._backend_id = graph._artifacts.backend_id
        self.compiled = self._globals[self._backend_id]

    def recorded_call(self, args: tuple[object, ...]) -> tuple[object, list[tuple]]:
        """The graph on `args` -> (its result, the inputs its compiled code was called
        with: one tuple per call)."""
        calls: list[tuple] = []

        def recorder(*inputs):
            calls.append(inputs)
            return self.compiled(*inputs)

        self._globals[self._backend_id] = recorder
        try:
            return self.graph(*args), calls
        finally:
            self._globals[self._backend_id] = self.compiled


class DirectGraph:
    """A graph function compiled by inductor through torch's AOT compile, one compiled
    graph per kind of arguments, each read from or written to the on-disk `store`; called
    as `graph(*args)` (the AOT function's own entry) or by site (`graph.call(site,
    *args)`): a site's first call records the compiled code's inputs, later calls hand
    them to the code directly."""

    def __init__(self, fn: Callable[..., object], options: dict[str, object], direct: bool,
                 store: GraphStore | None = None, name: str = ""):
        """direct: whether calls by site may skip the AOT function's entry (False: CUDA
        graphs replay what it ran)."""
        self._fn = fn
        self.name = name or fn.__name__
        self.options = options
        self.store = store
        self.direct = direct
        self._by_signature: dict[tuple[object, ...], _Entry] = {}
        # per site: its direct call (None: its code is called otherwise) and its graph
        self._sites: dict[Hashable, tuple[_Site | None, _Entry]] = {}
        self.compiled_now = 0          # graphs compiled in this process
        self.read = 0                  # graphs read from the store

    def __call__(self, *args: object):
        leaves, spec = pytree.tree_flatten(args)
        return self._entry(args, leaves, spec).graph(*args)

    def _entry(self, args: tuple[object, ...], leaves: list[object], spec) -> _Entry:
        signature = _signature(leaves, spec)
        entry = self._by_signature.get(signature)
        if entry is None:
            entry = self._by_signature[signature] = _Entry(self._obtain(args, leaves, spec))
        return entry

    def _obtain(self, args: tuple[object, ...], leaves: list[object], spec):
        """The compiled graph for these arguments: from the store, else compiled (and
        stored); one at a time in the process (dynamo's and inductor's compile state is
        global: a deferred bucket compiles in a thread of its own)."""
        with _OBTAINING:
            return self._obtain_now(args, leaves, spec)

    def _obtain_now(self, args: tuple[object, ...], leaves: list[object], spec):
        device = next((x.device for x in leaves if isinstance(x, torch.Tensor)),
                      torch.device("cpu"))
        key = entry_key(self.name, leaves, spec, self.options, device)
        graph = self.store.load(key) if self.store is not None else None
        if graph is not None:
            self.read += 1
            return graph
        backend = torch._TorchCompileInductorWrapper(None, self.options, False)
        graph = torch.compile(self._fn, backend=backend, fullgraph=True,
                              dynamic=False).aot_compile((args, {}))
        self.compiled_now += 1
        if self.store is not None:
            self.store.save(key, graph)
        return graph

    def prepare(self, *args: object) -> None:
        """Compile (or read) the graph for arguments like these without running it: shapes
        and structure are all it takes (a deferred bucket, compiled while others serve)."""
        leaves, spec = pytree.tree_flatten(args)
        self._entry(args, leaves, spec)

    def call(self, site: Hashable, *args: object):
        """The graph on `args`, from a call site whose arguments hold the same tensors at
        every call except its top-level tensor arguments."""
        known = self._sites.get(site)
        if known is None:
            return self._learn(site, args)
        direct, entry = known
        return direct(args) if direct is not None and self.direct else entry.graph(*args)

    def _learn(self, site: Hashable, args: tuple[object, ...]):
        leaves, spec = pytree.tree_flatten(args)
        entry = self._entry(args, leaves, spec)
        out, calls = entry.recorded_call(args)
        direct = self._site(entry.compiled, calls[0], args, out) if len(calls) == 1 else None
        self._sites[site] = (direct, entry)
        return out

    @staticmethod
    def _site(compiled: Callable[..., object], inputs: tuple[object, ...],
              args: tuple[object, ...], out: object) -> _Site:
        # which of the code's inputs are the site's top-level tensor arguments: those
        # change from call to call, every other input is the same tensor at every call
        top = {id(arg): j for j, arg in enumerate(args) if isinstance(arg, torch.Tensor)}
        slots = tuple((i, top[id(x)]) for i, x in enumerate(inputs) if id(x) in top)
        return _Site(boxed(compiled), list(inputs), slots, _layout(out, [0]))


def same_results(first: object, again: object) -> bool:
    """Whether two results hold the same tensors bit for bit (NaN equal to NaN)."""
    a = [x for x in pytree.tree_leaves(first) if isinstance(x, torch.Tensor)]
    b = [x for x in pytree.tree_leaves(again) if isinstance(x, torch.Tensor)]
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype
                                    and torch.equal(x.nan_to_num(), y.nan_to_num())
                                    for x, y in zip(a, b))


def check_direct(graphs: list[DirectGraph], part: str, first: object,
                 again: Callable[[], object]) -> bool:
    """Run `again` (the same work as the run through the graphs' own entries that gave
    `first`, from the same start, now by direct calls) and compare; on any difference or
    error every graph of `part` goes back to its entry, with a warning. Returns whether
    direct calls stay."""
    expected = [x.clone() if isinstance(x, torch.Tensor) else x
                for x in pytree.tree_leaves(first)]
    try:
        same = same_results(expected, again())
        reason = "their results differ from the graphs' own entries'"
    except Exception as exc:       # another torch whose backend sees other inputs
        same, reason = False, f"{type(exc).__name__}: {exc}"
    if not same:
        log.warning("the %s's compiled graphs are called through their own entries: direct "
                    "calls failed their check (%s)", part, reason)
        for graph in graphs:
            graph.direct = False
    return same

