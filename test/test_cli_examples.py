"""Every `flash-planner` command line the docs show: its subcommand and flags exist, and each
complete `plan` example runs as written on this machine (the demo model, offline) and
succeeds. Usage lines with placeholders (TASK, PRESET|DIR, [...]) are only checked for their
flags; `fetch` and `serve` examples are parsed, not run (the network; a server)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from flash_planner.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
FENCED = re.compile(r"```[a-z]*\n(.*?)```", re.S)
INLINE = re.compile(r"`(flash-planner [^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# A task written as "..." in an example stands for any task.
TASK = "bring the red cup from the kitchen table to the sink"


def _examples() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        lines = []
        for block in FENCED.findall(text):
            lines += re.sub(r"\\\n\s*", " ", block).splitlines()
        lines += INLINE.findall(FENCED.sub("", text))
        for line in lines:
            line = line.strip().removeprefix("$ ")
            if line.startswith("flash-planner "):
                found.append((str(page.relative_to(ROOT)), line.split("  #")[0].strip()))
    return list(dict.fromkeys(found))


EXAMPLES = _examples()


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _is_complete(argv: list[str]) -> bool:
    """No placeholder: no metavar in capitals, no alternatives or optional parts."""
    return not any(re.search(r"[A-Z]{3,}(?![a-z])|\||\[|\]", arg) and not arg.startswith(
        ("http", "Qwen/")) for arg in argv)


def test_the_docs_show_examples_of_every_subcommand_users_run():
    shown = {shlex.split(line)[1] for _, line in EXAMPLES}
    assert {"plan", "generate", "fetch", "serve", "build-engines", "smoke"} <= shown


@pytest.mark.parametrize("page,line", EXAMPLES, ids=[f"{p}: {line[:60]}" for p, line in
                                                      EXAMPLES])
def test_every_documented_flag_exists(page, line):
    words = line.split()
    subparsers = _subparsers()
    assert words[1] in subparsers, f"{page}: no subcommand {words[1]!r} in `{line}`"
    known = set(subparsers[words[1]]._option_string_actions)
    unknown = sorted(set(FLAG.findall(line)) - known)
    assert not unknown, f"{page}: `{line}` names flags that {words[1]} lacks: {unknown}"


# A plan example with its task (a bare `flash-planner plan` in prose names the command).
RUNNABLE = [(page, line) for page, line in EXAMPLES if line.split()[1] == "plan"
            and len(shlex.split(line)) > 2 and _is_complete(shlex.split(line)[1:])]


def test_some_plan_examples_are_complete():
    assert len(RUNNABLE) >= 4


@pytest.mark.parametrize("page,line", RUNNABLE, ids=[f"{p}: {line[:60]}" for p, line in
                                                      RUNNABLE])
def test_every_complete_plan_example_runs_as_written(page, line, capsys):
    argv = [TASK if arg == "..." else arg for arg in shlex.split(line)[1:]]
    build_parser().parse_args(argv)   # argparse errors exit here with their own message
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 0, f"{page}: `{line}` exited {code}: {err}"
    assert "Traceback" not in err
