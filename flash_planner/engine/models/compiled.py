"""The target's decode and verify forwards with static shapes, compiled once per layer layout.

Why: an eager forward pays Python and dispatch for every op of every layer (about 0.37 ms
per layer on a CPU core, 23 ms for the 27B's 64 layers), which on Thor would add 40% to
the 27B's weight-read floor and several times the MoE's. A compiled forward pays it once per
graph call; on CUDA the whole forward is captured as one CUDA graph and replayed.

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
compiled graph, its parameters and state views passed as inputs. The 27B's 64 layers are 16
calls of one graph. Prefill chunks stay eager (their own, larger shapes).
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..cache import InferenceState
from .layers import rope_cos_sin
from .moe import RoutingRecord, SparseMoeBlock

log = logging.getLogger(__name__)

SPAN_LAYERS = 4       # the fewest layers one graph call runs (fewer calls, same compile)
MAX_PERIOD = 8        # longer layer patterns are compiled layer kind by layer kind


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


def span_bounds(kinds: Sequence[object]) -> list[tuple[int, int]]:
    """Cut layers into spans [a, b) of whole periods of their kinds, SPAN_LAYERS or more
    layers each where the model is deep enough; no period up to MAX_PERIOD: one layer each."""
    n = len(kinds)
    period = next((p for p in range(1, min(n, MAX_PERIOD) + 1)
                   if all(kinds[i] == kinds[i - p] for i in range(p, n))), None)
    size = 1 if period is None else period * -(-SPAN_LAYERS // period)
    return [(a, min(a + size, n)) for a in range(0, n, size)]


# A cache directory the user chose for torch before we ran (inductor sets the variable itself
# to a temporary directory the first time it compiles, so it is read at import).
_USER_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def compile_cache_dir(configured: str | None = None) -> Path:
    """Where compiled graphs persist across starts: the configured directory, else
    $TORCHINDUCTOR_CACHE_DIR as the user set it, else $XDG_CACHE_HOME/flash_planner/
    torch_compile (~/.cache by default)."""
    if configured or _USER_CACHE:
        return Path(configured or _USER_CACHE).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "flash_planner" / "torch_compile"


# The three graphs: their arguments are modules and tensors only (Python numbers would be
# baked into the graph and recompile it for every new value).

def _entry(embed: nn.Embedding, ids: torch.Tensor, positions: torch.Tensor,
           key_positions: torch.Tensor, rotary_dim: int, theta: float):
    x = embed(ids)
    cos, sin = rope_cos_sin(positions, rotary_dim, theta, x.dtype)
    mask = key_positions[None, :] <= positions[0, :, None]            # [T, C]
    return x, cos, sin, mask


def _span(layers: tuple[nn.Module, ...], caches: tuple[tuple[torch.Tensor, ...], ...],
          x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
          mask: torch.Tensor, valid: torch.Tensor, window_rows: torch.Tensor):
    """Consecutive decoder layers; returns each layer's output and each MoE layer's ids."""
    outs, routes = [], []
    for layer, cache in zip(layers, caches):
        mix, post = layer.pre_mixer(x)
        if layer.is_linear:
            core = layer.linear_attn.mix_static(mix, valid, window_rows, cache)
        else:
            core = layer.self_attn.mix_static(mix, cos, sin, positions, mask, cache)
        x = x + layer.mixer.post(core, post)
        h = layer.post_attention_layernorm(x)
        if isinstance(layer.mlp, SparseMoeBlock):
            out, ids = layer.mlp.routed(h, valid)
            routes.append(ids)
        else:
            out = layer.mlp(h)
        x = x + out
        outs.append(x)
    return outs, routes


def _head(norm: nn.Module, weight: torch.Tensor, x: torch.Tensor):
    normed = norm(x)
    return normed, (normed @ weight.T).float()


def _own_copy(fn):
    """fn with a code object of its own. Dynamo keeps compiled graphs, and the guards that
    choose among them, per code object: each engine's stay its own (two engines in one
    process neither share entries nor exhaust each other's recompile limit)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


@dataclass(frozen=True)
class CompileReport:
    """What `StaticForward.warm_up` did: telemetry and the node's summary show it."""

    backend: str              # "inductor" (CPU) or "inductor + CUDA graphs"
    buckets: tuple[int, ...]
    spans: int                # graph calls per forward for the layers
    graphs: int               # graphs compiled (or loaded from the cache) at warm-up
    seconds: float
    cache_dir: str

    def as_dict(self) -> dict[str, object]:
        return {"backend": self.backend, "buckets": list(self.buckets), "spans": self.spans,
                "graphs": self.graphs, "seconds": round(self.seconds, 3),
                "cache_dir": self.cache_dir}

    def __str__(self) -> str:
        return (f"compiled forward ({self.backend}): buckets {list(self.buckets)}, "
                f"{self.spans} layer graph calls per forward, {self.graphs} graphs in "
                f"{self.seconds:.1f} s (cache {self.cache_dir})")


@dataclass
class _Span:
    layers: tuple[nn.Module, ...]
    first: int                                               # its first layer id
    caches: dict[bool, tuple[tuple[torch.Tensor, ...], ...]]  # recording? -> per layer


class StaticForward:
    """Runs `TargetModel.forward` for blocks of up to max_block rows through compiled
    static-shape graphs on one `InferenceState` (the engine's; its tensors never move)."""

    def __init__(self, model: nn.Module, state: InferenceState, max_block: int,
                 cache_dir: str | None = None):
        self.model, self.state = model, state
        self.cache_dir = compile_cache_dir(cache_dir)
        self.buckets = row_buckets(max_block)
        self.device = model.embed_tokens.weight.device
        self.cuda_graphs = self.device.type == "cuda"
        bounds = span_bounds([layer_kind(layer) for layer in model.layers])
        self.spans = [_Span(tuple(model.layers[a:b]), a,
                            {rec: tuple(self._cache(i, rec) for i in range(a, b))
                             for rec in (False, True)}) for a, b in bounds]
        kinds = len({tuple(layer_kind(x) for x in s.layers) for s in self.spans})
        # dynamo's per-code limit: every bucket x (recording or not) x span kind
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   2 * len(self.buckets) * kinds)
        # On a CPU the graph's host wrapper in C++ (not Python) halves what a call costs;
        # on CUDA the captured graph is replayed and the wrapper runs only at capture.
        opts = dict(fullgraph=True, dynamic=False,
                    options={"cpp_wrapper": not self.cuda_graphs,
                             "emulate_precision_casts": True})
        self.entry = torch.compile(_own_copy(_entry), **opts)
        self.span = torch.compile(_own_copy(_span), **opts)
        self.head = torch.compile(_own_copy(_head), **opts)
        capacity = state.capacity
        self.key_positions = torch.arange(capacity, device=self.device)
        self.ids = {tb: torch.zeros(1, tb, dtype=torch.long, device=self.device)
                    for tb in self.buckets}
        self.positions = {tb: torch.zeros(1, tb, dtype=torch.long, device=self.device)
                          for tb in self.buckets}
        k1 = state.gdn.conv.shape[2]
        # per (bucket, real rows): which rows are real, and the rows the conv window keeps
        self.padding = {(tb, t): (torch.arange(tb, device=self.device) < t,
                                  torch.arange(t, t + k1, device=self.device))
                        for tb in self.buckets for t in range(1, tb + 1)}
        self.graphs: dict[int, _Captured] = {}
        self.report: CompileReport | None = None
        self.calls = 0                      # forwards run compiled since warm-up

    def _cache(self, layer: int, record: bool) -> tuple[torch.Tensor, ...]:
        kv, gdn = self.state.kv, self.state.gdn
        if layer in gdn.slot:
            s = gdn.slot[layer]
            steps = (gdn.step_states[s], gdn.conv_rows[s]) if record else ()
            return (gdn.state[s], gdn.conv[s], *steps)
        s = kv.slot[layer]
        scales = (kv.k_scale[s], kv.v_scale[s]) if kv.is_fp8 else ()
        return (kv.k[s], kv.v[s], *scales)

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def accepts(self, ids: torch.Tensor, state: InferenceState, record_steps: bool) -> bool:
        """Whether this forward can run compiled: the engine's state, one sequence, a block
        that fits a bucket (T = 1, or recording its steps: prefill chunks stay eager), and an
        FP8 cache already calibrated (the first prefill chunk does that, eagerly)."""
        b, t = ids.shape
        tb = self.bucket(t)
        return (state is self.state and b == 1 and tb is not None
                and (t == 1 or record_steps) and self.report is not None
                and state.length + tb <= state.capacity
                and (not state.kv.is_fp8 or all(state.kv.calibrated)))

    def run(self, ids: torch.Tensor, record_steps: bool, taps: tuple[int, ...],
            all_logits: bool, routing: RoutingRecord | None):
        """`TargetModel.forward` of a block `accepts` took; returns (logits, taps)."""
        t = ids.shape[1]
        tb = self.bucket(t)
        start = self.state.begin(t, record_steps)
        self.calls += 1
        self.ids[tb][:, :t].copy_(ids)
        self.positions[tb][0] = self.key_positions[start:start + tb]
        valid, window_rows = self.padding[(tb, t)]
        if self.cuda_graphs:
            logits, outs, routes = self.graphs[tb].replay(valid, window_rows)
        else:
            # Every call after warm-up matches a graph compiled for this engine's own
            # modules and state tensors; checking only the guards that tell those graphs
            # apart (bucket, recording, layer kinds) saves a third of a call's cost.
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                logits, outs, routes = self._forward(tb, valid, window_rows)
        kept = [logits[:, :t] if all_logits else logits[:, t - 1:t]]
        kept += [outs[i][:, :t] for i in taps]
        if routing is not None:
            kept += [ids[:t] for ids in routes]
        if self.cuda_graphs:   # the graph's outputs: the next replay overwrites them
            kept = [x.clone() for x in kept]
        if routing is not None:
            routing.ids.extend(kept[1 + len(taps):])
        return kept[0], kept[1:1 + len(taps)]

    def _forward(self, tb: int, valid: torch.Tensor, window_rows: torch.Tensor):
        """The graphs of one forward: entry, the spans, head. -> (logits [1, tb, V],
        per-layer outputs (the last after the final norm), MoE ids per sparse layer)."""
        model, positions = self.model, self.positions[tb]
        rope = model.cfg.rope
        x, cos, sin, mask = self.entry(model.embed_tokens, self.ids[tb], positions,
                                       self.key_positions, rope.rotary_dim, rope.theta)
        record = tb > 1
        outs: list[torch.Tensor] = []
        routes: list[torch.Tensor] = []
        for span in self.spans:
            layer_outs, ids = self.span(span.layers, span.caches[record], x, cos, sin,
                                        positions, mask, valid, window_rows)
            outs += layer_outs
            routes += ids
            x = layer_outs[-1]
        normed, logits = self.head(model.norm, model.output_weight, x)
        outs[-1] = normed
        return logits, outs, routes

    @torch.inference_mode()
    def warm_up(self, progress: Callable[[str], None] | None = None) -> CompileReport:
        """Compile (or load from the on-disk cache) every bucket's graphs, running each once
        on the engine's state, which is left empty."""
        # process-wide: inductor reads the variable whenever it looks for a cached graph
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir)
        counters = torch._dynamo.utils.counters["stats"]
        before = counters["unique_graphs"]
        t0 = time.perf_counter()
        kv = self.state.kv
        for i, tb in enumerate(self.buckets):
            t1 = time.perf_counter()
            self.state.reset()
            kv.calibrated = [True] * len(kv.calibrated)   # scales of 1 for the warm-up run
            self.state.begin(tb, tb > 1)
            valid, window_rows = self.padding[(tb, tb)]
            if self.cuda_graphs:
                self.graphs[tb] = _Captured(self, tb)
            else:
                self._forward(tb, valid, window_rows)
            if progress is not None:
                progress(f"compiled the {tb}-row forward ({i + 1}/{len(self.buckets)}, "
                         f"{time.perf_counter() - t1:.1f} s)")
        self.state.reset()
        self.report = CompileReport(
            "inductor + CUDA graphs" if self.cuda_graphs else "inductor", self.buckets,
            len(self.spans), counters["unique_graphs"] - before, time.perf_counter() - t0,
            str(self.cache_dir))
        log.info("%s", self.report)
        return self.report


class _Captured:
    """One bucket's forward as a CUDA graph: compiled, run once to warm up, captured, and
    replayed with its inputs copied into the static buffers it was captured with."""

    def __init__(self, fwd: StaticForward, tb: int):
        self.fwd, self.tb = fwd, tb
        self.valid, self.window_rows = (x.clone() for x in fwd.padding[(tb, tb)])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fwd._forward(tb, self.valid, self.window_rows)        # compile and autotune
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fwd._forward(tb, self.valid, self.window_rows)

    def replay(self, valid: torch.Tensor, window_rows: torch.Tensor):
        self.valid.copy_(valid)
        self.window_rows.copy_(window_rows)
        self.graph.replay()
        return self.outputs
