"""Launch the flash_planner node with its parameter file.

Arguments: params_file (default: the installed share/flash_planner/config/planner.yaml),
model (a preset name from config/models, e.g. qwen3_6_27b; empty keeps the file's
``model.preset``), namespace, log_level, autostart (bring the node to active on start),
skills_file (the robot's skill catalog with its bindings; empty keeps the file's
``planner.skills_file``), execute_tasks (plan and execute each ``~/task`` message on the
catalog's bound servers: ``execution.from_task_topic``), and mcp (start ``flash-planner mcp``
beside the node over streamable HTTP on mcp_port, calling the node's own ~/plan; with
mcp_execute its ``execute`` tool runs plans through the node's ~/execute and its gate).
"""

import os
import sys

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess, OpaqueFunction
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
    node_name = "/" + "/".join(p for p in (arg("namespace").strip("/"), "flash_planner") if p)
    mcp = []
    if flag("mcp"):
        command = [sys.executable, "-m", "flash_planner.ros.mcp_door", "--node", node_name,
                   "--transport", "http", "--port", arg("mcp_port")]
        if arg("skills_file"):
            command += ["--skills", arg("skills_file")]
        if flag("mcp_execute"):
            command.append("--execute")
        mcp = [ExecuteProcess(cmd=command, output="screen", name="flash_planner_mcp")]
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
        ),
        *mcp,
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
            DeclareLaunchArgument(
                "mcp", default_value="false",
                description="start an MCP server (streamable HTTP) beside the node",
            ),
            DeclareLaunchArgument("mcp_port", default_value="8765",
                                  description="the MCP server's port (endpoint /mcp)"),
            DeclareLaunchArgument(
                "mcp_execute", default_value="false",
                description="the MCP server's execute tool (through ~/execute and its gate)",
            ),
            OpaqueFunction(function=_planner_node),
        ]
    )
