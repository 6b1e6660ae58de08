"""bench/soak.py's 100-request mix against the real node on rclpy: topic tasks (with
deadlines and speculative off) and Plan goals (with cancels), queue policy preempt.

Cycles after a cancel are counted by the client here, so feedback already in flight when
the cancel is sent is included; the node-side bound (one cycle) is test_soak.py's.
"""

from __future__ import annotations

import os

import soak
from live import requires_ros

from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.skills import SkillCatalog

pytestmark = requires_ros
N = 100


def test_soak_100_requests_through_the_node(harness, ros_context):
    h = harness(**{"planner.queue_policy": "preempt", "planner.feedback_period_ms": 0.0})
    h.bring_up()
    names = SkillCatalog.from_yaml(default_skills_path()).names
    driver = soak.NodeDriver(ros_context, "flash_planner", os.getpid(), names)
    try:
        driver.wait_ready()
        report = soak.run(driver, N, seed=2)
    finally:
        driver.close()
    print(report)
    assert report["requests"] == N and soak.failures(report) == []
