"""`colcon build`, as a cell's machine builds this package (docs/node.md, "On a Jetson Thor", step 3):
this repository in a workspace's `src/`, the Python environment activated, the ROS install found through
AMENT_PREFIX_PATH (here the venv's ROS wheels stand for a sourced /opt/ros/jazzy). Then the installed
package is what runs: its files, its imports, and both installed node executables driving an ALOHA stack
over DDS. Everything else in the suite runs from the source checkout; this is the path a deployment
takes, and a file CMakeLists.txt forgot to install shows up only here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_launch import drive_an_aloha_stack

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# Top-level entries of a clone that the build neither reads nor installs (the tests and benchmarks, ~11 MB),
# and what a developer's checkout has there beside its sources (besides hidden ones and *.egg-info).
NOT_COPIED = frozenset(("build", "install", "log", "bench", "test", "_exp"))


def not_copied(folder: str, names: list[str]) -> list[str]:
    """What the workspace's copy of the checkout leaves out (shutil.copytree's `ignore`)."""
    top = Path(folder) == REPO

    def left_out(name: str) -> bool:
        return name in NOT_COPIED or name.startswith(".") or name.endswith(".egg-info")

    return [n for n in names if n == "__pycache__" or (top and left_out(n))]


@dataclass(frozen=True)
class Workspace:
    root: Path
    env: dict[str, str]  # after `source install/setup.bash`

    @property
    def prefix(self) -> Path:
        return self.root / "install" / "rmuscle_ros"


def build_environment(root: Path) -> dict[str, str]:
    """The shell a deployment builds in: the venv activated, the ROS install's prefix in AMENT_PREFIX_PATH
    (what sourcing /opt/ros/jazzy/setup.bash sets), nothing of this checkout on the Python path, and no
    colcon defaults of the user's (~/.colcon) to change the build."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CMAKE_PREFIX_PATH", "COLCON_HOME")}
    return env | {
        "VIRTUAL_ENV": sys.prefix,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "AMENT_PREFIX_PATH": sys.prefix,
        "COLCON_HOME": str(root / ".colcon"),
    }


def sourced(root: Path, env: dict[str, str]) -> dict[str, str]:
    """The environment after `source install/setup.bash` in a shell with `env`."""
    out = subprocess.run(
        ["bash", "-c", "source install/setup.bash && env -0"],
        cwd=root,
        env=env,
        capture_output=True,
        check=True,
    ).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    if not (VENV_BIN / "colcon").is_file():
        pytest.skip(f"colcon is not installed in {VENV_BIN.parent} (the `dev` extra has it: make venv)")
    pytest.importorskip("rclpy", reason="ROS 2 wheels not installed (make venv installs them)")
    for tool in ("cmake", "make", "c++"):
        if shutil.which(tool) is None:
            pytest.skip(f"'{tool}' not found: colcon builds the interfaces with CMake and a C++ compiler")
    root = tmp_path_factory.mktemp("colcon_ws")
    shutil.copytree(REPO, root / "src" / "rmuscle_ros", ignore=not_copied)
    env = build_environment(root)
    log = root / "colcon_build.log"
    with log.open("wb") as out:
        # As the Thor guide has it (no --symlink-install: everything is copied into install/).
        done = subprocess.run(
            [str(VENV_BIN / "colcon"), "build", "--packages-select", "rmuscle_ros"],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900,
        )  # fmt: skip
    assert done.returncode == 0, f"colcon build failed (exit {done.returncode}):\n{log.read_text()[-4000:]}"
    return Workspace(root, sourced(root, env))


def test_colcon_build_installs_the_nodes_the_launch_file_the_profiles_and_the_messages(workspace) -> None:
    share = workspace.prefix / "share" / "rmuscle_ros"
    for name in ("rmuscle_node", "action_streamer", "aloha_sim"):  # where `ros2 run` and launch_ros look
        executable = workspace.prefix / "lib" / "rmuscle_ros" / name
        assert executable.is_file() and os.access(executable, os.X_OK), executable
    for folder in ("config", "launch", "systemd"):
        shipped = sorted(p.name for p in (REPO / folder).iterdir() if p.is_file())
        assert (share / folder).is_dir(), f"{folder}/ not installed into {share}"
        assert sorted(p.name for p in (share / folder).iterdir()) == shipped, folder
        for name in shipped:
            assert (share / folder / name).read_bytes() == (REPO / folder / name).read_bytes(), name
    assert sorted(p.name for p in (share / "msg").glob("*.msg")) == sorted(
        p.name for p in (REPO / "msg").glob("*.msg")
    )
    assert (
        workspace.prefix / "share" / "ament_index" / "resource_index" / "packages" / "rmuscle_ros"
    ).is_file()
    # The sourced workspace comes before the ROS install, as an overlay does.
    assert workspace.env["AMENT_PREFIX_PATH"].split(os.pathsep)[:2] == [str(workspace.prefix), sys.prefix]


def test_the_installed_package_runs_from_the_install_and_finds_its_files_there(workspace, tmp_path) -> None:
    """Imported in a shell that sourced the workspace, away from the checkout: every module of the package,
    its generated messages included, loads from install/, and the files the package looks up at run time
    (the demo's profile, the bag tools' message definitions, the shared-memory profile for large frames)
    are the installed ones, not the checkout's."""
    probe = """
import json, sys
import rmuscle_ros.demo, rmuscle_ros.node.rmuscle_node, rmuscle_ros.node.action_streamer
import rmuscle_ros.node.aloha_sim, rmuscle_ros.node.replay_demo
from rmuscle_ros.msg import ActionChunk, CacheStatus
from rmuscle_ros import paths
from rmuscle_ros.node import bags
from ament_index_python.packages import get_package_share_directory
store = bags.typestore(with_interfaces=True)
print(json.dumps({
    "modules": {n: m.__file__ for n, m in sys.modules.items() if n.startswith("rmuscle_ros") and getattr(m, "__file__", None)},
    "source_checkout": paths.source_checkout(),
    "profile": str(paths.package_file("config", "rmuscle_default.yaml")),
    "msg": str(paths.package_file("msg")),
    "registered": sorted(t for t in store.fielddefs if t.startswith("rmuscle_ros/")),
    "share": get_package_share_directory("rmuscle_ros"),
}))
"""
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=workspace.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    prefix, share = str(workspace.prefix), str(workspace.prefix / "share" / "rmuscle_ros")
    elsewhere = {n: f for n, f in found["modules"].items() if not f.startswith(prefix + os.sep)}
    assert not elsewhere, f"modules not loaded from {prefix}: {elsewhere}"
    assert "rmuscle_ros.msg._action_chunk" in found["modules"]
    assert found["source_checkout"] is False
    assert found["share"] == share
    assert found["profile"] == f"{share}/config/rmuscle_default.yaml"
    assert found["msg"] == f"{share}/msg"
    assert found["registered"] == ["rmuscle_ros/msg/ActionChunk", "rmuscle_ros/msg/CacheStatus"]


def test_the_installed_nodes_drive_an_aloha_stack(workspace, tmp_path) -> None:
    """The installed executables (lib/rmuscle_ros, run as `ros2 run` and launch_ros run them) with the
    installed launch file's remappings and the installed profiles: the same check as the source checkout's
    (test_launch), the cell's follower arms receiving the policy's commands."""
    share = workspace.prefix / "share" / "rmuscle_ros"
    drive_an_aloha_stack(
        tmp_path,
        config=share / "config",
        launch=share / "launch" / "rmuscle.launch.py",
        executables=workspace.prefix / "lib" / "rmuscle_ros",
        env=workspace.env,
        domain_offset=55,
    )
