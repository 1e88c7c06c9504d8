"""The graph engine's computation on the CPU: folded weights and kernel definitions vs the eager model.

CUDA graphs and Triton kernels need a GPU (test_engine_gpu.py); this checks everything else the graph
engine does — weight folding, precomputed adaRMS, K/V layout, bucketing, split-K — in float32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import random_inputs, rel_l2, tiny_model

from rmuscle_ros.engine import ops
from rmuscle_ros.engine.fused import KV_ALIGN, FusedPi05, KVBuffers, round_up, split_k
from rmuscle_ros.models.config import GemmaConfig, get_preset

TINY = get_preset("tiny")
VARIANTS = {
    "tiny (MQA)": TINY,
    "GQA, 2 KV heads": dataclasses.replace(
        TINY,
        vlm=dataclasses.replace(TINY.vlm, num_kv_heads=2),
        expert=dataclasses.replace(TINY.expert, num_kv_heads=2),
    ),
    "MHA, split-K": dataclasses.replace(
        TINY,
        vlm=GemmaConfig(width=128, depth=2, mlp_dim=256, num_heads=8, num_kv_heads=8, head_dim=64),
        expert=GemmaConfig(width=64, depth=2, mlp_dim=1024, num_heads=8, num_kv_heads=8, head_dim=64),
        num_cameras=2,
    ),
}


def run_fused(fused: FusedPi05, inputs, noise, bucket: int) -> torch.Tensor:
    cfg = fused.cfg
    tokens = inputs.tokens[0][inputs.token_mask[0]]
    padded = torch.zeros(bucket, dtype=torch.long)
    padded[: len(tokens)] = tokens
    pad_mask = torch.cat(
        [
            inputs.image_masks[0].repeat_interleave(cfg.vision.tokens_per_image),
            torch.arange(bucket) < len(tokens),
        ]
    )
    kv = KVBuffers.allocate(
        cfg, round_up(len(pad_mask) + cfg.horizon, KV_ALIGN), torch.device("cpu"), torch.float32
    )
    with torch.no_grad():
        visual = fused.encode_images(inputs.images[0], torch.empty(cfg.image_tokens, cfg.vlm.width))
        key_bias = fused.prefill(visual, padded, pad_mask, kv)
        return fused.denoise(noise[0], key_bias, kv, torch.empty_like(noise[0]))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_matches_eager(variant: str) -> None:
    cfg = VARIANTS[variant]
    model = tiny_model(cfg, seed=5)
    inputs, noise = random_inputs(cfg, valid_tokens=19, pad_to=19)
    inputs.image_masks[0, -1] = False  # a missing camera
    expected = model.sample_actions(inputs, noise)[0]
    fused = FusedPi05(model, device="cpu", dtype=torch.float32, ops=ops)
    assert rel_l2(run_fused(fused, inputs, noise, bucket=32), expected) < 1e-5


def test_bucket_padding_does_not_change_the_result() -> None:
    model = tiny_model(seed=6)
    inputs, noise = random_inputs(model.cfg, valid_tokens=20, pad_to=20)
    fused = FusedPi05(model, device="cpu", dtype=torch.float32, ops=ops)
    assert (
        rel_l2(run_fused(fused, inputs, noise, bucket=32), run_fused(fused, inputs, noise, bucket=96)) < 1e-6
    )


def test_split_k_choice() -> None:
    assert split_k(2048) == 4 and split_k(4096) == 8 and split_k(24576) == 8  # π0.5 expert o/down, 7B
    assert split_k(128) == 1 and split_k(1000) == 1
