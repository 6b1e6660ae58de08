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
- the KV cache is read at its full capacity under a position mask, never sliced by length;
- positions, the padding mask and the conv window's rows are tensors, never Python ints;
- state is updated in place (KV rows, GDN state, conv window, per-step checkpoints).

Compile once per layout, not per layer: the layer kinds (GDN or attention, MLP or MoE)
repeat with a period (the hybrids: 3 GDN + 1 attention); layers are cut into spans of whole
periods (at least `SPAN_LAYERS` layers) and every span of one kind signature shares one
compiled graph. A span's parameters and buffers are packed into one flat tensor per dtype
(`pack_layers`), which the graph takes with the span's state views: a few inputs per call
instead of fifteen per layer. The 27B's 64 layers are 16 calls of one graph on CUDA (8 on a
CPU); a model of one span runs embedding, layers and head as one graph. On a CPU warm
graphs are called without dynamo (direct.py). Prefill chunks stay eager (their own, larger
shapes).
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ...kernels.toolchain import toolchain_error
from ..cache import InferenceState
from ..config import cache_home
from .direct import DirectGraph, check_direct
from .layers import rope_cos_sin
from .moe import RoutingRecord, SparseMoeBlock

log = logging.getLogger(__name__)

# The fewest layers one graph call runs. On a CPU every call costs ~50 us of host work
# (bench/overhead.py, 64 layers: 8-layer spans 1.06 ms a forward, 4-layer 1.40; compile
# 116 s against 90); on CUDA the forward replays as one captured graph whatever the spans,
# and smaller graphs compile sooner.
SPAN_LAYERS = {"cpu": 8, "cuda": 4}
MAX_PERIOD = 8        # longer layer patterns are compiled layer kind by layer kind
ALIGN_BYTES = 64      # where each packed tensor starts (vector loads, Triton's pointer hints)


def row_buckets(max_block: int) -> tuple[int, ...]:
    """Block sizes the forwards are compiled for: 1 (plain decode), the powers of two below
    max_block, and max_block (the largest verify block)."""
    out, size = [1], 2
    while size < max_block:
        out.append(size)
        size *= 2
    return tuple(out + ([max_block] if max_block > 1 else []))


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


# A cache directory the user chose for torch before we ran (inductor sets the variable itself
# to a temporary directory the first time it compiles, so it is read at import).
_USER_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def compile_cache_dir(configured: str | None = None) -> Path:
    """Where compiled graphs persist across starts: the configured directory, else
    $TORCHINDUCTOR_CACHE_DIR as the user set it, else torch_compile under `cache_home()`."""
    if configured or _USER_CACHE:
        return Path(configured or _USER_CACHE).expanduser()
    return cache_home() / "torch_compile"


# The graphs (entry, span, head; or all three as one, `whole_forward`): their arguments are
# modules and tensors only (Python numbers would be baked into the graph and recompile it
# for every new value).

def _entry(embed: nn.Embedding, ids: torch.Tensor, positions: torch.Tensor,
           key_positions: torch.Tensor, rotary_dim: int, theta: float):
    x = embed(ids)
    cos, sin = rope_cos_sin(positions, rotary_dim, theta, x.dtype)
    return x, cos, sin, key_mask(key_positions, positions)


def key_mask(key_positions: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Which cache rows each row of the block attends to: [B, T, C], each batch row at its
    own positions."""
    return key_positions[None, None, :] <= positions[:, :, None]


def layer_step(layer: nn.Module, cache: tuple[torch.Tensor, ...], x: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               mask: torch.Tensor, valid: torch.Tensor, window_rows: torch.Tensor):
    """One decoder layer of a static-shape forward -> (its output, the MoE's expert ids or
    None)."""
    mix, post = layer.pre_mixer(x)
    if layer.is_linear:
        core = layer.linear_attn.mix_static(mix, valid, window_rows, cache)
    else:
        core = layer.self_attn.mix_static(mix, cos, sin, positions, mask, cache)
    x = x + layer.mixer.post(core, post)
    h = layer.post_attention_layernorm(x)
    if isinstance(layer.mlp, SparseMoeBlock):
        out, ids = layer.mlp.routed(h, valid)
        return x + out, ids
    return x + layer.mlp(h), None


def span_forward(layers: tuple[nn.Module, ...],
                 caches: tuple[tuple[torch.Tensor, ...], ...], x: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor, valid: torch.Tensor, window_rows: torch.Tensor):
    """Consecutive decoder layers, their tensors read from the modules; returns each layer's
    output and each MoE layer's ids."""
    outs, routes = [], []
    for layer, cache in zip(layers, caches):
        x, ids = layer_step(layer, cache, x, cos, sin, positions, mask, valid, window_rows)
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
                        mask: torch.Tensor, valid: torch.Tensor, window_rows: torch.Tensor):
    """`span_forward` of a span whose tensors were packed into `flats` (`pack_layers`), run
    through the template `steps` of the first span packed the same way."""
    outs, routes = [], []
    for step, cache in zip(steps, caches):
        tensors = {name: flats[group][offset:offset + numel].view(shape)
                   for name, group, offset, numel, shape in step.slots}
        x, ids = torch.func.functional_call(
            step, tensors, (cache, x, cos, sin, positions, mask, valid, window_rows))
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
                  key_positions: torch.Tensor, rotary_dim: int, theta: float,
                  steps: tuple[LayerStep, ...], flats: tuple[torch.Tensor, ...],
                  caches: tuple[tuple[torch.Tensor, ...], ...], valid: torch.Tensor,
                  window_rows: torch.Tensor, norm: nn.Module, weight: torch.Tensor):
    """Entry, the one span and head as one graph: a model whose layers form a single span
    pays one graph call per forward instead of three."""
    x, cos, sin, mask = _entry(embed, ids, positions, key_positions, rotary_dim, theta)
    outs, routes = packed_span_forward(steps, flats, caches, x, cos, sin, positions, mask,
                                       valid, window_rows)
    normed, logits, finite = _head(norm, weight, outs[-1])
    return logits, outs[:-1] + [normed], routes, finite


def _own_copy(fn):
    """fn with a code object of its own. Dynamo keeps compiled graphs, and the guards that
    choose among them, per code object: each engine's stay its own (two engines in one
    process neither share entries nor exhaust each other's recompile limit)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


@contextmanager
def quiet_inductor():
    """Compiling with the C++ wrapper warns, once per op, that ops without a C shim (the
    triangular solve of the GDN verify) run through a proxy: correct, and not for users."""
    logger = logging.getLogger("torch._inductor.ir")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def compile_graph(fn, cuda_graphs: bool, variants: int, rows: int = 1) -> DirectGraph:
    """torch.compile of one graph function, static shapes, no graph break allowed; rows:
    the most rows a GEMM of it multiplies. On a CPU its sites may be called directly
    (direct.py); on CUDA the captured graph is replayed instead."""
    # dynamo's per-code limit must admit every variant (bucket x recording x graph kind)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               variants)
    # On a CPU the graph's host wrapper in C++ (not Python) halves what a call costs; on
    # CUDA the captured graph is replayed and the wrapper runs only at capture. Rounding to
    # the compute dtype where eager does keeps bf16 close to eager.
    options: dict[str, object] = {"cpp_wrapper": not cuda_graphs,
                                  "emulate_precision_casts": True}
    if not cuda_graphs:
        # What else a CPU call's wrapper costs, per span of 4 layers (of ~120 us): a check of
        # every input's sizes and strides (~15 us; the inputs are the tensors compiled with,
        # so the check cannot fail) and one allocation per intermediate (~80: one pool).
        options.update(size_asserts=False, memory_planning=True, memory_pool="combined",
                       post_grad_fusion_options={"decompose_mm_pass": {}})
        _decompose_small_gemms(rows)
    return DirectGraph(_own_copy(fn), options, direct=not cuda_graphs)


def _decompose_small_gemms(rows: int) -> None:
    """On a CPU, let inductor write a GEMM of a block's few rows (and weights of at most
    2048 columns) as a loop it fuses with its neighbours, instead of a BLAS call that costs
    microseconds of dispatch for nanoseconds of work (8 per layer; -10 to -25% per forward at
    the bench's widths). Inductor does this for one row; its limit is a module setting."""
    from torch._inductor.fx_passes import decompose_mem_bound_mm as small_gemms

    small_gemms.cpu_max_first_dimension_decomposition = max(
        small_gemms.cpu_max_first_dimension_decomposition, rows)


@dataclass(frozen=True)
class CompileReport:
    """What warm-up did: telemetry and the node's summary show it."""

    backend: str              # "inductor" (CPU) or "inductor + CUDA graphs"
    buckets: tuple[int, ...]
    parts: tuple[str, ...]    # the models compiled: target, and the MTP head where loaded
    spans: int                # graph calls per target forward for its layers
    graphs: int               # graphs compiled (or read from the cache) at warm-up
    seconds: float
    cache_dir: str
    batches: tuple[int, ...] = (1,)   # batch buckets (a batch of slots' forwards)

    def plus(self, other: CompileReport) -> CompileReport:
        return replace(self, parts=self.parts + other.parts, graphs=self.graphs + other.graphs,
                       seconds=self.seconds + other.seconds,
                       batches=max(self.batches, other.batches, key=len))

    def as_dict(self) -> dict[str, object]:
        return {"backend": self.backend, "buckets": list(self.buckets),
                "batches": list(self.batches),
                "parts": list(self.parts), "spans": self.spans, "graphs": self.graphs,
                "seconds": round(self.seconds, 3), "cache_dir": self.cache_dir}

    def __str__(self) -> str:
        batches = f" x batches {list(self.batches)}" if self.batches != (1,) else ""
        return (f"compiled {' + '.join(self.parts)} ({self.backend}): buckets "
                f"{list(self.buckets)}{batches}, {self.spans} layer graph calls per target "
                f"forward, {self.graphs} graphs in {self.seconds:.1f} s (cache "
                f"{self.cache_dir})")


def layer_cache(state: InferenceState, layer: int, record: bool) -> tuple[torch.Tensor, ...]:
    """A layer's views of the state, as `mix_static` takes them: GDN (state, conv window,
    then step states and conv rows when recording), attention (k, v, then FP8 scales)."""
    kv, gdn = state.kv, state.gdn
    if layer in gdn.slot:
        s = gdn.slot[layer]
        steps = (gdn.step_states[s], gdn.conv_rows[s]) if record else ()
        return (gdn.state[s], gdn.conv[s], *steps)
    s = kv.slot[layer]
    scales = (kv.k_scale[s], kv.v_scale[s]) if kv.is_fp8 else ()
    return (kv.k[s], kv.v[s], *scales)


class StaticGraphs:
    """What a compiled model shares: the buckets, the position and padding tensors, the
    compile options, the on-disk cache, warm-up and (on CUDA) one captured graph per bucket.
    Subclasses stage their inputs in per-bucket buffers and define `_forward(key, valid,
    window_rows)`, the graphs of one forward, key = (batch bucket, row bucket).

    Bound to one sequence's state (batches (1,)), or to a batch's slots (`slots.py`):
    then a forward of slots 0..m-1 runs padded to the smallest of `batches` >= m. The
    padding batch rows are free slots: their rows are marked not real (the GDN state and
    conv window stay as they were) and they write KV rows at positions 0.. of their own
    slot, which the next request to take the slot prefills over before anything reads
    them."""

    part = ""
    spans = 1
    records = False           # whether blocks of several rows keep per-step checkpoints

    def __init__(self, state: InferenceState, max_block: int, cache_dir: str | None,
                 device: torch.device, batches: tuple[int, ...] = (1,)):
        self.state = state
        self.cache_dir = compile_cache_dir(cache_dir)
        self.buckets = row_buckets(max_block)
        self.batches = batches
        self._bucket_of = {rows: next(b for b in self.buckets if b >= rows)
                           for rows in range(1, self.buckets[-1] + 1)}
        self._batch_of = {m: next(b for b in batches if b >= m)
                          for m in range(1, batches[-1] + 1)}
        self.keys = tuple((bb, tb) for bb in self.batches for tb in self.buckets)
        self.device = device
        self.cuda_graphs = device.type == "cuda"
        self.key_positions = torch.arange(state.capacity, device=device)
        self.positions = {key: torch.zeros(key, dtype=torch.long, device=device)
                          for key in self.keys}
        self._starts = {bb: torch.zeros(bb, 1, dtype=torch.long, device=device)
                        for bb in self.batches}
        self._padding: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.report: CompileReport | None = None
        self.calls = 0                      # forwards run compiled since warm-up
        self.compiled: list[DirectGraph] = []
        self.direct = False                 # calls skip dynamo (checked at warm-up)

    def _compile(self, fn, kinds: int = 1) -> DirectGraph:
        graph = compile_graph(fn, self.cuda_graphs, 2 * len(self.keys) * kinds,
                              self.buckets[-1])
        self.compiled.append(graph)
        return graph

    def bucket(self, rows: int) -> int | None:
        return self._bucket_of.get(rows)

    def padding(self, bb: int, tb: int, m: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid [bb, tb]: rows 0..t-1 of batch rows 0..m-1 are real; window_rows
        [bb, K-1]: the rows of [window, block] each batch row's conv window keeps)."""
        key = (bb, tb, m, t)
        if key not in self._padding:
            k1, device = self.state.gdn.conv.shape[2], self.device
            running = torch.arange(bb, device=device)[:, None] < m
            valid = running & (torch.arange(tb, device=device) < t)
            window_rows = torch.where(running, torch.arange(t, t + k1, device=device),
                                      torch.arange(k1, device=device))
            self._padding[key] = (valid, window_rows)
        return self._padding[key]

    def _slots(self, state: object, batch: int) -> list[InferenceState] | None:
        """The sequences a forward on `state` of `batch` rows runs: this state itself, or
        slots 0..batch-1 of it (`slots.BatchRows`); None when not bound to them."""
        if state is self.state and batch == 1:
            return [state]
        if getattr(state, "whole", None) is self.state and batch in self._batch_of:
            return state.slots
        return None

    def fits(self, state: object, batch: int, rows: int) -> bool:
        """This state (or a batch of its slots), a block that fits a bucket and every
        sequence's cache, and an FP8 cache already calibrated (the first prefill chunk does
        that, eagerly)."""
        tb = self.bucket(rows)
        if tb is None or self.report is None:
            return False
        slots = self._slots(state, batch)
        return (slots is not None and all(s.length + tb <= s.capacity for s in slots)
                and (not state.kv.is_fp8 or all(state.kv.calibrated)))

    def _begin(self, state: object, rows: int, record: bool
               ) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor]:
        tb = self.bucket(rows)
        start = state.begin(rows, record)
        self.calls += 1
        if isinstance(start, int):     # one sequence
            bb, m = 1, 1
            if tb == 1:      # a decode step: the one position, without slicing the arange
                self.positions[1, 1].fill_(start)
            else:
                self.positions[1, tb][0].copy_(self.key_positions[start:start + tb])
        else:                          # slots 0..m-1 of a batch, each at its own length
            m = len(start)
            bb = self._batch_of[m]
            starts = self._starts[bb]
            starts.zero_()
            starts[:m, 0].copy_(torch.tensor(start))
            torch.add(starts, self.key_positions[:tb], out=self.positions[bb, tb])
        return (bb, tb), *self.padding(bb, tb, m, rows)

    def _run(self, key: tuple[int, int], valid: torch.Tensor, window_rows: torch.Tensor):
        if self.direct:
            return self._forward(key, valid, window_rows)
        return run_graph(self.graphs.get(key), partial(self._forward, key), valid,
                         window_rows)

    def _forward(self, key: tuple[int, int], valid: torch.Tensor, window_rows: torch.Tensor):
        raise NotImplementedError

    def _warm_state(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The state emptied and opened for a full bucket at position 0 of every row (FP8
        scales of 1), as warm-up runs it -> (valid, window_rows)."""
        bb, tb = key
        kv = self.state.kv
        self.state.reset()
        kv.calibrated = [True] * len(kv.calibrated)
        self.state.begin(tb, self.records and tb > 1)
        self.positions[key].copy_(self.key_positions[:tb].expand(bb, tb))
        return self.padding(bb, tb, bb, tb)

    def warm_up(self, progress: Callable[[str], None] | None = None) -> CompileReport:
        """Compile (or read from the on-disk cache) every bucket's graphs, running each once
        on the state, which is left empty."""

        def every_bucket() -> None:
            for i, key in enumerate(self.keys):
                t1 = time.perf_counter()
                valid, window_rows = self._warm_state(key)
                if self.cuda_graphs:
                    self.graphs[key] = CapturedGraph(partial(self._forward, key), valid,
                                                     window_rows)
                elif self.compiled[0].direct:
                    self._check_direct(key, self._forward(key, valid, window_rows))
                else:
                    self._forward(key, valid, window_rows)
                if progress is not None:
                    bb, tb = key
                    rows = f"{tb}-row" if bb == 1 else f"{bb} x {tb}-row"
                    progress(f"compiled the {self.part}'s {rows} forward ({i + 1}/"
                             f"{len(self.keys)}, {time.perf_counter() - t1:.1f} s)")
            self.state.reset()

        self.report = warm_up_report(every_bucket, self.part, self.cuda_graphs, self.buckets,
                                     self.spans, self.cache_dir, self.batches)
        self.direct = all(graph.direct for graph in self.compiled)
        return self.report

    def _check_direct(self, key: tuple[int, int], first: object) -> None:
        """The bucket's forward again from the same empty state, now by direct calls: it
        must give what dynamo's first calls gave (outputs, recurrent state), bit for bit."""
        gdn = self.state.gdn

        def again() -> object:
            return self._forward(key, *self._warm_state(key)), gdn.state, gdn.conv

        check_direct(self.compiled, self.part, (first, gdn.state, gdn.conv), again)


@torch.inference_mode()
@quiet_inductor()
def warm_up_report(run: Callable[[], None], part: str, cuda_graphs: bool,
                   buckets: tuple[int, ...], spans: int, cache_dir: Path,
                   batches: tuple[int, ...] = (1,)) -> CompileReport:
    """Run `run` (the first call of every graph: compiling, or reading the on-disk cache
    at `cache_dir`) and report what it took."""
    # process-wide: inductor reads the variable whenever it looks for a cached graph
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    counters = torch._dynamo.utils.counters["stats"]
    before, t0 = counters["unique_graphs"], time.perf_counter()
    try:
        run()
    except Exception as exc:    # a compiled graph calls the kernels unguarded (dispatch.py)
        clear = toolchain_error(exc)
        if clear is None:
            raise
        raise clear from exc
    report = CompileReport("inductor + CUDA graphs" if cuda_graphs else "inductor", buckets,
                           (part,), spans, counters["unique_graphs"] - before,
                           time.perf_counter() - t0, str(cache_dir), batches)
    log.info("%s", report)
    return report


def run_graph(captured: CapturedGraph | None, forward: Callable[..., object],
              *inputs: torch.Tensor):
    """One compiled forward: the CUDA graph replayed with `inputs` copied in, or on a CPU
    the compiled code called. Every call after warm-up matches a graph compiled for these
    modules and state tensors, so only the guards that tell those graphs apart (bucket,
    recording, layer kinds) are checked: a third of a call's cost saved."""
    if captured is not None:
        return captured.replay(*inputs)
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        return forward(*inputs)


@dataclass
class _Span:
    steps: tuple[LayerStep, ...]      # the template: the first span packed the same way
    flats: tuple[torch.Tensor, ...]   # this span's tensors (`pack_layers`)
    # (batch bucket, recording?) -> per layer, its state views of rows 0..bb-1
    caches: dict[tuple[int, bool], tuple[tuple[torch.Tensor, ...], ...]]


def batch_rows(views: tuple[torch.Tensor, ...], bb: int, batch: int
               ) -> tuple[torch.Tensor, ...]:
    """The first bb of a state's `batch` rows of a layer's state views (the views
    themselves when that is all of them: a one-sequence state's FP8 scales have no batch
    dimension)."""
    return views if bb == batch else tuple(x[:bb] for x in views)


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
        templates = len({id(span.steps) for span in self.spans_of})
        if self.spans == 1:
            self.whole = self._compile(whole_forward)
        else:
            self.entry = self._compile(_entry)
            self.span = self._compile(packed_span_forward, templates)
            self.head = self._compile(_head)
        self.ids = {key: torch.zeros(key, dtype=torch.long, device=self.device)
                    for key in self.keys}

    def accepts(self, ids: torch.Tensor, state: InferenceState, record_steps: bool) -> bool:
        """Whether this forward can run compiled (`fits`); a block of more than one row
        only when it records its steps: prefill chunks stay eager."""
        b, t = ids.shape
        return self.fits(state, b, t) and (t == 1 or record_steps)

    def run(self, ids: torch.Tensor, state: object, record_steps: bool,
            taps: tuple[int, ...], all_logits: bool, routing: RoutingRecord | None):
        """`TargetModel.forward` of a block `accepts` took; returns (logits, taps, finite:
        per returned row, 1 when its logits are finite)."""
        m, t = ids.shape
        key, valid, window_rows = self._begin(state, t, record_steps)
        padded = key != (m, t)
        # (slicing only where a block is padded: each slice is a few us of a 1-row step)
        (self.ids[key][:m, :t] if padded else self.ids[key]).copy_(ids)
        logits, outs, routes, finite = self._run(key, valid, window_rows)
        if padded or not all_logits:
            rows = slice(0, t) if all_logits else slice(t - 1, t)
            logits, finite = logits[:m, rows], finite[:m, rows]
        kept = [logits, finite, *(outs[i][:m, :t] if padded else outs[i] for i in taps)]
        if routing is not None:
            kept += [ids.view(*key, -1)[:m, :t].reshape(m * t, -1) for ids in routes]
        if self.cuda_graphs:   # the graph's outputs: the next replay overwrites them
            kept = [x.clone() for x in kept]
        if routing is not None:
            routing.ids.extend(kept[2 + len(taps):])
        return kept[0], kept[2:2 + len(taps)], kept[1]

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
                                   self.key_positions, rope.rotary_dim, rope.theta,
                                   span.steps, span.flats, span.caches[caches], valid,
                                   window_rows, model.norm, model.output_weight)
        x, cos, sin, mask = self.entry.call(key, model.embed_tokens, self.ids[key], positions,
                                            self.key_positions, rope.rotary_dim, rope.theta)
        outs: list[torch.Tensor] = []
        routes: list[torch.Tensor] = []
        for i, span in enumerate(self.spans_of):
            layer_outs, ids = self.span.call((*key, i), span.steps, span.flats,
                                             span.caches[caches], x, cos, sin, positions,
                                             mask, valid, window_rows)
            outs += layer_outs
            routes += ids
            x = layer_outs[-1]
        normed, logits, finite = self.head.call(key, model.norm, model.output_weight, x)
        outs[-1] = normed
        return logits, outs, routes, finite


class CapturedGraph:
    """A forward as a CUDA graph: run once to compile and warm up, captured, and replayed
    with its per-call inputs copied into the static tensors it was captured with."""

    def __init__(self, forward: Callable[..., object], *inputs: torch.Tensor):
        self.inputs = tuple(x.clone() for x in inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward(*self.inputs)                                  # compile and autotune
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = forward(*self.inputs)

    def replay(self, *inputs: torch.Tensor):
        for static, x in zip(self.inputs, inputs):
            static.copy_(x)
        self.graph.replay()
        return self.outputs
