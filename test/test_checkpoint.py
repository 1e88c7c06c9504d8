"""Checkpoint loading with the real LeRobot/openpi key layout, and clear errors for bad files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import random_inputs, tiny_model
from safetensors.torch import load_file, save_file

from rmuscle_ros.models.checkpoint import CheckpointError, load_model, save_checkpoint
from rmuscle_ros.models.config import get_preset

EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
TIED = "paligemma_with_expert.paligemma.lm_head.weight"
EXPERT_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A tiny checkpoint in LeRobot's layout and the reference actions of the model it came from."""
    model = tiny_model(seed=3)
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_checkpoint(model, path)
    inputs, noise = random_inputs(model.cfg)
    return path, model.sample_actions(inputs, noise)


def _actions(path: Path) -> torch.Tensor:
    model = load_model(get_preset("tiny"), path)
    inputs, noise = random_inputs(model.cfg)
    return model.sample_actions(inputs, noise)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    tensors = load_file(str(src))
    edit(tensors)
    save_file(tensors, str(dst))
    return dst


def test_lerobot_layout_round_trip(saved) -> None:
    path, expected = saved
    assert all(k.startswith("model.") for k in load_file(str(path)))
    assert torch.equal(_actions(path), expected)


def test_openpi_layout_without_prefix(saved, tmp_path: Path) -> None:
    path, expected = saved

    def strip(t: dict) -> None:
        for k in list(t):
            t[k.removeprefix("model.")] = t.pop(k)

    assert torch.equal(_actions(_rewrite(path, tmp_path / "openpi.safetensors", strip)), expected)


def test_embedding_only_as_tied_lm_head_and_unused_heads_ignored(saved, tmp_path: Path) -> None:
    path, expected = saved

    def tie(t: dict) -> None:
        embed = t.pop("model." + EMBED)
        t["model." + TIED] = embed
        t["model." + EXPERT_HEAD] = torch.zeros(embed.shape[0], 64)  # present in real files, never used

    assert torch.equal(_actions(_rewrite(path, tmp_path / "tied.safetensors", tie)), expected)


def test_legacy_time_mlp_names(saved, tmp_path: Path) -> None:
    path, expected = saved

    def rename(t: dict) -> None:
        for k in [k for k in t if k.startswith("model.time_mlp_")]:
            t[k.replace("model.time_mlp_", "model.action_time_mlp_")] = t.pop(k)

    assert torch.equal(_actions(_rewrite(path, tmp_path / "legacy.safetensors", rename)), expected)


def test_missing_tensor_is_named(saved, tmp_path: Path) -> None:
    path, _ = saved
    key = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.down_proj.weight"
    bad = _rewrite(path, tmp_path / "missing.safetensors", lambda t: t.pop(key))
    with pytest.raises(
        CheckpointError, match=r"missing tensor .*gemma_expert\.model\.layers\.1\.mlp\.down_proj"
    ):
        _actions(bad)


def test_misshaped_tensor_is_named(saved, tmp_path: Path) -> None:
    path, _ = saved
    key = "model.action_in_proj.weight"
    bad = _rewrite(path, tmp_path / "shape.safetensors", lambda t: t.__setitem__(key, torch.zeros(64, 14)))
    with pytest.raises(CheckpointError, match=r"action_in_proj\.weight.*\[64, 14\].*\[64, 32\]"):
        _actions(bad)


def test_other_architecture_is_refused(saved, tmp_path: Path) -> None:
    path, _ = saved
    bad = _rewrite(
        path, tmp_path / "pi0.safetensors", lambda t: t.__setitem__("model.state_proj.weight", torch.zeros(2))
    )
    with pytest.raises(CheckpointError, match=r"state_proj.*π0 checkpoint"):
        _actions(bad)


def test_nan_weights_are_refused(saved, tmp_path: Path) -> None:
    path, _ = saved
    key = "model.time_mlp_in.bias"
    bad = _rewrite(path, tmp_path / "nan.safetensors", lambda t: t[key].__setitem__(0, float("nan")))
    with pytest.raises(CheckpointError, match=r"time_mlp_in\.bias.*NaN"):
        _actions(bad)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_file_gives_a_clear_error(saved, tmp_path: Path, damage: str) -> None:
    path, _ = saved
    data = path.read_bytes()
    bad = tmp_path / f"{damage}.safetensors"
    bad.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": b"\x00not a safetensors file" * 10, "empty": b""}[
            damage
        ]
    )
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        _actions(bad)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        _actions(tmp_path / "nope.safetensors")
