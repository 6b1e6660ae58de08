"""Fixtures of the ROS tests: a private ROS domain, the endless checkpoint, the harness."""

from __future__ import annotations

import os
import random

import pytest
from live import Harness
from safetensors.torch import load_file, save_file

from flash_planner.train.tiny import write_tiny_checkpoint

# Parallel test runs on one machine must not hear each other: a random domain per run,
# loopback only; pytest-xdist's workers of one run take consecutive domains (they share the
# run's id, so they draw the same base).
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_BASE = random.Random(os.environ.get("PYTEST_XDIST_TESTRUNUID")).randrange(1, 102 - _WORKERS)
if _WORKERS > 1:        # a domain set outside would be shared by the workers: replaced
    os.environ["ROS_DOMAIN_ID"] = str(_BASE + _WORKER)
else:
    os.environ.setdefault("ROS_DOMAIN_ID", str(_BASE))
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")


def pytest_configure(config):
    """Register launch_testing's marker, so test_launch.py collects quietly without it."""
    config.addinivalue_line("markers", "launch_test: a launch_testing entry point")


@pytest.fixture(scope="session")
def endless_dir(tmp_path_factory):
    """A tiny checkpoint whose lm_head is zero: greedy decoding emits token 0 forever.

    Token 0 is <|endoftext|>, which is not an EOS id of the tiny model, so a request runs to
    max_new_tokens: a deterministic long-running request for cancel, preemption and shutdown
    tests (the demo model finishes a plan in well under a second).
    """
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("endless"))
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"].zero_()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def ros_context():
    import rclpy
    from rclpy.context import Context

    ctx = Context()
    rclpy.init(context=ctx)
    yield ctx
    if ctx.ok():
        rclpy.shutdown(context=ctx)


@pytest.fixture
def harness(ros_context):
    made = []

    def make(**overrides) -> Harness:
        made.append(Harness(ros_context, **overrides))
        return made[-1]

    yield make
    for h in made:
        h.close()


@pytest.fixture
def endless(harness, endless_dir):
    """A harness factory whose node serves the endless model, brought up."""

    def make(**overrides) -> Harness:
        h = harness(**{"model.path": str(endless_dir), "engine.max_context": 8192,
                       **overrides})
        h.bring_up()
        return h

    return make
