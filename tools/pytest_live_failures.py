"""A pytest plugin for short GPU leases: each failure's report is appended to the file named
by LIVE_FAILURES as it happens, so a run stopped by a time limit still says what failed.

    LIVE_FAILURES=failures.log python -m pytest -p pytest_live_failures ...   # tools/ on the path
"""

from __future__ import annotations

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("LIVE_FAILURES")
    # under pytest-xdist the controller sees every worker's reports: write them there once
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
