"""Launch the flash_planner node with its parameter file.

Arguments: params_file (default: the installed share/flash_planner/config/planner.yaml),
model (a preset name from config/models, e.g. qwen3_6_27b; empty keeps the file's
``model.preset``), namespace, log_level, autostart (bring the node to active on start),
skills_file (the robot's skill catalog with its bindings; empty keeps the file's
``planner.skills_file``) and execute_tasks (plan and execute each ``~/task`` message on the
catalog's bound servers: ``execution.from_task_topic``).
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

    def flag(name):
        return arg(name).strip().lower() in ("1", "true", "yes", "on")

    overrides = {"autostart": flag("autostart"),
                 "execution.from_task_topic": flag("execute_tasks")}
    if arg("model"):
        overrides["model.preset"] = arg("model")
    if arg("skills_file"):
        overrides["planner.skills_file"] = arg("skills_file")
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
            DeclareLaunchArgument(
                "skills_file", default_value="", description="skill catalog YAML (bindings)"
            ),
            DeclareLaunchArgument(
                "execute_tasks", default_value="false",
                description="plan and execute each ~/task message on the bound servers",
            ),
            OpaqueFunction(function=_planner_node),
        ]
    )
