"""Flash-Next's hashed n-gram ids and the memory-mapped table they index.

Ids (exact int64 arithmetic, as the checkpoint was trained): for each token, the tokens 1 and
2 before it in its segment (a segment restarts after the first EOS id; before its start, and
before the sequence, the EOS id stands in) are multiplied by per-layer odd multipliers
(splitmix64 of the seed and the layer's PLE index, kept below 2^63 / vocab so a product with a
token id fits) and xor-ed: the 2-gram from (t, t-1), the 3-gram from (t, t-1, t-2). Each
order has `heads_per_ngram` heads, each with its own prime-sized table (the primes after
`ngram_vocab_size_base`, consecutive over heads and PLE layers), stacked into one table at
per-head offsets.

The table is large (51 GB in FP8 for the published model, more than its other weights) and a
token reads 16 rows of it, so it is never loaded: `NGramTable` reads the rows a block needs
straight from the checkpoint's shards (`ngram_embedding.shard_{i}.weight`, rows in shard
order) in the safetensors files.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from ...weights.shard import read_header

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
LAYER_PRIME = 10007
# safetensors dtype -> (numpy storage dtype, torch dtype its bytes are)
STORED = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16),
          "BF16": (np.uint16, torch.bfloat16), "F8_E4M3": (np.uint8, torch.float8_e4m3fn)}


def splitmix64(value: int) -> int:
    value = (value + GAMMA) & MASK64
    value = ((value ^ (value >> 30)) * MIX1) & MASK64
    value = ((value ^ (value >> 27)) * MIX2) & MASK64
    return (value ^ (value >> 31)) & MASK64


def multipliers(vocab: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd multipliers of one PLE layer, one per position of the n-gram."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + LAYER_PRIME * ple_index
    return [2 * (splitmix64((base + GAMMA * (i + 1)) & MASK64) % half) + 1
            for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_sizes(base: int, heads: int, ple_index: int) -> list[int]:
    """The prime table sizes of one PLE layer's heads: the primes after base - 1, counted
    over the heads of every PLE layer before it."""
    sizes, n, skip = [], base - 1, ple_index * heads
    for i in range(skip + heads):
        n += 1
        while not _is_prime(n):
            n += 1
        if i >= skip:
            sizes.append(n)
    return sizes


class NGramHasher:
    """One PLE layer's n-gram ids of a block, given the tokens before it."""

    def __init__(self, vocab: int, ngram_size: int, heads_per_ngram: int, base: int,
                 ple_index: int, seed: int, eos: int):
        self.ngram_size, self.heads, self.eos = ngram_size, heads_per_ngram, eos
        self.mult = multipliers(vocab, ngram_size, ple_index, seed)
        sizes = head_sizes(base, (ngram_size - 1) * heads_per_ngram, ple_index)
        # on the CPU whatever device the model is built on (the loader builds it on meta)
        self.sizes = torch.tensor(sizes, dtype=torch.long, device="cpu")
        self.offsets = torch.tensor([0, *np.cumsum(sizes)[:-1].tolist()], dtype=torch.long,
                                    device="cpu")
        self.rows = int(sum(sizes))

    def __call__(self, history: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """history [B, n-1] (the raw ids before the block; EOS at a sequence's start) and
        ids [B, T] -> table rows [B, T, (n-1) * heads] (int64)."""
        tokens = torch.cat([history, ids], dim=1).long()
        b, length = tokens.shape
        pos = torch.arange(length, device=tokens.device)
        eos_at = torch.where(tokens == self.eos, pos, -1)
        last_eos = torch.cummax(eos_at, dim=1).values
        before = torch.cat([eos_at.new_full((b, 1), -1), last_eos[:, :-1]], dim=1)
        in_segment = pos - (before + 1)                      # the token's place in its segment
        shifted = []
        for s in range(self.ngram_size):
            src = tokens.gather(1, (pos - s).clamp_min(0).expand(b, -1))
            ok = (in_segment >= s) & (pos >= s)
            shifted.append(torch.where(ok, src, torch.full_like(src, self.eos)))
        out = []
        sizes, offsets = self.sizes.to(tokens.device), self.offsets.to(tokens.device)
        for order in range(2, self.ngram_size + 1):
            mixed = shifted[0] * self.mult[0]                # int64, wrapping as trained
            for s in range(1, order):
                mixed = torch.bitwise_xor(mixed, shifted[s] * self.mult[s])
            lo = (order - 2) * self.heads
            block = slice(lo, lo + self.heads)
            out.append(torch.remainder(mixed[..., None], sizes[block]) + offsets[block])
        return torch.cat(out, dim=-1)[:, -ids.shape[1]:]


class StoredTensor:
    """One tensor in a safetensors file, read by element ranges (pread), never loaded."""

    def __init__(self, path: Path, name: str, error: type[Exception]):
        start, header = read_header(path, error)  # checked: no read past the end
        entry = header.get(name)
        if entry is None or entry.get("dtype") not in STORED:
            raise error(f"{path}: {name} is missing or of a dtype the n-gram table cannot "
                        f"read ({None if entry is None else entry.get('dtype')}; "
                        f"known: {', '.join(STORED)})")
        self.path, self.name, self.stored = path, name, entry["dtype"]
        self.shape = tuple(entry["shape"])
        self.storage, self.dtype = STORED[self.stored]
        self.itemsize = np.dtype(self.storage).itemsize
        self.fd = os.open(path, os.O_RDONLY)
        self.offset = start + entry["data_offsets"][0]

    def read(self, at: int, count: int) -> bytes:
        """`count` elements from element `at` (row-major)."""
        return os.pread(self.fd, count * self.itemsize, self.offset + at * self.itemsize)

    def values(self, raw: bytes | bytearray) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(raw, dtype=self.storage).copy()).view(self.dtype)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


FP8_BLOCK = 128      # a `weight_scale_inv` table's block (rows and columns), as Qwen's FP8


class NGramTable:
    """The rows of one PLE layer's n-gram table, read from its shards as they are needed.

    Rows are read with pread, not through a memory map: a map's page faults bring in whole
    large folios of the page cache (megabytes around each row on this kernel: a 40-row
    gather grew the process by 21 MB), which count as the process's memory, while a read
    copies only the row. The page cache stays the kernel's to reclaim.

    An FP8 (e4m3) shard may carry a scale beside it, read the same way: `weight_scale` with
    one element (per tensor) or one per row ([rows] or [rows, 1]), or `weight_scale_inv` per
    128 x 128 block; without one its values are the embeddings as stored."""

    def __init__(self, shards: list[tuple[Path, str]], scales: list[tuple[Path, str] | None],
                 error: type[Exception]):
        """shards: (file, tensor name) in row order; scales: each shard's scale tensor."""
        self.shards = [StoredTensor(path, name, error) for path, name in shards]
        first = self.shards[0]
        for shard in self.shards:
            if shard.stored != first.stored or len(shard.shape) != 2:
                raise error(f"{shard.path}: {shard.name} differs from the table's other "
                            f"shards ({shard.stored} {list(shard.shape)})")
        shapes = sorted({shard.shape for shard in self.shards})
        if len(shapes) != 1:
            raise error(f"the n-gram table's shards must have one shape, got {shapes}")
        (self.per_shard, self.dim), = shapes
        self.rows = self.per_shard * len(self.shards)
        self.dtype = first.dtype
        self.row_bytes = self.dim * first.itemsize
        self.scales = [None if s is None else self._scale(StoredTensor(*s, error), error)
                       for s in scales]
        if any(s is not None for s in self.scales) and first.stored != "F8_E4M3":
            raise error(f"{first.path}: the n-gram table is {first.stored} with scales beside "
                        "it; scales are read for an F8_E4M3 table only")

    def _scale(self, scale: StoredTensor, error: type[Exception]
               ) -> tuple[str, StoredTensor | torch.Tensor]:
        """(kind, what): kind `tensor` (its value, read once), `row` or `block` (the tensor,
        read per gathered row), from the tensor's name and shape."""
        size = math.prod(scale.shape)
        blocks = (-(-self.per_shard // FP8_BLOCK), -(-self.dim // FP8_BLOCK))
        if scale.name.endswith("_inv") and scale.shape == blocks:
            return "block", scale
        if not scale.name.endswith("_inv") and size == 1:
            value = scale.values(scale.read(0, 1)).float()
            scale.close()
            return "tensor", value
        if not scale.name.endswith("_inv") and scale.shape in ((self.per_shard,),
                                                                (self.per_shard, 1)):
            return "row", scale
        raise error(f"{scale.path}: {scale.name} has shape {list(scale.shape)}; an n-gram "
                    f"shard of {self.per_shard} rows x {self.dim} takes weight_scale [], [1], "
                    f"[{self.per_shard}] or [{self.per_shard}, 1], or weight_scale_inv "
                    f"{list(blocks)} ({FP8_BLOCK} x {FP8_BLOCK} blocks)")

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (int64, any shape) -> [*shape, dim] on the CPU: in the stored dtype, or in
        float32 with its scales applied where the table has them."""
        flat = rows.reshape(-1).tolist()
        buf = bytearray(len(flat) * self.row_bytes)
        view = memoryview(buf)
        for i, row in enumerate(flat):
            at = i * self.row_bytes
            shard = self.shards[row // self.per_shard]
            view[at:at + self.row_bytes] = shard.read((row % self.per_shard) * self.dim,
                                                      self.dim)
        out = self.shards[0].values(buf).reshape(len(flat), self.dim)
        if any(s is not None for s in self.scales):
            out = out.float() * self._row_scales(flat)
        return out.reshape(*rows.shape, self.dim)

    def _row_scales(self, flat: list[int]) -> torch.Tensor:
        """[len(flat), dim] float32: each gathered row's scale per column (1 unscaled)."""
        out = torch.ones(len(flat), self.dim)
        cols = torch.arange(self.dim) // FP8_BLOCK
        for i, row in enumerate(flat):
            scale = self.scales[row // self.per_shard]
            if scale is None:
                continue
            kind, tensor = scale
            local = row % self.per_shard
            if kind == "tensor":
                value = tensor
            elif kind == "row":
                value = tensor.values(tensor.read(local, 1)).float()
            else:
                width = tensor.shape[1]
                # a multiplier despite its name, as in Qwen's FP8 Linears
                value = tensor.values(tensor.read(local // FP8_BLOCK * width, width)
                                      ).float()[cols]
            out[i] = value
        return out

    def __del__(self) -> None:
        for shard in getattr(self, "shards", ()):
            shard.close()
        for scale in getattr(self, "scales", ()):
            if scale is not None and isinstance(scale[1], StoredTensor):
                scale[1].close()
