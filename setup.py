"""Setuptools shim for pip: metadata lives in pyproject.toml; this adds the ROS 2 data files.

The ROS build is ament_cmake (CMakeLists.txt), which installs all of this itself; for a pip install
(the dev venv) the ament index marker, package.xml and the config YAMLs are installed as data files so
that ament_index finds the package. scripts/setup_ros_venv.sh then adds the generated interfaces.
"""

from glob import glob

from setuptools import find_packages, setup

PACKAGE = "rmuscle_ros"

setup(
    packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/config", sorted(glob("config/*.yaml")) + sorted(glob("config/*.xml"))),
        # the message definitions, which the bag tools read (rmuscle_ros/paths.py) where no source is beside
        (f"share/{PACKAGE}/msg", sorted(glob("msg/*.msg"))),
        (f"share/{PACKAGE}/launch", sorted(glob("launch/*.launch.py"))),
        # the unit that runs the launch under systemd on a cell, and its settings' example
        (f"share/{PACKAGE}/systemd", sorted(glob("systemd/*"))),
        # pip ignores setup.cfg install_scripts; launch_ros looks for lib/<package>/<executable>.
        (f"lib/{PACKAGE}", ["libexec/rmuscle_node", "libexec/action_streamer", "libexec/aloha_sim"]),
    ],
)
