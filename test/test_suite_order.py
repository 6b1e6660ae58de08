"""The suite's slowest files are collected first (suite_order.SLOW_FIRST), so that the workers
start on them: every name there is a file of the suite, and the Makefile keeps the order."""

from __future__ import annotations

from pathlib import Path

from quick_tier import QUICK
from suite_order import SLOW_FIRST, slow_rank

ROOT = Path(__file__).resolve().parents[1]


def test_every_slow_file_exists():
    assert [name for name in SLOW_FIRST if not (ROOT / "test" / name).is_file()] == []


def test_every_quick_file_exists_and_none_is_slow():
    """A file renamed away would silently leave `make check`; a slow one would not be quick."""
    assert [name for name in QUICK if not (ROOT / "test" / name).is_file()] == []
    assert set(QUICK).isdisjoint(SLOW_FIRST)
    assert "check:" in (ROOT / "Makefile").read_text()


def test_slow_files_sort_first_and_in_their_order():
    class Item:
        def __init__(self, nodeid: str):
            self.nodeid = nodeid

    items = [Item("test/test_cli.py::test_a"), Item("test/test_peer.py::test_b"),
             Item("test/engine/test_compiled.py::test_c"), Item("test/test_cli.py::test_d")]
    items.sort(key=slow_rank)
    assert [i.nodeid for i in items] == [
        "test/engine/test_compiled.py::test_c", "test/test_peer.py::test_b",
        "test/test_cli.py::test_a", "test/test_cli.py::test_d"]


def test_make_test_keeps_the_collection_order():
    assert "--no-loadscope-reorder" in (ROOT / "Makefile").read_text()
