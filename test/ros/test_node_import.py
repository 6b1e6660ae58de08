"""The ROS layer imports without ROS 2, and planner_node says so in one line when run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flash_planner.ros import node

ROS_MODULES = ["rclpy", "launch", "launch_ros", "launch_testing", "diagnostic_msgs",
               "rcl_interfaces", "std_msgs", "flash_planner_interfaces"]
ROS_LAYER = ["flash_planner.ros.node", "flash_planner.ros.params", "flash_planner.ros.convert",
             "flash_planner.ros.diagnostics", "flash_planner.ros.action_server",
             "flash_planner.ros.topics", "flash_planner.ros.interface_spec"]


def test_ros_layer_imports_with_ros_blocked():
    """With every ROS module made unimportable, all of flash_planner.ros still imports."""
    code = (
        "import sys\n"
        f"sys.modules.update(dict.fromkeys({ROS_MODULES!r}))\n"  # None entries: ImportError
        f"for name in {ROS_LAYER!r}:\n"
        "    __import__(name)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_node_module_import_is_light():
    """Importing the entry point pulls in neither rclpy nor torch (main() must fail fast)."""
    code = ("import sys, flash_planner.ros.node\n"
            "print(sorted(m for m in ('rclpy', 'torch') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_main_exits_2_with_one_line_without_rclpy(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rclpy", None)
    with pytest.raises(SystemExit) as exc:
        node.main([])
    assert exc.value.code == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert out.out == "" and len(lines) == 1
    assert "rclpy" in lines[0] and "setup.bash" in lines[0]
