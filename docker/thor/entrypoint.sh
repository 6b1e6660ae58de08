#!/usr/bin/env bash
# The image's entry point: ROS 2 and the flash_planner workspace sourced, then the command.
set -e
source "/opt/ros/${ROS_DISTRO:-jazzy}/setup.bash"
source /opt/flash_planner_ws/install/setup.bash
exec "$@"
