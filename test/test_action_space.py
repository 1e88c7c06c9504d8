"""A checkpoint's state and action conventions (openpi's ALOHA adaptation, delta actions), and what a
π0.5-size policy refuses to run without: what decides where the arms go on a cell."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rmuscle_ros.runtime.action_space import (
    ALOHA_DELTA_ACTIONS,
    ActionSpace,
    gripper_from_pi,
    gripper_to_pi,
)
from rmuscle_ros.runtime.policy import Observation, Policy, PolicyConfig, synthetic_observation
from rmuscle_ros.runtime.transforms import build_prompt, discretize_state

CAMERAS = ("cam_high", "cam_left_wrist", "cam_right_wrist")
ALOHA_STATE = np.array(
    [0.1, -0.96, 1.16, 0.05, -0.3, 0.2, 0.8, -0.1, -0.9, 1.1, 0.0, -0.4, 0.1, 0.3], np.float32
)


def write_openpi_stats(path: Path, dims: int = 14) -> Path:
    """openpi's norm_stats.json for an ALOHA model in π's space: arm-joint actions are small offsets."""
    state_q01 = np.array([-0.6, -0.2, -1.7, -1.0, -1.2, -1.5, -1.2] * 2 + [0.0] * (dims - 14))
    state_q99 = np.array([0.6, 1.7, 0.2, 1.0, 1.2, 1.5, 1.0] * 2 + [0.0] * (dims - 14))
    action_q01 = np.array([-0.05] * 6 + [-0.5] + [-0.05] * 6 + [-0.5] + [0.0] * (dims - 14))
    action_q99 = np.array([0.05] * 6 + [1.0] + [0.05] * 6 + [1.0] + [0.0] * (dims - 14))
    stats = {
        "state": {"q01": state_q01.tolist(), "q99": state_q99.tolist()},
        "actions": {"q01": action_q01.tolist(), "q99": action_q99.tolist()},
    }
    path.write_text(json.dumps({"norm_stats": stats}))
    return path


def aloha_policy(stats: Path, **changes: object) -> Policy:
    fields: dict[str, object] = {
        "cameras": CAMERAS,
        "norm_stats": str(stats),
        "aloha_adapt_to_pi": True,
        "delta_actions": ALOHA_DELTA_ACTIONS,
    }
    return Policy(PolicyConfig(**(fields | changes)))


def normalized(policy: Policy, actions: np.ndarray) -> torch.Tensor:
    """(horizon, 14) un-normalised model actions -> the (1, horizon, 32) model output that gives them."""
    stats = policy.stats.actions
    out = torch.zeros(1, policy.model_cfg.horizon, policy.model_cfg.action_dim)
    scale = stats.q99 - stats.q01 + 1e-6
    out[0, :, :14] = torch.from_numpy(((actions - stats.q01) / scale * 2 - 1).astype(np.float32))
    return out


def test_gripper_conversions_follow_the_linkage_constants() -> None:
    """Values worked out by hand from the constants openpi takes from the ALOHA and Interbotix code: fully
    open, the horn stands at 90°; closed (18.44 mm), at asin(-0.58170) = -0.62081 rad (-35.6°); π's 0 is the joint's 0.5476 rad."""
    np.testing.assert_allclose(gripper_to_pi(np.array([1.0])), [(np.pi / 2 - 0.5476) / 1.082], atol=1e-4)
    np.testing.assert_allclose(gripper_to_pi(np.array([0.0])), [(-0.62081 - 0.5476) / 1.082], atol=1e-4)
    np.testing.assert_allclose(gripper_from_pi(np.array([0.0])), [(0.5476 + 0.6213) / 2.1123], atol=1e-6)
    # Monotone over the opening, and saturating (not NaN) where the linkage cannot reach: a reading below
    # any real one stays shut (openpi's formula turns the sign there and reads it wide open).
    opening = np.linspace(-2.0, 1.5, 351)
    angle = gripper_to_pi(opening)
    assert np.isfinite(angle).all() and (np.diff(angle) >= 0).all()


def test_holding_still_is_commanded_as_the_measured_state(tmp_path: Path) -> None:
    """An openpi ALOHA checkpoint predicts arm joints as offsets from the state: offset 0 means stay. The
    published chunk holds each arm joint where it is (before, it was commanded to 0 rad), flipped joints
    included, and a gripper comes back through π's gripper space."""
    policy = aloha_policy(write_openpi_stats(tmp_path / "norm_stats.json"))
    model_state = policy.space.state_to_model(ALOHA_STATE)
    model_actions = np.zeros((policy.model_cfg.horizon, 14))
    model_actions[:, [6, 13]] = 0.25  # π's gripper value
    actions = policy.postprocess(normalized(policy, model_actions), model_state)
    joints = list(ALOHA_DELTA_ACTIONS)
    np.testing.assert_allclose(actions[:, joints], np.broadcast_to(ALOHA_STATE[joints], (50, 12)), atol=1e-4)
    np.testing.assert_allclose(actions[:, [6, 13]], gripper_from_pi(np.full((50, 2), 0.25)), atol=1e-4)

    # An offset on the shoulder (π turns it the other way) moves the robot's shoulder down by as much.
    model_actions[:, 1] = 0.02
    moved = policy.postprocess(normalized(policy, model_actions), model_state)
    np.testing.assert_allclose(moved[:, 1], ALOHA_STATE[1] - 0.02, atol=1e-4)
    with pytest.raises(ValueError, match="need the call's state"):
        policy.postprocess(normalized(policy, model_actions))


def test_the_prompt_holds_the_state_in_the_checkpoints_space(tmp_path: Path) -> None:
    policy = aloha_policy(write_openpi_stats(tmp_path / "norm_stats.json"))
    obs = Observation(synthetic_observation(policy.cfg, "x").images, ALOHA_STATE, "fold the towel")
    inputs, _, _ = policy.preprocess(obs)
    flipped = ALOHA_STATE.astype(np.float64) * np.array([1, -1, -1, 1, 1, 1, 1] * 2)
    flipped[[6, 13]] = gripper_to_pi(flipped[[6, 13]])
    want = build_prompt(
        "fold the towel", discretize_state(policy.stats.state.normalize(flipped.astype(np.float32)))
    )
    tokens = inputs.tokens[0][inputs.token_mask[0]].tolist()
    assert tokens == policy.tokenizer.encode(want)
    # Robot units in the prompt would be other bins for the flipped joints.
    plain = build_prompt("fold the towel", discretize_state(policy.stats.state.normalize(ALOHA_STATE)))
    assert plain != want


def test_an_infer_publishes_absolute_actions(tmp_path: Path) -> None:
    """Through infer: the delta chunk is the absolute one less the state, call for call."""
    stats = write_openpi_stats(tmp_path / "norm_stats.json")
    absolute = aloha_policy(stats, aloha_adapt_to_pi=False)
    offsets = aloha_policy(stats, aloha_adapt_to_pi=False, delta_actions=())
    obs = Observation(synthetic_observation(absolute.cfg, "x").images, ALOHA_STATE, "x")
    noise = torch.randn(1, 50, 32)
    delta = absolute.infer(obs, noise).actions - offsets.infer(obs, noise).actions
    joints = list(ALOHA_DELTA_ACTIONS)
    np.testing.assert_allclose(delta[:, joints], np.broadcast_to(ALOHA_STATE[joints], (50, 12)), atol=1e-5)
    np.testing.assert_array_equal(delta[:, [6, 13]], 0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"aloha_adapt_to_pi": True, "state_dim": 7, "action_dim": 7},
            r"^aloha_adapt_to_pi: needs ALOHA's 14-D",
        ),
        ({"delta_actions": (3, 1)}, r"^delta_actions: needs distinct action dimensions in increasing order"),
        ({"delta_actions": (0, 14)}, r"^delta_actions: .* \(0\.\.13\), got \[0, 14\]"),
        ({"delta_actions": (0, 8), "state_dim": 7}, r"^delta_actions: .* \(0\.\.6\)"),
    ],
)
def test_bad_conventions_are_refused_naming_the_field(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**changes)


def test_identity_space_changes_nothing() -> None:
    space = ActionSpace(14, 14)
    assert space.identity
    np.testing.assert_array_equal(space.state_to_model(ALOHA_STATE), ALOHA_STATE)


def test_stats_wider_than_the_robot_are_cut_to_it(tmp_path: Path) -> None:
    """Older openpi norm_stats.json files hold all 32 model dimensions; openpi uses the leading ones. Any
    other count is refused: a joint list missing a joint would put each range on its neighbour."""
    wide = Policy(PolicyConfig(cameras=CAMERAS, norm_stats=str(write_openpi_stats(tmp_path / "w.json", 32))))
    exact = Policy(PolicyConfig(cameras=CAMERAS, norm_stats=str(write_openpi_stats(tmp_path / "e.json"))))
    assert wide.stats.state.dim == wide.stats.actions.dim == 14
    np.testing.assert_array_equal(wide.stats.actions.q99, exact.stats.actions.q99)
    for dims in (16, 13):
        with pytest.raises(
            ValueError, match=rf"norm_stats: cover 14 state / 14 action dimensions, .* {dims} / {dims}"
        ):
            Policy(
                PolicyConfig(
                    cameras=CAMERAS, norm_stats=str(tmp_path / "e.json"), state_dim=dims, action_dim=dims
                )
            )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {},
            r"^checkpoint: preset 'pi05' needs a trained checkpoint .* checkpoint, norm_stats, tokenizer not given",
        ),
        ({"checkpoint": "m.safetensors", "norm_stats": "n.json"}, r"^tokenizer: .* tokenizer not given"),
        ({"checkpoint": "m.safetensors", "tokenizer": "t.model"}, r"^norm_stats: .* norm_stats not given"),
        (
            {"checkpoint": "m.safetensors", "random_weights": True},
            r"^random_weights: set, but so is checkpoint",
        ),
    ],
)
def test_a_pi05_policy_needs_its_checkpoint_stats_and_tokenizer(
    fields: dict[str, object], message: str
) -> None:
    """A cell whose checkpoint or tokenizer setting came out empty must not run random weights or byte
    tokens it was never trained on: refused, unless random weights are asked for (benchmarks)."""
    with pytest.raises(ValueError, match=message):
        PolicyConfig(preset="pi05", **fields)
    assert PolicyConfig(preset="pi05", random_weights=True).checkpoint is None


def test_a_pi05_policy_refuses_another_tokenizer(tmp_path: Path, spm_model: Path) -> None:
    stats = write_openpi_stats(tmp_path / "norm_stats.json")
    cfg = PolicyConfig(
        preset="pi05", checkpoint="absent.safetensors", norm_stats=str(stats), tokenizer=str(spm_model)
    )
    with pytest.raises(
        ValueError, match=r"tokenizer: .* has 100 pieces; a π0.5 checkpoint reads PaliGemma's 257152"
    ):
        Policy(cfg)
