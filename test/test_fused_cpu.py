"""The graph engine's computation on the CPU: folded weights and kernel definitions vs the eager model.

CUDA graphs and Triton kernels need a GPU (test_engine_gpu.py); this checks everything else the graph
engine does — weight folding, precomputed adaRMS, K/V layout, bucketing, split-K — in float32.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import random_inputs, rel_l2, tiny_model

from rmuscle_ros.engine import ops
from rmuscle_ros.engine.fused import NEG_INF, FusedPi05, call_layout, pack_prompt, split_k
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


@pytest.mark.parametrize("missing", [-1, 0])  # the first camera missing: padding before any real token
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_matches_eager(variant: str, missing: int) -> None:
    cfg = VARIANTS[variant]
    model = tiny_model(cfg, seed=5)
    inputs, noise = random_inputs(cfg, valid_tokens=19, pad_to=19)
    inputs.image_masks[0, missing] = False
    expected = model.sample_actions(inputs, noise)[0]
    fused = FusedPi05(model, device="cpu", dtype=torch.float32, ops=ops)
    assert rel_l2(fused.run(inputs, noise, bucket=32), expected) < 1e-5


def test_bucket_padding_does_not_change_the_result() -> None:
    model = tiny_model(seed=6)
    inputs, noise = random_inputs(model.cfg, valid_tokens=20, pad_to=20)
    fused = FusedPi05(model, device="cpu", dtype=torch.float32, ops=ops)
    assert rel_l2(fused.run(inputs, noise, bucket=32), fused.run(inputs, noise, bucket=96)) < 1e-6


def test_call_layout_positions_and_key_bias() -> None:
    """RoPE positions count the real tokens before each row (-1 before the first); the actions follow the
    real prefix; padding keys are masked, the actions attend each other; the key length is aligned."""
    pad = np.array([False, False, True, True, False, True])
    layout = call_layout(pad, horizon=3)
    assert (layout.rope_rows - 1).tolist() == [-1, -1, 0, 1, 1, 2, 3, 4, 5]
    bias, masked = layout.key_bias.tolist(), float(np.float32(NEG_INF))
    assert len(bias) == 16 and bias[:9] == [masked, masked, 0, 0, masked, 0, 0, 0, 0]
    assert bias[9:] == [masked] * 7 and layout.key_bias.dtype == torch.float32


def test_split_k_choice() -> None:
    assert split_k(2048) == 4 and split_k(4096) == 8 and split_k(24576) == 8  # π0.5 expert o/down, 7B
    assert split_k(128) == 1 and split_k(1000) == 1


def test_pack_prompt_moves_valid_tokens_first() -> None:
    tokens, mask = pack_prompt(
        torch.tensor([0, 7, 0, 8, 9]), torch.tensor([False, True, False, True, True]), 4
    )
    assert tokens.tolist() == [7, 8, 9, 0] and mask.tolist() == [True, True, True, False]
    with pytest.raises(ValueError, match="more than the bucket"):
        pack_prompt(torch.arange(5), torch.ones(5, dtype=torch.bool), 4)


@pytest.mark.parametrize(("image_size", "patch_size", "cameras"), [(224, 14, 2), (40, 8, 3)])
def test_patch_embedding_is_the_convolution(image_size: int, patch_size: int, cameras: int) -> None:
    """The patch matmul (pixels gathered per patch) equals SigLIP's stride-p convolution, in float32."""
    cfg = dataclasses.replace(
        TINY, vision=dataclasses.replace(TINY.vision, image_size=image_size, patch_size=patch_size)
    )
    model = tiny_model(cfg, seed=7)
    gen = torch.Generator().manual_seed(1)
    images = torch.rand(cameras, 3, image_size, image_size, generator=gen) * 2 - 1
    emb = model.vision_tower.embeddings
    conv = F.conv2d(images, emb.patch_embedding.weight, emb.patch_embedding.bias, stride=patch_size)
    expected = (conv.flatten(2).transpose(1, 2) + emb.position_embedding.weight).reshape(-1, cfg.vision.width)
    fused = FusedPi05(model, device="cpu", dtype=torch.float32, ops=ops)
    tokens = fused.embed_patches(images)
    assert tokens.shape == (cameras * (image_size // patch_size) ** 2, cfg.vision.width)
    assert tokens.dtype == torch.float32 and tokens.is_contiguous()
    assert rel_l2(tokens, expected) < 1e-6


def test_keep_counts_are_exact_for_integral_products_and_refuse_fractions_outside_0_1() -> None:
    """rho_count is ceil(ρ·n) with float error forgiven (0.14·50 is 7.000000000000001 in binary: 7 rows,
    not 8), and a keep fraction outside (0, 1] is refused by rho_count and step_neuron_counts themselves
    rather than kept as one row or neuron. Found by a mutation review."""
    from rmuscle_ros.engine.fused import rho_count, step_neuron_counts

    assert rho_count(0.14, 50) == 7 and rho_count(0.07, 100) == 7 and rho_count(0.25, 10) == 3
    for rho in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"a keep fraction must be in \(0, 1\]"):
            rho_count(rho, 10)
        with pytest.raises(ValueError, match=r"rho_n must be in \(0, 1\]"):
            step_neuron_counts(rho, 4096, 10, 1, "uniform")
