"""The π0.5 model: full-size shapes, configs, and the masking semantics users rely on."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import random_inputs, tiny_model

from rmuscle_ros.models.config import GemmaConfig, Pi05Config, VisionConfig, get_preset
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model


def _param_count(cfg: Pi05Config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Pi05Model(cfg).parameters())


def test_full_size_matches_the_published_checkpoint() -> None:
    # lerobot/pi05_base holds 3,616,757,520 F32 parameters = every module below plus one unused
    # 257152 x 1024 expert lm_head (see shared/reference/pi05_architecture.md §2).
    assert _param_count(get_preset("pi05")) + 257_152 * 1024 == 3_616_757_520


def test_presets_share_the_structure() -> None:
    big, tiny = get_preset("pi05-7b"), get_preset("tiny")
    assert big.vlm.width == 3072 and big.expert == big.vlm and big.vlm.num_kv_heads == 16
    assert tiny.vision.tokens_per_image == 256 and tiny.num_cameras == 3 and tiny.horizon == 50
    assert _param_count(tiny) < 2_000_000


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"expert": GemmaConfig(64, 3, 128, 8, 1, 16)}, "depth"),
        ({"expert": GemmaConfig(64, 2, 128, 4, 1, 16)}, "num_heads"),
        ({"num_cameras": 4}, "num_cameras"),
        ({"horizon": 0}, "horizon"),
    ],
)
def test_invalid_configs_are_rejected(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(get_preset("tiny"), **change)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"horizon": 50.5}, "model.horizon must be a positive integer"),
        ({"num_cameras": 2.5}, "model.num_cameras must be a positive integer"),
        ({"num_steps": True}, "model.num_steps must be a positive integer"),
        ({"max_token_len": 200.0}, "model.max_token_len must be a positive integer"),
        ({"time_min_period": 10.0}, "time_min_period .* must be below time_max_period"),
        ({"time_max_period": float("nan")}, "time_max_period must be a positive finite number"),
        ({"vision": {"width": 64}}, "model.vision must be a VisionConfig"),
        ({"expert": VisionConfig()}, "model.expert must be a GemmaConfig"),
    ],
)
def test_config_fields_have_their_types(change: dict, message: str) -> None:
    """Found in review: float dims and a dict vision were accepted, to fail later inside the model build."""
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(get_preset("tiny"), **change)


def test_nested_configs_refuse_float_dims_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"vision\.depth must be a positive integer, got 2\.5"):
        VisionConfig(width=64, depth=2.5, mlp_dim=128, num_heads=2)
    with pytest.raises(ValueError, match=r"gemma\.head_dim must be a positive integer, got 16\.0"):
        GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=16.0)
    tiny = get_preset("tiny").to_dict()
    yaml_floats = {**tiny, "vlm": {**tiny["vlm"], "depth": 2.0}, "expert": {**tiny["expert"], "depth": 2.0}}
    with pytest.raises(ValueError, match=r"model\.vlm: gemma\.depth must be a positive integer, got 2\.0"):
        Pi05Config.from_dict(yaml_floats)
    with pytest.raises(ValueError, match=r"model\.vision must be a mapping"):
        Pi05Config.from_dict({**tiny, "vision": 64})
    with pytest.raises(ValueError, match=r"unknown model\.expert config keys: \['heads'\]"):
        Pi05Config.from_dict({**tiny, "expert": {**tiny["expert"], "heads": 8}})
    assert Pi05Config.from_dict(tiny) == get_preset("tiny")


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown model preset 'pi0'"):
        get_preset("pi0")


def test_missing_camera_is_ignored(tiny: Pi05Model) -> None:
    """A masked camera's pixels must not influence the actions (π0.5 missing-camera semantics)."""
    inputs, noise = random_inputs(tiny.cfg)
    inputs.image_masks[0, 2] = False
    first = tiny.sample_actions(inputs, noise)
    inputs.images[0, 2] = torch.rand_like(inputs.images[0, 2])
    assert torch.allclose(tiny.sample_actions(inputs, noise), first, atol=1e-6, rtol=0)
    inputs.image_masks[0, 2] = True  # and the mask does matter
    assert not torch.allclose(tiny.sample_actions(inputs, noise), first, atol=1e-3)


def test_prompt_padding_is_not_computed_into_the_result(tiny: Pi05Model) -> None:
    short, noise = random_inputs(tiny.cfg, valid_tokens=12, pad_to=12)
    long = ModelInputs(
        short.images,
        short.image_masks,
        torch.cat([short.tokens, torch.randint(0, 300, (1, 40))], 1),
        torch.cat([short.token_mask, torch.zeros(1, 40, dtype=torch.bool)], 1),
    )
    assert torch.allclose(
        tiny.sample_actions(long, noise), tiny.sample_actions(short, noise), atol=1e-6, rtol=0
    )


def test_batch_rows_are_independent(tiny: Pi05Model) -> None:
    batch, noise = random_inputs(tiny.cfg, batch=2)
    both = tiny.sample_actions(batch, noise)
    one = ModelInputs(*(t[1:] for t in (batch.images, batch.image_masks, batch.tokens, batch.token_mask)))
    assert torch.allclose(both[1:], tiny.sample_actions(one, noise[1:]), atol=1e-5)


def test_bf16_eager_stays_close_to_float32() -> None:
    model = tiny_model()
    inputs, noise = random_inputs(model.cfg)
    ref = model.sample_actions(inputs, noise)
    out = model.to(torch.bfloat16).sample_actions(inputs, noise)
    assert out.dtype == torch.float32
    assert ((out - ref).norm() / ref.norm()).item() < 5e-2
