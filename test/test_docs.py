"""The docs stay honest: every relative link, anchor and image in README.md and docs/
resolves, every `make` target they name exists, no page speaks of how the work was done
instead of what the software does, and performance.md stays short with a command for every
figure."""

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


# Words about how figures came about rather than what they are: an issue's number, the work
# sessions, a machine being lent, the brief, a drawing tool of the developers.
STALE = re.compile(r"\bissue \d+|\bthis session\b|\bsessions\b|\bwas lent\b|\bnone was lent\b"
                   r"|\blent to\b|\bthe issue's\b|\bthe brief\b|farm-studio", re.I)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_and_their_anchors_resolve(page: Path):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue          # a URL
        path, _, anchor = target.partition("#")
        linked = page.parent / path if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert not broken, f"{_page_id(page)}: links that resolve to nothing: {broken}"


def test_anchors_are_made_as_github_makes_them(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Against llama.cpp\n## Constrained plans and the grammar's cost\n")
    assert anchors(page) == {"against-llamacpp", "constrained-plans-and-the-grammars-cost"}


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_pages_speak_of_the_software_not_of_how_it_was_built(page: Path):
    stale = [f"line {n}: {line.strip()}" for n, line in enumerate(page.read_text().splitlines(), 1)
             if STALE.search(line)]
    assert not stale, f"{_page_id(page)}:\n" + "\n".join(stale)


def test_the_stale_wording_check_catches_what_it_is_for():
    for line in ("issue 14 adds a refusal", "none was lent", "the sessions so far",
                 "the house has no circle (`farm-studio look`)"):
        assert STALE.search(line), line
    assert not STALE.search("a session of the planner service")


def test_performance_page_is_short_and_every_figure_names_its_command():
    """At most ~300 lines; every section holding a table or a code block of figures names
    the command that reproduces them (`python bench/...`, `make ...` or `flash-planner ...`),
    or is a summary whose every row links to such a section of the page."""
    text = (ROOT / "docs" / "performance.md").read_text()
    assert len(text.splitlines()) <= 300

    def summary(section: str) -> bool:
        rows = [r for r in re.findall(r"^\|.*$", section, flags=re.M)[2:]]
        return bool(rows) and "```" not in section and all("](#" in r for r in rows)

    sections = re.split(r"^## ", text, flags=re.M)[1:]
    silent = [s.splitlines()[0] for s in sections
              if re.search(r"^(\||```)", s, flags=re.M) and not summary(s)
              and not re.search(r"`(python bench/|make |flash-planner )", s)]
    assert not silent, f"sections with figures but no command: {silent}"


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



def _map_block() -> str:
    page = (ROOT / "docs" / "architecture.md").read_text()
    return page.split("## Where things are", 1)[1].split("```")[1]


def _unnamed(block: str) -> list[str]:
    """Modules, presets, catalogs, benchmarks and tools the architecture map does not name
    (a kernel op's kernel.py, reference.py and skinny.py are named by pattern)."""
    kernels = ROOT / "flash_planner" / "kernels"
    files = [p for p in (ROOT / "flash_planner").rglob("*.py")
             if "assets" not in p.parts and kernels not in p.parents]
    files += [p for p in kernels.rglob("*.py")
              if not (p.parent != kernels
                      and p.name in ("kernel.py", "reference.py", "skinny.py"))]
    files += [*(ROOT / "config" / "catalogs").glob("*.yaml"), *(ROOT / "bench").glob("gpu.py"),
              *(ROOT / "tools").iterdir()]
    names = [p.name for p in files if p.name != "__init__.py"]
    names += [p.stem for p in (ROOT / "config" / "models").glob("*.yaml")
              if not p.stem.endswith(("_fp8", "_nvfp4"))]
    # a name counts where it stands as a word of its own ("tiles.py", not "weight_tiles.py")
    return sorted({n for n in names if not re.search(rf"(?<![\w]){re.escape(n)}\b", block)})


def test_the_architecture_map_names_every_module():
    assert _unnamed(_map_block()) == []


def test_the_map_check_catches_a_module_left_out():
    block = _map_block().replace("toolchain.py", "").replace("inference.py", "")
    assert _unnamed(block) == ["inference.py", "toolchain.py"]


AUTO_BATCH = re.compile(r"max_batch`?[^|\n]{0,40}?(?:0 = )?auto(?::|, is) (\d+)", re.S)


def test_the_pages_state_max_batch_auto_as_the_config_sets_it():
    """The README's batching row gives max_batch auto's value per device as
    `engine/config.py` sets it, and every page's "max_batch ... auto: N" agrees with both
    devices' value (a page naming no device must hold for either)."""
    from flash_planner.engine.config import AUTO_MAX_BATCH

    cpu, gpu = AUTO_MAX_BATCH
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines()
               if line.startswith("| Several requests at once"))
    assert f"`max_batch` auto: {cpu} on a CPU, {gpu} on a GPU" in row, row
    for page in PAGES:
        text = " ".join(page.read_text().split())
        assert "keeps 1 by default" not in text, _page_id(page)
        stated = {int(n) for n in AUTO_BATCH.findall(text)}
        assert stated <= ({cpu} & {gpu}), (_page_id(page), stated, AUTO_MAX_BATCH)


def test_the_max_batch_check_reads_each_spelling():
    for text in ("engine `max_batch`; 0 = auto: 8)", "`engine.max_batch` (auto: 8)",
                 "`max_batch`). The default, 0 = auto, is 8"):
        assert AUTO_BATCH.findall(" ".join(text.split())) == ["8"], text
