"""tools/thor_deps.py: the Thor image's Python dependencies resolve for Python 3.12 manylinux
aarch64 from wheels, every dependency pinned: the committed file passes the check (`make
thor-deps` runs it alone), and a file with a fault fails it, naming the package."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import thor_deps  # noqa: E402


def _lock(tmp_path: Path, drop: str = "", add: str = "") -> Path:
    lines = [line for line in thor_deps.LOCK.read_text().splitlines()
             if not line.startswith(f"{drop}==") or not drop]
    path = tmp_path / "requirements-thor.txt"
    path.write_text("\n".join(lines + ([add] if add else [])) + "\n")
    return path


def test_the_committed_file_pins_the_runtimes_whole_closure():
    pins = thor_deps.read_lock(thor_deps.LOCK)
    assert set(map(thor_deps.canonicalize_name, thor_deps.ROOTS)) <= set(pins)
    assert not any(thor_deps.PROVIDED.match(name) for name in pins)   # the container's own


def test_the_committed_file_resolves_for_thor(capsys):
    assert thor_deps.main([]) == 0, capsys.readouterr().err
    assert "every dependency pinned" in capsys.readouterr().out


def test_a_pin_without_an_aarch64_wheel_fails_naming_the_package(tmp_path, capsys):
    # llama-cpp-python publishes a source distribution only
    lock = _lock(tmp_path, add="llama-cpp-python==0.3.36")
    assert thor_deps.main(["--requirements", str(lock)]) == 1
    err = capsys.readouterr().err
    assert "no Python 3.12 manylinux aarch64 wheel for llama-cpp-python==0.3.36" in err


def test_a_dependency_the_file_forgets_fails_naming_who_needs_it(tmp_path, capsys):
    lock = _lock(tmp_path, drop="regex")
    assert thor_deps.main(["--requirements", str(lock)]) == 1
    err = capsys.readouterr().err
    pinned = thor_deps.read_lock(thor_deps.LOCK)["transformers"]
    assert f"transformers {pinned} requires regex" in err and "does not pin" in err
