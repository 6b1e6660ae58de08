#!/usr/bin/env bash
# Install flash_planner on a Jetson AGX Thor, bare metal (docs/thor.md):
#   tools/thor_install.sh [PRESET]
# Needs JetPack 7 (Ubuntu 24.04, Python 3.12, CUDA 13), ROS 2 Jazzy from apt
# (ros-jazzy-ros-base, python3-colcon-common-extensions) and PyTorch for CUDA 13 importable by
# python3. Creates a virtual environment that sees those system packages, installs our pinned
# Python dependencies into it (tools/requirements-thor.txt, checked in CI for aarch64),
# colcon-builds both packages here, writes install/thor_env.sh (source it to run), and
# fetches PRESET's models into the Hugging Face cache when one is given.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FLASH_PLANNER_VENV:-$HOME/.flash_planner/venv}"
ros="/opt/ros/${ROS_DISTRO:-jazzy}"
preset="${1:-}"

fail() { echo "thor_install: $*" >&2; exit 1; }
[ -f "$ros/setup.bash" ] || fail "ROS 2 is not installed at $ros (apt install ros-jazzy-ros-base)"
command -v colcon >/dev/null || fail "colcon is missing (apt install python3-colcon-common-extensions)"
python3 -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
    || fail "python3 is $(python3 -V 2>&1), JetPack 7 ships 3.12"
python3 -c 'import torch' 2>/dev/null \
    || fail "python3 cannot import torch: install PyTorch for CUDA 13 first (docs/thor.md)"

echo "== virtual environment $venv (with the system's torch and ROS packages)"
[ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --no-deps -r "$repo/tools/requirements-thor.txt"
"$venv/bin/python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'

echo "== colcon build in $repo"
set +u
source "$ros/setup.bash"
source "$venv/bin/activate"
set -u
cd "$repo"
colcon build --base-paths . flash_planner_interfaces --cmake-args -DBUILD_TESTING=OFF

cat > install/thor_env.sh <<ENV
# source this file to run flash_planner (written by tools/thor_install.sh)
source "$ros/setup.bash"
source "$venv/bin/activate"
source "$repo/install/setup.bash"
ENV

if [ -n "$preset" ]; then
    echo "== fetching the models of $preset"
    flash-planner fetch "$preset"
fi
echo "done: source $repo/install/thor_env.sh, then ros2 launch flash_planner planner.launch.py${preset:+ model:=$preset}"
