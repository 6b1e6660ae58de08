"""The Triton pieces both GEMM kernels (tiled.py, skinny.py) are made of: the decode of each
format's weight tile, the exact dot, one K step per format, the routing of expert rows.

FORMAT (formats.py's names) is a constexpr of every helper that branches on it, so each
specialization compiles only its format's code; Triton inlines the helpers, so no
specialization pays registers for another format's branch.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The CPU interpreter stores bf16 as raw uint16 and multiplies those integers in tl.dot: under
# it every dot runs in fp32 (read at import; tests set the variable before importing kernels).
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETED = tl.constexpr(_INTERPRETING)
# nvfp4's E2M1 codes are moved into a 16-bit float's fields: bf16's on the GPU
# (E2M1_PAIRS_PTX), each weight decoded times 2^-63, the 2^63 put back on the sums after the
# K loop (NVFP4_UNSCALE); fp16's under the interpreter (e2m1_bits), whose bf16 conversion
# flushes subnormals
NVFP4_SCALE = tl.constexpr(2.0 ** 14 if _INTERPRETING else 2.0 ** 63)
NVFP4_UNSCALE = tl.constexpr(1.0 if _INTERPRETING else 2.0 ** 63)


@triton.jit
def exact(t):
    """A decoded weight tile (bf16 or fp8 values) in the dtype its arithmetic runs in: bf16 on
    the GPU (one instruction a pair, exact for these values), float32 under the CPU
    interpreter, whose bf16 arithmetic returns garbage; the decode itself is the same."""
    if INTERPRETED:
        t = t.to(tl.float32)
    elif t.dtype != tl.bfloat16:
        t = t.to(tl.bfloat16)
    return t


@triton.jit
def dot_xwt(x, w):
    """x [BM, BK] as loaded @ w [BN, BK]^T -> float32 [BM, BN], on tensor cores.

    `w` holds values exact in bf16 (bf16 on the GPU, float32 under the interpreter: e4m3,
    E2M1 x e4m3 times 2^-63, q - z, or bf16 weights), so bf16 dots multiply exactly and
    accumulate in fp32. Rows in another dtype are split into bf16 pieces instead of the
    weight being converted: fp32 x into three (8 significant bits each: all 24 of x), where
    tf32 would round x to 11 bits and IEEE fp32 would leave the tensor cores idle; fp16 x
    into two (its 11 bits), where fp16 could not hold nvfp4's weights times 2^-63.
    """
    if INTERPRETED:
        acc = tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    elif x.dtype == tl.float32:
        wt = tl.trans(w.to(tl.bfloat16))
        hi = x.to(tl.bfloat16)
        rest = x - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(hi, wt, tl.dot(mid, wt, tl.dot(lo, wt)))     # smallest terms first
    elif x.dtype == tl.float16:
        wt = tl.trans(w.to(tl.bfloat16))
        hi = x.to(tl.bfloat16)
        lo = (x.to(tl.float32) - hi.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(hi, wt, tl.dot(lo, wt))
    else:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)))
    return acc


@triton.jit
def dot_step(x, w, FLOAT: tl.constexpr, USE_DOT: tl.constexpr):
    """x [BM, BK] @ w [BN, BK]^T -> float32 [BM, BN]. Tensor cores (USE_DOT): quantized
    weights as decoded (`exact`) through dot_xwt; float weights as loaded (x's dtype; fp16
    ones with fp16 rows on fp16 tensor cores, not bf16-exact), fp32 ones in tf32x3 (three
    tf32 products, about fp32's precision). Else, for 1-4 rows, a broadcast multiply and a
    sum over K on CUDA cores."""
    if not USE_DOT:
        acc = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    elif not FLOAT:
        acc = dot_xwt(x, w)
    elif not INTERPRETED and w.dtype == tl.float16 and x.dtype == tl.float16:
        acc = tl.dot(x, tl.trans(w))
    elif w.dtype != tl.float32:
        acc = dot_xwt(x, w.to(tl.float32))     # upcast at once: the interpreter's bf16 quirk
    elif INTERPRETED:
        acc = tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(w), input_precision="tf32x3")
    return acc


@triton.jit
def block_index(k0, size, BLOCK_K: tl.constexpr):
    """k0 // size for k0 and size multiples of BLOCK_K (a step lies in one scale block or
    group), without an integer division by a runtime value (about 15 instructions a K step):
    with a = k0 / BLOCK_K and b = size / BLOCK_K, (a + 0.5) / b lies at least 0.5 / b from
    any integer, and float32's approximate division (2 ulp; the IEEE one calls a slow path
    that needs a stack frame) is off by less than that below 2^21 K steps, so truncating it
    is exact."""
    b = tl.cast(size // BLOCK_K, tl.float32)
    a = tl.cast(k0 // BLOCK_K, tl.float32) + 0.5
    return tl.cast(tl.math.fdiv(a, b, approx=True), tl.int32)


@triton.jit
def fp8_tile(weight, w_off, s_rows, mn, mk, k0, block_k, BLOCK_K: tl.constexpr):
    """e4m3 decoded [BN, BK] (unscaled; exact: see `exact`) and the block scale [BN] of each
    row."""
    rk = tl.arange(0, BLOCK_K)
    wq = tl.load(weight + k0 + w_off + rk[None, :], mask=mn[:, None] & mk[None, :], other=0)
    s = tl.load(s_rows + block_index(k0, block_k, BLOCK_K), mask=mn, other=0.0)   # [BN]
    # the hardware's conversion (sm_89+: e4m3x2 -> f16x2, then to bf16; sm_100+ direct):
    # exact, every e4m3 value is a bf16 one; the skinny K loop 375 -> ~200 instructions on
    # sm_90, ~150 on sm_110 (the kernels report), the integer field moves gone
    return exact(wq.to(tl.float8e4nv, bitcast=True)), s


@triton.jit
def nvfp4_tile(packed, p_off, scale, s_off, mn, k0, K, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """Decoded and group-scaled, the even-k and odd-k columns, [BN, BK / 2] each: exact
    (see `exact`), times 2^-63 on the GPU (e2m1_bits; the kernels undo it with the global
    scale). K bounds the columns unless EVEN (the whole tile lies before K: masks constant
    along a row, so the loads can be 16-byte vectors)."""
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 16
    rj = tl.arange(0, HALF)
    rg = tl.arange(0, GROUPS)
    if EVEN:
        byte_mask = mn[:, None]                       # broadcast along the row by tl.load
        group_mask = mn[:, None]
    else:
        byte_mask = mn[:, None] & (rj < (K - k0) // 2)[None, :]      # bytes left in a row
        group_mask = mn[:, None] & (rg < (K - k0) // 16)[None, :]
    sb = tl.load(scale + k0 // 16 + s_off + rg[None, :], mask=group_mask, other=0)
    # the hardware's e4m3 conversion, times NVFP4_SCALE (exact: <= 448 * 2^63): e2m1_bits
    s = exact(sb.to(tl.float8e4nv, bitcast=True)) * NVFP4_SCALE          # [BN, GROUPS]
    # one scale per 8 bytes (16 values): [BN, GROUPS] -> [BN, GROUPS, 8] -> [BN, HALF]
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, 8)), (BLOCK_N, HALF))
    byte = tl.load(packed + k0 // 2 + p_off + rj[None, :], mask=byte_mask, other=0)
    if INTERPRETED:
        b = byte.to(tl.int32)
        low = e2m1_bits(b, 0).to(tl.uint16).to(tl.float16, bitcast=True)
        high = e2m1_bits(b, 4).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        low, high = nibble_pairs(byte, E2M1_PAIRS_PTX)
    return exact(low) * s, exact(high) * s


# nibble_pairs' PTX for E2M1: the codes of the low and high nibbles moved into bf16's fields
# (bias 127): the sign to bit 15, exponent and mantissa to bits 6-8, so that each reads as
# the value times 2^-126 and the subnormal 0.5 is a bf16 subnormal (no code needs a case of
# its own). Times the group scale times 2^63 (one mul.bf16x2 a pair, which keeps subnormals)
# that is the weight times 2^-63, exactly (<= 6 significant bits, >= 2^-73; 2^126 at once
# would overflow with the scale). Two PRMTs put each byte in the high half of a 16-bit lane,
# then a pair of values takes two shifts and one LOP3 (low nibbles: the sign and the
# magnitude shifted apart, kept by one mask, 0x81C0 a lane) or a shift, an AND and a LOP3
# (high nibbles: the byte's low bit would fall inside the magnitude's mask): 1.75
# instructions a value, against ~3.5 through Triton's integer operations (the skinny K loop
# at the 27B's shapes, 4 warps, 418-437 -> 317-332 on sm_90, 405-432 -> 303-317 on sm_110)
E2M1_PAIRS_PTX = tl.constexpr("""{
.reg .b32 t0, t1, a, b;
prmt.b32 t0, $4, 0, 0x1404;
prmt.b32 t1, $4, 0, 0x3424;
shl.b32 a, t0, 4;
shr.b32 b, t0, 2;
lop3.b32 $0, a, b, 0x81C081C0, 0xA8;
shl.b32 a, t1, 4;
shr.b32 b, t1, 2;
lop3.b32 $1, a, b, 0x81C081C0, 0xA8;
shr.b32 a, t0, 6;
and.b32 a, a, 0x01C001C0;
lop3.b32 $2, t0, a, 0x80008000, 0xEC;
shr.b32 b, t1, 6;
and.b32 b, b, 0x01C001C0;
lop3.b32 $3, t1, b, 0x80008000, 0xEC;
}""")


@triton.jit
def e2m1_bits(t, SHIFT: tl.constexpr):
    """Under the interpreter, the E2M1 codes at bit SHIFT of int32 bytes t moved into fp16's
    fields (bias 15) as E2M1_PAIRS_PTX moves them into bf16's: the value times 2^-14, the scale
    times 2^14 (NVFP4_SCALE)."""
    sign = (t & (0x8 << SHIFT)) << (12 - SHIFT)
    return sign | ((t & (0x7 << SHIFT)) << (9 - SHIFT))


@triton.jit
def int4_tile(packed, p_off, scale, zero, g_rows, mn, even, k0, group, BLOCK_K: tl.constexpr):
    """q - zero of the even-k and odd-k columns, [BN, BK / 2] each (exact: see `exact`), and
    the group scale [BN] of each row."""
    HALF: tl.constexpr = BLOCK_K // 2
    g = block_index(k0, group, BLOCK_K)
    s = tl.load(scale + g_rows + g, mask=mn, other=0.0)               # [BN]
    z = tl.load(zero + g_rows + g, mask=mn, other=0)
    # no int-to-float conversion (67 I2F a K step on sm_90): q and the zero into bf16's
    # mantissa (128 + q), one bf16 subtraction per pair
    zb = exact(magic_bf16(z.to(tl.int32)))[:, None]
    rj = tl.arange(0, HALF)
    byte = tl.load(packed + k0 // 2 + p_off + rj[None, :],
                   mask=mn[:, None] & even[None, :], other=0)        # [BN, HALF]
    if INTERPRETED:
        b = byte.to(tl.int32)
        low, high = exact(magic_bf16(b & 0xF)) - zb, exact(magic_bf16(b >> 4)) - zb
    else:
        low, high = nibble_pairs(byte, INT4_PAIRS_PTX)
        low, high = low - zb, high - zb
    return low, high, s


# nibble_pairs' PTX for int4: 128 + each nibble as bfloat16. Two PRMTs spread the bytes
# into 16-bit lanes, then one LOP3 a pair of values masks the nibble and ORs it into the
# mantissa of 128 (the high nibbles shifted down first, one shift a pair). With
# block_index, the skinny K loop at the 27B's shapes, 4 warps, 372-379 -> 253-259
# instructions on sm_90 and sm_110 (Triton's own integer operations spent three PRMTs a pair
# of bytes)
INT4_PAIRS_PTX = tl.constexpr("""{
.reg .b32 t0, t1, a, b;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
shr.b32 a, t0, 4;
lop3.b32 $2, a, 0x000F000F, 0x43004300, 0xEA;
shr.b32 b, t1, 4;
lop3.b32 $3, b, 0x000F000F, 0x43004300, 0xEA;
}""")


@triton.jit
def nibble_pairs(byte, PTX: tl.constexpr):
    """uint8 bytes -> (their low nibbles, their high nibbles) as bfloat16, decoded by `PTX`
    (INT4_PAIRS_PTX, E2M1_PAIRS_PTX) on the GPU, four bytes a register: $4 the bytes, $0 $1
    the low nibbles' four values, $2 $3 the high ones (test/kernels/test_decode_ptx.py runs
    each on every byte in every position)."""
    return tl.inline_asm_elementwise(
        asm=PTX, constraints="=r,=r,=r,=r,r", args=[byte], dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True, pack=4)


@triton.jit
def magic_bf16(q):
    """int32 0..127 -> bfloat16 128 + q, exactly: q ORed into the mantissa of 128 (0x4300),
    so that one bf16 subtraction of 128 + zero gives q - zero exactly (small integers), as
    FasterTransformer's and Marlin's int4 decodes do with fp16."""
    return (q | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def row_offsets(rn, K, i0, i1, i2, FORMAT: tl.constexpr):
    """Where weight rows rn start: in w [BN, 1], and in s (and z) [BN] or [BN, 1]."""
    if FORMAT == "fp8":
        w_off, s_off = rn[:, None] * K, (rn // i0) * i2
    elif FORMAT == "nvfp4":
        w_off, s_off = rn[:, None] * i0, rn[:, None] * i1
    elif FORMAT == "int4":
        w_off, s_off = rn[:, None] * i0, rn * i2
    else:
        w_off, s_off = rn[:, None] * K, rn
    return w_off, s_off


@triton.jit
def expert_bases(w, s, z, expert, rows, K, i0, i1, i2, FORMAT: tl.constexpr):
    """w and s moved to expert `expert`'s weight of `rows` rows (one int64 offset each, so
    a stack may pass 2^31 elements), z too for int4 (nvfp4's global scales are read after
    the K loop: the kernels move z there, keeping no pointer live across it)."""
    e = expert.to(tl.int64)
    if FORMAT == "fp8":
        w += e * rows * K
        s += e * tl.cdiv(rows, i0) * i2
    elif FORMAT == "nvfp4":
        w += e * rows * i0
        s += e * rows * i1
    elif FORMAT == "int4":
        w += e * rows * i0
        s += e * rows * i2
        z += e * rows * i2
    else:
        w += e * rows * K
    return w, s, z


@triton.jit
def k_masks(k0, k_hi, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """The K step's column masks (EVEN: the step lies inside K): 8- and 16-bit formats [BK]
    twice; 4-bit ones [BK / 2], the bytes and their high nibbles (values k0 + 2j + 1)."""
    WIDTH: tl.constexpr = BLOCK_K // 2 if FORMAT == "nvfp4" or FORMAT == "int4" else BLOCK_K
    r = tl.arange(0, WIDTH)
    if FORMAT == "nvfp4":
        mk = r < (k_hi - k0) // 2
        odd = mk
    elif EVEN:
        mk = tl.full((WIDTH,), 1, tl.int1)
        odd = mk
    elif FORMAT == "int4":
        mk = 2 * r < k_hi - k0                    # k0 + 2j < K: byte j holds a value
        odd = 2 * r + 1 < k_hi - k0               # its high nibble too (not past odd K)
    else:
        mk = r < k_hi - k0
        odd = mk
    return mk, odd


@triton.jit
def load_x(x, x_off, rows, mk, odd, k0, k_hi, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
           WHOLE: tl.constexpr, EVEN: tl.constexpr):
    """x's K step for the rows masked in `rows` [BM]: 8- and 16-bit formats the [BM, BK] tile
    twice; 4-bit ones the columns k0 + 2j and k0 + 2j + 1, [BM, BK / 2] each, split in
    registers from one contiguous load where WHOLE (k_hi bounds the whole tile's loads unless
    EVEN: the step lies inside K, so only the rows are masked, a mask the K loop does not
    recompute; the masks bound the others')."""
    if WHOLE:
        # the strided halves are scalar loads with an address each (int4's skinny K loop
        # 431 -> 376 instructions on sm_90); joining the weight's halves into one tile
        # instead cost more (nvfp4's skinny K loop 365 against 316 split so); the FMA path
        # and nvfp4's tiled kernel keep the strided halves (split, they spilled 8 bytes)
        rk = tl.arange(0, BLOCK_K)
        if EVEN:
            k_mask = rows[:, None]
        else:
            k_mask = rows[:, None] & (rk < k_hi - k0)[None, :]
        whole = tl.load(x + x_off + k0 + rk[None, :], mask=k_mask, other=0.0)
        xa, xb = tl.split(tl.reshape(whole, (whole.shape[0], BLOCK_K // 2, 2)))
    elif FORMAT == "nvfp4" or FORMAT == "int4":
        xk = x + x_off + k0 + 2 * tl.arange(0, BLOCK_K // 2)[None, :]
        xa = tl.load(xk, mask=rows[:, None] & mk[None, :], other=0.0)
        xb = tl.load(xk + 1, mask=rows[:, None] & odd[None, :], other=0.0)
    else:
        xk = x + x_off + k0 + tl.arange(0, BLOCK_K)[None, :]
        xa = tl.load(xk, mask=rows[:, None] & mk[None, :], other=0.0)
        xb = xa
    return xa, xb


@triton.jit
def decode(w, s, z, w_off, s_off, mn, mk, k0, k_hi, i1, FORMAT: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """The weight tile at k0 of the rows at w_off / s_off: (a, b, scale [BN]). 8- and 16-bit
    formats: the [BN, BK] tile twice; 4-bit: its even-k and odd-k columns. scale: the block
    or group scale of each row (1 where the tile is already scaled or needs none)."""
    if FORMAT == "fp8":
        a, sc = fp8_tile(w, w_off, s + s_off, mn, mk, k0, i1, BLOCK_K)
        b = a
    elif FORMAT == "nvfp4":
        a, b = nvfp4_tile(w, w_off, s, s_off, mn, k0, k_hi, BLOCK_N, BLOCK_K, EVEN)
        sc = 1.0
    elif FORMAT == "int4":
        a, b, sc = int4_tile(w, w_off, s, z, s_off, mn, mk, k0, i1, BLOCK_K)
    else:
        rk = tl.arange(0, BLOCK_K)
        a = tl.load(w + k0 + w_off + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        b = a
        sc = 1.0
    return a, b, sc


@triton.jit
def product(acc, xa, xb, wa, wb, sc, FORMAT: tl.constexpr, USE_DOT: tl.constexpr):
    """acc plus the K step's products, exact, times the step's scale. nvfp4's pair is added
    to acc one dot after the other, each accumulating into acc on the tensor cores (their sum
    first cost one fp32 add per accumulator, 16 a K step in the skinny kernel's 16 x 32
    gated tiles, and kept one more [BM, BN] fp32 tile live in the tiled kernel's)."""
    if FORMAT == "nvfp4":
        acc += dot_step(xa, wa, False, USE_DOT)
        acc += dot_step(xb, wb, False, USE_DOT)
    elif FORMAT == "int4":
        part = dot_step(xa, wa, False, USE_DOT) + dot_step(xb, wb, False, USE_DOT)
        acc += part * sc[None, :]
    elif FORMAT == "fp8":
        acc += dot_step(xa, wa, False, USE_DOT) * sc[None, :]
    else:
        acc += dot_step(xa, wa, True, USE_DOT)
    return acc


@triton.jit
def k_step(acc, up, x, x_off, rows, w, s, z, w_off, s_off, u_off, t_off, mn, k0, k_hi, i1,
           FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           EVEN: tl.constexpr, USE_DOT: tl.constexpr, STRIDED: tl.constexpr,
           WEIGHT_FIRST: tl.constexpr, GATED: tl.constexpr):
    """One K step of both kernels: (acc, up) plus x's products with the weight rows at
    w_off / s_off (and, GATED, the up rows at u_off / t_off), x loaded once. WEIGHT_FIRST:
    the weight tile decoded before x is loaded (the order each kernel compiled leanest in).
    STRIDED: nvfp4's x halves loaded strided, not split from one load (load_x: the tiled
    kernel's)."""
    WHOLE: tl.constexpr = USE_DOT and (FORMAT == "int4" or (FORMAT == "nvfp4" and not STRIDED))
    mk, odd = k_masks(k0, k_hi, FORMAT, BLOCK_K, EVEN)
    if WEIGHT_FIRST:
        wa, wb, sc = decode(w, s, z, w_off, s_off, mn, mk, k0, k_hi, i1, FORMAT, BLOCK_N,
                            BLOCK_K, EVEN)
        xa, xb = load_x(x, x_off, rows, mk, odd, k0, k_hi, FORMAT, BLOCK_K, WHOLE, EVEN)
    else:
        xa, xb = load_x(x, x_off, rows, mk, odd, k0, k_hi, FORMAT, BLOCK_K, WHOLE, EVEN)
        wa, wb, sc = decode(w, s, z, w_off, s_off, mn, mk, k0, k_hi, i1, FORMAT, BLOCK_N,
                            BLOCK_K, EVEN)
    acc = product(acc, xa, xb, wa, wb, sc, FORMAT, USE_DOT)
    if GATED:
        ua, ub, su = decode(w, s, z, u_off, t_off, mn, mk, k0, k_hi, i1, FORMAT, BLOCK_N,
                            BLOCK_K, EVEN)
        up = product(up, xa, xb, ua, ub, su, FORMAT, USE_DOT)
    return acc, up


@triton.jit
def routed_rows(topk_ids, expert, rm, M, topk, TOPK: tl.constexpr):
    """For rows rm [BM]: the slot j in which each chose `expert`, and its row m * k + j of y
    [M * k, N], -1 where the row did not choose it (ids are distinct within a row)."""
    rt = tl.arange(0, TOPK)
    ids = tl.load(topk_ids + rm[:, None] * topk + rt[None, :],
                  mask=(rm < M)[:, None] & (rt < topk)[None, :], other=-1)   # [BM, TOPK]
    hit = ids == expert
    slot = tl.sum(tl.where(hit, rt[None, :], 0), axis=1)
    # one row index per row, not (m, j, chosen): the epilogue keeps it live across the K loop
    return slot, tl.where(tl.max(hit.to(tl.int32), axis=1) > 0, rm * topk + slot, -1)
