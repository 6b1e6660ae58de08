"""Where `make test` can provide ROS 2 (Jazzy wheels or a sourced ROS 2), CI must have it."""

from __future__ import annotations

import os
import platform
import sys

import pytest
from live import MISSING
from skip_policy import in_ci

WHEELS_PLATFORM = (platform.system() == "Linux" and platform.machine() == "x86_64"
                   and (3, 10) <= sys.version_info[:2] <= (3, 12))


def test_rclpy_and_the_interfaces_import_where_make_test_provides_them():
    if not (WHEELS_PLATFORM or os.environ.get("ROS_DISTRO")):
        pytest.skip("no Jazzy wheels for this platform and no sourced ROS 2: "
                    "source a ROS 2 Jazzy setup.bash")
    if MISSING is not None and not in_ci():
        pytest.skip(MISSING)  # e.g. pytest run by hand, without make test's environment
    assert MISSING is None, MISSING
    import rclpy  # noqa: F401

    from flash_planner_interfaces.action import Plan
    from flash_planner_interfaces.msg import PlanTelemetry

    assert Plan.Goal().max_new_tokens == 0 and PlanTelemetry().new_tokens == 0
