#!/usr/bin/env bash
# Provide ROS 2 Jazzy (rclpy, messages), our flash_planner_interfaces and colcon to the tests,
# and write OUT/env.sh, which `make test` sources before pytest. Three cases, never mixed:
#   sourced  a ROS 2 setup.bash was sourced (Thor: apt ROS): its rclpy and its colcon; the
#            interfaces are built with that colcon.
#   wheels   x86_64 Linux, Python 3.10-3.12: ROS 2 Jazzy's PyPI wheels go into the venv and
#            the interfaces are built against them with cmake.
#   none     anything else: env.sh records why, and the ROS tests skip with that reason.
# Idempotent: a step runs again only when the hash of its inputs (stored in a stamp) changed.
# Usage: tools/ros_env.sh VENV OUT
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(cd "$1" && pwd)
mkdir -p "$2"
OUT=$(cd "$2" && pwd)
PY=$VENV/bin/python
PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
IFACE=$REPO/flash_planner_interfaces
# The execution tests' own action and service types (test servers); never installed with
# the planner.
TEST_IFACE=$REPO/test/ros/flash_planner_test_msgs
ROS_REQ=$REPO/tools/requirements-ros-jazzy.txt
COLCON_REQ=$REPO/tools/requirements-colcon.txt

say() { echo "ros_env: $*" >&2; }
hash_of() { cat "$@" | sha256sum | cut -c1-16; }
stamp_ok() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

# The case this machine is in; "none: <why>" when neither ROS source can work here.
ros_mode() {
    if [ -n "${ROS_DISTRO:-}" ]; then
        "$PY" -c "import rclpy" 2>/dev/null && echo sourced && return
        echo "none: ROS_DISTRO=$ROS_DISTRO is set but its rclpy does not import with $PY"
        return
    fi
    if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
        echo "none: the Jazzy wheels exist for x86_64 Linux only; source a ROS 2 Jazzy setup.bash"
    elif [[ ! "$PYVER" =~ ^3\.1[012]$ ]]; then
        echo "none: the Jazzy wheels exist for Python 3.10-3.12, this venv has $PYVER"
    else
        echo wheels
    fi
}

install_colcon() {
    local want
    want=$(hash_of "$COLCON_REQ")
    if [ ! -x "$VENV/bin/colcon" ] && command -v colcon >/dev/null; then
        return  # a colcon of the user's or of a sourced ROS 2: use that one
    fi
    stamp_ok "$VENV/.colcon" "$want" && return
    say "installing colcon from PyPI into $VENV"
    "$PY" -m pip install -q -r "$COLCON_REQ"
    echo "$want" > "$VENV/.colcon"
}

install_wheels() {
    local want
    want=$(hash_of "$ROS_REQ")
    stamp_ok "$VENV/.ros_wheels" "$want" && return
    say "installing ROS 2 Jazzy wheels into $VENV"
    "$PY" -m pip install -q -r "$ROS_REQ"
    # Workaround: the wheels' CMake exports name the wheel builder's Python
    # (/opt/python/cp3X-cp3X/...) for the Python and numpy include dirs; point them here.
    local include site
    include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    { grep -rl --include='*.cmake' '/opt/python/cp3' "$VENV/share" || true; } | xargs -r sed -i -E \
        -e "s#/opt/python/cp3[0-9]+-cp3[0-9]+/include/python3\.[0-9]+#$include#g" \
        -e "s#/opt/python/cp3[0-9]+-cp3[0-9]+/lib/python3\.[0-9]+/site-packages#$site#g"
    echo "$want" > "$VENV/.ros_wheels"
}

# Every input of the interfaces build: their sources, the case and the interpreter.
interfaces_hash() {
    { find "$IFACE" "$TEST_IFACE" -type f -print0 | sort -z | xargs -0 cat; echo "$1 $PY"; } \
        | sha256sum | cut -c1-16
}

build_interfaces_cmake() {
    local tool package
    for tool in cmake cc c++; do
        command -v "$tool" >/dev/null || { say "building the ROS interfaces needs $tool:" \
            "apt install cmake g++ (Debian/Ubuntu)"; exit 1; }
    done
    rm -rf "$OUT/build" "$OUT/install"
    : > "$OUT/cmake.log"
    for package in "$IFACE" "$TEST_IFACE"; do
        build_one_cmake "$package"
    done
}

build_one_cmake() {
    local src=$1 name build
    name=$(basename "$src")
    build=$OUT/build/$name
    say "building $name with cmake (about 15 s)"
    # The venv is an ament prefix: the wheels install share/ (ament index, CMake configs).
    AMENT_PREFIX_PATH=$VENV CMAKE_PREFIX_PATH=$VENV \
        cmake -S "$src" -B "$build" -DCMAKE_INSTALL_PREFIX="$OUT/install" \
        -DPython3_EXECUTABLE="$PY" -DBUILD_TESTING=OFF >>"$OUT/cmake.log" 2>&1 \
        && cmake --build "$build" -j"$(nproc)" >>"$OUT/cmake.log" 2>&1 \
        && cmake --install "$build" >>"$OUT/cmake.log" 2>&1 \
        || { tail -20 "$OUT/cmake.log" >&2; say "$name build failed: $OUT/cmake.log"; exit 1; }
}

build_interfaces_colcon() {
    rm -rf "$OUT/build" "$OUT/install"
    say "building flash_planner_interfaces with colcon"
    (cd "$OUT" && colcon --log-base "$OUT/log" build --base-paths "$IFACE" "$TEST_IFACE" \
        --build-base "$OUT/build" --install-base "$OUT/install" \
        --cmake-args -DBUILD_TESTING=OFF >"$OUT/colcon.log" 2>&1) \
        || { tail -20 "$OUT/colcon.log" >&2; say "interfaces build failed: $OUT/colcon.log"; exit 1; }
}

write_env() {
    local mode=$1 site libs
    {
        echo "# Written by tools/ros_env.sh ($mode); sourced by make test."
        echo "export PATH=\"$VENV/bin:\$PATH\""
        echo "export FLASH_PLANNER_ROS_ENV=\"$mode\""
        case $mode in
        sourced)
            echo ". \"$OUT/install/local_setup.sh\"" ;;
        wheels)
            site=$OUT/install/lib/python$PYVER/site-packages
            # The wheels' own libraries: venv/lib and the auditwheel folders ros_*.libs.
            libs=$(find "$VENV/lib/python$PYVER/site-packages" -maxdepth 1 -name 'ros_*.libs' \
                   -type d | sort | tr '\n' ':')
            echo "export AMENT_PREFIX_PATH=\"$OUT/install:$VENV\""
            echo "export PYTHONPATH=\"$site\${PYTHONPATH:+:\$PYTHONPATH}\""
            echo "export LD_LIBRARY_PATH=\"$OUT/install/lib:$VENV/lib:$libs\${LD_LIBRARY_PATH:-}\""
            # Workaround: a .pth file of the wheels (ros_wheels_bootstrapper) re-executes
            # every Python start to set LD_LIBRARY_PATH; it is set above, so skip the re-exec.
            echo "export _ROS_WHEELS_BOOTSTRAP_COMPLETE=1" ;;
        esac
    } > "$OUT/env.sh.tmp"
    mv "$OUT/env.sh.tmp" "$OUT/env.sh"
}

mode=$(ros_mode)
case $mode in
sourced)
    if [ -f "$VENV/.ros_wheels" ]; then
        say "$VENV holds the Jazzy wheels and a ROS 2 is sourced: never mix the two;"
        say "use a fresh venv (make distclean) or a shell without the sourced ROS 2"
        exit 1
    fi
    command -v colcon >/dev/null || { say "a sourced ROS 2 without colcon: install" \
        "python3-colcon-common-extensions"; exit 1; }
    want=$(interfaces_hash sourced)
    stamp_ok "$OUT/interfaces.stamp" "$want" \
        || { build_interfaces_colcon; echo "$want" > "$OUT/interfaces.stamp"; } ;;
wheels)
    install_colcon
    install_wheels
    want=$(interfaces_hash wheels)
    stamp_ok "$OUT/interfaces.stamp" "$want" \
        || { build_interfaces_cmake; echo "$want" > "$OUT/interfaces.stamp"; } ;;
*)
    install_colcon
    say "no ROS 2 here (${mode#none: }); the ROS tests will skip" ;;
esac
write_env "$mode"
