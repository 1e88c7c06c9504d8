"""Parity with an implementation we did not write: LeRobot's π0.5 at reduced widths (float32, CPU)."""

from __future__ import annotations

import torch
from conftest import LEROBOT_FIXTURE, lerobot_fixture_config, lerobot_fixture_io, rel_l2

from rmuscle_ros.engine import ops
from rmuscle_ros.engine.fused import KV_ALIGN, FusedPi05, KVBuffers, round_up
from rmuscle_ros.models.checkpoint import load_model


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
    per_image = cfg.vision.tokens_per_image
    for i in range(expected.shape[0]):
        tokens = inputs.tokens[i][inputs.token_mask[i]]
        bucket = round_up(len(tokens), 16)
        padded = torch.zeros(bucket, dtype=torch.long)
        padded[: len(tokens)] = tokens
        pad_mask = torch.cat(
            [inputs.image_masks[i].repeat_interleave(per_image), torch.arange(bucket) < len(tokens)]
        )
        kv = KVBuffers.allocate(
            cfg, round_up(len(pad_mask) + cfg.horizon, KV_ALIGN), torch.device("cpu"), torch.float32
        )
        with torch.no_grad():
            visual = fused.encode_images(inputs.images[i], torch.empty(cfg.image_tokens, cfg.vlm.width))
            key_bias = fused.prefill(visual, padded, pad_mask, kv)
            actions = fused.denoise(noise[i], key_bias, kv, torch.empty_like(noise[i]))
        assert rel_l2(actions, expected[i]) < 1e-5, f"sample {i}"
