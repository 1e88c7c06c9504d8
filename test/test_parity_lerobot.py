"""Parity with an implementation we did not write: LeRobot's π0.5 at reduced widths (float32, CPU)."""

from __future__ import annotations

import torch
from conftest import LEROBOT_FIXTURE, lerobot_fixture_config, lerobot_fixture_io, rel_l2

from rmuscle_ros.engine import ops
from rmuscle_ros.engine.fused import FusedPi05, round_up
from rmuscle_ros.models.checkpoint import load_model
from rmuscle_ros.models.pi05 import ModelInputs


def test_eager_reproduces_lerobot_actions() -> None:
    model = load_model(lerobot_fixture_config(), LEROBOT_FIXTURE / "model.safetensors")
    inputs, noise, expected = lerobot_fixture_io()
    actions = model.sample_actions(inputs, noise)
    assert actions.shape == expected.shape == (2, 50, 32)
    for i in range(expected.shape[0]):  # sample 1 has a right-padded prompt
        assert rel_l2(actions[i], expected[i]) < 1e-5, f"sample {i}"


def test_fused_forward_reproduces_lerobot_actions() -> None:
    """The graph engine's computation (folded weights, PyTorch definitions of its kernels) on CPU."""
    cfg = lerobot_fixture_config()
    model = load_model(cfg, LEROBOT_FIXTURE / "model.safetensors")
    inputs, noise, expected = lerobot_fixture_io()
    fused = FusedPi05(model, device="cpu", dtype=torch.float32, ops=ops)
    for i in range(expected.shape[0]):
        one = ModelInputs(
            *(t[i : i + 1] for t in (inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask))
        )
        actions = fused.run(one, noise[i : i + 1], bucket=round_up(int(inputs.token_mask[i].sum()), 16))
        assert rel_l2(actions, expected[i]) < 1e-5, f"sample {i}"
