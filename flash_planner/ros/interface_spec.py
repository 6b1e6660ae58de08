"""Read the fields of the flash_planner_interfaces ``.msg``/``.action`` files without ROS.

A deliberately small subset of the rosidl text format: one ``type name [default]`` per
line, ``#`` comments, ``---`` between the sections of an action; constants
(``type NAME=value``) are skipped. Used by tests and tools that must run where no ROS is
installed; rosidl itself remains the authority on a ROS machine.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = "flash_planner_interfaces"
ACTION_SECTIONS = ("goal", "result", "feedback")
SEPARATOR = "---"

Field = tuple[str, str]  # (type, name), e.g. ("builtin_interfaces/Time", "stamp")


def interfaces_dir() -> Path | None:
    """The ``flash_planner_interfaces/`` source folder next to this package, if present.

    Found only in a source checkout (or a colcon ``--symlink-install``); an installed wheel
    or a plain colcon install has no such folder and gets ``None``.
    """
    path = Path(__file__).resolve().parents[2] / PACKAGE
    return path if (path / "package.xml").is_file() else None


def _sections(text: str) -> list[list[Field]]:
    """Fields of each ``---``-separated section of an interface definition."""
    sections: list[list[Field]] = [[]]
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line == SEPARATOR:
            sections.append([])
            continue
        parts = line.split(None, 2)
        if len(parts) < 2:
            raise ValueError(f"line {lineno}: expected 'type name', got {raw.strip()!r}")
        type_, name = parts[0], parts[1]
        if "=" in name or (len(parts) > 2 and parts[2].startswith("=")):
            continue  # a constant, not a field
        sections[-1].append((type_, name))
    return sections


def read_fields(path: str | Path) -> list[Field]:
    """The ``(type, name)`` fields of a ``.msg`` file, in order."""
    sections = _sections(Path(path).read_text(encoding="utf-8"))
    if len(sections) != 1:
        raise ValueError(f"{path}: a message has one section, found {len(sections)}")
    return sections[0]


def read_action(path: str | Path) -> dict[str, list[Field]]:
    """The ``(type, name)`` fields of each section (goal, result, feedback) of an action."""
    sections = _sections(Path(path).read_text(encoding="utf-8"))
    if len(sections) != len(ACTION_SECTIONS):
        raise ValueError(f"{path}: an action has 3 sections, found {len(sections)}")
    return dict(zip(ACTION_SECTIONS, sections))
