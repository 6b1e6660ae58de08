"""Mixture-of-experts grouped GEMMs (float, FP8, NVFP4 and int4 experts): the Triton kernels
against their references, and the references against a per-(m, j) loop written here.

Routing is built on purpose (`routing`): expert 0 in every row (its slot moving from row to
row), expert E - 1 in row 0 alone, expert E - 2 in no row where k leaves room, the other
slots drawn from the experts in between. So some experts are chosen by no row, one by exactly
one row and one by all. Shapes are odd on purpose: N 40 / 72 against 64-wide N tiles, K 96 /
160 against the K steps and the FP8 blocks, odd K and a partial last group for int4; M = 1
(decode), 5, 16 (verify), 37 (a 64-row prefill tile); S = 1 (gate/up) and S = k (down).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from flash_planner.kernels import dispatch, report
from flash_planner.kernels.gemm import ops as kernel
from flash_planner.kernels.gemm import reference
from flash_planner.kernels.gemm.context import context
from flash_planner.kernels.gemm.formats import FORMATS
from flash_planner.kernels.gemm.reference import dequantize_fp8, dequantize_int4, dequantize_nvfp4
from flash_planner.kernels.gemm.skinny import rows_gemm
from flash_planner.kernels.gemm.tune import split_operands
from flash_planner.kernels.specs import record_launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = {"float": "moe_gemm", "fp8": "moe_fp8_gemm", "nvfp4": "moe_nvfp4_gemm",
         "int4": "moe_int4_gemm"}
FINITE_E4M3 = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)


def routing(m: int, k: int, e: int, seed: int = 0) -> torch.Tensor:
    """topk_ids [M, k] int32, distinct per row, as the module docstring says."""
    gen = torch.Generator().manual_seed(seed)
    pool = list(range(1, e - 2 if e - 3 >= k - 1 else e - 1))     # neither 0 nor E - 1
    rows = []
    for r in range(m):
        others = [pool[i] for i in torch.randperm(len(pool), generator=gen)[:k - 1].tolist()]
        if r == 0 and k > 1:
            others[0] = e - 1
        row = [0, *others]
        rows.append(row[r % k:] + row[:r % k])
    return torch.tensor(rows, dtype=torch.int32).reshape(m, k)


def fewest_experts(k: int) -> int:
    """The fewest experts for which `routing` at k leaves one unchosen (a launch runs one
    program per expert, so the interpreted kernel tests use no more)."""
    return k + 2


# ---- stacked expert weights (the arguments after topk_ids)

def float_args(e, n, k, dtype, gen):
    return ((torch.randn(e, n, k, generator=gen) * 0.1).to(dtype),)


def fp8_args(e, n, k, block_n, block_k, gen):
    weight = FINITE_E4M3[torch.randint(0, len(FINITE_E4M3), (e, n, k), generator=gen)]
    scale = torch.rand(e, -(-n // block_n), -(-k // block_k), generator=gen) * 0.01 + 1e-3
    return weight, scale, block_n, block_k


def nvfp4_args(e, n, k, gen):
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(0, 0x7F, (e, n, k // 16), dtype=torch.uint8, generator=gen)  # > 0
    return packed, scale, torch.rand(e, generator=gen) * 0.02 + 0.01


def int4_args(e, n, k, group, gen):
    groups = -(-k // group)
    packed = torch.randint(0, 256, (e, n, -(-k // 2)), dtype=torch.uint8, generator=gen)
    scale = torch.rand(e, n, groups, generator=gen) * 0.02 + 1e-3
    zero = torch.randint(0, 16, (e, n, groups), dtype=torch.uint8, generator=gen)
    return packed, scale, zero, group


# name -> (format, K, make(E, activation dtype, generator) -> the weight arguments)
CASES = {
    "float-40x96": ("float", 96, lambda e, dt, g: float_args(e, 40, 96, dt, g)),
    "fp8-b16x32-72x160": ("fp8", 160, lambda e, dt, g: fp8_args(e, 72, 160, 16, 32, g)),
    "fp8-b128x64-40x96": ("fp8", 96, lambda e, dt, g: fp8_args(e, 40, 96, 128, 64, g)),
    "nvfp4-72x160": ("nvfp4", 160, lambda e, dt, g: nvfp4_args(e, 72, 160, g)),
    "int4-g32-40x97": ("int4", 97, lambda e, dt, g: int4_args(e, 40, 97, 32, g)),
    "int4-g64-72x159": ("int4", 159, lambda e, dt, g: int4_args(e, 72, 159, 64, g)),
}
SMALL = {"float": "float-40x96", "fp8": "fp8-b128x64-40x96", "nvfp4": "nvfp4-72x160",
         "int4": "int4-g32-40x97"}


def _functions(fmt):
    return getattr(kernel, NAMES[fmt]), getattr(reference, NAMES[fmt])


def _on(device, args):
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def _inputs(case, m, k, e, s, dtype, seed=0):
    """(format, x [M, S, K], topk_ids, weight arguments) on DEVICE."""
    fmt, kdim, make = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, s, kdim, generator=gen).to(dtype)
    return fmt, x.to(DEVICE), routing(m, k, e, seed).to(DEVICE), _on(DEVICE, make(e, dtype, gen))


def _close(out, ref):
    """fp32: 1e-4 relative to the largest output; bf16: one rounding of the output."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol = 1e-4 if out.dtype == torch.float32 else 1e-2
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=1e-4 * scale)


# ---- the reference against a per-(m, j) loop

def per_pair(fmt, x, topk_ids, args):
    """y[m, j] one pair at a time, each from its expert's whole dequantized weight, in fp64."""
    m, s, k = x.shape
    rows = []
    for r in range(m):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[r, j])
            if fmt == "float":
                w = args[0][e].double()
            elif fmt == "fp8":
                w = dequantize_fp8(args[0][e], args[1][e], args[2], args[3])
            elif fmt == "nvfp4":
                w = dequantize_nvfp4(args[0][e], args[1][e], args[2][e])
            else:
                w = dequantize_int4(args[0][e], args[1][e], args[2][e], args[3], k)
            rows.append(w.double() @ x[r, j if s > 1 else 0].double())
    return torch.stack(rows).reshape(m, topk_ids.shape[1], -1)


@pytest.mark.parametrize("k", [3, 4])
@pytest.mark.parametrize("m", [1, 16])
def test_routing_covers_unchosen_single_and_shared_experts(m, k):
    for e in (8, fewest_experts(k)):
        counts = torch.bincount(routing(m, k, e).flatten(), minlength=e)
        assert counts[0] == m and counts[e - 1] == 1 and counts[e - 2] == 0


@pytest.mark.parametrize("s", ["S1", "Sk"])
@pytest.mark.parametrize("route", [(3, 1), (3, 2), (8, 4)], ids=lambda r: f"E{r[0]}-k{r[1]}")
@pytest.mark.parametrize("case", CASES)
def test_reference_matches_the_per_pair_loop(case, route, s):
    e, k = route
    fmt, x, ids, args = _inputs(case, 5, k, e, 1 if s == "S1" else k, torch.float32)
    x, ids, args = x.cpu(), ids.cpu(), _on("cpu", args)
    want = per_pair(fmt, x, ids, args)
    torch.testing.assert_close(_functions(fmt)[1](x, ids, *args).double(), want, rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())  # fp32 sums vs fp64


# ---- kernels against references

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 5, 16, 37], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, m, dtype):
    for s in (1, 4):                                     # gate/up, down
        fmt, x, ids, args = _inputs(case, m, 4, fewest_experts(4), s, dtype, seed=m)
        kernel_fn, reference_fn = _functions(fmt)
        _close(kernel_fn(x, ids, *args), reference_fn(x, ids, *args))


@pytest.mark.parametrize("s", ["S1", "Sk"])
@pytest.mark.parametrize("route", [(3, 1), (3, 2), (8, 2)], ids=lambda r: f"E{r[0]}-k{r[1]}")
@pytest.mark.parametrize("fmt", SMALL)
def test_kernel_matches_reference_on_other_routings(fmt, route, s):
    e, k = route
    _, x, ids, args = _inputs(SMALL[fmt], 5, k, e, 1 if s == "S1" else k, torch.float32)
    kernel_fn, reference_fn = _functions(fmt)
    _close(kernel_fn(x, ids, *args), reference_fn(x, ids, *args))


def moe_rows(fmt, x, ids, e, width, args, config, gated=False):
    """The skinny kernel on experts with one configuration (operands as the launcher takes
    them)."""
    tensors, params = split_operands(fmt, args)
    return rows_gemm(context(x.device), fmt, x, tensors, FORMATS[fmt].ints(tensors, params, width),
                     width, FORMATS[fmt].k_align(params), gated, config, topk_ids=ids, experts=e)


# (rows, BLOCK_M, BLOCK_N, K step, split): the skinny kernels' FMA and tensor-core paths, K
# whole or split over programs that meet through the (expert, N tile) counters
SKINNY = [(1, 1, 32, 32, 1), (3, 4, 16, 32, 3), (5, 16, 32, 32, 2), (16, 16, 64, 32, 4)]


@pytest.mark.parametrize("s", ["S1", "Sk"])
@pytest.mark.parametrize("config", SKINNY, ids=lambda c: "M{}-BM{}-BN{}-BK{}-S{}".format(*c))
@pytest.mark.parametrize("case", ["float-40x96", "fp8-b16x32-72x160", "nvfp4-72x160",
                                  "int4-g64-72x159"])
def test_skinny_paths_match_the_reference(case, config, s):
    from flash_planner.kernels.gemm.configs import RowsConfig

    m, *tiles = config
    k = 3
    e = fewest_experts(k)
    for dtype in (torch.float32, torch.bfloat16):
        fmt, x, ids, args = _inputs(case, m, k, e, 1 if s == "S1" else k, dtype, seed=m)
        ref = _functions(fmt)[1](x, ids, *args)
        out = moe_rows(fmt, x, ids.to(torch.int32), e, ref.shape[2], args, RowsConfig(*tiles))
        _close(out, ref)
        assert int(context(x.device).counters(1).abs().sum()) == 0


def test_int64_ids_strided_x_and_an_empty_block():
    fmt, x, ids, args = _inputs("int4-g32-40x97", 5, 4, 8, 4, torch.bfloat16)
    wide = torch.zeros(5, 4, 100, dtype=x.dtype, device=DEVICE)
    wide[..., 1:98] = x
    strided = wide[..., 1:98]                                # rows 100 apart, K unit stride
    out = kernel.moe_int4_gemm(strided, ids.long(), *args)
    _close(out, reference.moe_int4_gemm(x, ids, *args))
    empty = kernel.moe_int4_gemm(x[:0], ids[:0], *args)
    assert empty.shape == (0, 4, 40)


# ---- launches, signatures, errors

@pytest.mark.parametrize("fmt", NAMES)
def test_launches_are_declared_specs(fmt):
    kernel_fn = _functions(fmt)[0]
    with record_launches() as launches:
        for dtype in (torch.float32, torch.bfloat16):
            for m in (1, 37):
                _, x, ids, args = _inputs(SMALL[fmt], m, 2, 3, 1, dtype)
                kernel_fn(x, ids, *args)
    assert len(launches) == 4
    skinny = [launch for launch in launches if launch.name.endswith("_rows_kernel")]
    assert len(skinny) == 2                                 # M = 1: the split-K kernel
    specs = report.all_specs()
    assert all(any(spec.admits(launch) for spec in specs) for launch in launches)


@pytest.mark.parametrize("fmt", NAMES)
def test_signatures_match_reference_and_dispatch(fmt):
    kernel_fn, reference_fn = _functions(fmt)
    assert inspect.signature(kernel_fn) == inspect.signature(reference_fn)
    public = getattr(dispatch, NAMES[fmt])
    assert list(inspect.signature(public).parameters) == list(
        inspect.signature(reference_fn).parameters)
    assert NAMES[fmt] in dispatch.TRITON_OPS and NAMES[fmt] in dispatch.__all__


def _bad_calls():
    gen = torch.Generator().manual_seed(0)
    x, ids = torch.randn(3, 1, 96, generator=gen), routing(3, 2, 3)
    (w,) = float_args(3, 40, 96, torch.float32, gen)
    q, s, bn, bk = fp8_args(3, 40, 96, 32, 32, gen)
    p, e, g = nvfp4_args(3, 40, 96, gen)
    p4, f, z, group = int4_args(3, 40, 96, 32, gen)
    f24, z24 = int4_args(3, 40, 96, 24, gen)[1:3]
    wrong_ids = ids.clone()
    wrong_ids[1, 1] = 3
    # The id values (range, repeats) are checked on CPU only in the launcher (a host sync on
    # CUDA); block_k and group multiples of the K step only there.
    values = ("kernel", "reference") if DEVICE == "cpu" else ("reference",)
    both, kernel_only = ("kernel", "reference"), ("kernel",)
    return {  # name -> (format, arguments, the argument the error names, sides)
        "x-S": ("float", (torch.randn(3, 3, 96), ids, w), "x", both),
        "x-rank": ("float", (x[:, 0], ids, w), "x", both),
        "x-dtype": ("float", (x.long(), ids, w), "x", both),
        "ids-rows": ("float", (x, ids[:2], w), "topk_ids", both),
        "ids-dtype": ("float", (x, ids.float(), w), "topk_ids", both),
        "ids-range": ("float", (x, wrong_ids, w), "topk_ids", values),
        "ids-negative": ("fp8", (x, -ids - 1, q, s, bn, bk), "topk_ids", values),
        "ids-repeated": ("int4", (x, ids[:, :1].repeat(1, 2), p4, f, z, group), "topk_ids",
                         values),
        "float-weight-K": ("float", (x, ids, w[..., :90]), "weight", both),
        "float-weight-dtype": ("float", (x, ids, w.half()), "weight", both),
        "fp8-weight-rank": ("fp8", (x, ids, q[0], s, bn, bk), "weight", both),
        "fp8-scale": ("fp8", (x, ids, q, s[:, :1], bn, bk), "scale", both),
        "fp8-block_k": ("fp8", (x, ids, q, s[:, :, :2].contiguous(), bn, 48), "block_k",
                        kernel_only),
        "nvfp4-packed": ("nvfp4", (x, ids, p[..., :40], e, g), "packed", both),
        "nvfp4-global_scale": ("nvfp4", (x, ids, p, e, g[:1]), "global_scale", both),
        "int4-zero": ("int4", (x, ids, p4, f, z.int(), group), "zero", both),
        "int4-group": ("int4", (x, ids, p4, f24, z24, 24), "group", kernel_only),
    }


BAD = _bad_calls()


@pytest.mark.parametrize("case,side", [(c, side) for c in BAD for side in BAD[c][3]])
def test_bad_operands_raise_naming_the_argument(case, side):
    fmt, args, name, _ = BAD[case]
    fn = _functions(fmt)[0 if side == "kernel" else 1]
    with pytest.raises(ValueError, match=name):
        fn(*_on(DEVICE, args))


# ---- gated stacks: each expert's gate rows, then its up rows; y = silu(gate) * up

GATED = {
    "float": (96, lambda e, dt, g: float_args(e, 80, 96, dt, g)),
    "fp8": (160, lambda e, dt, g: fp8_args(e, 64, 160, 16, 32, g)),
    "nvfp4": (160, lambda e, dt, g: (*nvfp4_args(e, 72, 160, g)[:2],
                                     torch.rand(e, 2, generator=g) * 0.02 + 0.01)),
    "int4": (97, lambda e, dt, g: int4_args(e, 80, 97, 32, g)),
}


def _gated_inputs(fmt, m, k, e, dtype, seed=0):
    kdim, make = GATED[fmt]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 1, kdim, generator=gen).to(dtype)
    return x.to(DEVICE), routing(m, k, e, seed).to(DEVICE), _on(DEVICE, make(e, dtype, gen))


def _halves(fmt, args):
    """The gate stack's and the up stack's arguments of a gated stack's."""
    n = args[0].shape[1]
    rows = (slice(0, n // 2), slice(n // 2, n))
    if fmt == "fp8":
        w, s, bn, bk = args
        return [(w[:, r].contiguous(), s[:, r.start // bn:r.stop // bn].contiguous(), bn, bk)
                for r in rows]
    if fmt == "nvfp4":
        p, s, gs = args
        return [(p[:, r].contiguous(), s[:, r].contiguous(), gs[:, h].contiguous())
                for h, r in enumerate(rows)]
    return [tuple(a[:, r].contiguous() if isinstance(a, torch.Tensor) else a for a in args)
            for r in rows]


@pytest.mark.parametrize("fmt", GATED)
def test_gated_reference_is_silu_of_gate_times_up(fmt):
    x, ids, args = _gated_inputs(fmt, 5, 3, 8, torch.float32)
    reference_fn = _functions(fmt)[1]
    gate_args, up_args = _halves(fmt, args)
    want = (torch.nn.functional.silu(reference_fn(x, ids, *gate_args))
            * reference_fn(x, ids, *up_args))
    torch.testing.assert_close(reference_fn(x, ids, *args, gated=True), want, rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 5, 16, 37], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("fmt", GATED)
def test_gated_kernel_matches_reference(fmt, m, dtype):
    """Up to 16 rows the skinny kernel's fused epilogue; a prefill chunk the tiled kernel's
    float32 sums with the activation beside it."""
    x, ids, args = _gated_inputs(fmt, m, 3, fewest_experts(3), dtype, seed=m)
    kernel_fn, reference_fn = _functions(fmt)
    with record_launches() as launches:
        out = kernel_fn(x, ids, *args, gated=True)
    assert out.shape == (m, 3, args[0].shape[1] // 2)
    _close(out, reference_fn(x, ids, *args, gated=True))
    if m <= 16:
        assert launches[0].constexprs["GATED"] is True


@pytest.mark.parametrize("config", SKINNY, ids=lambda c: "M{}-BM{}-BN{}-BK{}-S{}".format(*c))
@pytest.mark.parametrize("fmt", GATED)
def test_gated_skinny_paths_match_the_reference(fmt, config):
    from flash_planner.kernels.gemm.configs import RowsConfig

    m, *tiles = config
    e = fewest_experts(3)
    x, ids, args = _gated_inputs(fmt, m, 3, e, torch.float32, seed=m)
    out = moe_rows(fmt, x, ids.to(torch.int32), e, args[0].shape[1] // 2, args,
                   RowsConfig(*tiles), gated=True)
    _close(out, _functions(fmt)[1](x, ids, *args, gated=True))
    assert int(context(x.device).counters(1).abs().sum()) == 0


def test_a_gated_stack_that_cannot_split_evenly_is_refused():
    x, ids, args = _gated_inputs("nvfp4", 2, 3, 8, torch.float32)
    with pytest.raises(ValueError, match="global_scale"):
        kernel.moe_nvfp4_gemm(x, ids, args[0], args[1], args[2][:, 0], gated=True)
    fp8 = fp8_args(8, 48, 160, 16, 32, torch.Generator().manual_seed(0))   # I = 24: no
    with pytest.raises(ValueError, match="block_n 16"):
        kernel.moe_fp8_gemm(x, ids, *_on(DEVICE, fp8), gated=True)



# Qwen3.8-Flash-Next's routing (512 experts, top 10), on small experts: the interpreter runs
# every (expert, tile) program (seconds a launch here), so N is one tile and K two steps; the
# routing code is every format's: NVFP4 (the published experts' format) stands for them
ROUTED_512 = {"nvfp4": lambda g: nvfp4_args(512, 32, 64, g)}


@pytest.mark.parametrize("fmt,m", [("nvfp4", 3), ("nvfp4", 17)])
def test_flash_next_routing_512_experts_top_10(fmt, m):
    """512 experts, top 10 (an ids tile of 16 with 6 masked slots): decode/verify rows (the
    split-K kernels: gate/up, S = 1, and down, S = 10) and a prefill tile (down, each slot
    reading its own row)."""
    gen = torch.Generator().manual_seed(m)
    args = _on(DEVICE, ROUTED_512[fmt](gen))
    ids = routing(m, 10, 512, seed=m).to(DEVICE)
    assert int(ids.max()) == 511 and len(set(ids.flatten().tolist())) > 2 * m
    kernel_fn, reference_fn = _functions(fmt)
    for s in (1, 10) if m <= 16 else (10,):
        x = torch.randn(m, s, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
        _close(kernel_fn(x, ids, *args), reference_fn(x, ids, *args))
