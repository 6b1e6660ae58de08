"""Which skips a CI run accepts: any other skip fails the test when the `CI` variable is set.

A development or CI machine has no GPU and no TensorRT, and PyPI has no `ros2 launch`; every
other test runs there, so a skip for another reason means a dependency went missing silently,
and CI must turn red instead of green. A pytest plugin (test/conftest.py imports its hook;
test_skip_policy.py loads it with `-p skip_policy`).
"""

from __future__ import annotations

import os

import pytest

# Each entry is a substring of an accepted skip reason, with why it cannot run here.
ALLOWED_SKIPS = (
    # No CUDA GPU on development or CI machines (the CUDA parametrizations of the tests).
    "no CUDA GPU",
    # TensorRT needs NVIDIA's GPU wheels and a CUDA GPU; neither exists on these machines.
    "TensorRT and a CUDA GPU are not available",
    # `ros2 launch` and launch_testing are not on PyPI: they need a sourced ROS 2 install.
    "launch_testing are not installed",
)


def in_ci() -> bool:
    """Whether this run is a CI run (`CI` set to anything but '', 0 or false)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_reason(report) -> str:
    """The reason of a skipped report ('Skipped: ' prefix removed)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI, a skip whose reason is not in ALLOWED_SKIPS becomes a failure naming it."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if not any(allowed in reason for allowed in ALLOWED_SKIPS):
        report.outcome = "failed"
        report.longrepr = (f"unexpected skip under CI: {reason}\n(accepted skips: "
                           f"test/skip_policy.py ALLOWED_SKIPS)")
