"""The static roofline of the kernels report (kernels/roofline.py): the K loop found in SASS,
its instruction count and mix, the bytes a K step reads and the issue / memory ratio.

The parser is checked on hand-written SASS in cuobjdump's format (no compiler needed); the
compiled checks run in a child process without TRITON_INTERPRET, skipped where Triton cannot
compile here (as in test_compile.py): a toy loop whose structure is known, and one real
GEMM specialization per kernel for sm_90.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton
import triton.language as tl

from flash_planner.kernels import roofline

HEADER = """
\tcode for sm_90a
\t.target\tsm_90a

\t\tFunction : toy_kernel
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
"""


def sass(*lines: str) -> str:
    """cuobjdump -sass text: each instruction line with its encoding comment and the
    control-code line that follows it."""
    out = [HEADER]
    for line in lines:
        out.append(f"        {line:<70}/* 0x000000000000794d */\n"
                   f"{'':<78}/* 0x000fea0003800000 */")
    return "\n".join(out) + "\n"


# a K loop of BLOCK_K 64 at 0x30..0xc0 (10 instructions), then the trap that ends a function
K_LOOP = sass(
    "/*0000*/                   LDC R1, c[0x0][0x28] ;",
    "/*0010*/                   S2R R0, SR_TID.X ;",
    "/*0020*/                   IMAD.MOV.U32 R4, RZ, RZ, RZ ;",
    "/*0030*/                   LDG.E.128 R8, desc[UR4][R2.64] ;",
    "/*0040*/                   I2FP.F32.S32 R5, R8 ;",
    "/*0050*/                   F2FP.BF16.F32.PACK_AB R6, R5, R5 ;",
    "/*0060*/                   HMMA.16816.F32.BF16 R12, R8, R6, R12 ;",
    "/*0070*/                   FFMA R4, R5.reuse, R5, R4 ;",
    "/*0080*/              @!PT LDS RZ, [RZ] ;",
    "/*0090*/                   UIADD3 UR6, UR6, 0x40, URZ ;",
    "/*00a0*/                   ISETP.GE.AND P0, PT, R0, UR6, PT ;",
    "/*00b0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;",
    "/*00c0*/              @!P0 BRA 0x30 ;",
    "/*00d0*/                   STG.E desc[UR4][R2.64], R4 ;",
    "/*00e0*/                   EXIT ;",
    "/*00f0*/                   BRA 0xf0;",
)

# sm_110-style: an outer K loop (0x10..0xa0, BLOCK_K 32, closed by a uniform-predicate
# branch) holding an inner loop (0x50..0x70) and a branch to an out-of-line mbarrier wait
# after EXIT (0xc0..0xd0, a spin loop), which jumps back into the K loop: not a loop itself
NESTED = sass(
    "/*0000*/                   MOV R1, RZ ;",
    "/*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R8 ;",
    "/*0020*/              @!P0 BRA 0xc0 ;",
    "/*0030*/                   UTCHMMA gdesc[UR8], gdesc[UR10], tmem[UR12], tmem[UR14], "
    "idesc[UR15], UPT ;",
    "/*0040*/                   ULDC UR4, c[0x0][0x380] ;",
    "/*0050*/                   IADD3 R1, R1, 0x1, RZ ;",
    "/*0060*/                   ISETP.NE.AND P1, PT, R1, 0x4, PT ;",
    "/*0070*/               @P1 BRA 0x50 ;",
    "/*0080*/                   UIADD3 UR6, UR6, 0x20, URZ ;",
    "/*0090*/                   UISETP.GE.AND UP0, UPT, UR6, UR7, UPT ;",
    "/*00a0*/                   BRA.U !UP0, 0x10 ;",
    "/*00b0*/                   EXIT ;",
    "/*00c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R8 ;",
    "/*00d0*/              @!P0 BRA 0xc0 ;",
    "/*00e0*/                   BRA 0x30 ;",
    "/*00f0*/                   BRA 0xf0;",
)


def test_the_k_loop_of_handwritten_sass_counted_exactly():
    instructions = roofline.parse(K_LOOP)
    assert len(instructions) == 16
    assert instructions[8].predicate == "@!PT" and instructions[8].opcode == "LDS"
    loop = roofline.main_loop(instructions)
    assert (loop.start, loop.end, len(loop.body), loop.nested) == (0x30, 0xC0, 10, 0)
    assert loop.mix() == {"convert": 2, "int": 2, "float": 1, "mma": 1, "memory": 2,
                          "other": 2}
    assert loop.steps(64) == 1 and loop.steps(32) == 2 and loop.steps(128) is None
    assert [(lp.start, lp.end) for lp in roofline.loops(instructions)] == [(0x30, 0xC0)]


def test_nested_loops_and_out_of_line_waits():
    instructions = roofline.parse(NESTED)
    found = {(lp.start, lp.end): (len(lp.body), lp.nested)
             for lp in roofline.loops(instructions)}
    assert found == {(0x50, 0x70): (3, 0), (0x10, 0xA0): (10, 1), (0xC0, 0xD0): (2, 0)}
    loop = roofline.main_loop(instructions)
    assert (loop.start, len(loop.body), loop.nested) == (0x10, 10, 1)
    assert loop.mix() == {"convert": 0, "int": 4, "float": 0, "mma": 1, "memory": 1,
                          "other": 4}
    assert loop.steps(32) == 1


def test_sass_that_is_not_one_function_is_refused():
    with pytest.raises(roofline.SassError, match="no SASS instructions"):
        roofline.parse("cuobjdump info    : File 'x.cubin' does not contain device code")
    with pytest.raises(roofline.SassError, match="one function"):
        roofline.parse(K_LOOP + K_LOOP)
    assert roofline.main_loop(roofline.parse(sass("/*0000*/ EXIT ;"))) is None


def test_the_ratio_at_the_fp8_anchor():
    """The skinny fp8 K loop a colleague counted (27B MLP down, BLOCK_M 16, 4 warps, 64 x 64
    e4m3 bytes a step): 375 instructions issue in 1.5x the H200's memory time of a step and
    in 0.79x Thor's (FACTS.md section 21)."""
    h200, thor = roofline.DEVICES["sm_90"], roofline.DEVICES["sm_110"]
    assert roofline.ratio(375, 4, 4096, h200) == pytest.approx(1.506, abs=1e-3)
    assert roofline.ratio(375, 4, 4096, thor) == pytest.approx(0.793, abs=1e-3)
    assert h200.memory_s(4096) == pytest.approx(4096 * 132 / 4.3e12)
    assert thor.issue_s(375, 4) == pytest.approx(375 / 1.575e9)
    with pytest.raises(ValueError, match="must read bytes"):
        roofline.ratio(375, 4, 0, h200)


@pytest.mark.parametrize(("fmt", "block_n", "block_k", "gated", "weight", "want"), [
    ("fp8", 64, 64, False, None, 4096 + 4096 * 4 / (128 * 128)),   # fp32 per 128 x 128
    ("fp8", 32, 64, True, None, 2 * (2048 + 2048 * 4 / (128 * 128))),
    ("nvfp4", 64, 128, False, None, 4096 + 64 * 128 / 16),          # e4m3 per 16 values
    ("int4", 64, 128, False, None, 4096 + 64 * 5),                   # fp32 + u8 per 128
    ("float", 64, 64, False, "*bf16", 8192),
    ("float", 32, 64, True, "*fp32", 2 * 8192),
], ids=["fp8", "fp8-gated", "nvfp4", "int4", "bf16", "fp32-gated"])
def test_weight_bytes_per_k_step(fmt, block_n, block_k, gated, weight, want):
    assert roofline.step_bytes(fmt, block_n, block_k, gated, weight) == pytest.approx(want)


def test_unknown_format_named():
    with pytest.raises(ValueError, match="unknown GEMM format 'fp6'"):
        roofline.step_bytes("fp6", 64, 64)


def test_every_opcode_class_is_a_known_class():
    assert set(roofline.OPCODE_CLASSES.values()) <= set(roofline.CLASSES)


# ---- compiled (a child process without TRITON_INTERPRET)

@triton.jit
def _row_sums(x, out, K, BLOCK: tl.constexpr):
    """out[j] = sum over k0 of x[k0 + j]: one load and one add per element a K step."""
    r = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        acc += tl.load(x + k0 + r)
    tl.store(out + r, acc)


def compiled_facts() -> dict:
    """Run in the child: the toy loop compiled twice for sm_90, and one skinny and one tiled
    GEMM spec through the report's own row."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flash_planner.kernels import report
    from flash_planner.kernels.gemm import skinny, tiled

    why = report.cannot_compile()
    if why is not None:
        return {"skip": why}
    toys = []
    for _ in range(2):
        source = ASTSource(fn=_row_sums, signature={"x": "*fp32", "out": "*fp32", "K": "i32",
                                                    "BLOCK": "constexpr"},
                           constexprs={"BLOCK": 128},
                           attrs={(0,): [["tt.divisibility", 16]],
                                  (2,): [["tt.divisibility", 16]]})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 1, "num_stages": 1})
        text = report.cuobjdump(compiled.asm["cubin"], "-sass")
        found = roofline.loops(roofline.parse(text))
        loop = roofline.main_loop(roofline.parse(text))
        toys.append({"loops": len(found), "size": len(loop.body), "steps": loop.steps(128),
                     "loads": sum(i.base == "LDG" for i in loop.body),
                     "adds": sum(i.base == "FADD" for i in loop.body), "mix": loop.mix()})
    fp8 = next(s for s in skinny.SPECS if s.constexprs["FORMAT"] == "fp8"
               and s.constexprs["BLOCK_M"] == 16 and " 27B " in s.label and "down" in s.label)
    nvfp4 = next(s for s in tiled.SPECS if s.constexprs["FORMAT"] == "nvfp4"
                 and not s.constexprs["ROUTED"] and " 27B " in s.label)
    return {"toys": toys, "gemms": [report.compile_row(s, "sm_90") for s in (fp8, nvfp4)]}


CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("roofline_child", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(json.dumps(module.compiled_facts()))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", CHILD, __file__], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in facts:
        pytest.skip(facts["skip"])
    return facts


def test_a_compiled_toy_loop_is_found_and_counted_stably(compiled):
    """The toy's one loop: a vector load (4 fp32 a thread) and 4 adds per K step. ptxas
    unrolls it: the count per step divides the body by the steps its in-place add makes."""
    first, second = compiled["toys"]
    assert first == second
    assert first["loops"] == 1
    steps = first["steps"]
    assert steps is not None and first["loads"] == steps and first["adds"] == 4 * steps
    assert 5 * steps <= first["size"] <= 16 * steps
    assert first["mix"]["mma"] == 0 and first["mix"]["convert"] == 0


def test_a_real_gemm_spec_has_a_k_loop_and_sane_bytes(compiled):
    fp8, nvfp4 = compiled["gemms"]
    assert fp8["tile"] == "16x64x64" and fp8["bytes"] == pytest.approx(4097, abs=1)
    assert fp8["steps"] == 1 and fp8["nested"] == 0 and fp8["device"] == "H200"
    assert 80 <= fp8["instr"] <= 1000 and fp8["mix"]["mma"] > 0
    assert sum(fp8["mix"].values()) == fp8["loop"] == fp8["instr"]
    assert fp8["ratio"] == pytest.approx(
        roofline.ratio(fp8["instr"], 4, fp8["bytes"], roofline.DEVICES["sm_90"]), rel=1e-3)
    assert nvfp4["tile"] == "64x64x64" and nvfp4["bytes"] == pytest.approx(2048 + 256)
    assert nvfp4["steps"] == 1 and nvfp4["instr"] > 0 and nvfp4["mix"]["mma"] > 0
