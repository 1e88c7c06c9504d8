"""ROS parameters -> NodeConfig: defaults, profiles, and errors that name the parameter."""

from __future__ import annotations

from pathlib import Path

import pytest

from rmuscle_ros.node.params import (
    ALOHA_JOINTS,
    ParameterError,
    load_params_file,
    node_config,
    parameter_defaults,
)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"


def test_defaults_build_a_valid_config() -> None:
    cfg = node_config({})
    assert cfg.model.preset == "tiny" and cfg.model.state_dim == 14 == len(ALOHA_JOINTS)
    assert cfg.model.cameras == ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    assert cfg.model.checkpoint is None  # "" in ROS means "none"
    assert "model.cameras" not in parameter_defaults()  # derived from camera_topics


@pytest.mark.parametrize("profile", sorted(p.name for p in CONFIG_DIR.glob("rmuscle_*.yaml")))
def test_shipped_profiles_are_valid(profile: str) -> None:
    node_config(load_params_file(CONFIG_DIR / profile))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"model.preset": "pi0"}, r"^model\.preset: unknown 'pi0'"),
        ({"model.backend": "tensorrt"}, r"^model\.backend"),
        ({"control_period_s": 0.0}, r"^control_period_s: must be > 0"),
        ({"max_skew_s": float("nan")}, r"^max_skew_s"),
        ({"cache.rho_p": 1.5}, r"^cache\.rho_p: must be in \(0, 1\]"),
        ({"cache.similarity_threshold": -0.1}, r"^cache\.similarity_threshold"),
        ({"actions_per_inference": 51}, r"^actions_per_inference: must be in 1\.\.50"),
        ({"camera_topics": ["a", "a"]}, r"^camera_topics: needs distinct"),
        ({"camera_topics": ["a", "b", "c", "d"]}, r"^camera_topics: π0\.5 has 3 image slots"),
        ({"joint_names": [f"j{i}" for i in range(40)]}, r"^joint_names: must be an int in 1\.\.32"),
        ({"prompt": "  "}, r"^prompt: must not be empty"),
        ({"warmup": "yes"}, r"^warmup: expected bool"),
        ({"model.seed": 1.5}, r"^model\.seed: expected int"),
        ({"model.presett": "tiny"}, r"^model\.presett: unknown parameter"),
    ],
)
def test_invalid_parameters_are_named(params: dict, message: str) -> None:
    with pytest.raises(ParameterError, match=message):
        node_config(params)
