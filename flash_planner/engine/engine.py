"""The engine: one loaded target model, its tokenizer and its preallocated inference state.

`EngineConfig` (config.py) says what to load and how much to preallocate; `Engine.load`
does all the heavy work up front (weights, KV cache, GDN state, a verify's kept rows) and
reports the bytes it holds. Requests that cannot fit are refused before prefill by `check_fits`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .checkpoint import Checkpoint, load_checkpoint
from .config import EngineConfig
from .inputs.vision_input import VisionInput, vision_input
from .loop.mtp_proposer import MTPProposer
from .loop.proposer import Proposer
from .loop.proposers import WHY_MISSING, ProposerBytes, build_proposers
from .loop.sampling import GREEDY, SamplingParams
from .methods import METHODS
from .models.graphs.compiled import CompileReport, StaticForward
from .models.graphs.compiled_drafts import StaticDrafter, StaticHead
from .models.graphs.compiled_flash_next import StaticFlashNext
from .models.graphs.static_graphs import StaticGraphs, row_buckets
from .state.cache import ContextOverflowError, InferenceState
from .state.kv_scales import kv_scales_label
from .state.prefix import PrefixCache
from .state.slots import SlotStates
from .state.traffic import TrafficModel
from .threads import Threads, apply_threads
from .trt.backends import make_dense
from .weights import tuning

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class MemoryReport:
    weights: int
    kv_cache: int
    gdn_state: int
    checkpoints: int
    weights_per_forward: int = 0   # what one target forward reads (decode is bound by it)
    vision: int = 0                # the vision tower, once loaded, and its cached embeddings

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.gdn_state + self.checkpoints + self.vision

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv_cache": self.kv_cache,
                "gdn_state": self.gdn_state, "checkpoints": self.checkpoints,
                "vision": self.vision, "total": self.total,
                "weights_per_forward": self.weights_per_forward}

    def __str__(self) -> str:
        mib = 1 << 20
        vision = f", vision {self.vision / mib:.1f} MiB" if self.vision else ""
        return (f"weights {self.weights / mib:.1f} MiB, KV {self.kv_cache / mib:.1f} MiB, "
                f"GDN state {self.gdn_state / mib:.1f} MiB, a verify's kept rows "
                f"{self.checkpoints / mib:.1f} MiB{vision}, total {self.total / mib:.1f} MiB; "
                f"one target forward reads {self.weights_per_forward / mib:.1f} MiB of weights")


def read_generation_defaults(path: Path) -> SamplingParams:
    """The sampling settings of `path`/generation_config.json (greedy when it is absent; a
    file we cannot use is logged and read as greedy, it never blocks loading)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return GREEDY
    try:
        return SamplingParams.from_generation_config(json.loads(file.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        log.warning("%s: ignored (%s); the model's default sampling is greedy", file, exc)
        return GREEDY


class Engine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, state: InferenceState,
                 device: torch.device, dtype: torch.dtype,
                 proposers: dict[str, Proposer] | None = None,
                 extra_bytes: ProposerBytes | None = None):
        self.config = config
        self.checkpoint = checkpoint
        self.model = checkpoint.model
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.state = state
        # bytes a cycle moves besides the weights, per request (traffic.py; telemetry)
        self.traffic = TrafficModel.of(state)
        self.device = device
        self.dtype = dtype
        # method -> proposer: dflash and/or mtp as loaded, auto (routing among them and
        # plain decoding) when the method is auto
        self.proposers = proposers or {}
        self.extra_bytes = extra_bytes or ProposerBytes(0, 0)
        self.compile_report: CompileReport | None = None   # None: every forward is eager
        # the compiled models and drafters (compile_in_background, wait_compiled)
        self.statics: list[StaticGraphs | StaticDrafter] = []
        self._later: threading.Thread | None = None    # compile_in_background, while it runs
        self._later_lock = threading.Lock()   # its start and its end, one at a time
        self.background_held = False       # compile_in_background waits for a release
        self._batch_slots: dict[int, SlotStates] = {}      # batch.py's, by max_batch
        self.threads: Threads | None = None   # set by `load`; None: as the process had it
        self.gemm = None     # set by `load`: the device's GemmContext (kernels/gemm/context.py)
        self.prefix_cache = (PrefixCache(config.prefix_cache_entries) if config.prefix_cache
                             else None)
        # the checkpoint's own sampling defaults (generation_config.json; `sampling: model`)
        self.generation_defaults = read_generation_defaults(Path(config.model_path))
        # a vision-language checkpoint's images (its tower loads on the first one)
        self.vision = vision_input(checkpoint.path, checkpoint.raw_config, dtype, device)

    @property
    def seed_tap_ids(self) -> tuple[int, ...]:
        """Every target layer a loaded proposer taps (what a prefix snapshot keeps)."""
        return tuple(sorted({t for p in self.proposers.values() for t in p.tap_ids}))

    @property
    def seed_rows(self) -> int:
        """The most prompt-tail rows a loaded proposer seeds from."""
        return max((p.seed_rows for p in self.proposers.values()), default=0)

    @property
    def proposer(self) -> Proposer | None:
        """The default proposer (config.method); None decodes plainly."""
        if self.config.method == "none" or not self.proposers:
            return None
        return self.proposers[self.config.method]

    def proposer_for(self, method: str | None,
                     proposers: dict[str, Proposer] | None = None) -> Proposer | None:
        """The proposer a request asks for: None = the default; 'none' = plain decoding.
        `proposers`: the set to take it from (a batch slot's forks of the engine's)."""
        if proposers is not None and method != "none":
            chosen = self.proposer_for(method)
            return None if chosen is None else proposers[chosen.name]
        if method is None:
            return self.proposer
        if method == "none":
            return None
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method == "auto" and not self.proposers:
            return None       # nothing to route to: plain decoding
        if method not in self.proposers:
            loaded = ", ".join(self.proposers) or "none (plain decoding only)"
            raise ValueError(f"method {method!r} is not loaded in this engine (loaded: "
                             f"{loaded}); {WHY_MISSING[method]}")
        return self.proposers[method]

    @classmethod
    def load(cls, config: EngineConfig, progress: Callable[[str], None] | None = None,
             hold_background: bool = False) -> Engine:
        """Load weights (and drafter), preallocate state, and set up the dense backend;
        `progress` receives one line per exported/built segment. `hold_background`: the
        buckets deferred to the background (`compile_lazy`) wait for
        `compile_in_background(release=True)`, so that the caller's own warm-up requests
        (the planner's) do not share the interpreter with them (0.5 s against 0.15 s for the
        demo's)."""
        device = config.resolve_device()
        dtype = config.resolve_dtype(device)
        threads = apply_threads(config.threads, device)
        checkpoint = load_checkpoint(Path(config.model_path), dtype=dtype, device=device,
                                     weights=config.weights)
        if checkpoint.config.flash_next is not None:
            config = flash_next_config(config)
        if config.dense_backend != "torch":
            checkpoint.model.set_dense(make_dense(
                checkpoint.model, config.dense_backend, config.segment_cache,
                # a batch's verify runs its real rows as one sequence (models/qwen/packing.py)
                max_tokens=max(config.prefill_chunk,
                               config.max_block * config.resolve_max_batch(device)),
                opt_tokens=config.max_block, progress=progress))
        state = InferenceState(checkpoint.config, capacity=config.max_context + config.max_block,
                               max_steps=config.max_block,
                               kv_dtype=config.resolve_kv_dtype(dtype), compute_dtype=dtype,
                               device=device, kv_scales=checkpoint.kv_scales)
        proposers, extra = build_proposers(config, checkpoint, state, dtype, device)
        engine = cls(config, checkpoint, state, device, dtype, proposers, extra)
        engine.threads = threads
        engine.background_held = hold_background
        engine.gemm = tuning.gemm_context(device)
        if tuning.wanted(device):     # before the graphs: they capture the chosen launches
            tuning.tune_linears([checkpoint.model, *proposers.values()], dtype, progress)
        tuning.route_vendors([checkpoint.model, *proposers.values()], dtype)
        if config.resolve_compile(device):
            engine.compile_report = compile_forwards(engine, progress)
            max_batch = config.resolve_max_batch(device)
            if max_batch > 1:         # the batch's forwards too: no request compiles
                engine.batch_slots(max_batch, progress)
            engine.compile_in_background()
        log.info("loaded %s on %s (%s, weights %s, %s, dense segments: %s, proposers: %s): %s",
                 config.model_path, device, dtype, engine.weights_label, engine.kv_scales_label,
                 checkpoint.model.dense.name, ", ".join(proposers) or "none", engine.memory)
        return engine

    @property
    def weights_label(self) -> str:
        """How the target's Linears are held, e.g. "fp8 block 128x128 (Qwen)" or "fp32"."""
        return ", ".join(sorted(self.checkpoint.quantized)) or str(self.dtype).split(".")[-1]

    @property
    def kv_scales_label(self) -> str:
        """Where the target's KV cache scales come from: "KV scales: from the checkpoint
        (16 layers)", "KV scales: calibrated on the first prompt", ..."""
        return kv_scales_label(self.checkpoint.kv_scales,
                               len(self.checkpoint.config.full_attention_layers),
                               self.state.kv.k.dtype)

    def batch_slots(self, max_batch: int, progress: Callable[[str], None] | None = None
                    ) -> SlotStates:
        """Slots for max_batch running requests and one for prefilling a newcomer
        (batch.py), emptied, with the MTP head's slots for their forks (`slots.heads`, where
        the head is loaded). Allocated when first asked for this size and kept; where this
        engine compiles, the forwards over them are compiled then (target, MTP head, the
        DFlash drafter's groups), and the models run their batched forwards through them."""
        slots = self._batch_slots.get(max_batch)
        mtp = self.proposers.get("mtp")
        mtp = mtp if isinstance(mtp, MTPProposer) else None
        dflash = self.proposers.get("dflash")
        if slots is None:
            st = self.state
            slots = SlotStates(self.model_config, max_batch + 1, st.capacity, st.max_steps,
                               st.kv.k.dtype, self.dtype, self.device,
                               kv_scales=self.checkpoint.kv_scales)
            slots.heads = None if mtp is None else mtp.head_slots(max_batch)
            if self.compile_report is not None:
                self._compile_slots(slots, max_batch, mtp, dflash, progress)
                self.compile_in_background()
            self._batch_slots[max_batch] = slots
        self.model.batch_static = slots.static
        if dflash is not None:
            dflash.drafter.batch_static = slots.drafts
        if mtp is not None:
            mtp.head.batch_static = slots.heads.static
            slots.heads.whole.reset()
            for view in slots.heads.views:
                view.reset()
        for view in slots.views:
            view.reset()
        return slots

    def _compile_slots(self, slots: SlotStates, max_batch: int, mtp: MTPProposer | None,
                       dflash: Proposer | None,
                       progress: Callable[[str], None] | None) -> None:
        """The batch's compiled forwards over `slots`, warmed up now: the target's per batch
        bucket, the MTP head's over head slots 0.. per batch bucket (its forks draft
        together, a lone one over one row: a CPU's head costs its rows), the DFlash
        drafter's per group of 2 or more requests."""
        config = self.config
        if self.model_config.flash_next is not None:
            return                   # a Flash-Next batch's forwards run eager
        slots.static = StaticForward(self.model, slots.whole, config.max_block,
                                     config.compile_cache, row_buckets(max_batch))
        report = slots.static.warm_up(progress, first_rows(self))
        self.statics.append(slots.static)
        if slots.heads is not None:
            slots.heads.static = StaticHead(mtp.head, slots.heads.whole, config.max_block,
                                            config.compile_cache, row_buckets(max_batch),
                                            *mtp.chain_parts())
            report = report.plus(slots.heads.static.warm_up(progress, first_rows(self)))
            self.statics.append(slots.heads.static)
        if dflash is not None:
            slots.drafts = StaticDrafter(dflash.drafter, dflash.embed, dflash.lm_head_weight,
                                         dflash.block_size, dflash.window.capacity,
                                         config.compile_cache, row_buckets(max_batch)[1:])
            report = report.plus(slots.drafts.warm_up(progress, config.compile_lazy))
            self.statics.append(slots.drafts)
        self.compile_report = self.compile_report.plus(report)

    def compile_in_background(self, release: bool = False) -> None:
        """Start compiling the buckets the warm-ups deferred (`EngineConfig.compile_lazy`):
        one thread, after every warm-up (two compiles at once are not safe), the parts in
        the order they were warmed up; not while held (`Engine.load(hold_background=True)`)
        unless this call `release`s it."""
        def run() -> None:
            while True:
                with self._later_lock:   # a part added now is seen, or starts a new thread
                    pending = [static for static in self.statics if static.later]
                    if not pending:
                        self._later = None
                        return
                pending[0].compile_later()

        with self._later_lock:
            if release:
                self.background_held = False
            if (self.background_held or self._later is not None
                    or not any(static.later for static in self.statics)):
                return
            self._later = threading.Thread(target=run, name="compile later", daemon=True)
            self._later.start()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait (bounded by `timeout`) for the buckets compiling in the background ->
        whether every bucket of every compiled part is compiled now."""
        thread = self._later
        if thread is not None:
            thread.join(timeout)
        return all(static.compiled_all() for static in self.statics)

    @property
    def memory(self) -> MemoryReport:
        held, extra = self.state.nbytes, self.extra_bytes
        slots = [s.nbytes for s in self._batch_slots.values()]
        slots += [s.heads.nbytes for s in self._batch_slots.values() if s.heads is not None]
        return MemoryReport(weights=self.checkpoint.weight_bytes + extra.weights,
                            kv_cache=held.kv + extra.kv + sum(s.kv for s in slots),
                            gdn_state=held.gdn_state + sum(s.gdn_state for s in slots),
                            checkpoints=held.checkpoints + sum(s.checkpoints for s in slots),
                            weights_per_forward=self.checkpoint.bytes_per_forward,
                            vision=self.vision.nbytes if self.vision is not None else 0)

    def require_vision(self) -> VisionInput:
        """The engine's images, or the error every front door gives a text-only model."""
        if self.model_config.flash_next is not None:
            raise ValueError(f"{self.config.model_path} is a Flash-Next target, whose images "
                             "this engine does not take yet (text only)")
        if self.vision is None:
            raise ValueError(f"{self.config.model_path} is a text-only model (no vision "
                             "tower): it cannot take images")
        return self.vision

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse, before any work, a request the preallocated context cannot hold."""
        if prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        needed = prompt_tokens + max_new_tokens
        if needed > self.config.max_context:
            raise ContextOverflowError(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = "
                f"{needed} exceeds max_context {self.config.max_context}")

    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        tok = self.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(tok.eos_token_id)
        return tuple(sorted(ids))


def flash_next_config(config: EngineConfig) -> EngineConfig:
    """A Flash-Next target runs its dense parts in torch (auto becomes that; another backend
    is refused naming the setting); its forwards compile as `compile` says."""
    if config.dense_backend not in ("torch", "auto"):
        raise ValueError(f"{config.model_path} is a Flash-Next (qwen4_exp) target, which runs "
                         "its dense parts in torch for now: dense_backend cannot be set")
    return replace(config, dense_backend="torch")


def first_rows(engine: Engine) -> tuple[int, ...] | None:
    """The verify blocks the first requests run, whose buckets the warm-up compiles before
    the others (`compile_lazy`; None: every bucket at warm-up): 1 (plain decoding), the
    DFlash drafter's block, the MTP head's chain plus its anchor. A block of other rows (a
    grammar's forced tokens, a short draft) runs eager until its bucket is ready."""
    if not engine.config.compile_lazy:
        return None
    rows = [1]
    if "dflash" in engine.proposers:
        rows.append(engine.proposers["dflash"].block_size)
    if "mtp" in engine.proposers:
        rows.append(engine.config.mtp_steps + 1)
    return tuple(rows)


def compile_forwards(engine: Engine, progress: Callable[[str], None] | None = None
                     ) -> CompileReport:
    """Compile the target's decode and verify forwards, the MTP head's and the DFlash
    drafter's (where loaded), warming every shape up now so that no request pays for it."""
    config = engine.config
    flash_next = engine.model_config.flash_next is not None
    kind = StaticFlashNext if flash_next else StaticForward
    static = kind(engine.model, engine.state, config.max_block, config.compile_cache)
    report = static.warm_up(progress, None if flash_next else first_rows(engine))
    engine.statics.append(static)
    engine.model.set_static(static)
    mtp = engine.proposers.get("mtp")
    if mtp is not None and not flash_next:       # Flash-Next's MTP module runs eager
        head = StaticHead(mtp.head, mtp.state, config.max_block, config.compile_cache,
                          (1,), *mtp.chain_parts())
        report = report.plus(head.warm_up(progress, first_rows(engine)))
        engine.statics.append(head)
        mtp.head.static = head
    dflash = engine.proposers.get("dflash")
    if dflash is not None:
        drafter = StaticDrafter(dflash.drafter, dflash.embed, dflash.lm_head_weight,
                                dflash.block_size, dflash.window.capacity,
                                config.compile_cache)
        report = report.plus(drafter.warm_up(progress))
        engine.statics.append(drafter)
        dflash.drafter.static = drafter
    return report
