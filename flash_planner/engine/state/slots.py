"""The inference state of several requests at once: slots of one preallocated state.

`SlotStates` allocates one `InferenceState` whose batch rows are slots (KV rows, GDN state
and conv window, a verify's kept rows, FP8 scales per row: the checkpoint's in every row where
it stores them, kv_scales.py). Each slot is also seen as an ordinary one-sequence state
(`InferenceState.row`): a request prefills, restores a prefix snapshot, commits and rolls
back through it exactly as it does alone, and nothing else of the batch is touched. The
slots of running requests are rows 0..m-1 (`move` closes the gap a finished request leaves),
so one forward over `rows(m)` verifies every running request's block: rows 0..m-1 of each
tensor, each row at its own length (`ForwardContext` reads one start per row from
`BatchRows.begin`).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .cache import InferenceState
from .kv_scales import KVScales


class BatchRows:
    """Slots 0..m-1 as the state of one batched forward: their storage, one start per row.
    Every slot's view is left with the block's rows pending, to commit as it accepts."""

    def __init__(self, whole: InferenceState, slots: list[InferenceState],
                 writing: list[InferenceState] | None = None):
        m = len(slots)
        self.whole = whole             # whose compiled forwards take these rows
        self.slots = slots
        self.capacity = whole.capacity
        self.max_steps = whole.max_steps
        self.device = whole.device
        # the slots whose rows count (the others pad: their rows are discarded)
        calibrated = [all(s.kv.calibrated[i] for s in (writing or slots))
                      for i in range(len(whole.kv.calibrated))]
        if whole.kv.is_fp8 and not all(calibrated):
            raise RuntimeError("every slot of a batched forward must have prefilled first "
                               "(its FP8 scales are calibrated on its own prompt)")
        self.kv = whole.kv.rows(0, m, calibrated)
        self.gdn = whole.gdn.rows(0, m)
        self.flash = None if whole.flash is None else whole.flash.rows(0, m)

    @property
    def rope_shift(self) -> list[int]:
        """Each slot's rotary shift (InferenceState.rope_shift), one per row."""
        return [s.rope_shift for s in self.slots]

    def begin(self, num_tokens: int, record_steps: bool) -> list[int]:
        """`InferenceState.begin` of every slot; their first positions, one per row."""
        return [s.begin(num_tokens, record_steps) for s in self.slots]

    def reset(self) -> None:
        """After a failed forward every slot's state is unreliable: all are emptied."""
        for s in self.slots:
            s.reset()


class SlotStates:
    """`batch` slots of `capacity` tokens each; `view(i)` is slot i's own state."""

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, max_steps: int,
                 kv_dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device,
                 kv_scales: KVScales | None = None):
        if batch < 1:
            raise ValueError(f"a batch holds at least one request, got {batch}")
        self.whole = InferenceState(cfg, capacity, max_steps, kv_dtype, compute_dtype, device,
                                    batch=batch, scale_per_row=True, kv_scales=kv_scales)
        self.views = [self.whole.row(i) for i in range(batch)]
        # the compiled forwards over these slots (compiled.py's, with batch buckets), if any
        self.static: object | None = None
        # a batch's (Engine.batch_slots): the MTP head's slots for its requests' forks, and
        # the DFlash drafter's compiled forwards for their drafts together
        self.heads: SlotStates | None = None
        self.drafts: object | None = None

    @classmethod
    def around(cls, state: InferenceState) -> SlotStates:
        """One slot that is `state` itself (a batch of one keeps the engine's own state, and
        with it the compiled forwards bound to that state)."""
        slots = object.__new__(cls)
        slots.whole, slots.views, slots.static = state, [state], None
        slots.heads = slots.drafts = None
        return slots

    @property
    def batch(self) -> int:
        return len(self.views)

    @property
    def nbytes(self):
        return self.whole.nbytes

    def view(self, index: int) -> InferenceState:
        return self.views[index]

    def rows(self, m: int, writing: list[int] | None = None) -> BatchRows:
        """Slots 0..m-1 as one batched forward's state; `writing`: the slots whose rows
        count, when the others only pad (attention-only states, which discard them)."""
        if not 1 <= m <= self.batch:
            raise ValueError(f"rows({m}) outside 1..{self.batch} slots")
        return BatchRows(self.whole, self.views[:m],
                         None if writing is None else [self.views[i] for i in writing])

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Slot src's committed rows into slot dst (then free): its KV rows and FP8 scales,
        GDN state and conv window, rotary shift. O(its bytes), once when a request leaves
        the batch."""
        a, b = self.views[src], self.views[dst]
        if a.pending:
            raise RuntimeError(f"slot {src} has {a.pending} uncommitted rows")
        n = a.length
        kv, gdn = self.whole.kv, self.whole.gdn
        for t in (kv.k, kv.v):
            t[:, dst, :n].copy_(t[:, src, :n])
        if kv.k_scale.dim() == 3:
            kv.k_scale[:, dst].copy_(kv.k_scale[:, src])
            kv.v_scale[:, dst].copy_(kv.v_scale[:, src])
        gdn.state[:, dst].copy_(gdn.state[:, src])
        gdn.conv[:, dst].copy_(gdn.conv[:, src])
        if self.whole.flash is not None:
            self.whole.flash.move(src, dst, n)
        b.length, b.pending, b.recorded, b.rope_shift = n, 0, False, a.rope_shift
        b.kv.calibrated[:] = a.kv.calibrated
        a.reset()
