"""Setuptools shim: metadata lives in pyproject.toml; this adds the ROS 2 data files.

colcon/ament_python (and the later ament_cmake build) find the package through the ament index marker
and read package.xml from share/, so both are installed as data files next to the config YAMLs.
"""

from glob import glob

from setuptools import find_packages, setup

PACKAGE = "rmuscle_ros"

setup(
    packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/config", sorted(glob("config/*.yaml"))),
    ],
)
