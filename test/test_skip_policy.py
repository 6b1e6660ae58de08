"""Under `CI`, a skip outside test/skip_policy.py's list fails the run; listed skips pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SAMPLE = '''
import pytest

@pytest.mark.skipif(True, reason={reason!r})
def test_marked():
    pass

def test_inline():
    pytest.skip({reason!r})
'''


def _run(tmp_path: Path, reason: str, ci: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE.format(reason=reason))
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(HERE)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "skip_policy", "-p",
           "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)


def test_unlisted_skip_fails_under_ci(tmp_path):
    proc = _run(tmp_path, "somelib is not installed", "true")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # A skip in setup (a skipif mark) reads as an error, one in the test body as a failure.
    assert "1 failed, 1 error" in proc.stdout
    assert proc.stdout.count("unexpected skip under CI: somelib is not installed") >= 2


@pytest.mark.parametrize("reason", ["no CUDA GPU", "TensorRT and a CUDA GPU are not available"])
def test_listed_skip_passes_under_ci(tmp_path, reason):
    proc = _run(tmp_path, reason, "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 skipped" in proc.stdout


@pytest.mark.parametrize("ci", ["", "0", "false"])
def test_unlisted_skip_is_a_skip_outside_ci(tmp_path, ci):
    proc = _run(tmp_path, "somelib is not installed", ci)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 skipped" in proc.stdout


def test_cuda_tests_carry_the_marker_make_test_gpu_selects():
    """`make test-gpu` runs `-m cuda`: every test skipped for want of a GPU, nothing else."""
    root = HERE.parent
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p",
           "no:cacheprovider", "test/engine/test_parity.py", "test/engine/test_compiled.py"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert any("cuda" in i and "test_parity" in i for i in ids), ids
    assert any("test_compile_on_cuda" in i or "cuda_graphs" in i for i in ids), ids
    assert all("cuda" in i.lower() for i in ids), ids
