"""Where the suite's minutes went: seconds per test file (setup, call and teardown of every
test in it) from the JUnit XML `make test` writes, longest first.

    python tools/suite_minutes.py [build/test-report.xml] [--top N]

`--dist loadfile` gives each file to one worker whole, so a file's seconds are one worker's;
the suite's wall time is at least its longest file's and about the sum over the workers.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def file_seconds(report: Path) -> dict[str, float]:
    """test file -> seconds, from pytest's JUnit XML (classname: the file's dotted path)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        while module and not module[-1].startswith("test_"):
            module.pop()                   # a test class's name after its module's
        seconds["/".join(module) + ".py"] += float(case.get("time", 0.0))
    return dict(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", nargs="?", type=Path,
                        default=Path("build/test-report.xml"))
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if not args.report.is_file():
        print(f"{args.report}: no such report (make test writes it)", file=sys.stderr)
        return 2
    seconds = file_seconds(args.report)
    total = sum(seconds.values())
    print(f"{len(seconds)} files, {total:.0f} s of test time ({total / 2:.0f} s on 2 workers)")
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{s:8.1f}  {100 * s / total:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
