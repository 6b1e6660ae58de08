"""What every compiled static-shape model shares (compiled.py's target, compiled_drafts.py's
MTP head and DFlash drafter): the row and batch buckets, compiling a graph function with
the options a CPU or CUDA wants, the on-disk cache, warm-up (its report: warm_up_report.py)
and the buckets compiled after it, padding and positions per (batch bucket, row bucket)
key, the state views a layer's graph takes, and one CUDA graph captured per key
(captured.py). compiled.py's docstring says why the forwards are compiled
and how their static shapes are kept.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from ...config import cache_home
from ...progress import ProgressLine
from ...state.cache import InferenceState
from ..qwen.moe import RoutingRecord
from .captured import CapturedGraph, run_graph
from .direct import DirectGraph, check_direct
from .graph_store import GraphStore
from .warm_up_report import CompileReport, quiet_inductor, warm_up_report

log = logging.getLogger(__name__)


def row_buckets(max_block: int) -> tuple[int, ...]:
    """Block sizes the forwards are compiled for: 1 (plain decode), the powers of two below
    max_block, and max_block (the largest verify block)."""
    out, size = [1], 2
    while size < max_block:
        out.append(size)
        size *= 2
    return tuple(out + ([max_block] if max_block > 1 else []))


SMALLEST_KEY_BUCKET = 256
TIMED_RUNS = 3        # each key's forward timed at warm-up, the fastest kept (`best_rows`)


def key_buckets(capacity: int) -> tuple[int, ...]:
    """How many cache rows a CUDA graph's attention reads (`cache_attention`, read when the
    graph is captured): powers of two from SMALLEST_KEY_BUCKET, and the capacity. A forward
    replays the smallest that holds its rows; on a CPU the op reads the exact number."""
    out, size = [], SMALLEST_KEY_BUCKET
    while size < capacity:
        out.append(size)
        size *= 2
    return tuple(out + [capacity])



# A cache directory the user chose for torch before we ran (inductor sets the variable itself
# to a temporary directory the first time it compiles, so it is read at import).
_USER_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def compile_cache_dir(configured: str | None = None) -> Path:
    """Where compiled graphs persist across starts: the configured directory, else
    $TORCHINDUCTOR_CACHE_DIR as the user set it, else torch_compile under `cache_home()`."""
    if configured or _USER_CACHE:
        return Path(configured or _USER_CACHE).expanduser()
    return cache_home() / "torch_compile"



def compile_graph(fn, cuda_graphs: bool, rows: int = 1, cache_dir: Path | None = None,
                  name: str = "") -> DirectGraph:
    """One graph function compiled ahead of time, static shapes, no graph break allowed,
    each of its graphs read from (or written to) the store under `cache_dir`; rows: the most
    rows a GEMM of it multiplies. On a CPU its sites may be called directly (direct.py); on
    CUDA the captured graph is replayed instead."""
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
    store = GraphStore(cache_dir) if cache_dir is not None else None
    return DirectGraph(fn, options, not cuda_graphs, store, name or fn.__name__)


def _decompose_small_gemms(rows: int) -> None:
    """On a CPU, let inductor write a GEMM of a block's few rows (and weights of at most
    2048 columns) as a loop it fuses with its neighbours, instead of a BLAS call that costs
    microseconds of dispatch for nanoseconds of work (8 per layer; -10 to -25% per forward at
    the bench's widths). Inductor does this for one row; its limit is a module setting."""
    from torch._inductor.fx_passes import decompose_mem_bound_mm as small_gemms

    small_gemms.cpu_max_first_dimension_decomposition = max(
        small_gemms.cpu_max_first_dimension_decomposition, rows)



def layer_cache(state: InferenceState, layer: int, record: bool) -> tuple[torch.Tensor, ...]:
    """A layer's views of the state, as `mix_static` takes them: GDN (state, conv window,
    then the kept rows when recording), attention (k, v, then FP8 scales)."""
    kv, gdn = state.kv, state.gdn
    if layer in gdn.slot:
        s = gdn.slot[layer]
        return (gdn.state[s], gdn.conv[s], *(gdn.kept(s) if record else ()))
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
    records = False           # whether blocks of several rows keep their GDN rows (verify)

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
        # how many cache rows the next forward's attention reads: the block's last position
        # + 1 (on CUDA, the key bucket its graph was captured with); a host tensor, read by
        # `cache_attention` when it runs
        self.key_rows = torch.zeros(1, dtype=torch.long)
        self.key_buckets = key_buckets(state.capacity) if self.cuda_graphs else ()
        self.positions = {key: torch.zeros(key, dtype=torch.long, device=device)
                          for key in self.keys}
        self._starts = {bb: torch.zeros(bb, 1, dtype=torch.long, device=device)
                        for bb in self.batches}
        self._padding: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[tuple[int, int, int], CapturedGraph] = {}   # + key bucket
        self.report: CompileReport | None = None
        self.ready: set[tuple[int, int]] = set()   # keys whose graphs are compiled
        self.later: tuple[tuple[int, int], ...] = ()   # keys warm-up left to compile_later
        self.calls = 0                      # forwards run compiled since warm-up
        # seconds of each key's forward, measured at warm-up (`best_rows` reads them)
        self.seconds: dict[tuple[int, int], float] = {}
        self.compiled: list[DirectGraph] = []
        self._uncalled: set[tuple[int, int]] = set()   # deferred keys not yet called
        self.direct = False                 # calls skip the graphs' entries (warm-up checks)

    def _compile(self, fn) -> DirectGraph:
        graph = compile_graph(fn, self.cuda_graphs, self.buckets[-1], self.cache_dir,
                              f"{self.part} {fn.__name__}")
        self.compiled.append(graph)
        return graph

    def bucket(self, rows: int) -> int | None:
        return self._bucket_of.get(rows)

    def batch_bucket(self, batch: int) -> int | None:
        """The smallest batch bucket of at least `batch` rows (None: more than the largest)."""
        return self._batch_of.get(batch)

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
        if tb is None or (self._batch_of.get(batch), tb) not in self.ready:
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
            self.key_rows[0] = start + tb
        else:                          # slots 0..m-1 of a batch, each at its own length
            m = len(start)
            bb = self._batch_of[m]
            starts = self._starts[bb]
            starts.zero_()
            starts[:m, 0].copy_(torch.tensor(start))
            torch.add(starts, self.key_positions[:tb], out=self.positions[bb, tb])
            self.key_rows[0] = max(start) + tb
        return (bb, tb), *self.padding(bb, tb, m, rows)

    def key_bucket(self, rows: int) -> int:
        """The smallest key bucket of at least `rows` cache rows (CUDA graphs)."""
        return next(b for b in self.key_buckets if b >= rows)

    def _run(self, key: tuple[int, int], valid: torch.Tensor, window_rows: torch.Tensor):
        if key not in self.seconds:        # compiled after warm-up: timed on real calls
            return self._timed_call(key, valid, window_rows)
        return self._call(partial(self._forward, key), self.graphs, key,
                          int(self.key_rows[0]), valid, window_rows)

    def _timed_call(self, key: tuple[int, int], valid: torch.Tensor,
                    window_rows: torch.Tensor):
        """A deferred key's forward, timed: its second call gives `best_rows` its cost (the
        first includes learning its call sites)."""
        t0 = time.perf_counter()
        out = self._call(partial(self._forward, key), self.graphs, key,
                         int(self.key_rows[0]), valid, window_rows)
        if key in self._uncalled:
            self._uncalled.discard(key)
        else:
            self.seconds[key] = time.perf_counter() - t0
        return out

    def _call(self, forward: Callable[..., object], graphs: dict, key: tuple[int, ...],
              rows: int, valid: torch.Tensor, window_rows: torch.Tensor):
        """One compiled forward of `key` reading `rows` cache rows: called directly, the
        CUDA graph captured for its key bucket (`graphs`, by key and key bucket) replayed,
        or through the graph's own entry."""
        if self.direct:
            return forward(valid, window_rows)
        captured = graphs[(*key, self.key_bucket(rows))] if graphs else None
        return run_graph(captured, forward, valid, window_rows)

    def _forward(self, key: tuple[int, int], valid: torch.Tensor, window_rows: torch.Tensor):
        raise NotImplementedError

    def _hand_out(self, key: tuple[int, int], m: int, t: int, logits: torch.Tensor,
                  finite: torch.Tensor, tapped: list[torch.Tensor], routes: list[torch.Tensor],
                  routing: RoutingRecord | None):
        """A target forward's results, its real rows already taken: (logits, taps, finite),
        the real rows' expert ids into `routing`; on CUDA copies (the graph's outputs: the
        next replay overwrites them)."""
        kept = [logits, finite, *tapped]
        if routing is not None:
            kept += [ids.view(*key, -1)[:m, :t].reshape(m * t, -1) for ids in routes]
        if self.cuda_graphs:
            kept = [x.clone() for x in kept]
        n = 2 + len(tapped)
        if routing is not None:
            routing.ids.extend(kept[n:])
        return kept[0], kept[2:n], kept[1]

    def _warm_state(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The state emptied and opened for a full bucket at position 0 of every row (FP8
        scales of 1), as warm-up runs it -> (valid, window_rows)."""
        bb, tb = key
        kv = self.state.kv
        self.state.reset()
        kv.calibrated = [True] * len(kv.calibrated)
        self.state.begin(tb, self.records and tb > 1)
        self.positions[key].copy_(self.key_positions[:tb].expand(bb, tb))
        self.key_rows[0] = tb
        return self.padding(bb, tb, bb, tb)

    def warm_up(self, progress: Callable[[str], None] | None = None,
                first_rows: Sequence[int] | None = None) -> CompileReport:
        """Compile (or read from the on-disk cache) the buckets' graphs, running each once
        on the state, which is left empty. With `first_rows` (the blocks the first requests
        verify: 1 for plain decoding, each loaded proposer's block) on a CPU, only their
        buckets of one sequence now (a first request runs alone; batches of several come
        later, if at all): the others (`later`) are compiled afterwards without running
        (`compile_later`), their forwards eager until each is ready (`fits`)."""
        every = self._extra_keys()
        keys, extra = self.keys, every
        if first_rows is not None and not self.cuda_graphs:
            wanted = {self.bucket(min(r, self.buckets[-1])) for r in first_rows}
            keys = tuple(k for k in self.keys if k[0] == self.batches[0] and k[1] in wanted)
            extra = tuple(k for k in every if k[1] == self.batches[0])
        later = tuple(k for k in self.keys + every if k not in keys + extra)

        def every_bucket() -> None:
            if progress is not None:
                deferred = f", {len(later)} more in the background" if later else ""
                buckets = "bucket" if len(keys) == 1 else "buckets"
                progress(ProgressLine(f"compiling the {self.part}'s forwards: {len(keys)} "
                                      f"{buckets}{deferred}, or reading them from "
                                      f"{self.cache_dir}", "compiling", 0, len(keys)))
            for i, key in enumerate(keys):
                t1 = time.perf_counter()
                if self.cuda_graphs:     # one graph per key bucket, all of one compiled code
                    for kb in self.key_buckets:
                        valid, window_rows = self._warm_state(key)
                        self.key_rows[0] = kb
                        self.graphs[(*key, kb)] = CapturedGraph(partial(self._forward, key),
                                                                valid, window_rows)
                elif self.compiled[0].direct:
                    self._check_direct(key, self._forward(key, *self._warm_state(key)))
                else:
                    self._forward(key, *self._warm_state(key))
                self.seconds[key] = self._timed(key)
                self.ready.add(key)
                if progress is not None:
                    progress(ProgressLine(
                        f"compiled the {self.part}'s {self.what(key)} ({i + 1}/{len(keys)}, "
                        f"{time.perf_counter() - t1:.1f} s)", "compiling", i + 1, len(keys)))
            self._warm_extra(progress, extra)
            self.state.reset()

        self.report = replace(warm_up_report(every_bucket, self.compiled, self.part,
                                             self.cuda_graphs,
                                             self.buckets, self.spans, self.cache_dir,
                                             self.batches), captured=len(self.graphs),
                              deferred=len(later))
        self.direct = all(graph.direct for graph in self.compiled)
        self.later = later
        return self.report

    def what(self, key: tuple) -> str:
        """What a key's graph computes, for progress lines: e.g. "2 x 16-row forward"."""
        bb, tb = key
        return f"{tb}-row forward" if bb == 1 else f"{bb} x {tb}-row forward"

    def compiled_all(self) -> bool:
        """Whether every graph of this part is compiled (none deferred or failed)."""
        return set(self.keys + self._extra_keys()) <= self.ready

    def compile_later(self) -> None:
        """The keys warm-up deferred, compiled (or read) one after another without running
        (the engine's background thread, `compile_in_background`); each serves from its
        next forward on. A key that fails stays eager, with a warning."""
        for key in compile_in_turn(self.part, self.later, self._prepare, self.what):
            if key in self.keys:           # a forward: timed on its first calls
                self._uncalled.add(key)
            self.ready.add(key)
        self.later = ()

    def _prepare(self, key: tuple) -> None:
        """Compile (or read) the graphs of `key` without running them: the state is
        serving meanwhile. Subclasses that defer keys define it."""
        raise NotImplementedError

    def _extra_keys(self) -> tuple[tuple[str, int], ...]:
        """Keys (name, batch bucket) of a subclass's graphs besides one forward per key."""
        return ()

    def _warm_extra(self, progress: Callable[[str], None] | None,
                    keys: tuple[tuple[str, int], ...]) -> None:
        """Those of `_extra_keys` the warm-up compiles, warmed up here (and `ready`)."""

    def _timed(self, key: tuple[int, int]) -> float:
        """The fastest of TIMED_RUNS compiled forwards of `key` from the empty state."""
        best = float("inf")
        for _ in range(TIMED_RUNS):
            valid, window_rows = self._warm_state(key)
            if self.cuda_graphs:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            self._run(key, valid, window_rows)
            if self.cuda_graphs:
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - t0)
        return best

    def best_rows(self, lengths: Sequence[int], overhead: float = 0.0) -> int:
        """The rows a batch of blocks of these lengths (one per slot) verifies best at: the
        row bucket whose cycle (its forward, timed at warm-up, and `overhead` seconds of
        the cycle's other work: drafting, accepting) verifies the most of their rows a
        second, each block cut to it. A compiled forward pads every block to the longest:
        one block of 16 rows beside seven of 1 costs 128 rows for 23, where 8 rows of 1
        verify 8 at a fraction of the cost and the long block goes on next cycle (its
        rows are the grammar's forced tokens or drafts: cutting them is lossless). The
        drafts are paid for before the cut, so the more a cycle costs besides its
        forward, the less a shorter forward saves."""
        bb = self._batch_of[len(lengths)]
        longest = self.bucket(max(lengths))
        best, rate = longest, 0.0
        for tb in self.buckets:
            if tb > longest:
                break
            if (bb, tb) not in self.seconds:     # not compiled yet, or not yet timed
                continue
            r = sum(min(n, tb) for n in lengths) / (overhead + self.seconds[(bb, tb)])
            if r >= rate:
                best, rate = tb, r
        return best

    def _check_direct(self, key: tuple[int, int], first: object) -> None:
        """The bucket's forward again from the same empty state, now by direct calls: it
        must give what the first calls through the graphs' entries gave (outputs, recurrent
        state), bit for bit."""
        gdn = self.state.gdn

        def again() -> object:
            return self._forward(key, *self._warm_state(key)), gdn.state, gdn.conv

        check_direct(self.compiled, self.part, (first, gdn.state, gdn.conv), again)


def compile_in_turn(part: str, keys: Sequence[Hashable], prepare: Callable[[Hashable], None],
                    what: Callable[[Hashable], str]) -> Iterator[Hashable]:
    """`prepare` each of a part's deferred keys in turn (a background thread) -> the keys
    that compiled; one that fails stays eager, with a warning saying why."""
    with torch.inference_mode(), quiet_inductor():
        for i, key in enumerate(keys):
            t0 = time.perf_counter()
            try:
                prepare(key)
            except Exception as exc:     # the key's forwards stay eager, and say why
                log.warning("the %s's %s stays eager: compiling it failed (%s: %s)", part,
                            what(key), type(exc).__name__, exc)
                continue
            log.info("compiled the %s's %s in the background (%d/%d, %.1f s)", part,
                     what(key), i + 1, len(keys), time.perf_counter() - t0)
            yield key


def batch_rows(views: tuple[torch.Tensor, ...], bb: int, batch: int
               ) -> tuple[torch.Tensor, ...]:
    """The first bb of a state's `batch` rows of a layer's state views (the views
    themselves when that is all of them: a one-sequence state's FP8 scales have no batch
    dimension)."""
    return views if bb == batch else tuple(x[:bb] for x in views)
