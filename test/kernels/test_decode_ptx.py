"""The GPU decodes' inline PTX (kernels/gemm/tiles.py), executed here on every byte.

A GPU runs the PTX; the interpreter runs the integer path beside it. So that the two cannot
drift apart unseen on a machine without a GPU, this file executes the PTX text itself with
the five instructions it uses (prmt, shl, shr, and, lop3, as the PTX ISA defines them) and
checks the bits it returns against the formats' definitions: int4's 128 + q in bfloat16,
and E2M1's value times 2^-126 in bfloat16's fields.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from flash_planner.kernels.gemm import tiles

MASK = 0xFFFFFFFF
# E2M1 codes 0-7: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (OCP MX spec); bit 3 the sign
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def prmt(a: int, b: int, c: int) -> int:
    """prmt.b32 (default mode): byte i of the result is byte (c's nibble i & 7) of {b, a},
    or that byte's sign replicated where the nibble's bit 3 is set."""
    pool = (b << 32) | a
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """lop3.b32: each result bit is bit (a, b, c) of lut, a the most significant index bit
    (lut = F(0xF0, 0xCC, 0xAA))."""
    out = 0
    for bit in range(32):
        index = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> index) & 1) << bit
    return out


def run_ptx(text: str, inputs: dict[str, int]) -> dict[str, int]:
    """Execute the PTX's prmt/shl/shr/and/lop3 lines in order; registers by name ($0, t0, ...)."""
    regs = dict(inputs)

    def value(token: str) -> int:
        token = token.strip()
        return regs[token] if token in regs else int(token, 0) & MASK

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        match = re.fullmatch(r"(\w+)\.b32\s+(\S+),\s*(.*)", line)
        assert match, f"an instruction this test cannot execute: {line!r}"
        op, dest, rest = match.groups()
        args = [value(t) for t in rest.split(",")]
        if op == "prmt":
            regs[dest] = prmt(*args)
        elif op == "shl":
            regs[dest] = (args[0] << args[1]) & MASK if args[1] < 32 else 0
        elif op == "shr":
            regs[dest] = args[0] >> args[1] if args[1] < 32 else 0
        elif op == "and":
            regs[dest] = args[0] & args[1]
        elif op == "lop3":
            regs[dest] = lop3(*args)
        else:
            raise AssertionError(f"an instruction this test cannot execute: {line!r}")
    return regs


def bf16(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).item()


def words() -> list[int]:
    """Every byte value in every byte position of the input register, and random words."""
    out = [byte << (8 * pos) for byte in range(256) for pos in range(4)]
    rng = np.random.default_rng(0)
    return out + [0xFFFFFFFF] + [int(w) for w in rng.integers(0, 2 ** 32, 2000, np.uint64)]


def decoded(ptx: str):
    """(byte, its nibble, which, the 16-bit result) for both nibbles of every byte of every
    word, from the PTX's outputs: $0 $1 the low nibbles' four lanes, $2 $3 the high ones."""
    for word in words():
        regs = run_ptx(ptx, {"$4": word})
        for first, which, shift in ((0, "low", 0), (2, "high", 4)):
            lanes = [regs[f"${first + i // 2}"] >> (16 * (i % 2)) & 0xFFFF for i in range(4)]
            for i, bits in enumerate(lanes):
                byte = (word >> (8 * i)) & 0xFF
                yield byte, (byte >> shift) & 0xF, which, bits


def test_int4_pairs_give_128_plus_q() -> None:
    for byte, q, which, bits in decoded(tiles.INT4_PAIRS_PTX.value):
        assert bf16(bits) == 128 + q, f"byte {byte:#x}: {which} nibble"


def test_e2m1_pairs_give_the_value_times_2_to_the_minus_126() -> None:
    for byte, code, which, bits in decoded(tiles.E2M1_PAIRS_PTX.value):
        want = (-1.0 if code & 8 else 1.0) * E2M1[code & 7] * 2.0 ** -126
        value = bf16(bits)
        assert value == want and (bits >> 15) == (code >> 3), \
            f"byte {byte:#x}, {which} nibble {code:#x}: {value!r}, want {want!r}"


def test_the_executor_reads_prmt_and_lop3_as_the_isa_defines_them() -> None:
    """Hand-worked cases of the two instructions whose semantics the checks above rest on."""
    assert prmt(0x44332211, 0, 0x1404) == 0x22001100
    assert prmt(0x44332211, 0x88776655, 0x7654) == 0x88776655
    assert prmt(0x000000F0, 0, 0x8888) == 0xFFFFFFFF                 # sign replicated
    assert lop3(0xF0, 0xCC, 0xAA, 0xEA) == (0xF0 & 0xCC) | 0xAA
    assert lop3(0xF0, 0xCC, 0xAA, 0xA8) == (0xF0 | 0xCC) & 0xAA
