"""systemd/rmuscle@.service, the unit that starts the launch again whenever it ends (docs/node.md, "Under
systemd"): checked by systemd's own parser, and its command run by bash as systemd would hand it over.
Not run here: systemd itself (no systemd manager in this container or in CI), nor `ros2 launch` (not on
PyPI: a stand-in `ros2` records what it was given)."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "rmuscle@.service"
ENV = ROOT / "systemd" / "rmuscle.env"
LAUNCH = ROOT / "launch" / "rmuscle.launch.py"
LAUNCH_OWN = {"sigterm_timeout", "sigkill_timeout"}  # launch's own settings, read by every process it runs


def unit_settings() -> dict[str, str]:
    """section.key -> value (each key is set once in this unit)."""
    settings, section = {}, ""
    for line in UNIT.read_text().splitlines():
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith("#"):
            key, value = line.split("=", 1)
            assert f"{section}.{key}" not in settings, f"{key} set twice in [{section}]"
            settings[f"{section}.{key}"] = value
    return settings


def env_file() -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in ENV.read_text().splitlines() if line and not line.startswith("#")
    )


def launch_arguments(words: list[str]) -> dict[str, str]:
    return dict(w.split(":=", 1) for w in words if ":=" in w)


def declared_launch_arguments() -> set[str]:
    tree = ast.parse(LAUNCH.read_text())
    return {
        n.args[0].value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "DeclareLaunchArgument"
    }


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (apt: systemd)"
)
def test_systemd_reads_the_unit_without_a_complaint(tmp_path) -> None:
    """systemd-analyze verify, on the unit as an instance for root (a user every machine has): a misspelt key
    or value is only a warning to systemd (status 0), which ignores the line, so it must say nothing about
    this unit either (a `Restart=sometimes` said "Failed to parse service restart specifier, ignoring").
    Lines about the host's own units (verify loads those this one names) are not this unit's."""
    instance = tmp_path / "rmuscle@root.service"
    shutil.copy(UNIT, instance)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(instance)], capture_output=True, text=True, timeout=60
    )
    about_this_unit = [line for line in (done.stdout + done.stderr).splitlines() if "rmuscle@" in line]
    assert done.returncode == 0 and about_this_unit == [], done.stdout + done.stderr


def test_the_unit_restarts_the_launch_and_stops_it_as_a_ctrl_c_does() -> None:
    """What the restart path relies on: the launch ends with status 0 when rmuscle_node's process ends
    (end_with_policy_node:=true), so only Restart=always starts it again; a stop sends SIGINT to every process
    of the unit at once, as a terminal does, so that each node starts its shutdown whether launch forwards
    its own SIGINT or not (it does only without a terminal; with one, a SIGINT to launch alone reached no
    node until launch's SIGTERM 5 s later: launch 3.4.3's sources); systemd's SIGKILL comes after launch's
    own escalation, which leaves rmuscle_node its shutdown's recording."""
    s = unit_settings()
    assert s["Service.Restart"] == "always" and s["Service.KillSignal"] == "SIGINT"
    assert s["Service.KillMode"] == "control-group"
    words = shlex.split(s["Service.ExecStart"])
    assert words[:2] == ["/bin/bash", "-c"] and len(words) == 3
    command = launch_arguments(shlex.split(words[2].replace("$$", "$")))
    assert command["end_with_policy_node"] == "true"
    sigterm = re.fullmatch(r"\$\{RMUSCLE_SIGTERM_TIMEOUT:-([0-9]+)\}", command["sigterm_timeout"])
    assert sigterm is not None, command["sigterm_timeout"]
    escalation_s = float(sigterm.group(1)) + float(command["sigkill_timeout"])
    assert float(s["Service.TimeoutStopSec"]) > escalation_s
    assert int(s["Unit.StartLimitBurst"]) >= 2, "a single restart at least"


@pytest.mark.parametrize("sigterm_timeout", ["", "60"])
def test_the_units_command_runs_the_launch_with_the_cells_settings(tmp_path, sigterm_timeout: str) -> None:
    """The ExecStart line, as systemd hands it to bash ($$ -> $) with rmuscle.env's settings: ROS's and the
    workspace's setup scripts sourced, the venv activated after them, then `ros2 launch rmuscle_ros rmuscle.launch.py` with the unit's
    arguments and the cell's, each one the launch file declares or one of launch's own. The setup scripts
    and `ros2` are stand-ins (ROS's CLI is not on PyPI)."""
    settings = env_file()
    assert {"ROS_SETUP", "RMUSCLE_WORKSPACE", "RMUSCLE_VENV", "RMUSCLE_LAUNCH_ARGS", "ROS_DOMAIN_ID"} <= set(
        settings
    )
    bin_dir, workspace = tmp_path / "bin", tmp_path / "ws"
    bin_dir.mkdir()
    (workspace / "install").mkdir(parents=True)
    said = tmp_path / "ros2.json"
    ros2 = bin_dir / "ros2"
    ros2.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'venv': os.environ.get('VENV_SOURCED')}}, open({str(said)!r}, 'w'))\n"
    )
    ros2.chmod(0o755)
    (tmp_path / "ros_setup.bash").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    (workspace / "install" / "setup.bash").write_text("export WS_SOURCED=yes\n")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "activate").write_text(
        '[ "$WS_SOURCED" = yes ] && export VENV_SOURCED=last\n'
    )
    env = {
        "PATH": os.environ["PATH"],
        **settings,
        "ROS_SETUP": str(tmp_path / "ros_setup.bash"),
        "RMUSCLE_WORKSPACE": str(workspace),
        "RMUSCLE_VENV": str(tmp_path / "venv"),
        "RMUSCLE_LAUNCH_ARGS": settings["RMUSCLE_LAUNCH_ARGS"] + " namespace:=cell1",
    }
    if sigterm_timeout:
        env["RMUSCLE_SIGTERM_TIMEOUT"] = sigterm_timeout
    words = shlex.split(unit_settings()["Service.ExecStart"].replace("$$", "$"))
    done = subprocess.run(words, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ran = json.loads(said.read_text())
    assert ran["venv"] == "last" and ran["argv"][:3] == ["launch", "rmuscle_ros", "rmuscle.launch.py"], ran
    arguments = launch_arguments(ran["argv"][3:])
    assert arguments["params_file"] == "/etc/rmuscle/cell.yaml" and arguments["namespace"] == "cell1"
    assert arguments["sigterm_timeout"] == (sigterm_timeout or "30") and arguments["sigkill_timeout"] == "10"
    assert len(arguments) == len(ran["argv"]) - 3, "each word after the file is a name:=value"
    unknown = set(arguments) - declared_launch_arguments() - LAUNCH_OWN
    assert not unknown, f"not arguments of the launch file: {unknown}"
