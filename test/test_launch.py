"""The launch file: valid Python everywhere; where launch_ros exists (a ROS install), it builds."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[1] / "launch" / "rmuscle.launch.py"


def test_launch_file_is_valid_python_with_the_aloha_remappings() -> None:
    tree = ast.parse(LAUNCH.read_text())
    remaps = next(
        n for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.targets[0].id == "ALOHA_REMAPPINGS"
    )
    pairs = ast.literal_eval(remaps.value)
    assert ("images/base", "/cam_high/camera/color/image_rect_raw") in pairs
    assert {to for _, to in pairs} >= {"/follower_left/joint_states", "/follower_right/joint_states"}
    # Every node topic it remaps is one the node subscribes to by default.
    from rmuscle_ros.node.params import NodeConfig

    cfg = NodeConfig()
    assert {frm for frm, _ in pairs} == set(cfg.camera_topics) | set(cfg.joint_state_topics)


def test_the_streamer_is_remapped_onto_the_policys_chunks_and_the_follower_arms() -> None:
    tree = ast.parse(LAUNCH.read_text())
    remaps = next(
        n for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.targets[0].id == "STREAMER_REMAPPINGS"
    )
    pairs = dict(ast.literal_eval(remaps.value))
    from rmuscle_ros.node.action_streamer import StreamerConfig

    cfg = StreamerConfig()
    assert set(pairs) == {
        "action_chunk",
        *cfg.joint_state_topics,
        *cfg.arm_command_topics,
        *cfg.gripper_command_topics,
    }
    assert pairs["action_chunk"] == "rmuscle_node/action_chunk"  # the policy node's ~/action_chunk
    for side in ("left", "right"):
        assert pairs[f"joint_states/{side}"] == f"/follower_{side}/joint_states"
        assert pairs[f"commands/{side}/joint_group"] == f"/follower_{side}/commands/joint_group"
        assert pairs[f"commands/{side}/joint_single"] == f"/follower_{side}/commands/joint_single"


@pytest.mark.skipif(
    importlib.util.find_spec("launch_ros") is None,
    reason="launch_ros is not on PyPI; this runs in a ROS install (docker/Thor image)",
)
def test_launch_description_builds() -> None:
    spec = importlib.util.spec_from_file_location("rmuscle_launch", LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    description = module.generate_launch_description()
    assert len(description.entities) >= 11  # 5 arguments, then each node with its two autostart events
