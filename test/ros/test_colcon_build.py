"""The build docs/ros.md documents: `colcon build --symlink-install` of both packages, then
their imports.

Builds flash_planner and the nested flash_planner_interfaces (naming both paths, as colcon
stops descending at the root package) against the ROS 2 that `make test` provides, sources
the workspace's install/setup.sh and imports the generated Plan action from there.
"""

from __future__ import annotations

import json
import os
import sys

from live import requires_ros
from test_packaging import PKG, _clean_env, _copy_repo, _run, _within

pytestmark = requires_ros
PROBE = """
import json, flash_planner_interfaces.action as a, flash_planner.ros.node as n
print(json.dumps({"action": a.__file__, "node": n.__file__, "goal": str(a.Plan.Goal())}))
"""


def _ros_env(tmp_path) -> dict[str, str]:
    """This environment without our prebuilt interfaces: the build must make its own."""
    env = _clean_env(COLCON_HOME=str(tmp_path / "colcon_home"))
    ours = os.path.join("build", "ros_env", "install")
    prefixes = [p for p in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep)
                if p and not p.endswith(ours)]
    env["AMENT_PREFIX_PATH"] = env["CMAKE_PREFIX_PATH"] = os.pathsep.join(prefixes)
    env.pop("PYTHONPATH", None)
    return env


def test_colcon_builds_both_packages_and_the_workspace_imports_them(tmp_path):
    ws = tmp_path / "ws"
    _copy_repo(ws / "src" / PKG)
    env = _ros_env(tmp_path)
    cmd = ["colcon", "build", "--symlink-install", "--base-paths", f"src/{PKG}",
           f"src/{PKG}/flash_planner_interfaces", "--cmake-args",
           f"-DPython3_EXECUTABLE={sys.executable}", "-DBUILD_TESTING=OFF"]
    proc = _run(cmd, 300, cwd=ws, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for package in ("flash_planner_interfaces", PKG):
        assert f"Finished <<< {package} [" in proc.stdout, proc.stdout

    script = '. "$1" >/dev/null && "$2" -c "$3"'
    proc = _run(["bash", "-c", script, "_", "install/setup.sh", sys.executable, PROBE], 120,
                cwd=ws, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert _within(found["action"], ws), found  # not the interfaces that make test built
    assert _within(found["node"], ws), found
    assert "max_new_tokens=0" in found["goal"]
