"""Quantile normalisation and the LeRobot / openpi stats file formats."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from rmuscle_ros.runtime.normalize import (
    NormStats,
    QuantileStats,
    identity_stats,
    load_norm_stats,
)

Q01 = np.array([-2.0, 0.0, 5.0], dtype=np.float32)
Q99 = np.array([2.0, 0.5, 5.0], dtype=np.float32)  # last dimension is constant: zero range


def _stats(convention: str) -> QuantileStats:
    return QuantileStats(q01=Q01, q99=Q99, convention=convention)  # type: ignore[arg-type]


def test_openpi_formula() -> None:
    x = np.array([0.0, 0.5, 5.0], dtype=np.float32)
    expected = (x - Q01) / (Q99 - Q01 + np.float32(1e-6)) * 2 - 1
    np.testing.assert_array_equal(_stats("openpi").normalize(x), expected)
    assert _stats("openpi").normalize(x)[2] == -1.0  # zero range: x == q01 maps to -1


def test_lerobot_formula() -> None:
    x = np.array([0.0, 0.5, 5.0], dtype=np.float32)
    y = _stats("lerobot").normalize(x)
    np.testing.assert_allclose(y[:2], [0.0, 1.0], rtol=0, atol=1e-7)
    assert y[2] == -1.0  # zero range uses 1e-8 as the denominator, and 0 / 1e-8 = 0


@pytest.mark.parametrize("convention", ["openpi", "lerobot"])
def test_roundtrip_and_padded_dims_pass_through(convention: str) -> None:
    stats = _stats(convention)
    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 3, size=(4, 50, 8)).astype(np.float32)
    x[..., 2] = 5.0  # the constant dimension only ever takes its constant value
    y = stats.normalize(x)
    assert y.shape == x.shape and y.dtype == np.float32
    np.testing.assert_array_equal(y[..., 3:], x[..., 3:])
    np.testing.assert_allclose(stats.unnormalize(y), x, rtol=0, atol=1e-5)
    z = rng.uniform(-1, 1, size=(50, 32)).astype(np.float32)
    np.testing.assert_allclose(stats.normalize(stats.unnormalize(z))[:, :2], z[:, :2], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(stats.unnormalize(z)[:, 3:], z[:, 3:])


def test_normalize_rejects_short_input() -> None:
    with pytest.raises(ValueError, match="shorter than the stats' dim 3"):
        _stats("openpi").normalize(np.zeros(2, dtype=np.float32))


def test_quantile_stats_validation() -> None:
    with pytest.raises(ValueError, match="float32"):
        QuantileStats(q01=Q01.astype(np.float64), q99=Q99, convention="openpi")
    with pytest.raises(ValueError, match="shape"):
        QuantileStats(q01=Q01, q99=Q99[:2], convention="openpi")
    with pytest.raises(ValueError, match="NaN or Inf"):
        QuantileStats(q01=np.array([np.nan], np.float32), q99=np.ones(1, np.float32), convention="openpi")
    with pytest.raises(ValueError, match=re.escape("q99 < q01 in dimensions [0]")):
        QuantileStats(q01=np.ones(1, np.float32), q99=np.zeros(1, np.float32), convention="openpi")
    with pytest.raises(ValueError, match="convention"):
        QuantileStats(q01=Q01, q99=Q99, convention="zscore")  # type: ignore[arg-type]
    # Ranges float32 cannot normalise with (found in review: loaded, then every state bin 0, or every chunk
    # non-finite): wider than float32, or so narrow that any value off q01 is ±Inf.
    for convention in ("openpi", "lerobot"):
        with pytest.raises(ValueError, match=re.escape("q99 - q01 in dimensions [1] is [inf]: past what")):
            QuantileStats(
                q01=np.array([0, -3e38], np.float32),
                q99=np.array([1, 3e38], np.float32),
                convention=convention,
            )
    with pytest.raises(ValueError, match=re.escape("q99 - q01 in dimensions [0] is [9.809")):
        QuantileStats(q01=np.zeros(1, np.float32), q99=np.full(1, 1e-44, np.float32), convention="lerobot")
    QuantileStats(q01=np.zeros(1, np.float32), q99=np.zeros(1, np.float32), convention="lerobot")  # eps


def test_quantile_stats_are_immutable_copies() -> None:
    source = Q01.copy()
    stats = QuantileStats(q01=source, q99=Q99, convention="openpi")
    source[0] = 100.0
    assert stats.q01[0] == -2.0
    with pytest.raises(ValueError):
        stats.q01[0] = 1.0


def test_norm_stats_rejects_mixed_conventions() -> None:
    with pytest.raises(ValueError, match="convention"):
        NormStats(state=_stats("openpi"), actions=_stats("lerobot"))


def test_identity_stats() -> None:
    stats = identity_stats(state_dim=14, action_dim=14)
    x = np.random.default_rng(1).uniform(-1, 1, size=(50, 32)).astype(np.float32)
    np.testing.assert_allclose(stats.state.normalize(x), x, rtol=0, atol=1e-7)
    np.testing.assert_allclose(stats.actions.unnormalize(x), x, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="state_dim"):
        identity_stats(0, 14)


# --- LeRobot safetensors -----------------------------------------------------------------------


def _write_lerobot(path: Path, drop: str | None = None) -> Path:
    tensors = {
        "observation.state.q01": np.array([-1.0, 0.0], np.float32),
        "observation.state.q99": np.array([1.0, 2.0], np.float32),
        "observation.state.mean": np.zeros(2, np.float32),
        "observation.state.std": np.ones(2, np.float32),
        "action.q01": np.array([0.0, 0.0, -3.0], np.float32),
        "action.q99": np.array([1.0, 4.0, 3.0], np.float32),
        "action.min": np.zeros(3, np.float32),
        "action.max": np.ones(3, np.float32),
    }
    if drop is not None:
        del tensors[drop]
    save_file(tensors, str(path))
    return path


def test_load_lerobot_safetensors(tmp_path: Path) -> None:
    stats = load_norm_stats(_write_lerobot(tmp_path / "normalizer_processor.safetensors"))
    assert stats.state.convention == stats.actions.convention == "lerobot"
    np.testing.assert_array_equal(stats.state.q99, [1.0, 2.0])
    np.testing.assert_array_equal(stats.actions.q01, [0.0, 0.0, -3.0])
    assert stats.actions.q01.dtype == np.float32


@pytest.mark.parametrize("mode", ["QUANTILES", "MEAN_STD", "QUANTILE10"])
def test_lerobot_stats_trained_with_another_mode_are_refused(tmp_path: Path, mode: str) -> None:
    """The normalizer file holds every statistic; the pipeline's JSON says which one the policy was trained
    with. Only π0.5's quantiles are supported: another mode is refused naming it (found in review)."""
    path = _write_lerobot(tmp_path / "policy_preprocessor_step_3_normalizer_processor.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"type": "pi05"}))  # other JSON beside it: ignored
    steps = [
        {"registry_name": "rename_observations_processor", "config": {}},
        {"registry_name": "normalizer_processor", "state_file": path.name,
         "config": {"eps": 1e-8, "norm_map": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": mode}}},
    ]  # fmt: skip
    (tmp_path / "policy_preprocessor.json").write_text(
        json.dumps({"name": "policy_preprocessor", "steps": steps})
    )
    if mode == "QUANTILES":
        assert load_norm_stats(path).actions.dim == 3
        return
    with pytest.raises(
        ValueError, match=f"policy_preprocessor.json normalises ACTION with {mode}; only QUANTILES"
    ):
        load_norm_stats(path)


@pytest.mark.parametrize("key", ["observation.state.q01", "action.q99"])
def test_lerobot_missing_key_is_named(tmp_path: Path, key: str) -> None:
    path = _write_lerobot(tmp_path / "stats.safetensors", drop=key)
    with pytest.raises(ValueError, match=re.escape(f"stats.safetensors has no key {key}")):
        load_norm_stats(path)


def test_lerobot_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError, match=re.escape("broken.safetensors is not a readable safetensors file")):
        load_norm_stats(path)


def test_lerobot_non_vector_stat(tmp_path: Path) -> None:
    path = tmp_path / "stats.safetensors"
    tensors = {"observation.state.q01": np.zeros((2, 2), np.float32), "observation.state.q99": np.ones(2)}
    save_file(
        {**tensors, "action.q01": np.zeros(1, np.float32), "action.q99": np.ones(1, np.float32)}, str(path)
    )
    with pytest.raises(ValueError, match=re.escape("observation.state.q01 must be a non-empty 1-D array")):
        load_norm_stats(path)


# --- openpi JSON -------------------------------------------------------------------------------


def _openpi_document() -> dict[str, Any]:
    return {
        "norm_stats": {
            "state": {"mean": [0.0, 0.0], "std": [1.0, 1.0], "q01": [-1.0, 0.5], "q99": [1.0, 1.5]},
            "actions": {"mean": [0.0], "std": [1.0], "q01": [-0.25], "q99": [0.75]},
        }
    }


def test_load_openpi_json(tmp_path: Path) -> None:
    path = tmp_path / "norm_stats.json"
    path.write_text(json.dumps(_openpi_document()))
    stats = load_norm_stats(path)
    assert stats.state.convention == stats.actions.convention == "openpi"
    np.testing.assert_array_equal(stats.state.q01, np.array([-1.0, 0.5], np.float32))
    np.testing.assert_array_equal(stats.actions.q99, np.array([0.75], np.float32))
    assert stats.state.q01.dtype == np.float32


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda d: d.pop("norm_stats"), "norm_stats"),
        (lambda d: d["norm_stats"].pop("actions"), "norm_stats.actions"),
        (lambda d: d["norm_stats"]["state"].pop("q99"), "norm_stats.state.q99"),
        (lambda d: d["norm_stats"]["actions"].update(q01=None), "norm_stats.actions.q01"),
    ],
)
def test_openpi_missing_key_is_named(tmp_path: Path, edit: Any, key: str) -> None:
    document = _openpi_document()
    edit(document)
    path = tmp_path / "norm_stats.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=re.escape(f"norm_stats.json has no key {key}")):
        load_norm_stats(path)


def test_openpi_bad_values(tmp_path: Path) -> None:
    document = _openpi_document()
    document["norm_stats"]["state"]["q01"] = ["a", "b"]
    path = tmp_path / "norm_stats.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=re.escape("norm_stats.state.q01 is not a numeric array")):
        load_norm_stats(path)

    document = _openpi_document()
    document["norm_stats"]["state"]["q99"] = [1.0]
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=r"norm_stats\.json: norm_stats\.state: .*shape"):
        load_norm_stats(path)


def test_openpi_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "norm_stats.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape("norm_stats.json is not valid JSON")):
        load_norm_stats(path)


def test_unknown_format_and_missing_file(tmp_path: Path) -> None:
    pickled = tmp_path / "stats.pkl"
    pickled.write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match=re.escape("stats.pkl: unknown format '.pkl'")):
        load_norm_stats(pickled)
    with pytest.raises(ValueError, match=re.escape("missing.json does not exist")):
        load_norm_stats(tmp_path / "missing.json")


def test_what_a_review_found_in_norm_stats_files_is_read_or_refused_by_name(tmp_path: Path) -> None:
    """Found in review, each reproduced: a LeRobot normalizer saved in bfloat16 (its stats cast to a bf16
    pipeline's dtype) ended in a bare TypeError from numpy; a pipeline norm_map that does not name STATE
    (LeRobot then leaves the state unnormalised) was taken for QUANTILES; boolean quantiles loaded as 0/1;
    a 5,000-digit number in openpi's JSON escaped naming no file."""
    import torch
    from safetensors.torch import save_file as save_torch

    bf16 = tmp_path / "bf16" / "normalizer_processor.safetensors"
    bf16.parent.mkdir()
    save_torch(
        {
            "observation.state.q01": torch.tensor([-1.0, 0.0], dtype=torch.bfloat16),
            "observation.state.q99": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
            "action.q01": torch.tensor([0.0, -3.0], dtype=torch.bfloat16),
            "action.q99": torch.tensor([1.0, 3.0], dtype=torch.bfloat16),
        },
        str(bf16),
    )
    stats = load_norm_stats(bf16)
    np.testing.assert_array_equal(stats.state.q99, [1.0, 2.0])
    assert stats.actions.q01.dtype == np.float32

    path = _write_lerobot(tmp_path / "policy_preprocessor_step_3_normalizer_processor.safetensors")
    steps = [{"registry_name": "normalizer_processor", "state_file": path.name,
              "config": {"norm_map": {"VISUAL": "IDENTITY", "ACTION": "QUANTILES"}}}]  # fmt: skip
    (tmp_path / "policy_preprocessor.json").write_text(json.dumps({"steps": steps}))
    with pytest.raises(ValueError, match="normalises STATE with IDENTITY; only QUANTILES"):
        load_norm_stats(path)

    flags = tmp_path / "flags.safetensors"
    save_torch(
        {"observation.state.q01": torch.tensor([True, False]), "observation.state.q99": torch.ones(2),
         "action.q01": torch.zeros(1), "action.q99": torch.ones(1)},
        str(flags),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"observation.state.q01 is torch.bool, not floating point"):
        load_norm_stats(flags)
    document = _openpi_document()
    document["norm_stats"]["actions"]["q01"] = [True]
    (tmp_path / "bools.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match=r"norm_stats.actions.q01 holds booleans, not quantiles"):
        load_norm_stats(tmp_path / "bools.json")
    (tmp_path / "digits.json").write_text('{"norm_stats": {"state": {"q01": [' + "9" * 5001 + "]}}}")
    with pytest.raises(ValueError, match=r"digits.json is not valid JSON"):
        load_norm_stats(tmp_path / "digits.json")


def test_lerobot_stats_of_the_models_32_dimensions_are_refused_for_a_smaller_robot() -> None:
    """Found by mutation testing: only openpi files cover the 32 padded dimensions; LeRobot stats of 32
    are another robot's, whose ranges would land on the ALOHA's joints. Refused naming both counts."""
    wide = QuantileStats(q01=-np.ones(32, np.float32), q99=np.ones(32, np.float32), convention="lerobot")
    with pytest.raises(ValueError, match=r"cover 32 state / 32 action dimensions, the robot has .* 14 / 14"):
        NormStats(state=wide, actions=wide).for_robot(14, 14, 32)
    padded = QuantileStats(q01=-np.ones(32, np.float32), q99=np.ones(32, np.float32), convention="openpi")
    assert NormStats(state=padded, actions=padded).for_robot(14, 14, 32).state.dim == 14
