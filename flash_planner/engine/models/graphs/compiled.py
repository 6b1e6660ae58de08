"""The target's decode and verify forwards with static shapes, compiled once per layer layout.

Why: an eager forward pays Python and dispatch for every op of every layer (0.2-0.4 ms per
layer on a CPU core, 15-23 ms at the 27B's 64 layers: bench/overhead.py), which on Thor
would add 25-40% to the 27B's weight-read floor and several times the MoE's. A compiled
forward pays it once per graph call; on CUDA the whole forward is captured as one CUDA
graph and replayed. The proposers' forwards follow in compiled_drafts.py.

Static shapes, so that nothing recompiles after warm-up:
- rows: a block of T rows (1 <= T <= max_block) runs padded to the smallest bucket >= T
  (`row_buckets`: 1, 2, 4, 8 and max_block). Padding rows leave the GDN state as it was
  (`GatedDeltaNet.mix_static`), route to experts the block already reads (MoE), and write
  KV rows past the real ones, which no real row attends to and the next forward overwrites;
- attention reads, and masks by position, only the cache's rows up to the block's last
  position, through an op the compiler does not see into
  (qwen/cache_attention.py): on a CPU the exact count, on CUDA one graph captured per key
  bucket (static_graphs.key_buckets), so the number of compiled graphs does not grow;
- positions, the padding mask and the conv window's rows are tensors, never Python ints;
- state is updated in place (KV rows, conv window; a verify's kept GDN rows, the GDN state on
  a plain step).

Compile once per layout, not per layer: the layer kinds (GDN or attention, MLP or MoE)
repeat with a period (the hybrids: 3 GDN + 1 attention); layers are cut into spans of whole
periods (at least `SPAN_LAYERS` layers) and every span of one kind signature shares one
compiled graph. A span's parameters and buffers are packed into one flat tensor per dtype
(`pack_layers`), which the graph takes with the span's state views: a few inputs per call
instead of fifteen per layer. The 27B's 64 layers are 16 calls of one graph on CUDA (8 on a
CPU); a model of one span runs embedding, layers and head as one graph. On a CPU warm
graphs are called directly (direct.py). Prefill chunks stay eager (their own, larger
shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ...state.cache import InferenceState
from ..qwen.layers import rope_cos_sin
from ..qwen.moe import RoutingRecord, SparseMoeBlock
from .static_graphs import (
    StaticGraphs,
    batch_rows,
    compile_cache_dir,
    layer_cache,
    row_buckets,
)
from .warm_up_report import CompileReport

__all__ = ["CompileReport", "StaticForward", "compile_cache_dir", "row_buckets",
           "span_bounds"]

# The fewest layers one graph call runs. On a CPU every call costs ~50 us of host work
# (bench/overhead.py, 64 layers: 8-layer spans 1.06 ms a forward, 4-layer 1.40; compile
# 116 s against 90); on CUDA the forward replays as one captured graph whatever the spans,
# and smaller graphs compile sooner.
SPAN_LAYERS = {"cpu": 8, "cuda": 4}
MAX_PERIOD = 8        # longer layer patterns are compiled layer kind by layer kind
ALIGN_BYTES = 64      # where each packed tensor starts (vector loads, Triton's pointer hints)


def layer_kind(layer: nn.Module) -> tuple[bool, bool]:
    """(GDN mixer?, mixture of experts?): what decides a layer's graph."""
    return layer.is_linear, isinstance(layer.mlp, SparseMoeBlock)


def span_bounds(kinds: Sequence[object], min_layers: int) -> list[tuple[int, int]]:
    """Cut layers into spans [a, b) of whole periods of their kinds, min_layers or more
    layers each where the model is deep enough; no period up to MAX_PERIOD: one layer each."""
    n = len(kinds)
    period = next((p for p in range(1, min(n, MAX_PERIOD) + 1)
                   if all(kinds[i] == kinds[i - p] for i in range(p, n))), None)
    size = 1 if period is None else period * -(-min_layers // period)
    return [(a, min(a + size, n)) for a in range(0, n, size)]


# The graphs (entry, span, head; or all three as one, `whole_forward`): their arguments are
# modules and tensors only (Python numbers would be baked into the graph and recompile it
# for every new value).

def _entry(embed: nn.Embedding, ids: torch.Tensor, positions: torch.Tensor,
           shifts: torch.Tensor, rotary_dim: int, theta: float):
    """Embeddings and rotary tables; each batch row turns by its cache position plus its
    rotary shift (shifts [B, 1]: after an image, InferenceState.rope_shift; else 0)."""
    x = embed(ids)
    cos, sin = rope_cos_sin(positions + shifts, rotary_dim, theta, x.dtype)
    return x, cos, sin


def layer_step(layer: nn.Module, cache: tuple[torch.Tensor, ...], x: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               key_rows: torch.Tensor, valid: torch.Tensor,
               window_rows: torch.Tensor):
    """One decoder layer of a static-shape forward -> (its output, the MoE's expert ids or
    None)."""
    mix, post = layer.pre_mixer(x)
    if layer.is_linear:
        core = layer.linear_attn.mix_static(mix, valid, window_rows, cache)
    else:
        core = layer.self_attn.mix_static(mix, cos, sin, positions, key_rows, cache)
    x = x + layer.mixer.post(core, post)
    h = layer.post_attention_layernorm(x)
    if isinstance(layer.mlp, SparseMoeBlock):
        out, ids = layer.mlp.routed(h, valid)
        return x + out, ids
    return x + layer.mlp(h), None


def span_forward(layers: tuple[nn.Module, ...],
                 caches: tuple[tuple[torch.Tensor, ...], ...], x: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 key_rows: torch.Tensor, valid: torch.Tensor,
                 window_rows: torch.Tensor):
    """Consecutive decoder layers, their tensors read from the modules; returns each layer's
    output and each MoE layer's ids."""
    outs, routes = [], []
    for layer, cache in zip(layers, caches):
        x, ids = layer_step(layer, cache, x, cos, sin, positions, key_rows, valid,
                            window_rows)
        outs.append(x)
        if ids is not None:
            routes.append(ids)
    return outs, routes


class LayerStep(nn.Module):
    """A decoder layer as one module call (`layer_step`), so that a graph can run it on
    another layer's tensors (`torch.func.functional_call`); `slots` says where each of them
    lies in the span's flat tensors (`pack_layers`)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        self.slots: tuple[tuple[str, int, int, int, tuple[int, ...]], ...] = ()

    def forward(self, *inputs: object):
        return layer_step(self.layer, *inputs)


def packed_span_forward(steps: tuple[LayerStep, ...], flats: tuple[torch.Tensor, ...],
                        caches: tuple[tuple[torch.Tensor, ...], ...], x: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                        key_rows: torch.Tensor, valid: torch.Tensor,
                        window_rows: torch.Tensor):
    """`span_forward` of a span whose tensors were packed into `flats` (`pack_layers`), run
    through the template `steps` of the first span packed the same way."""
    outs, routes = [], []
    for step, cache in zip(steps, caches):
        tensors = {name: flats[group][offset:offset + numel].view(shape)
                   for name, group, offset, numel, shape in step.slots}
        x, ids = torch.func.functional_call(
            step, tensors, (cache, x, cos, sin, positions, key_rows, valid, window_rows))
        outs.append(x)
        if ids is not None:
            routes.append(ids)
    return outs, routes


def pack_layers(layers: Sequence[nn.Module]) -> tuple[tuple[LayerStep, ...],
                                                       tuple[torch.Tensor, ...]]:
    """Move the layers' parameters and buffers into one flat tensor per dtype, each now a
    view of it (eager use is unchanged), at offsets aligned to ALIGN_BYTES. -> (a LayerStep
    per layer with its slots, the flat tensors).

    Why: a graph call pays about 0.4 us of host work per input tensor on a CPU (dynamo's
    lookup, the handle, the wrapper's bookkeeping); a span's 15 or so tensors per layer cost
    more than the layer's arithmetic at the bench's width. Packed, a span is 1-3 inputs."""
    steps = tuple(LayerStep(layer) for layer in layers)
    named = [list(step.named_parameters()) + list(step.named_buffers()) for step in steps]
    dtypes = sorted({t.dtype for entries in named for _, t in entries}, key=str)
    sizes = [0] * len(dtypes)
    for step, entries in zip(steps, named):
        slots = []
        for name, t in entries:
            group = dtypes.index(t.dtype)
            align = max(1, ALIGN_BYTES // t.element_size())
            offset = -(-sizes[group] // align) * align
            slots.append((name, group, offset, t.numel(), tuple(t.shape)))
            sizes[group] = offset + t.numel()
        step.slots = tuple(slots)
    device = named[0][0][1].device
    flats = tuple(torch.empty(n, dtype=d, device=device) for n, d in zip(sizes, dtypes))
    with torch.no_grad():
        for step, entries in zip(steps, named):
            for (name, t), (_, group, offset, numel, shape) in zip(entries, step.slots):
                view = flats[group][offset:offset + numel].view(shape)
                view.copy_(t)
                if isinstance(t, nn.Parameter):
                    t.data = view
                else:
                    owner, _, leaf = name.rpartition(".")
                    step.get_submodule(owner)._buffers[leaf] = view
    return steps, flats


def _head(norm: nn.Module, weight: torch.Tensor, x: torch.Tensor):
    """-> (normed x, logits, per row 1 when its logits are finite else 0): a row's sum is
    NaN or Inf iff a logit is (or the row reaches ~1e34: broken all the same); in the graph
    it costs nothing, outside ~10 us a forward."""
    normed = norm(x)
    logits = (normed @ weight.T).float()
    return normed, logits, logits.sum(dim=-1).isfinite().long()


def whole_forward(embed: nn.Embedding, ids: torch.Tensor, positions: torch.Tensor,
                  shifts: torch.Tensor, rotary_dim: int, theta: float,
                  steps: tuple[LayerStep, ...], flats: tuple[torch.Tensor, ...],
                  caches: tuple[tuple[torch.Tensor, ...], ...], key_rows: torch.Tensor,
                  valid: torch.Tensor, window_rows: torch.Tensor, norm: nn.Module,
                  weight: torch.Tensor):
    """Entry, the one span and head as one graph: a model whose layers form a single span
    pays one graph call per forward instead of three."""
    x, cos, sin = _entry(embed, ids, positions, shifts, rotary_dim, theta)
    outs, routes = packed_span_forward(steps, flats, caches, x, cos, sin, positions, key_rows,
                                       valid, window_rows)
    normed, logits, finite = _head(norm, weight, outs[-1])
    return logits, outs[:-1] + [normed], routes, finite


@dataclass
class _Span:
    steps: tuple[LayerStep, ...]      # the template: the first span packed the same way
    flats: tuple[torch.Tensor, ...]   # this span's tensors (`pack_layers`)
    # (batch bucket, recording?) -> per layer, its state views of rows 0..bb-1
    caches: dict[tuple[int, bool], tuple[tuple[torch.Tensor, ...], ...]]


def _packed_spans(model: nn.Module, state: InferenceState,
                  batches: tuple[int, ...]) -> list[_Span]:
    """The model's layers cut into spans (`span_bounds`) and packed (`pack_layers`); spans
    of the same layer kinds and packing share the template steps, hence one graph."""
    layers = model.layers
    templates: dict[object, tuple[LayerStep, ...]] = {}
    spans = []
    min_layers = SPAN_LAYERS.get(model.embed_tokens.weight.device.type, SPAN_LAYERS["cuda"])
    for a, b in span_bounds([layer_kind(layer) for layer in layers], min_layers):
        steps, flats = pack_layers(layers[a:b])
        key = tuple((layer_kind(step.layer), step.slots) for step in steps)
        spans.append(_Span(templates.setdefault(key, steps), flats,
                           {(bb, rec): tuple(batch_rows(layer_cache(state, i, rec), bb,
                                                        state.gdn.state.shape[1])
                                             for i in range(a, b))
                            for bb in batches for rec in (False, True)}))
    return spans


class StaticForward(StaticGraphs):
    """Runs `TargetModel.forward` for blocks of up to max_block rows through compiled
    static-shape graphs on one `InferenceState` (the engine's; its tensors never move), or
    on slots of a batch's state (`slots.SlotStates.whole`), `batches` their buckets."""

    part = "target"
    records = True

    def __init__(self, model: nn.Module, state: InferenceState, max_block: int,
                 cache_dir: str | None = None, batches: tuple[int, ...] = (1,)):
        super().__init__(state, max_block, cache_dir, model.embed_tokens.weight.device,
                         batches)
        if batches != (1,):
            self.part = f"batch of {batches[-1]}'s target"
        self.model = model
        self.spans_of = _packed_spans(model, state, self.batches)
        self.spans = len(self.spans_of)
        if self.spans == 1:
            self.whole = self._compile(whole_forward)
        else:
            self.entry = self._compile(_entry)
            self.span = self._compile(packed_span_forward)
            self.head = self._compile(_head)
        self.ids = {key: torch.zeros(key, dtype=torch.long, device=self.device)
                    for key in self.keys}
        # per batch bucket, each row's rotary shift (after an image; 0 without)
        self.shifts = {bb: torch.zeros(bb, 1, dtype=torch.long, device=self.device)
                       for bb in self.batches}
        self._shifted: dict[int, bool] = {}      # whether a bucket's shifts are not all 0

    def accepts(self, ids: torch.Tensor, state: InferenceState, record_steps: bool) -> bool:
        """Whether this forward can run compiled (`fits`); a block of more than one row
        only when it records its steps: prefill chunks stay eager (those holding image
        tokens among them). The text after an image runs compiled, its rotary shift an
        input."""
        b, t = ids.shape
        return self.fits(state, b, t) and (t == 1 or record_steps)

    def run(self, ids: torch.Tensor, state: object, record_steps: bool,
            taps: tuple[int, ...], all_logits: bool, routing: RoutingRecord | None):
        """`TargetModel.forward` of a block `accepts` took; returns (logits, taps, finite:
        per returned row, 1 when its logits are finite)."""
        m, t = ids.shape
        key, valid, window_rows = self._begin(state, t, record_steps)
        self._shift(key[0], state.rope_shift)
        padded = key != (m, t)
        # (slicing only where a block is padded: each slice is a few us of a 1-row step)
        (self.ids[key][:m, :t] if padded else self.ids[key]).copy_(ids)
        logits, outs, routes, finite = self._run(key, valid, window_rows)
        if padded or not all_logits:
            rows = slice(0, t) if all_logits else slice(t - 1, t)
            logits, finite = logits[:m, rows], finite[:m, rows]
        tapped = [outs[i][:m, :t] if padded else outs[i] for i in taps]
        return self._hand_out(key, m, t, logits, finite, tapped, routes, routing)

    def _shift(self, bb: int, shift: int | list[int]) -> None:
        """Stage each row's rotary shift (padding rows: 0); a tensor write only where one
        changes, which a request without images never does."""
        shifts = self.shifts[bb]
        rows = shift if isinstance(shift, list) else [shift]
        if any(rows) or self._shifted.get(bb, False):
            shifts.zero_()
            shifts[:len(rows), 0].copy_(torch.tensor(rows))
            self._shifted[bb] = any(rows)

    def _prepare(self, key: tuple[int, int]) -> None:
        """The graphs of `key`'s forward compiled without running them (a deferred bucket):
        the entry's outputs, computed eagerly (embedding and rotary tables touch no state),
        stand for the spans' and the head's inputs, which have their shapes."""
        model, positions = self.model, self.positions[key]
        rope = model.cfg.rope
        bb, tb = key
        valid, window_rows = self.padding(bb, tb, bb, tb)
        caches = (bb, tb > 1)
        entry = (model.embed_tokens, self.ids[key], positions, self.shifts[bb],
                 rope.rotary_dim, rope.theta)
        if self.spans == 1:
            span = self.spans_of[0]
            self.whole.prepare(*entry, span.steps, span.flats, span.caches[caches],
                               self.key_rows, valid, window_rows, model.norm,
                               model.output_weight)
            return
        self.entry.prepare(*entry)
        x, cos, sin = _entry(*entry)
        for span in self.spans_of:       # one graph unless a span's packing differs
            self.span.prepare(span.steps, span.flats, span.caches[caches], x, cos, sin,
                              positions, self.key_rows, valid, window_rows)
        self.head.prepare(model.norm, model.output_weight, x)

    def _forward(self, key: tuple[int, int], valid: torch.Tensor,
                 window_rows: torch.Tensor):
        """The graphs of one forward: entry, the spans, head. -> (logits [bb, tb, V],
        per-layer outputs (the last after the final norm), MoE ids per sparse layer, per row
        whether its logits are finite [bb, tb])."""
        model, positions = self.model, self.positions[key]
        rope = model.cfg.rope
        bb, tb = key
        caches = (bb, tb > 1)      # blocks of several rows record their steps
        if self.spans == 1:
            span = self.spans_of[0]
            return self.whole.call(key, model.embed_tokens, self.ids[key], positions,
                                   self.shifts[bb], rope.rotary_dim, rope.theta, span.steps,
                                   span.flats, span.caches[caches], self.key_rows, valid,
                                   window_rows, model.norm, model.output_weight)
        x, cos, sin = self.entry.call(key, model.embed_tokens, self.ids[key], positions,
                                      self.shifts[bb], rope.rotary_dim, rope.theta)
        outs: list[torch.Tensor] = []
        routes: list[torch.Tensor] = []
        for i, span in enumerate(self.spans_of):
            layer_outs, ids = self.span.call((*key, i), span.steps, span.flats,
                                             span.caches[caches], x, cos, sin, positions,
                                             self.key_rows, valid, window_rows)
            outs += layer_outs
            routes += ids
            x = layer_outs[-1]
        normed, logits, finite = self.head.call(key, model.norm, model.output_weight, x)
        outs[-1] = normed
        return logits, outs, routes, finite
