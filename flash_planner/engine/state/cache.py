"""Inference state the models read and write: KV cache, GDN state, a verify's kept rows.

Everything is preallocated for `capacity` tokens (max_context plus one speculative block) and
owned by the engine; a forward receives the `InferenceState` explicitly. A forward over S
tokens writes KV rows at positions `length .. length+S-1`; a plain one advances the GDN state
to the last row. A recording forward (a speculative verify) leaves the GDN state where it was
and keeps each row's normalised k, delta and log decay; `commit(n)` then keeps the first n
rows: the KV length moves forward by n (rows past it are overwritten by the next forward),
and the GDN state advances by those n rows from what the verify kept (kernels/gdn_commit: one
state written per request, whatever was rejected, and no second forward).

Layouts ([B, T, H, D] convention): KV per layer [B, C, Hkv, D]; GDN state [Lg, B, Hv, Dk, Dv]
float32; conv window [Lg, B, K-1, conv_dim]; kept rows: k [Lg, B, S, Hk, Dk], delta
[Lg, B, S, Hv, Dv], g [Lg, B, S, Hv], float32; conv rows [Lg, B, K-1+S, conv_dim] (window
before the block, then the block's pre-conv rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...kernels import dispatch
from ...kernels.kv_append.reference import FP8_MAX
from ..config import ModelConfig
from .flash_state import FlashState
from .kv_scales import KVScales


class ContextOverflowError(ValueError):
    """A request that does not fit the preallocated context."""


@dataclass(frozen=True)
class StateBytes:
    kv: int
    gdn_state: int
    checkpoints: int

    @property
    def total(self) -> int:
        return self.kv + self.gdn_state + self.checkpoints


@dataclass(frozen=True)
class StateCopy:
    """The committed rows of an `InferenceState`: KV rows with their FP8 scales and
    calibration flags, the GDN states and conv windows (what a prefix snapshot keeps)."""

    length: int
    k: torch.Tensor                    # [n_attn, B, length, Hkv, D] (uint8 for FP8)
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    calibrated: tuple[bool, ...]
    gdn_state: torch.Tensor
    gdn_conv: torch.Tensor
    rope_shift: int = 0
    flash: tuple | None = None         # a Flash-Next target's own state (flash_state.py)

    @property
    def nbytes(self) -> int:
        """What the copy holds, a Flash-Next target's windows, history and indexer keys
        included (the prefix cache's budget counts it)."""
        flash = 0 if self.flash is None else FlashState.saved_nbytes(self.flash)
        return flash + sum(t.nbytes for t in (self.k, self.v, self.k_scale, self.v_scale,
                                              self.gdn_state, self.gdn_conv))


class KVCache:
    """Full-attention KV rows for every attention layer, optionally FP8 with per-head scales.

    FP8 scales are per (layer, kv head), calibrated on the first write after `reset()` (the
    prompt's first prefill chunk) as amax * headroom / 448; later values beyond the range
    saturate at +-448 * scale. With `scale_per_row` each batch row (a slot of batched
    requests, `slots.py`) has its own: [layers, B, Hkv], calibrated on its own prompt. A
    layer whose scales the checkpoint stores (`scales`, kv_scales.py) holds those in every
    row and is `fixed`: calibrated from the start, through every `reset()`.
    """

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype,
                 compute_dtype: torch.dtype, device: torch.device, fp8_headroom: float = 2.0,
                 scale_per_row: bool = False, scales: KVScales | None = None):
        n = len(cfg.full_attention_layers)
        shape = (n, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.is_fp8 = dtype == torch.uint8
        per = (n, batch, cfg.num_kv_heads) if scale_per_row else (n, cfg.num_kv_heads)
        self.k_scale = torch.ones(per, dtype=torch.float32, device=device)
        self.v_scale = torch.ones(per, dtype=torch.float32, device=device)
        self.compute_dtype = compute_dtype
        self.capacity = capacity
        self.fp8_headroom = fp8_headroom
        # model layer index -> slot in the stacked cache
        self.slot = {layer: i for i, layer in enumerate(cfg.full_attention_layers)}
        fixed = [False] * n         # slots whose scales are the checkpoint's, never calibrated
        for layer in (scales.layers if scales is not None and self.is_fp8 else ()):
            s = self.slot[layer]
            self.k_scale[s] = scales.k[layer].to(device)      # [Hkv], into every row
            self.v_scale[s] = scales.v[layer].to(device)
            fixed[s] = True
        self.fixed = tuple(fixed)
        self.calibrated = list(self.fixed)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    def rows(self, lo: int, hi: int, calibrated: list[bool]) -> KVCache:
        """Batch rows lo..hi-1 as a cache of their own, sharing this one's storage. A cache
        with a scale per row hands a single row its scales as [layers, Hkv], so a slot is
        an ordinary one-sequence cache."""
        view = object.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.k, view.v = self.k[:, lo:hi], self.v[:, lo:hi]
        if self.k_scale.dim() == 3:
            pick = lo if hi - lo == 1 else slice(lo, hi)
            view.k_scale, view.v_scale = self.k_scale[:, pick], self.v_scale[:, pick]
        view.calibrated = calibrated
        return view

    def reset(self) -> None:
        self.calibrated = list(self.fixed)

    def clear(self) -> None:
        """Zero every row. A batched forward reads each slot past its own length under a
        mask, where a weight of 0 times a NaN row is NaN: the rows of a request that ended
        on non-finite values are cleared before the slot serves another."""
        self.k.zero_()
        self.v.zero_()

    def _calibrate(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k_scale.dim() == 3:
            raise RuntimeError("a batch of slots is calibrated slot by slot, on each prompt")
        for scale, rows in ((self.k_scale, k), (self.v_scale, v)):
            amax = rows.float().abs().amax(dim=(0, 1, 3))             # [Hkv]
            scale[slot] = (amax * self.fp8_headroom / FP8_MAX).clamp_min(1e-8)
        self.calibrated[slot] = True

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> None:
        """Write k, v [B, T, Hkv, D] at positions [B, T]."""
        slot = self.slot[layer]
        if self.is_fp8 and not self.calibrated[slot]:
            self._calibrate(slot, k, v)
        dispatch.kv_append(self.k[slot], k, positions,
                           self.k_scale[slot] if self.is_fp8 else None)
        dispatch.kv_append(self.v[slot], v, positions,
                           self.v_scale[slot] if self.is_fp8 else None)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0 .. length-1, [B, length, Hkv, D], compute dtype."""
        slot = self.slot[layer]
        ks = self.k_scale[slot] if self.is_fp8 else None
        vs = self.v_scale[slot] if self.is_fp8 else None
        return (dispatch.kv_read(self.k[slot], length, ks, self.compute_dtype),
                dispatch.kv_read(self.v[slot], length, vs, self.compute_dtype))


class GDNState:
    """Recurrent state and conv window of every Gated DeltaNet layer, plus a verify's kept
    rows (what `commit` replays)."""

    def __init__(self, cfg: ModelConfig, batch: int, max_steps: int, device: torch.device):
        n = len(cfg.linear_attention_layers)
        hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                          cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        k1 = max(cfg.linear_conv_kernel - 1, 0)
        c = cfg.gdn_conv_dim
        f32 = torch.float32
        self.state = torch.zeros(n, batch, hv, dk, dv, dtype=f32, device=device)
        self.conv = torch.zeros(n, batch, k1, c, dtype=f32, device=device)
        self.k_rows = torch.zeros(n, batch, max_steps, hk, dk, dtype=f32, device=device)
        self.delta_rows = torch.zeros(n, batch, max_steps, hv, dv, dtype=f32, device=device)
        self.g_rows = torch.zeros(n, batch, max_steps, hv, dtype=f32, device=device)
        self.conv_rows = torch.zeros(n, batch, k1 + max_steps, c, dtype=f32, device=device)
        self.max_steps = max_steps
        self.slot = {layer: i for i, layer in enumerate(cfg.linear_attention_layers)}

    BUFFERS = ("state", "conv", "k_rows", "delta_rows", "g_rows", "conv_rows")

    @property
    def nbytes_state(self) -> int:
        return self.state.nbytes + self.conv.nbytes

    @property
    def nbytes_checkpoints(self) -> int:
        return sum(t.nbytes for t in self.kept(None))

    def kept(self, slot: int | None) -> tuple[torch.Tensor, ...]:
        """The kept-row buffers (k, delta, g, conv rows): every layer's, or one layer's."""
        bufs = (self.k_rows, self.delta_rows, self.g_rows, self.conv_rows)
        return bufs if slot is None else tuple(b[slot] for b in bufs)

    def rows(self, lo: int, hi: int) -> GDNState:
        """Batch rows lo..hi-1 as a state of their own, sharing this one's storage."""
        view = object.__new__(GDNState)
        view.__dict__.update(self.__dict__)
        for name in self.BUFFERS:
            setattr(view, name, getattr(self, name)[:, lo:hi])
        return view

    def reset(self) -> None:
        self.state.zero_()
        self.conv.zero_()

    def commit(self, count: torch.Tensor) -> None:
        """Advance every row by its first count[row] kept rows (kernels/gdn_commit). The
        kernel takes contiguous tensors: a slot's rows of a batched state (a strided view)
        go layer by layer, where each layer's rows are contiguous."""
        tensors = (self.state, self.k_rows, self.delta_rows, self.g_rows, self.conv,
                   self.conv_rows)
        if not self.state.shape[0]:          # no GDN layer (an attention-only target)
            return
        if all(t.is_contiguous() for t in tensors):
            dispatch.gdn_commit(*tensors, count)
            return
        for layer in range(self.state.shape[0]):
            dispatch.gdn_commit(*(t[layer:layer + 1] for t in tensors), count)


class InferenceState:
    """All per-sequence state of one target model; `length` tokens are committed."""

    def __init__(self, cfg: ModelConfig, capacity: int, max_steps: int, kv_dtype: torch.dtype,
                 compute_dtype: torch.dtype, device: torch.device, batch: int = 1,
                 scale_per_row: bool = False, kv_scales: KVScales | None = None):
        self.capacity = capacity
        self.max_steps = max_steps
        self.device = device
        self.kv = KVCache(cfg, batch, capacity, kv_dtype, compute_dtype, device,
                          scale_per_row=scale_per_row, scales=kv_scales)
        self.gdn = GDNState(cfg, batch, max_steps, device)
        # Flash-Next (qwen4_exp): PLE windows, n-gram history, indexer keys
        self.flash = (FlashState(cfg, batch, capacity, compute_dtype, device)
                      if cfg.flash_next is not None else None)
        self.length = 0
        self.pending = 0          # rows run by the last forward, not yet committed
        self.recorded = False     # whether that forward kept its GDN rows (a verify)
        # rotary position of the next row minus its cache row: an image's tokens take fewer
        # positions than rows (mRoPE), so the text after it is shifted back (<= 0)
        self.rope_shift = 0
        # a batch's slot: its kept count goes here, to commit every slot's GDN rows at once
        self.defer_commit: Callable[[int], None] | None = None

    def row(self, index: int) -> InferenceState:
        """Batch row `index` as a one-sequence state of its own (a slot of batched
        requests): its own length and pending rows, this state's storage."""
        view = object.__new__(InferenceState)
        view.__dict__.update(self.__dict__)
        view.kv = self.kv.rows(index, index + 1, list(self.kv.fixed))
        view.flash = None if self.flash is None else self.flash.rows(index, index + 1)
        view.gdn = self.gdn.rows(index, index + 1)
        view.length, view.pending, view.recorded, view.rope_shift = 0, 0, False, 0
        return view

    @property
    def nbytes(self) -> StateBytes:
        # Flash-Next's indexer keys count as KV, its PLE windows as recurrent state
        keys = sum(t.nbytes for t in self.flash.index_keys.values()) if self.flash else 0
        windows = self.flash.nbytes - keys if self.flash else 0
        return StateBytes(kv=self.kv.nbytes + keys, gdn_state=self.gdn.nbytes_state + windows,
                          checkpoints=self.gdn.nbytes_checkpoints)

    def reset(self) -> None:
        self.kv.reset()
        self.gdn.reset()
        if self.flash is not None:
            self.flash.reset()
        self.length = 0
        self.pending = 0
        self.recorded = False
        self.rope_shift = 0

    def begin(self, num_tokens: int, record_steps: bool) -> int:
        """Open a forward over num_tokens rows; returns their first position."""
        if self.pending:
            raise RuntimeError(f"{self.pending} rows of the previous forward are uncommitted")
        if self.length + num_tokens > self.capacity:
            raise ContextOverflowError(
                f"context full: {self.length} + {num_tokens} tokens exceed the preallocated "
                f"capacity of {self.capacity}")
        if record_steps and num_tokens > self.max_steps:
            raise ValueError(f"cannot record {num_tokens} steps; checkpoints hold "
                             f"{self.max_steps}")
        self.pending = num_tokens
        self.recorded = record_steps
        return self.length

    def save(self) -> StateCopy:
        """A copy of the committed rows (none may be pending)."""
        if self.pending:
            raise RuntimeError(f"{self.pending} rows of the last forward are uncommitted")
        kv, gdn, n = self.kv, self.gdn, self.length
        return StateCopy(n, kv.k[:, :, :n].clone(), kv.v[:, :, :n].clone(),
                         kv.k_scale.clone(), kv.v_scale.clone(), tuple(kv.calibrated),
                         gdn.state.clone(), gdn.conv.clone(), self.rope_shift,
                         None if self.flash is None else self.flash.save(n))

    def load(self, copy: StateCopy) -> None:
        """Hold exactly the rows of `copy`, as when it was saved; a copy, O(its bytes)."""
        self.reset()
        kv, gdn, n = self.kv, self.gdn, copy.length
        kv.k[:, :, :n].copy_(copy.k)
        kv.v[:, :, :n].copy_(copy.v)
        kv.k_scale.copy_(copy.k_scale)
        kv.v_scale.copy_(copy.v_scale)
        kv.calibrated = list(copy.calibrated)
        gdn.state.copy_(copy.gdn_state)
        gdn.conv.copy_(copy.gdn_conv)
        if self.flash is not None:
            self.flash.load(copy.flash)
        self.length = n
        self.rope_shift = copy.rope_shift

    def truncate(self, length: int) -> None:
        """Forget committed rows from `length` on. Only an attention-only state (the MTP
        head's) can: its KV rows past the length are simply overwritten by the next forward,
        while a recurrent state has no record of where it was."""
        if self.gdn.state.shape[0]:
            raise RuntimeError("a state with recurrent (GDN) layers cannot be truncated")
        if self.pending or not 0 <= length <= self.length:
            raise ValueError(f"truncate({length}) with {self.length} committed and "
                             f"{self.pending} pending rows")
        self.length = length

    def keep(self, n: int) -> None:
        """Keep the first n (0: none) of the last forward's rows, without checkpoints: only
        an attention-only state can (its rows past the length are overwritten by the next
        forward), such as the MTP head's, whose batched forwards pad each request's rows."""
        if self.gdn.state.shape[0]:
            raise RuntimeError("a state with recurrent (GDN) layers commits with checkpoints")
        if not 0 <= n <= self.pending:
            raise ValueError(f"keep({n}) outside 0..{self.pending} pending rows")
        self.length += n
        self.pending = 0
        self.recorded = False

    def commit(self, n: int) -> None:
        """Keep the first n rows of the last forward; a recording forward's GDN state
        advances by those n rows."""
        if not 0 < n <= self.pending:
            raise ValueError(f"commit({n}) outside 1..{self.pending} pending rows")
        if n < self.pending and not self.recorded:
            raise RuntimeError("partial commit needs a forward with record_steps=True")
        if self.recorded and self.gdn.state.shape[0]:
            if self.defer_commit is not None:
                self.defer_commit(n)
            else:
                self.gdn.commit(torch.full((self.gdn.state.shape[1],), n, dtype=torch.int32,
                                           device=self.gdn.state.device))
        if self.flash is not None:
            self.flash.commit(n, self.pending)
        self.length += n
        self.pending = 0
        self.recorded = False
