"""Launch the flash_planner node with its parameter file.

Arguments: params_file (default: the installed share/flash_planner/config/planner.yaml),
model (a preset name from config/models, e.g. qwen3_6_27b; empty keeps the file's
``model.preset``), namespace, log_level and autostart (bring the node to active on start).
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node


def _planner_node(context):
    """Build the node once the launch arguments are known."""

    def arg(name):
        return LaunchConfiguration(name).perform(context)

    overrides = {"autostart": arg("autostart").strip().lower() in ("1", "true", "yes", "on")}
    if arg("model"):
        overrides["model.preset"] = arg("model")
    return [
        Node(
            package="flash_planner",
            executable="planner_node",
            name="flash_planner",
            namespace=arg("namespace"),
            output="screen",
            emulate_tty=True,
            parameters=[arg("params_file"), overrides],
            arguments=["--ros-args", "--log-level", arg("log_level")],
        )
    ]


def generate_launch_description():
    """Declare the launch arguments and start ``planner_node``."""
    default_params = os.path.join(
        get_package_share_directory("flash_planner"), "config", "planner.yaml"
    )
    return LaunchDescription(
        [
            DeclareLaunchArgument(
                "params_file", default_value=default_params, description="ROS parameter file"
            ),
            DeclareLaunchArgument(
                "model", default_value="", description="model preset (config/models/*.yaml)"
            ),
            DeclareLaunchArgument("namespace", default_value="", description="node namespace"),
            DeclareLaunchArgument("log_level", default_value="info", description="log level"),
            DeclareLaunchArgument(
                "autostart", default_value="true", description="configure and activate on start"
            ),
            OpaqueFunction(function=_planner_node),
        ]
    )
