"""The bytes a cycle moves besides the weights: KV rows, GDN state and kept rows, conv windows,
Flash-Next's windows and indexer keys. Counted from the state's own buffers (cache.py), so
they hold on the meta device and follow any change of layout.

Per request and cycle of T rows at a context of L committed tokens:
  kv          attention reads the L + T rows of every layer, writes T;
  gdn state   a plain forward reads the state and writes it; a verify (T > 1) reads it, and
              its commit reads it again and writes it once (kernels/gdn_commit);
  gdn rows    a verify writes its T kept rows (normalised k, delta, g); the commit reads the
              accepted ones (counted as `kept`, T when not given);
  conv        the window read and written; a verify also writes its [window, block] rows and
              the commit reads K-1 of them;
  flash       Flash-Next: the PLE windows read and written (a verify keeps [window, block]
              rows), the indexer's keys read over L + T rows and written for T.
A batch of B requests moves B times one request's bytes: each has its own state.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cache import InferenceState


@dataclass(frozen=True)
class StateTraffic:
    """(part, bytes read, bytes written) for one cycle."""

    parts: tuple[tuple[str, int, int], ...]

    @property
    def read(self) -> int:
        return sum(r for _, r, _ in self.parts)

    @property
    def written(self) -> int:
        return sum(w for _, _, w in self.parts)

    def part(self, name: str) -> tuple[int, int]:
        for part, read, written in self.parts:
            if part == name:
                return read, written
        raise KeyError(f"no state part {name!r} (parts: {[p for p, _, _ in self.parts]})")

    def times(self, batch: int) -> StateTraffic:
        return StateTraffic(tuple((p, r * batch, w * batch) for p, r, w in self.parts))

    def plus(self, other: StateTraffic) -> StateTraffic:
        """Part by part (both of one model: the same parts in the same order)."""
        return StateTraffic(tuple((p, r + r2, w + w2) for (p, r, w), (_, r2, w2)
                                  in zip(self.parts, other.parts)))

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {p: {"read": r, "written": w} for p, r, w in self.parts}


@dataclass(frozen=True)
class TrafficModel:
    """One request's bytes per unit of its state: what `cycle` multiplies."""

    kv_row: int            # one position's K and V over every attention layer
    gdn_state: int         # the recurrent state over every GDN layer
    gdn_row: int           # one kept row (k, delta, g) over every GDN layer
    conv_window: int       # the conv windows over every GDN layer
    conv_row: int          # one pre-conv row over every GDN layer
    flash_window: int = 0  # Flash-Next's PLE windows
    flash_row: int = 0     # one row of them
    key_row: int = 0       # one position's indexer keys over every attention layer

    @classmethod
    def of(cls, state: InferenceState) -> TrafficModel:
        """From the buffers of `state` (any device, the meta device included): one batch
        row's share of each."""
        kv, gdn, flash = state.kv, state.gdn, state.flash
        kv_row = 0
        if kv.k.numel():
            kv_row = kv.k[:, 0, 0].nbytes + kv.v[:, 0, 0].nbytes
        k_rows, delta_rows, g_rows, conv_rows = gdn.kept(None)
        gdn_row = sum(t[:, 0, 0].nbytes for t in (k_rows, delta_rows, g_rows)) if \
            gdn.state.shape[0] else 0
        conv_row = conv_rows[:, 0, 0].nbytes if gdn.state.shape[0] else 0
        fields = dict(kv_row=kv_row, gdn_state=gdn.state[:, 0].nbytes if gdn.state.shape[0]
                      else 0, gdn_row=gdn_row,
                      conv_window=gdn.conv[:, 0].nbytes if gdn.state.shape[0] else 0,
                      conv_row=conv_row)
        if flash is not None:
            windows = list(flash.ple_window.values())
            fields.update(flash_window=sum(w[0].nbytes for w in windows),
                          flash_row=sum(w[0, 0].nbytes for w in windows),
                          key_row=sum(k[0, 0].nbytes for k in flash.index_keys.values()))
        return cls(**fields)

    def cycle(self, rows: int, context: int, kept: int | None = None) -> StateTraffic:
        """One request's cycle of `rows` rows after `context` committed tokens (a verify
        when rows > 1; `kept`: rows it commits, rows when not given)."""
        return self.cycles(1, rows, context, rows if kept is None else kept, rows > 1)

    def cycles(self, n: int, rows: int, context: int, kept: int, verify: bool
               ) -> StateTraffic:
        """`n` cycles of one kind (verifies or plain steps) together, from the sums of their
        rows, contexts and kept rows: every part is affine in those, so a request's total
        needs its sums alone (telemetry adds four integers a cycle, not the parts)."""
        conv_k1 = self.conv_window // self.conv_row if self.conv_row else 0
        parts = [("kv", (context + rows) * self.kv_row, rows * self.kv_row)]
        if self.gdn_state:
            parts += [
                ("gdn state", (2 if verify else 1) * n * self.gdn_state, n * self.gdn_state),
                ("gdn rows", kept * self.gdn_row if verify else 0,
                 rows * self.gdn_row if verify else 0),
                ("conv", n * self.conv_window + (n * conv_k1 * self.conv_row if verify else 0),
                 n * self.conv_window
                 + ((n * conv_k1 + rows) * self.conv_row if verify else 0))]
        if self.flash_window or self.key_row:
            flash_k1 = self.flash_window // self.flash_row if self.flash_row else 0
            parts.append(("flash", n * self.flash_window + (context + rows) * self.key_row,
                          n * self.flash_window + rows * self.key_row
                          + ((n * flash_k1 + rows) * self.flash_row if verify else 0)))
        return StateTraffic(tuple(parts))
