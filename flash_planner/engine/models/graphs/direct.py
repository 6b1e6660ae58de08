"""Compiled graphs called without dynamo once their call sites are known.

Why: on a CPU a torch.compile'd call pays ~35 us of Python before its code runs, guards
skipped or not (the frame hook, the cache lookup, the compile wrapper, the stance's config
patch); a small model's whole decode step computes for less than that. The static forwards
call each graph from a few fixed places (a site: one bucket, one span) with the engine's own
tensors, so after the first call of a site, its inputs are known: the graph's tensors that
the site's arguments hold, the rest the very tensors dynamo read when it compiled. A direct
call hands those to the compiled code itself (~10 us).

How: the graph is compiled with inductor through a backend that keeps what it compiled and
the tensors it was compiled with. A site's first call goes through dynamo; when the backend
ran during it, each of the graph's inputs is located in the call's arguments (by identity;
its tensors are the engine's own, which never move). A site that reuses a graph compiled
for another (spans of one kind share one) finds it by the shapes and objects of its
arguments. The caller checks a whole forward once against dynamo's (`check_direct`);
anything unexpected (another torch whose backend sees other inputs) keeps dynamo's path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)


@dataclass
class _Compiled:
    fn: Callable[..., object]         # inductor's compiled code: fn(*inputs) -> outputs
    sources: tuple[object, ...]       # per input: its leaf index in the arguments, or a tensor


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
    """What decides which compiled graph dynamo picks for these arguments: their structure,
    tensors by shape, stride, dtype and which leaves are the same tensor, modules by
    identity, other values as they are."""
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


class DirectGraph:
    """A graph function compiled by inductor, called through dynamo (`graph(*args)`) or by
    site (`graph.call(site, *args)`): a site's first call goes through dynamo and teaches
    the site its inputs; later calls go straight to the compiled code."""

    def __init__(self, fn: Callable[..., object], options: dict[str, object], direct: bool):
        """direct: whether calls by site may skip dynamo (False: plain torch.compile)."""
        # what the backend compiled during the current first call: (code, example inputs)
        self._fresh: list[tuple[Callable[..., object], tuple[torch.Tensor, ...]]] = []
        self._by_signature: dict[tuple[object, ...], _Compiled] = {}
        self._sites: dict[Hashable, _Site | None] = {}
        self.direct = direct
        if direct:
            self._inductor = torch._TorchCompileInductorWrapper(None, options, False)
            self._dynamo = torch.compile(fn, backend=self._backend, fullgraph=True,
                                         dynamic=False)
        else:
            self._dynamo = torch.compile(fn, fullgraph=True, dynamic=False, options=options)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        fn = self._inductor(gm, example_inputs)
        self._fresh.append((fn, tuple(example_inputs)))
        return fn

    def __call__(self, *args: object):
        return self._dynamo(*args)

    def call(self, site: Hashable, *args: object):
        """The graph on `args`, from a call site whose arguments hold the same tensors at
        every call except its top-level tensor arguments."""
        if not self.direct:
            return self(*args)
        known = self._sites.get(site, False)
        if known is False:
            return self._learn(site, args)
        return self(*args) if known is None else known(args)

    def _learn(self, site: Hashable, args: tuple[object, ...]):
        leaves, spec = pytree.tree_flatten(args)
        signature = _signature(leaves, spec)
        self._fresh.clear()
        with torch.compiler.set_stance("default"):     # guards on: a new site may recompile
            out = self._dynamo(*args)
        if len(self._fresh) == 1:
            fn, examples = self._fresh[0]
            where = {id(x): i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
            self._by_signature[signature] = _Compiled(
                fn, tuple(where.get(id(x), x) for x in examples))
        compiled = self._by_signature.get(signature)
        self._sites[site] = None if compiled is None else self._site(compiled, args, leaves,
                                                                      out)
        return out

    @staticmethod
    def _site(compiled: _Compiled, args: tuple[object, ...], leaves: list[object],
              out: object) -> _Site:
        # the leaf index of each top-level argument that is itself a tensor
        top, index = {}, 0
        for j, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                top[index] = j
            index += len(pytree.tree_leaves(arg))
        inputs, slots = [], []
        for i, source in enumerate(compiled.sources):
            if isinstance(source, int):
                inputs.append(leaves[source])
                if source in top:
                    slots.append((i, top[source]))
            else:
                inputs.append(source)
        return _Site(boxed(compiled.fn), inputs, tuple(slots), _layout(out, [0]))


def same_results(first: object, again: object) -> bool:
    """Whether two results hold the same tensors bit for bit (NaN equal to NaN)."""
    a = [x for x in pytree.tree_leaves(first) if isinstance(x, torch.Tensor)]
    b = [x for x in pytree.tree_leaves(again) if isinstance(x, torch.Tensor)]
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype
                                    and torch.equal(x.nan_to_num(), y.nan_to_num())
                                    for x, y in zip(a, b))


def check_direct(graphs: list[DirectGraph], part: str, first: object,
                 again: Callable[[], object]) -> bool:
    """Run `again` (the same work as the dynamo run that gave `first`, from the same
    start, now by direct calls) and compare; on any difference or error every graph of
    `part` goes back to dynamo's path, with a warning. Returns whether direct calls stay."""
    expected = [x.clone() if isinstance(x, torch.Tensor) else x
                for x in pytree.tree_leaves(first)]
    try:
        same = same_results(expected, again())
        reason = "their results differ from dynamo's"
    except Exception as exc:       # another torch whose backend sees other inputs
        same, reason = False, f"{type(exc).__name__}: {exc}"
    if not same:
        log.warning("the %s's compiled graphs are called through dynamo: direct calls "
                    "failed their check (%s)", part, reason)
        for graph in graphs:
            graph.direct = False
    return same

