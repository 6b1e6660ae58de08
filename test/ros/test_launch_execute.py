"""launch_testing: the demo planner launched against the tests' skill servers, executing a
task from `~/task` (`execute_tasks:=true`) on them: the launch-file example of
docs/ros.md, "Running plans on the robot".

`planner.launch.py` with `skills_file` (test_node_execute.py's catalog: the default skills
bound to skill_servers.py's NavigateToPose, Manipulate and Speak) and the servers as a
process of their own. Needs what test_launch.py needs (`ros2 launch`, launch_testing, a
colcon install) plus flash_planner_test_msgs (built by tools/ros_env.sh); skipped elsewhere
with the same reason.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import unittest
from pathlib import Path

import pytest
from test_launch import MISSING, TIMEOUT, skip_unless_ros
from test_node_execute import write_catalog

if MISSING is None:
    import launch
    import launch_testing.actions
    import launch_testing.asserts
    import rclpy
    from ament_index_python.packages import get_package_share_directory
    from launch.actions import ExecuteProcess, IncludeLaunchDescription
    from launch.launch_description_sources import PythonLaunchDescriptionSource
    from rclpy.context import Context
    from rclpy.executors import SingleThreadedExecutor
    from std_msgs.msg import String

SERVERS = Path(__file__).resolve().parent / "skill_servers.py"


@pytest.mark.launch_test
@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def generate_test_description():
    launch_file = os.path.join(get_package_share_directory("flash_planner"), "launch",
                               "planner.launch.py")
    catalog = write_catalog(Path(tempfile.mkdtemp(prefix="flash_planner_execute_")))
    planner = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(launch_file),
        launch_arguments={"skills_file": catalog, "execute_tasks": "true",
                          "autostart": "true"}.items())
    servers = ExecuteProcess(cmd=[sys.executable, str(SERVERS)], output="screen")
    return launch.LaunchDescription([servers, planner,
                                     launch_testing.actions.ReadyToTest()])


@skip_unless_ros
class TestExecuteFromTheTaskTopic(unittest.TestCase):
    def test_a_task_runs_on_the_servers(self, proc_output):
        proc_output.assertWaitFor("skill servers up", timeout=TIMEOUT)
        proc_output.assertWaitFor("flash_planner active", timeout=TIMEOUT)
        context = Context()
        rclpy.init(context=context)
        node = rclpy.create_node("launch_execute_client", context=context)
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(node)
        try:
            results = []
            node.create_subscription(String, "/flash_planner/execution",
                                     lambda m: results.append(json.loads(m.data)), 10)
            pub = node.create_publisher(String, "/flash_planner/task", 10)
            deadline = time.monotonic() + TIMEOUT
            while pub.get_subscription_count() == 0 and time.monotonic() < deadline:
                executor.spin_once(timeout_sec=0.1)
            time.sleep(3.0)   # the node's graph check finds the servers (every 2 s)
            pub.publish(String(data="go to the kitchen"))
            while not results and time.monotonic() < deadline:
                executor.spin_once(timeout_sec=0.1)
            self.assertTrue(results and results[0]["success"], results)
            self.assertEqual(results[0]["steps_done"], 1)
        finally:
            executor.shutdown()
            node.destroy_node()
            rclpy.shutdown(context=context)
