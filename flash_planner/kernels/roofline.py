"""A static roofline of the weight-only GEMMs, read from their SASS: instructions per K step
against the weight bytes a K step reads.

A decode GEMM keeps up with memory only if an SM issues one K step's instructions in less
time than its share of the bandwidth takes to bring that step's weights in. Both sides are
counted from a cubin compiled here (no GPU):
  instructions  the main K loop of `cuobjdump -sass`: the body of a loop closed by a backward
                `BRA` (target at or below the branch), counted per warp per iteration,
                every instruction between the target and the branch inclusive (predicated-off
                padding such as `@!PT LDS` too: it takes an issue slot). Not loops: a branch
                to itself (the trap that ends a function) and a backward branch whose range
                holds an unpredicated EXIT (an out-of-line block, e.g. an mbarrier wait retry
                placed after the function's end, jumping back into the code). The K loop is
                the largest loop; loops inside it (none in our kernels at present; an
                mbarrier spin-wait would be one) are counted once, as one pass, and reported
                as `nested`, so that a nonzero `nested` marks the count as a lower bound.
                Blocks outside the body that it branches to (wait retries) are not counted.
                One iteration should be one K step of BLOCK_K (Triton's pipeliner does not
                unroll), but ptxas may unroll a loop (it does a plain load-and-add loop 4
                times): the in-place adds of the body tell. `k0 += BLOCK_K` there: one step;
                only m x BLOCK_K: m steps, and the count is divided by m; neither: unknown
                (`steps` None, the count taken as one step)
  bytes         BLOCK_N x BLOCK_K x the weight's bits / 8, plus the scale (and zero) bytes
                of those values, amortized over the values a scale covers (formats.py: fp8 one
                fp32 per 128 x 128 block, nvfp4 one e4m3 byte per 16, int4 an fp32 scale and a
                uint8 zero per group of 128); GATED programs decode two tiles a step (gate and
                up): twice that. nvfp4's global scale is read once, after the loop
  ratio         issue time / memory time of one K step on the device the target stands for:
                instructions x warps / SCHEDULERS / clock against bytes / (bandwidth / SMs).
                Under 1 the loop can keep up with the SM's share of bandwidth; over 1 it
                cannot, whatever the occupancy (both sides scale with the programs an SM holds)
The mix counts the loop's instructions by class (OPCODE_CLASSES): where the issue slots go.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .gemm.formats import DECLARED_INTS, FORMATS, NVFP4_GROUP

SCHEDULERS = 4    # warp schedulers per SM (Hopper, Blackwell): each issues one instruction
                  # per clock


@dataclass(frozen=True)
class Device:
    """The figures a target's roofline is read against."""

    name: str
    sms: int
    clock_hz: float
    read_bytes_per_s: float    # sustained weight read bandwidth of the whole device
    source: str

    def issue_s(self, instructions: int, warps: int) -> float:
        """Seconds an SM takes to issue `instructions` per warp for `warps` warps."""
        return instructions * warps / SCHEDULERS / self.clock_hz

    def memory_s(self, nbytes: float) -> float:
        """Seconds an SM's share of the bandwidth takes to read `nbytes`."""
        return nbytes / (self.read_bytes_per_s / self.sms)


# the sm_90 compile stands for the H200, the sm_110 compile for Thor
DEVICES = {
    "sm_90": Device("H200", 132, 1.98e9, 4.3e12,
                    "H200 SXM: 132 SMs, ~1.98 GHz boost, ~4.3 TB/s read of its 4.8 TB/s "
                    "HBM3e (FACTS.md section 21)"),
    "sm_110": Device("Thor", 20, 1.575e9, 273e9,
                     "Jetson AGX Thor T5000: 20 SMs, ~1.575 GHz, 273 GB/s LPDDR5X "
                     "(FACTS.md sections 6 and 21)"),
}

CLASSES = ("convert", "int", "float", "mma", "memory", "other")
# base opcode (modifiers dropped) -> class; an opcode missing here is "other": branches,
# barriers and their waits (BAR, DEPBAR, LDGDEPBAR, SYNCS), special registers (S2R, S2UR),
# warp shuffles (SHFL: the FMA path's sums over K), votes, fences
OPCODE_CLASSES = {
    **dict.fromkeys(("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "I2I", "I2IP", "FRND"),
                    "convert"),
    **dict.fromkeys(("IMAD", "IADD3", "IADD", "VIADD", "LOP3", "LOP", "SHF", "SHL", "SHR",
                     "PRMT", "LEA", "ISETP", "IABS", "IMNMX", "VIMNMX", "IMUL", "SEL", "MOV",
                     "POPC", "FLO", "BREV", "BMSK", "SGXT", "PLOP3", "P2R", "R2P", "IDP", "CS2R",
                     "UIMAD", "UIADD3", "UIADD", "ULOP3", "USHF", "USHL", "USHR", "UPRMT",
                     "ULEA", "UISETP", "USEL", "UMOV", "UPLOP3", "UIABS", "UIMNMX", "UFLO",
                     "UPOPC", "UBREV", "UBMSK", "USGXT", "UP2UR", "ULEPC"), "int"),
    **dict.fromkeys(("FMUL", "FFMA", "FADD", "FMNMX", "FSETP", "FSET", "FSEL", "FCHK", "MUFU",
                     "FSWZADD", "FFMA2", "FADD2", "FMUL2", "FMNMX2", "HMUL2", "HFMA2",
                     "HADD2", "HMNMX2", "HSETP2", "HSET2", "DADD", "DMUL", "DFMA", "DSETP"),
                    "float"),
    **dict.fromkeys(("HMMA", "HGMMA", "IMMA", "IGMMA", "QMMA", "QGMMA", "OMMA", "DMMA", "BMMA",
                     "UTCHMMA", "UTCQMMA", "UTCOMMA", "UTCIMMA", "UTCMMA"), "mma"),
    **dict.fromkeys(("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDGSTS", "LD", "ST", "LDL",
                     "STL", "LDC", "ULDC", "ATOM", "ATOMG", "ATOMS", "RED", "REDG", "UBLKCP",
                     "UTMALDG", "UTMASTG", "UTMAPF", "LDTM", "STTM", "UTCCP", "LDGMC"),
                    "memory"),
}
INT_ADDS = ("IADD3", "UIADD3", "VIADD", "IADD", "UIADD")


class SassError(RuntimeError):
    """The SASS could not be read as expected."""


@dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str              # "@P0", "@!UPT", ... or ""
    opcode: str                 # with modifiers: "HMMA.16816.F32.BF16"
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def kind(self) -> str:
        return OPCODE_CLASSES.get(self.base, "other")


@dataclass(frozen=True)
class Loop:
    start: int                  # the backward branch's target
    end: int                    # the branch's address
    body: tuple[Instruction, ...]
    nested: int = 0             # loops inside this one (counted once)

    def contains(self, other: Loop) -> bool:
        return self.start <= other.start and other.end <= self.end and other != self

    def mix(self) -> dict[str, int]:
        counts = Counter(ins.kind for ins in self.body)
        return {kind: counts.get(kind, 0) for kind in CLASSES}

    def increments(self) -> list[int]:
        """The immediates the body adds to a register in place (r = r + imm, the low word of
        an add): its induction steps (k0, pipeline stage indices, pointers)."""
        out = []
        for ins in self.body:
            if ins.base not in INT_ADDS or ".X" in ins.opcode:
                continue
            ops = [op.strip().removesuffix(".reuse") for op in ins.operands.split(",")]
            if ops[0] in ops[1:]:
                out += [int(op, 0) for op in ops[1:] if _IMMEDIATE.fullmatch(op)]
        return out

    def steps(self, block_k: int) -> int | None:
        """K steps of `block_k` one iteration makes: 1 where the body adds block_k in place
        (k0 += BLOCK_K), m where it adds only m x block_k (ptxas unrolled the loop m
        times), None where it adds neither (unknown)."""
        multiples = sorted(abs(i) // block_k for i in self.increments()
                           if i and abs(i) % block_k == 0)
        return multiples[0] if multiples else None


_IMMEDIATE = re.compile(r"-?0x[0-9a-f]+|-?\d+")
_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P(?:\d|T)\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_TARGET = re.compile(r"(?:^|,)\s*(?:`\()?0x([0-9a-f]+)\)?\s*$")


def parse(sass: str) -> list[Instruction]:
    """The instructions of the one function in `cuobjdump -sass` text, in address order."""
    functions = sass.count("Function :")
    if functions > 1:
        raise SassError(f"expected one function in the SASS, found {functions}")
    out = [Instruction(int(a, 16), (p or "").strip(), op, args.strip())
           for a, p, op, args in _LINE.findall(sass)]
    if not out:
        raise SassError("no SASS instructions found (not `cuobjdump -sass` output?)")
    return out


def branch_target(ins: Instruction) -> int | None:
    """The target address of a direct branch (`BRA 0x...`, `BRA.U !UP0, 0x...`), else None."""
    if ins.base != "BRA":
        return None
    match = _TARGET.search(ins.operands)
    if match is None:
        raise SassError(f"BRA at {ins.address:#x} with an unreadable target: {ins.operands!r}")
    return int(match.group(1), 16)


def loops(instructions: list[Instruction]) -> list[Loop]:
    """Every loop closed by a backward branch (the module docstring says which are not)."""
    found = []
    for ins in instructions:
        target = branch_target(ins)
        if target is None or target >= ins.address:
            continue
        body = tuple(x for x in instructions if target <= x.address <= ins.address)
        if any(x.base == "EXIT" and not x.predicate for x in body):
            continue
        found.append(Loop(target, ins.address, body))
    return [Loop(lp.start, lp.end, lp.body, sum(lp.contains(o) for o in found))
            for lp in found]


def main_loop(instructions: list[Instruction]) -> Loop | None:
    """The K loop: the largest loop (None in a kernel without one)."""
    return max(loops(instructions), key=lambda lp: len(lp.body), default=None)


def scale_bytes_per_value(fmt: str) -> float:
    """Bytes of scale (and zero point) per weight value at the declared parameters."""
    if fmt == "fp8":
        block_n, block_k, _ = DECLARED_INTS["fp8"](1, 1)
        return 4 / (block_n * block_k)                  # one fp32 per block
    if fmt == "nvfp4":
        return 1 / NVFP4_GROUP                          # one e4m3 per 16 values
    if fmt == "int4":
        group = DECLARED_INTS["int4"](1, 1)[1]
        return (4 + 1) / group                          # fp32 scale + uint8 zero per group
    if fmt == "float":
        return 0.0
    raise ValueError(f"no scale layout for format {fmt!r}")


def step_bytes(fmt: str, block_n: int, block_k: int, gated: bool = False,
               weight_type: str | None = None) -> float:
    """Weight bytes one program reads per K step; `weight_type` the float format's Triton
    pointer type ("*bf16", "*fp32"): its bits (the format table's 16 otherwise)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown GEMM format {fmt!r}; known: {', '.join(FORMATS)}")
    bits = FORMATS[fmt].bits
    if fmt == "float" and weight_type is not None:
        bits = int(re.sub(r"\D", "", weight_type))
    values = block_n * block_k
    return values * (bits / 8 + scale_bytes_per_value(fmt)) * (2 if gated else 1)


def ratio(instructions: int, warps: int, nbytes: float, device: Device) -> float:
    """Issue time / memory time of one K step on `device`."""
    if nbytes <= 0:
        raise ValueError(f"a K step must read bytes, got {nbytes}")
    return device.issue_s(instructions, warps) / device.memory_s(nbytes)


def is_gemm(spec: Any) -> bool:
    """Whether a kernels/specs.Spec is one of the weight-only GEMMs (skinny or tiled)."""
    return {"FORMAT", "BLOCK_N", "BLOCK_K"} <= set(spec.constexprs)


def spec_roofline(spec: Any, target: str, sass: str) -> dict:
    """The roofline fields of a GEMM spec's row, from its SASS for `target`: `loop` the K
    loop's instructions per iteration, `steps` the K steps an iteration makes (None:
    unknown, taken as 1), `instr` per K step."""
    c = spec.constexprs
    body = main_loop(parse(sass))
    nbytes = step_bytes(c["FORMAT"], c["BLOCK_N"], c["BLOCK_K"], c.get("GATED", False),
                        spec.types.get("w"))
    device = DEVICES[target]
    size = len(body.body) if body else 0
    steps = body.steps(c["BLOCK_K"]) if body else None
    instr = round(size / (steps or 1))
    return {"tile": f"{c.get('BLOCK_M', '?')}x{c['BLOCK_N']}x{c['BLOCK_K']}", "loop": size,
            "steps": steps, "nested": body.nested if body else 0, "instr": instr,
            "bytes": round(nbytes, 1), "device": device.name,
            "ratio": round(ratio(instr, spec.num_warps, nbytes, device), 3),
            "mix": body.mix() if body else dict.fromkeys(CLASSES, 0)}
