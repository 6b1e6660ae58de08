"""The docs stay honest: every relative link and image in README.md and docs/ resolves, and
every `make` target they name exists in the Makefile."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MAKE = re.compile(r"`make ([a-z][a-z0-9-]*)")


def _targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*):", text, flags=re.M))


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_docs_exist():
    assert (ROOT / "docs" / "architecture.md").is_file()


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue          # a URL or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{_page_id(page)}: links that resolve to nothing: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_make_targets_exist(page: Path):
    named = set(MAKE.findall(page.read_text()))
    missing = sorted(named - _targets())
    assert not missing, f"{_page_id(page)} names make targets the Makefile lacks: {missing}"


def test_every_committed_chart_is_shown_on_a_page():
    shown = set()
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.endswith(".png"):
                shown.add((page.parent / target).resolve())
    charts = sorted((ROOT / "docs" / "img").glob("*.png"))
    assert charts, "docs/img holds no chart"
    assert not [c.name for c in charts if c.resolve() not in shown]


def test_the_demos_stated_sizes_are_its_shipped_sizes():
    """README and the demo preset state the shipped demo's parameter counts; each stated
    ~N.NM is the count of what ships, rounded to one decimal."""
    from safetensors import safe_open

    demo = ROOT / "flash_planner" / "assets" / "demo"

    def count(path: Path, mtp: bool | None) -> float:
        with safe_open(str(path), "pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()
                       if mtp is None or k.startswith("mtp.") == mtp) / 1e6

    target = demo / "target" / "model.safetensors"
    sizes = [count(target, False), count(target, True),
             count(demo / "drafter" / "model.safetensors", None)]
    stated = [f"~{n:.1f}M-parameter" for n in sizes]
    for page in (ROOT / "README.md", ROOT / "config" / "models" / "demo.yaml"):
        text = " ".join(page.read_text().split())
        found = re.findall(r"~\d+(?:\.\d+)?M-parameter", text)
        assert found[:3] == stated, (page.name, found, stated)

