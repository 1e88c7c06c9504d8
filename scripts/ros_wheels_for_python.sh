#!/usr/bin/env bash
# Usage: scripts/ros_wheels_for_python.sh PYVER DIR      e.g. scripts/ros_wheels_for_python.sh 3.12 .whl/cp312
#
# Downloads the ROS 2 Jazzy wheels this package pins (scripts/ros-jazzy-*.txt) plus rosbags and simplejpeg, for CPython
# PYVER on x86_64 Linux, into DIR: for a machine without a package index (the GPU machine runs Python 3.12,
# this one 3.11). Two pure-Python dependencies ship only as source (empy, lark-parser); they are built into
# wheels here. numpy, Pillow, PyYAML and safetensors are left out: that machine has them with torch.
# bench/device_run.sh's `node` step installs from DIR (carry it along).
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 PYVER DIR" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
mkdir -p "$2"
dir=$(cd "$2" && pwd)
constraints="$repo/scripts/ros-jazzy-constraints.txt"
sdists=$(grep -i -E '^(empy|lark-parser)==' "$constraints")
# shellcheck disable=SC2086
"$py" -m pip wheel --disable-pip-version-check -q --no-deps -w "$dir" $sdists
"$py" -m pip download --disable-pip-version-check -q --only-binary=:all: --implementation cp \
  --python-version "$1" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any --find-links "$dir" -d "$dir" \
  -r "$repo/scripts/ros-jazzy-requirements.txt" -c "$constraints" "rosbags==$(sed -n 's/^rosbags==//p' "$constraints")" \
  "simplejpeg>=1.7"
rm -f "$dir"/numpy-* "$dir"/pillow-* "$dir"/PyYAML-* "$dir"/pyyaml-* "$dir"/safetensors-* "$dir"/setuptools-*
echo "$(find "$dir" -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1), in $dir"
