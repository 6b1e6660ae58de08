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
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def e4m3_to_float(bits):
    """uint8 e4m3fn bit patterns -> float32, exactly (NaN codes 0x7F / 0xFF never occur).

    Sign, exponent and mantissa moved into fp16's places: e4m3 (bias 7) read as fp16 (bias
    15) is the value times 2^-8, subnormals included (fp16's go down to 2^-24), so a shift and
    one power-of-two multiply decode it with no table and no branch.
    """
    b = bits.to(tl.int32)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def e2m1_to_float(nibble):
    """4-bit E2M1 codes (0..15, sign in bit 3) -> float32, exactly: 0, .5, 1, 1.5, 2, 3, 4, 6.

    As in e4m3_to_float, the fields moved into fp16's places (bias 1 -> 15) give the value
    times 2^-14, the subnormal 0.5 included; no table (a global list would not compile).
    """
    v = nibble.to(tl.int32)
    half = ((v & 0x8) << 12) | ((v & 0x7) << 9)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def dot_xwt(x, w):
    """x [BM, BK] as loaded @ w [BN, BK]^T -> float32 [BM, BN], on tensor cores.

    `w` is float32 holding values exact in bf16 and fp16 (e4m3, E2M1 x e4m3, q - z), so the
    dot multiplies exactly and accumulates in fp32. fp32 x is split into three bf16 pieces
    (8 significant bits each: all 24 of x), three bf16 dots: exact products again, where
    tf32 would round x to 11 bits and IEEE fp32 would leave the tensor cores idle.
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
    else:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)))
    return acc


@triton.jit
def dot_step(x, w, FLOAT: tl.constexpr, USE_DOT: tl.constexpr):
    """x [BM, BK] @ w [BN, BK]^T -> float32 [BM, BN]. Tensor cores (USE_DOT): quantized
    weights decoded to float32 through dot_xwt; float weights as loaded (x's dtype), fp32 ones
    in tf32x3 (three tf32 products, about fp32's precision). Else, for 1-4 rows, a broadcast
    multiply and a sum over K on CUDA cores."""
    if not USE_DOT:
        acc = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    elif not FLOAT:
        acc = dot_xwt(x, w)
    elif w.dtype != tl.float32:
        acc = dot_xwt(x, w.to(tl.float32))     # upcast at once: the interpreter's bf16 quirk
    elif INTERPRETED:
        acc = tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(w), input_precision="tf32x3")
    return acc


@triton.jit
def fp8_tile(weight, w_off, s_rows, mn, mk, k0, block_k, BLOCK_K: tl.constexpr):
    """e4m3 decoded to float32 [BN, BK] (unscaled) and the block scale [BN] of each row."""
    rk = tl.arange(0, BLOCK_K)
    wq = tl.load(weight + k0 + w_off + rk[None, :], mask=mn[:, None] & mk[None, :], other=0)
    s = tl.load(s_rows + k0 // block_k, mask=mn, other=0.0)          # [BN], one K block
    if INTERPRETED:
        return e4m3_to_float(wq), s
    # the hardware's conversion (sm_89+: e4m3x2 -> f16x2, then to bf16; sm_100+ direct):
    # exact, every e4m3 value is a bf16 one; the skinny K loop 375 -> ~200 instructions on
    # sm_90, ~150 on sm_110 (the kernels report), the integer field moves gone
    return wq.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), s


@triton.jit
def nvfp4_tile(packed, p_off, scale, s_off, mn, k0, K, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """Decoded and group-scaled to float32: the even-k and odd-k columns, [BN, BK / 2] each.
    K bounds the columns unless EVEN (the whole tile lies before K: masks constant along a
    row, so the loads can be 16-byte vectors)."""
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
    byte = tl.load(packed + k0 // 2 + p_off + rj[None, :], mask=byte_mask, other=0)
    sb = tl.load(scale + k0 // 16 + s_off + rg[None, :], mask=group_mask, other=0)
    s = e4m3_to_float(sb)                                             # [BN, GROUPS]
    # one scale per 8 bytes (16 values): [BN, GROUPS] -> [BN, GROUPS, 8] -> [BN, HALF]
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, 8)), (BLOCK_N, HALF))
    return e2m1_to_float(byte & 0xF) * s, e2m1_to_float(byte >> 4) * s


@triton.jit
def int4_tile(packed, p_off, scale, zero, g_rows, mn, even, k0, group, BLOCK_K: tl.constexpr):
    """q - zero of the even-k and odd-k columns in float32, [BN, BK / 2] each, and the group
    scale [BN] of each row."""
    HALF: tl.constexpr = BLOCK_K // 2
    rj = tl.arange(0, HALF)
    byte = tl.load(packed + k0 // 2 + p_off + rj[None, :],
                   mask=mn[:, None] & even[None, :], other=0)        # [BN, HALF]
    g = k0 // group
    s = tl.load(scale + g_rows + g, mask=mn, other=0.0)               # [BN]
    z = tl.load(zero + g_rows + g, mask=mn, other=0)
    if INTERPRETED:
        zf = z.to(tl.float32)[:, None]
        return (byte & 0xF).to(tl.float32) - zf, (byte >> 4).to(tl.float32) - zf, s
    # no int-to-float conversion (67 I2F a K step on sm_90): q and the zero into bf16's
    # mantissa, one bf16 subtraction per pair
    zb = magic_bf16(z.to(tl.int32))[:, None]
    b = byte.to(tl.int32)
    return magic_bf16(b & 0xF) - zb, magic_bf16(b >> 4) - zb, s


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
def load_x(x, x_off, rows, mk, odd, k0, k_hi, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """x's K step for the rows masked in `rows` [BM]: 8- and 16-bit formats the [BM, BK] tile
    twice; 4-bit ones the columns k0 + 2j and k0 + 2j + 1, [BM, BK / 2] each (k_hi bounds
    int4's whole tile; the masks the others)."""
    if FORMAT == "int4":
        # one contiguous load split in registers: the strided halves were scalar loads with
        # an address each (int4's skinny K loop 431 -> 376 instructions on sm_90; nvfp4's
        # gained 60 too, but spilled 16 bytes on sm_110 at 64 x 128 tiles)
        rk = tl.arange(0, BLOCK_K)
        whole = tl.load(x + x_off + k0 + rk[None, :],
                        mask=rows[:, None] & (rk < k_hi - k0)[None, :], other=0.0)
        xa, xb = tl.split(tl.reshape(whole, (whole.shape[0], BLOCK_K // 2, 2)))
    elif FORMAT == "nvfp4":
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
def product(acc, xa, xb, wa, wb, sc, FORMAT: tl.constexpr, USE_DOT: tl.constexpr,
            STEPWISE: tl.constexpr):
    """acc plus the K step's products, exact, times the step's scale. nvfp4's pair is added
    to acc one after the other where STEPWISE (the tiled kernel: summing the two first kept
    one more [BM, BN] fp32 tile live, 25 registers in the fp32 demo's 64-row tiles), else
    summed first (the skinny kernel: the other way cost its bf16 experts up to 20)."""
    if STEPWISE and FORMAT == "nvfp4":
        acc += dot_step(xa, wa, False, USE_DOT)
        acc += dot_step(xb, wb, False, USE_DOT)
    elif FORMAT == "nvfp4":
        acc += dot_step(xa, wa, False, USE_DOT) + dot_step(xb, wb, False, USE_DOT)
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
           EVEN: tl.constexpr, USE_DOT: tl.constexpr, STEPWISE: tl.constexpr,
           WEIGHT_FIRST: tl.constexpr, GATED: tl.constexpr):
    """One K step of both kernels: (acc, up) plus x's products with the weight rows at
    w_off / s_off (and, GATED, the up rows at u_off / t_off), x loaded once. WEIGHT_FIRST:
    the weight tile decoded before x is loaded (the order each kernel compiled leanest in)."""
    mk, odd = k_masks(k0, k_hi, FORMAT, BLOCK_K, EVEN)
    if WEIGHT_FIRST:
        wa, wb, sc = decode(w, s, z, w_off, s_off, mn, mk, k0, k_hi, i1, FORMAT, BLOCK_N,
                            BLOCK_K, EVEN)
        xa, xb = load_x(x, x_off, rows, mk, odd, k0, k_hi, FORMAT, BLOCK_K)
    else:
        xa, xb = load_x(x, x_off, rows, mk, odd, k0, k_hi, FORMAT, BLOCK_K)
        wa, wb, sc = decode(w, s, z, w_off, s_off, mn, mk, k0, k_hi, i1, FORMAT, BLOCK_N,
                            BLOCK_K, EVEN)
    acc = product(acc, xa, xb, wa, wb, sc, FORMAT, USE_DOT, STEPWISE)
    if GATED:
        ua, ub, su = decode(w, s, z, u_off, t_off, mn, mk, k0, k_hi, i1, FORMAT, BLOCK_N,
                            BLOCK_K, EVEN)
        up = product(up, xa, xb, ua, ub, su, FORMAT, USE_DOT, STEPWISE)
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
