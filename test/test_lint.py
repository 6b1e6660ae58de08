"""Lint gate: ``ruff check`` (configured in pyproject.toml) passes over the Python sources."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_PATHS = ("flash_planner", "test", "bench", "launch", "tools", "setup.py")


def _ruff() -> list[str] | None:
    """The ruff command of this interpreter's environment, else the one on PATH."""
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    exe = shutil.which("ruff")
    return [exe] if exe else None


def test_ruff_check_passes():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed")
    paths = [p for p in LINT_PATHS if (REPO / p).exists()]
    cmd = [*ruff, "check", "--no-cache", "--output-format", "concise", *paths]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff check failed:\n{proc.stdout}{proc.stderr}"
