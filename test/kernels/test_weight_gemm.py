"""Weight-only GEMMs (FP8 block/channel scales, NVFP4, int4 with zero points): the Triton
kernels against their references, and the references against a baseline written here.

The baseline decodes e4m3 and E2M1 from the formats' definitions (sign, exponent, mantissa)
code by code, picks nibble i of a row as byte i // 2 shifted by 4 * (i % 2), and indexes the
scales element by element, so a wrong table, nibble order or scale index in a reference fails.
Shapes are odd on purpose: N and K off the kernels' tiles, K off the 128-wide FP8 blocks, odd
K and a partial last group for int4, M = 1 (decode), 5, 16 (verify) and 37 (a prefill tile).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from flash_planner.kernels import dispatch, report
from flash_planner.kernels.gemm import ops, reference
from flash_planner.kernels.specs import record_launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODULES = {"fp8": (ops, reference), "nvfp4": (ops, reference), "int4": (ops, reference)}


# ---- the baseline, from the formats' definitions

def _e4m3(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if code & 0x7F == 0x7F:
        return float("nan")
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6                      # subnormal
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def _e2m1(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    return sign * (man / 2 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


E4M3 = torch.tensor([_e4m3(c) for c in range(256)])
E2M1 = torch.tensor([_e2m1(c) for c in range(16)])
FINITE_E4M3 = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)


def nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    """q [N, k]: value i of a row sits in byte i // 2, the low nibble for even i."""
    i = torch.arange(k)
    return (packed[:, i // 2].long() >> (4 * (i % 2))) & 0xF


def baseline_fp8(weight, scale, block_n, block_k):
    n, k = weight.shape
    s = scale[torch.arange(n)[:, None] // block_n, torch.arange(k)[None, :] // block_k]
    return E4M3[weight.long()] * s


def baseline_nvfp4(packed, scale, global_scale):
    k = packed.shape[1] * 2
    return E2M1[nibbles(packed, k)] * E4M3[scale.long()][:, torch.arange(k) // 16] * global_scale


def baseline_int4(packed, scale, zero, group, k):
    g = torch.arange(k) // group
    return (nibbles(packed, k).float() - zero[:, g].float()) * scale[:, g]


# ---- random quantized weights (the arguments after x)

def fp8_args(n, k, block_n, block_k, gen):
    weight = FINITE_E4M3[torch.randint(0, len(FINITE_E4M3), (n, k), generator=gen)]
    scale = torch.rand(-(-n // block_n), -(-k // block_k), generator=gen) * 0.01 + 1e-3
    return weight, scale, block_n, block_k


def nvfp4_args(n, k, gen):
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(0, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen)  # > 0
    return packed, scale, torch.tensor([0.0173])


def int4_args(n, k, group, gen):
    packed = torch.randint(0, 256, (n, -(-k // 2)), dtype=torch.uint8, generator=gen)
    groups = -(-k // group)
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 1e-3
    zero = torch.randint(0, 16, (n, groups), dtype=torch.uint8, generator=gen)
    return packed, scale, zero, group


# name -> (format, K, make the weight arguments from a generator)
CASES = {
    "fp8-block-200x300": ("fp8", 300, lambda g: fp8_args(200, 300, 128, 128, g)),
    "fp8-channel-45x260": ("fp8", 260, lambda g: fp8_args(45, 260, 1, 128, g)),
    "nvfp4-77x272": ("nvfp4", 272, lambda g: nvfp4_args(77, 272, g)),
    "nvfp4-130x208": ("nvfp4", 208, lambda g: nvfp4_args(130, 208, g)),
    "int4-g32-100x271": ("int4", 271, lambda g: int4_args(100, 271, 32, g)),
    "int4-g128-61x301": ("int4", 301, lambda g: int4_args(61, 301, 128, g)),
}


def _functions(fmt):
    kernel, reference = MODULES[fmt]
    name = f"{fmt}_gemm"
    return getattr(kernel, name), getattr(reference, name)


def _on(device, args):
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def _close(out, ref):
    """fp32: 1e-4 relative to the largest output; bf16 / fp16: one rounding of the output."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol = 1e-4 if out.dtype == torch.float32 else 1e-2
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=1e-4 * scale)


# ---- references against the baseline

@pytest.mark.parametrize("case", CASES)
def test_reference_matches_the_baseline(case):
    fmt, k, make = CASES[case]
    gen = torch.Generator().manual_seed(1)
    args = make(gen)
    if fmt == "fp8":
        w, want = reference.dequantize_fp8(*args), baseline_fp8(*args)
    elif fmt == "nvfp4":
        w, want = reference.dequantize_nvfp4(*args), baseline_nvfp4(*args)
    else:
        w, want = reference.dequantize_int4(*args, k), baseline_int4(*args, k)
    assert torch.equal(w, want)
    x = torch.randn(3, k, generator=gen)
    y = _functions(fmt)[1](x, *args)
    torch.testing.assert_close(y.double(), x.double() @ want.double().T, rtol=1e-5, atol=1e-5)


def test_baseline_tables_agree_with_torch_float8():
    finite = FINITE_E4M3
    assert torch.equal(E4M3[finite.long()], finite.view(torch.float8_e4m3fn).float())
    assert E2M1.tolist() == list(reference.E2M1)


# ---- kernels against references

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 5, 16, 37], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, m, dtype):
    fmt, k, make = CASES[case]
    gen = torch.Generator().manual_seed(m)
    args = _on(DEVICE, make(gen))
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    kernel, reference = _functions(fmt)
    _close(kernel(x, *args), reference(x, *args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["fp8-block-200x300", "nvfp4-77x272", "int4-g32-100x271"])
def test_leading_dims_and_strided_rows(case, dtype):
    fmt, k, make = CASES[case]
    gen = torch.Generator().manual_seed(7)
    args = _on(DEVICE, make(gen))
    wide = torch.randn(2, 3, k + 5, generator=gen).to(dtype).to(DEVICE)
    x = wide[..., 2:k + 2]                                   # [2, 3, K], rows k + 5 apart
    kernel, reference = _functions(fmt)
    out = kernel(x, *args)
    assert out.shape == (2, 3, len(args[0]))
    _close(out, reference(x, *args))


def test_kernels_decode_every_code_exactly():
    """x = I reads the dequantized weight out through the dot: exact, code by code."""
    eye = torch.eye(256, device=DEVICE)
    weight = FINITE_E4M3.reshape(2, 127)
    weight = torch.cat((weight, weight.flip(1)), 1)                       # [2, 254]
    scale = torch.ones(1, 2)
    args = _on(DEVICE, (weight, scale, 128, 128))
    assert torch.equal(ops.fp8_gemm(eye[:254, :254], *args).T.cpu(), baseline_fp8(
        weight, scale, 128, 128))
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)       # every nibble pair
    scale = torch.tensor([[0x01, 0x08, 0x38, 0x7E, 0x3F, 0x41, 0x29, 0x30]] * 4,
                         dtype=torch.uint8)
    args = _on(DEVICE, (packed, scale, torch.tensor([1.0])))
    assert torch.equal(ops.nvfp4_gemm(eye[:128, :128], *args).T.cpu(),
                       baseline_nvfp4(packed, scale, 1.0))
    zero = torch.tensor([[0, 8, 15, 2], [3, 12, 1, 9], [15, 0, 7, 4], [8, 8, 8, 8]],
                        dtype=torch.uint8)
    scale = torch.tensor([[1.0, 0.5, 0.25, 2.0]] * 4)
    args = _on(DEVICE, (packed, scale, zero, 32))                      # K = 127: odd, partial
    assert torch.equal(ops.int4_gemm(eye[:127, :127], *args).T.cpu(),
                       baseline_int4(packed, scale, zero, 32, 127))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 37], ids=lambda m: f"M{m}")
def test_per_channel_fp8_as_loaded_runs_on_the_triton_backend(m, dtype):
    """compressed-tensors' per-channel FP8 (a [N, 1] scale) as the loader builds it: an
    Fp8Linear with block_n 1 whose one scale per row is spread over [N, K / 128], called
    through dispatch with the Triton backend forced: the dequantized weight's product."""
    from flash_planner.engine.weights import fp8

    n, k = 45, 260                                   # N off the tile, K off the 128 blocks
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=gen)
    scale = w.abs().amax(1, keepdim=True) / 448                         # [N, 1] on disk
    q = (w / scale).to(torch.float8_e4m3fn)
    layout = fp8.ct_fp8("channel", None)
    with torch.device("meta"):
        module = layout.module(n, k)
    module = module.to_empty(device=DEVICE)
    packed = layout.convert({"weight": q, "weight_scale": scale}, n, k)
    module.set_packed({name: t.to(DEVICE) for name, t in packed.items()})
    assert (module.block_n, module.block_k) == (1, 128)
    assert tuple(module.scale.shape) == (n, 3)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    dispatch.set_backend("triton")
    try:
        assert dispatch._pick("fp8_gemm", None, x) is dispatch.TRITON_OPS["fp8_gemm"]
        with record_launches() as launches:
            out = module(x)
    finally:
        dispatch.set_backend("auto")
    assert len(launches) == 1
    want = (x.float() @ (q.float() * scale).to(DEVICE).T).to(dtype)
    _close(out, want)


# ---- launches, signatures, errors

@pytest.mark.parametrize("case", ["fp8-channel-45x260", "nvfp4-77x272", "int4-g128-61x301"])
def test_launches_are_declared_specs(case):
    fmt, k, make = CASES[case]
    args = _on(DEVICE, make(torch.Generator().manual_seed(0)))
    kernel = _functions(fmt)[0]
    with record_launches() as launches:
        for dtype in (torch.float32, torch.bfloat16):
            for m in (1, 37):
                kernel(torch.randn(m, k).to(dtype).to(DEVICE), *args)
    assert len(launches) == 4
    skinny = [launch for launch in launches if launch.name == "_gemm_rows_kernel"
              and launch.constexprs["FORMAT"] == fmt]
    assert len(skinny) == 2                                 # M = 1: the split-K kernel
    specs = report.all_specs()
    assert all(any(spec.admits(launch) for spec in specs) for launch in launches)


@pytest.mark.parametrize("fmt", MODULES)
def test_signatures_match_reference_and_dispatch(fmt):
    kernel, reference = _functions(fmt)
    assert inspect.signature(kernel) == inspect.signature(reference)
    public = getattr(dispatch, f"{fmt}_gemm")
    assert list(inspect.signature(public).parameters) == list(
        inspect.signature(reference).parameters)
    assert f"{fmt}_gemm" in dispatch.TRITON_OPS and f"dequantize_{fmt}" in dispatch.__all__


def _bad_calls():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256)
    w, s, _, _ = fp8_args(40, 256, 128, 128, gen)
    p, e, g = nvfp4_args(40, 256, gen)
    q, f, z, _ = int4_args(40, 256, 32, gen)
    return {
        "fp8-weight-K": (ops.fp8_gemm, (x, w[:, :200], s, 128, 128), "weight"),
        "fp8-scale-shape": (ops.fp8_gemm, (x, w, s[:, :1], 128, 128), "scale"),
        "fp8-scale-dtype": (ops.fp8_gemm, (x, w, s.half(), 128, 128), "scale"),
        "fp8-block_k": (ops.fp8_gemm, (x, w, s, 128, 48), "block_k"),
        "fp8-x-dtype": (ops.fp8_gemm, (x.long(), w, s, 128, 128), "x"),
        "nvfp4-K": (ops.nvfp4_gemm, (x[:, :250], p, e, g), "K"),
        "nvfp4-packed": (ops.nvfp4_gemm, (x, p[:, :64], e, g), "packed"),
        "nvfp4-scale": (ops.nvfp4_gemm, (x, p, e.float(), g), "scale"),
        "nvfp4-global_scale": (ops.nvfp4_gemm, (x, p, e, torch.ones(2)), "global_scale"),
        "int4-packed": (ops.int4_gemm, (x, q[:, 1:], f, z, 32), "packed"),
        "int4-scale": (ops.int4_gemm, (x, q, f[:, :3], z, 32), "scale"),
        "int4-zero": (ops.int4_gemm, (x, q, f, z.int(), 32), "zero"),
        "int4-group": (ops.int4_gemm, (x, q, f, z, 24), "group"),
    }


BAD = _bad_calls()


@pytest.mark.parametrize("case", BAD)
def test_bad_operands_raise_naming_the_tensor(case):
    fn, args, name = BAD[case]
    with pytest.raises(ValueError, match=name):
        fn(*_on(DEVICE, args))
