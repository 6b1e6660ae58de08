"""The Thor image recipe and install script against the repository (they cannot be run here:
no docker daemon, no Thor). What is checked is what would break silently: files they copy
exist, they install the very file `make thor-deps` checks with --no-deps, and they build the
two packages the docs name."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "thor" / "Dockerfile"
INSTALL = REPO / "tools" / "thor_install.sh"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_image_builds_on_the_jetpack_pytorch_container_with_ros_jazzy():
    steps = _instructions()
    assert steps[0][0] == "ARG" and steps[0][1].startswith("BASE_IMAGE=nvcr.io/nvidia/")
    assert steps[1] == ("FROM", "${BASE_IMAGE}")
    runs = " ".join(arg for word, arg in steps if word == "RUN")
    assert "ros-${ROS_DISTRO}-ros-base" in runs and "python3-colcon-common-extensions" in runs
    assert ("ARG", "ROS_DISTRO=jazzy") in steps
    # the checked lock file, without letting pip replace the container's torch
    assert ("COPY", "tools/requirements-thor.txt /tmp/requirements-thor.txt") in steps
    assert "pip install --no-deps -r /tmp/requirements-thor.txt" in runs
    assert ("colcon build --base-paths src/flash_planner "
            "src/flash_planner/flash_planner_interfaces") in runs


def test_what_the_image_copies_exists_and_is_not_ignored():
    for word, arg in _instructions():
        if word == "COPY" and not arg.startswith(". "):
            source = REPO / arg.split()[0]
            assert source.exists(), arg
    entry = REPO / "docker" / "thor" / "entrypoint.sh"
    assert os.access(entry, os.X_OK)
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".venv", "build", "install", ".git"} <= ignored
    assert not {"tools", "docker", "config", "flash_planner"} & ignored


def test_the_install_script_is_valid_bash_and_installs_the_checked_file():
    subprocess.run(["bash", "-n", str(INSTALL)], check=True)
    text = INSTALL.read_text()
    assert os.access(INSTALL, os.X_OK)
    assert 'pip install --no-deps -r "$repo/tools/requirements-thor.txt"' in text
    assert "colcon build --base-paths . flash_planner_interfaces" in text
    assert "--system-site-packages" in text


def test_the_install_script_stops_with_what_is_missing(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ROS_DISTRO": "no_such_distro"}
    done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, env=env)
    assert done.returncode == 1
    assert "ROS 2 is not installed at /opt/ros/no_such_distro" in done.stderr
