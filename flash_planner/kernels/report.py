"""Compile every declared kernel specialization for Thor (sm_110) and Hopper (sm_90), here.

No GPU is needed: Triton compiles to a cubin with the ptxas it ships, and its cuobjdump reads
the cubin's resource usage. One row per kernel x specialization x target:
  regs      registers per thread (<= 255). An SM has 64K registers, so a 128-thread
            program at R registers fits floor(65536 / (128 R)) times: resident warps
  stack     bytes of stack frame; local spills go there (must be 0 for per-cycle kernels)
  local     local-memory bytes (register spills)
  smem      shared memory per program, static + dynamic bytes; 227 KiB is the per-block
            limit on sm_90 and the one assumed for sm_110 (cc 10.x/11.x); Thor's SM has 228 KiB
  cubin     cubin size in bytes
  tensor    tensor-core instruction in the PTX: wgmma (sm_90), tcgen05 (sm_100/110),
            mma (sync MMA, any target), or none for kernels without tl.dot (and the skinny
            GEMMs' FMA specializations, BLOCK_M < 16)
  vector    the widest global load in bytes: ld.global.v4.b32 or a 16-byte cp.async is 16.
            Arguments a spec declares `aligned` are compiled as divisible by 16, as Triton
            specializes a launch whose pointers and sizes are; the others as unknown
The weight-only GEMMs' rows (skinny and tiled, 2-D and routed) add a static roofline of
their main K loop, read from `cuobjdump -sass` (roofline.py says how):
  instr     SASS instructions per warp per K step of BLOCK_K: the K loop's body, divided by
            the K steps one iteration makes (1 unless ptxas unrolled the loop)
  bytes     weight bytes one program reads per K step, scales included; twice for GATED
  ratio     issue time / memory time of a K step: instr x warps / 4 schedulers / clock
            against bytes / (bandwidth / SMs), for the H200 on sm_90 rows and Thor on sm_110
            rows (roofline.DEVICES). Over 1 the loop's instructions, not the weight reads,
            bound the kernel
`--json` adds per GEMM row the tile (BMxBNxBK), the device, `loop` (instructions per
iteration), `steps` (K steps per iteration: 1 unless ptxas unrolled the loop; None if the
body adds no BLOCK_K), `nested` (loops inside the K loop, counted once) and the loop's
instruction mix by class (counts per iteration); `--roofline` compiles the GEMMs only and
prints their rows with the mix.
Run as `python -m flash_planner.kernels.report [--json | --roofline]` (`make kernels-report`),
without TRITON_INTERPRET (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from . import roofline
from .specs import Spec
from .toolchain import ToolchainError, guarded

MODULES = ("accept.kernel", "gdn_commit.kernel", "gdn_steps.kernel", "gemm.skinny",
           "gemm.tiled", "kv_append.kernel")
TARGETS = {"sm_90": 90, "sm_110": 110}
SHARED_LIMIT = 227 * 1024  # bytes per block, sm_90; taken for sm_110 too (see the docstring)
MAX_REGS = 255
TENSOR_OPS = ("tcgen05", "wgmma", "mma")  # the first found in the PTX names the row


def kernel_modules() -> list:
    return [importlib.import_module(f"{__package__}.{name}") for name in MODULES]


def all_specs() -> list[Spec]:
    return [spec for module in kernel_modules() for spec in module.SPECS]


def uses_dot(spec: Spec) -> bool:
    """Whether the kernel is a matmul kernel: its source, or that of a @triton.jit helper it
    calls (at any depth; the weight-only GEMMs share one dot helper), calls tl.dot. A skinny
    GEMM's BLOCK_M under 16 compiles its FMA path instead (gemm/tiles.dot_step)."""
    from triton.runtime.jit import JITFunction

    if spec.constexprs.get("BLOCK_M", 16) < 16:
        return False
    todo, seen = [getattr(spec.kernel, "fn", spec.kernel)], set()
    while todo:
        fn = todo.pop()
        seen.add(fn)
        source = inspect.getsource(fn)
        if "tl.dot(" in source:
            return True
        todo += [obj.fn for name, obj in fn.__globals__.items()
                 if isinstance(obj, JITFunction) and f"{name}(" in source
                 and obj.fn not in seen]
    return False


def cannot_compile() -> str | None:
    """Why this Triton cannot compile for an NVIDIA GPU here, or None."""
    import triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 is set: interpreted kernels cannot be compiled"
    from triton.backends import backends

    if "nvidia" not in backends:
        return f"Triton {triton.__version__} has no NVIDIA backend"
    if not (_bin_dir() / "cuobjdump").is_file():
        return f"Triton {triton.__version__} ships no cuobjdump"
    return None


def _bin_dir() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def cuobjdump(cubin: bytes, option: str) -> str:
    """What Triton's cuobjdump prints for `cubin` with `option` (`--dump-resource-usage`,
    `-sass`)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(_bin_dir() / "cuobjdump"), option, f.name],
                              capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the one kernel in `cubin` (cuobjdump's figures)."""
    out = cuobjdump(cubin, "--dump-resource-usage")
    line = next(x for x in out.splitlines() if "REG:" in x)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return {k.lower(): int(fields[k]) for k in ("REG", "STACK", "SHARED", "LOCAL")}


def widest_load(ptx: str) -> int:
    """Bytes of the widest global load in `ptx` (plain loads and cp.async copies)."""
    widths = [int(v or 1) * int(bits) // 8 for v, bits in
              re.findall(r"ld\.global(?:\.\w+)*?(?:\.v(\d))?\.[bfsu](\d+)\s", ptx)]
    widths += [int(n, 0) for n in re.findall(r"cp\.async\.\w+\.shared\.global[^,]*,[^,]*,"
                                             r"\s*(0x[0-9a-f]+|\d+)", ptx)]
    return max(widths, default=0)


def compile_row(spec: Spec, target: str) -> dict:
    """Compile one specialization for one target; the report's row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = spec.kernel.arg_names
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in spec.aligned}
    source = ASTSource(fn=spec.kernel, signature=spec.signature(), constexprs=spec.constexprs,
                       attrs=attrs)
    compiled = guarded(triton.compile)(source, target=GPUTarget("cuda", TARGETS[target], 32),
                                       options={"num_warps": spec.num_warps,
                                                "num_stages": spec.num_stages})
    cubin = compiled.asm["cubin"]
    usage = resource_usage(cubin)
    ptx = compiled.asm["ptx"]
    row = {"kernel": spec.name, "spec": spec.label, "target": target,
           "per_cycle": spec.per_cycle, "matmul": uses_dot(spec),
           "warps": spec.num_warps, "regs": usage["reg"], "stack": usage["stack"],
           "local": usage["local"], "smem": usage["shared"] + compiled.metadata.shared,
           "cubin": len(cubin), "vector": widest_load(ptx),
           "tensor": next((op for op in TENSOR_OPS if op in ptx), "none")}
    if roofline.is_gemm(spec):
        row.update(roofline.spec_roofline(spec, target, cuobjdump(cubin, "-sass")))
    return row


def report(gemms_only: bool = False) -> list[dict]:
    specs = [s for s in all_specs() if roofline.is_gemm(s) or not gemms_only]
    return [compile_row(spec, target) for spec in specs for target in TARGETS]


def print_table(rows: list[dict]) -> None:
    """The report's table; the roofline columns filled for the GEMM rows only."""
    print(f"{'kernel':<20}{'specialization':<50}{'target':<8}{'warps':>5}{'regs':>6}"
          f"{'stack':>6}{'local':>6}{'smem':>7}{'cubin':>8}{'vector':>7}  {'tensor':<8}"
          f"{'instr':>6}{'bytes':>7}{'ratio':>6}")
    for r in rows:
        roof = (f"{r['instr']:>6}{r['bytes']:>7.0f}{r['ratio']:>6.2f}" if "ratio" in r
                else "")
        print(f"{r['kernel']:<20}{r['spec']:<50}{r['target']:<8}{r['warps']:>5}{r['regs']:>6}"
              f"{r['stack']:>6}{r['local']:>6}{r['smem']:>7}{r['cubin']:>8}{r['vector']:>7}"
              f"  {r['tensor']:<8}{roof}".rstrip())


def print_roofline(rows: list[dict]) -> None:
    """The GEMM rows: tile, K loop, bytes, ratio on the target's device, instruction mix."""
    print(f"{'kernel':<20}{'specialization':<50}{'target':<8}{'device':<7}{'tile':<11}"
          f"{'warps':>5}{'instr':>6}{'bytes':>7}{'ratio':>6}"
          + "".join(f"{kind:>8}" for kind in roofline.CLASSES))
    for r in rows:
        if "ratio" not in r:
            continue
        flag = "" if r["steps"] == 1 and not r["nested"] else "  *"
        print(f"{r['kernel']:<20}{r['spec']:<50}{r['target']:<8}{r['device']:<7}"
              f"{r['tile']:<11}{r['warps']:>5}{r['instr']:>6}{r['bytes']:>7.0f}"
              f"{r['ratio']:>6.2f}" + "".join(f"{r['mix'][kind]:>8}"
                                              for kind in roofline.CLASSES) + flag)
    print("* the K loop holds nested loops (counted once) or makes other than one K step an "
          "iteration (steps in --json): check its SASS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="one JSON list of rows")
    shown.add_argument("--roofline", action="store_true",
                       help="the GEMM specializations only, with their K loop's instruction mix")
    args = parser.parse_args()
    why = cannot_compile()
    if why is not None:
        sys.exit(f"kernels report: {why}")
    try:
        rows = report(gemms_only=args.roofline)
    except ToolchainError as exc:
        sys.exit(f"kernels report: {exc}")
    except roofline.SassError as exc:
        sys.exit(f"kernels report: reading the SASS: {exc}")
    if args.json:
        print(json.dumps(rows))
    elif args.roofline:
        print_roofline(rows)
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
