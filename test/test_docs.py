"""The docs stay honest: every relative link and image in README.md and docs/ resolves, and
every `make` target they name exists in the Makefile."""

from __future__ import annotations

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
