"""A KV cache whose unused rows are NaN: a forward that reads them gives NaN logits, even
under a mask (a weight of 0 times NaN is NaN), so a test can tell which rows were read."""

from __future__ import annotations


def poison(kv, start: int = 0) -> None:
    """Rows start.. of a KV cache made NaN (an FP8 cache: e4m3's NaN code)."""
    for t in (kv.k, kv.v):
        t[..., start:, :, :].fill_(0x7F if kv.is_fp8 else float("nan"))
