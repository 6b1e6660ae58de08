"""Every declared kernel specialization compiles to a cubin for sm_90 and sm_110, here.

The interpreter accepts code that no GPU compiler does (module globals, dtype mismatches
between branches) and says nothing about registers; this compiles the same specs the
launchers use (kernels/specs.py) with Triton's own ptxas, in a child process without
TRITON_INTERPRET, and checks the resources per kernel and target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flash_planner.kernels import report


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = "from flash_planner.kernels.report import cannot_compile; print(cannot_compile())"
    why = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=300).stdout.strip()
    if why != "None":
        pytest.skip(why)
    proc = subprocess.run([sys.executable, "-m", "flash_planner.kernels.report", "--json"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_spec_compiles_for_every_target(rows):
    want = {(s.name, s.label, t) for s in report.all_specs() for t in report.TARGETS}
    assert {(r["kernel"], r["spec"], r["target"]) for r in rows} == want
    assert all(r["cubin"] > 0 for r in rows)


def test_no_spills_on_the_per_cycle_kernels(rows):
    for r in rows:
        assert r["regs"] <= report.MAX_REGS, r
        if r["per_cycle"]:
            assert r["local"] == 0 and r["stack"] == 0, r


def test_shared_memory_within_the_per_block_limit(rows):
    assert all(r["smem"] <= report.SHARED_LIMIT for r in rows)


def test_matmul_kernels_use_tensor_cores(rows):
    """Every matmul kernel runs its tl.dot on tensor cores. On sm_90 that is wgmma or the
    sync mma: the weight-only GEMMs' decode and verify tiles have 16 rows (M is 1-16 there)
    and wgmma needs 64-row tiles, so Triton emits mma for those and wgmma for the 64-row
    prefill tiles. On sm_110 the report names what Triton emits (tcgen05 or mma)."""
    for r in rows:
        if not r["matmul"]:
            assert r["tensor"] == "none", r
        elif r["target"] == "sm_90":
            assert r["tensor"] in ("mma", "wgmma"), r
        else:
            assert r["tensor"] != "none", r


def test_cannot_compile_names_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET=1 is set" in report.cannot_compile()


def test_skinny_gemms_load_16_byte_vectors_at_the_model_shapes(rows):
    """The decode GEMMs (2-D and mixture-of-experts) stream their weights in 16-byte loads
    (ld.global.v4 on the FMA path, 16-byte cp.async into the tensor-core path's pipeline),
    not byte by byte: a K step starts on a multiple of BLOCK_K the compiler can see, and its
    row masks are constant along K."""
    skinny = [r for r in rows if r["kernel"].endswith("_rows_kernel")
              and any(f" {model} " in r["spec"] for model in ("27B", "35B-A3B", "Flash-Next"))]
    assert len(skinny) >= 2 * (3 * 4 + 4 * 4 + 4 * 2)
    for r in skinny:
        assert r["vector"] == 16, r
