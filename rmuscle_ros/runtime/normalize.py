"""Quantile normalisation of state and actions, with the stats loaded from LeRobot or openpi files.

π0.5 maps each state/action dimension from its [q01, q99] range (1st and 99th percentile over the
training data) onto [-1, 1]. LeRobot and openpi differ only in how they guard a zero range, so the
convention is recorded with the stats and both are reproduced exactly:

- openpi:  y = (x - q01) / (q99 - q01 + 1e-6) * 2 - 1      (epsilon always added)
- lerobot: y = 2 * (x - q01) / d - 1, d = q99 - q01, with d = 1e-8 only where d == 0

Stats cover the robot's real dimensions (e.g. 14 for ALOHA); the padded model dimensions beyond them
pass through unchanged. An openpi file covering all 32 padded dimensions (older openpi files) is cut to
the robot's (`NormStats.for_robot`), as openpi does. Files are read as safetensors or JSON only, never pickle.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

Convention = Literal["lerobot", "openpi"]

OPENPI_EPS = 1e-6  # openpi adds this to every range
LEROBOT_EPS = 1e-8  # LeRobot's normalizer eps, substituted only for zero ranges

# LeRobot normalizer processor files (policy_preprocessor_step_N_normalizer_processor.safetensors)
# store flat "{feature}.{stat}" keys.
LEROBOT_STATE_FEATURE = "observation.state"
LEROBOT_ACTION_FEATURE = "action"


def _freeze(array: np.ndarray) -> np.ndarray:
    frozen = array.copy()
    frozen.setflags(write=False)
    return frozen


@dataclass(frozen=True)
class QuantileStats:
    """Per-dimension 1% / 99% quantiles, (dim,) float32 each, and the formula they were made for.

    The arrays are copied and made read-only at construction, so a stats object cannot change after
    it has been validated.
    """

    q01: np.ndarray
    q99: np.ndarray
    convention: Convention

    def __post_init__(self) -> None:
        if self.convention not in get_args(Convention):
            raise ValueError(f"convention must be one of {get_args(Convention)}, got {self.convention!r}")
        for name in ("q01", "q99"):
            value = getattr(self, name)
            if not isinstance(value, np.ndarray) or value.dtype != np.float32 or value.ndim != 1:
                raise ValueError(
                    f"{name} must be a 1-D float32 numpy array, got "
                    f"{type(value).__name__} {getattr(value, 'dtype', '')} {getattr(value, 'shape', '')}"
                )
            if value.size == 0:
                raise ValueError(f"{name} is empty")
            if not np.all(np.isfinite(value)):
                raise ValueError(f"{name} contains NaN or Inf")
        if self.q01.shape != self.q99.shape:
            raise ValueError(f"q01 shape {self.q01.shape} differs from q99 shape {self.q99.shape}")
        if np.any(self.q99 < self.q01):
            bad = np.flatnonzero(self.q99 < self.q01).tolist()
            raise ValueError(f"q99 < q01 in dimensions {bad}")
        with np.errstate(over="ignore", divide="ignore"):
            width = self.q99 - self.q01
            usable = np.isfinite(self._scale()) & np.isfinite(np.float32(1.0) / self._scale())
        if not usable.all():  # q99 - q01 past float32 (every value would normalise to ±1), or so small
            # that any value off q01 normalises to ±Inf: found in review, the stats loaded and the state
            # bins all came out 0, or every chunk non-finite
            bad = np.flatnonzero(~usable).tolist()
            raise ValueError(
                f"q99 - q01 in dimensions {bad} is {width[bad].tolist()}: past what float32 can "
                "normalise with (stats of another unit or a corrupt file?)"
            )
        object.__setattr__(self, "q01", _freeze(self.q01))
        object.__setattr__(self, "q99", _freeze(self.q99))

    @property
    def dim(self) -> int:
        """Number of leading entries of the last axis that these stats normalise."""
        return int(self.q01.shape[0])

    def _scale(self) -> np.ndarray:
        """Width of the [q01, q99] range as each convention guards it against zero, (dim,) float32."""
        width = self.q99 - self.q01
        if self.convention == "openpi":
            return width + np.float32(OPENPI_EPS)
        return np.where(width == 0, np.float32(LEROBOT_EPS), width)

    def _split(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[-1] < self.dim:
            raise ValueError(f"last axis of shape {x.shape} is shorter than the stats' dim {self.dim}")
        return x[..., : self.dim], x[..., self.dim :]

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """Raw values -> [-1, 1] on the first `dim` entries of the last axis; the rest pass through.

        x: (..., D) with D >= dim, in the robot's units. Returns a new array of shape (..., D) with
        dtype promoted from x and float32.
        """
        head, tail = self._split(x)
        if self.convention == "openpi":
            normalized = (head - self.q01) / self._scale() * 2.0 - 1.0
        else:
            normalized = 2.0 * (head - self.q01) / self._scale() - 1.0
        return np.concatenate([normalized, tail.astype(normalized.dtype)], axis=-1)

    def unnormalize(self, y: np.ndarray) -> np.ndarray:
        """Inverse of `normalize`: [-1, 1] -> robot units on the first `dim` entries, the rest unchanged."""
        head, tail = self._split(y)
        if self.convention == "openpi":
            restored = (head + 1.0) / 2.0 * self._scale() + self.q01
        else:
            restored = (head + 1.0) * self._scale() / 2.0 + self.q01
        return np.concatenate([restored, tail.astype(restored.dtype)], axis=-1)


@dataclass(frozen=True)
class NormStats:
    """Quantile stats for the observation state and for the actions, from one file."""

    state: QuantileStats
    actions: QuantileStats

    def __post_init__(self) -> None:
        for name in ("state", "actions"):
            if not isinstance(getattr(self, name), QuantileStats):
                raise ValueError(f"{name} must be QuantileStats, got {type(getattr(self, name)).__name__}")
        if self.state.convention != self.actions.convention:
            # Both come from one file; a mix means stats from two sources were combined by mistake.
            raise ValueError(
                f"state uses the {self.state.convention} convention but actions use {self.actions.convention}"
            )

    def for_robot(self, state_dim: int, action_dim: int, model_dim: int) -> NormStats:
        """The stats of the robot's state_dim / action_dim dimensions. They must cover exactly those, except
        openpi files covering all `model_dim` (32) padded dimensions, as openpi wrote them before it
        normalised ahead of padding; openpi uses their leading entries. Any other count is a ValueError
        naming both: stats of another robot, or joint lists missing a joint, would put each joint's range
        on its neighbour."""
        padded = self.state.convention == "openpi" and self.state.dim == self.actions.dim == model_dim
        if (self.state.dim, self.actions.dim) != (state_dim, action_dim) and not padded:
            raise ValueError(
                f"norm_stats: cover {self.state.dim} state / {self.actions.dim} action dimensions, the robot "
                f"has state_dim / action_dim {state_dim} / {action_dim}"
            )

        def head(stats: QuantileStats, dim: int) -> QuantileStats:
            return QuantileStats(stats.q01[:dim].copy(), stats.q99[:dim].copy(), stats.convention)

        return NormStats(head(self.state, state_dim), head(self.actions, action_dim))


def identity_stats(state_dim: int, action_dim: int) -> NormStats:
    """Stats with q01 = -1, q99 = 1, for the `tiny` demo, which has no dataset and hence no stats.

    Uses the LeRobot convention because without openpi's epsilon the map is the identity up to float
    rounding (openpi's would scale by 2 / (2 + 1e-6)).
    """
    for name, value in (("state_dim", state_dim), ("action_dim", action_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")

    def unit_range(dim: int) -> QuantileStats:
        return QuantileStats(
            q01=np.full(dim, -1.0, dtype=np.float32),
            q99=np.full(dim, 1.0, dtype=np.float32),
            convention="lerobot",
        )

    return NormStats(state=unit_range(state_dim), actions=unit_range(action_dim))


def load_norm_stats(path: str | os.PathLike[str]) -> NormStats:
    """Read quantile stats from a LeRobot normalizer `*.safetensors` or an openpi `*.json` file.

    LeRobot: flat keys "observation.state.q01/q99" and "action.q01/q99" (other stats ignored).
    openpi: {"norm_stats": {"state": {"q01": [...], "q99": [...], ...}, "actions": {...}}}.
    Raises ValueError naming the file and, where relevant, the missing or bad key.
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"norm stats file {file} does not exist or is not a file")
    suffix = file.suffix.lower()
    if suffix == ".safetensors":
        return _load_lerobot_stats(file)
    if suffix == ".json":
        return _load_openpi_stats(file)
    raise ValueError(
        f"norm stats file {file}: unknown format {suffix!r} (expected a LeRobot .safetensors "
        "normalizer file or an openpi norm_stats.json)"
    )


def _as_quantile_vector(file: Path, key: str, value: Any) -> np.ndarray:
    """One q01/q99 entry as a (dim,) float32 array; the error names the file and key. Booleans are not
    quantiles (found in review: JSON true/false or a BOOL tensor loaded as 0/1)."""

    def booleans(v: Any) -> bool:
        if isinstance(v, np.ndarray):
            return v.dtype == np.bool_
        return isinstance(v, bool) or (isinstance(v, (list, tuple)) and any(booleans(x) for x in v))

    if booleans(value):
        raise ValueError(f"norm stats file {file}: {key} holds booleans, not quantiles")
    try:
        array = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as error:
        raise ValueError(f"norm stats file {file}: {key} is not a numeric array ({error})") from error
    if array.ndim != 1 or array.size == 0:
        raise ValueError(
            f"norm stats file {file}: {key} must be a non-empty 1-D array, got shape {array.shape}"
        )
    if not np.all(np.isfinite(array)):
        raise ValueError(f"norm stats file {file}: {key} contains NaN or Inf")
    return array


def _quantile_stats(file: Path, prefix: str, q01: Any, q99: Any, convention: Convention) -> QuantileStats:
    try:
        return QuantileStats(
            q01=_as_quantile_vector(file, f"{prefix}.q01", q01),
            q99=_as_quantile_vector(file, f"{prefix}.q99", q99),
            convention=convention,
        )
    except ValueError as error:
        if str(file) in str(error):
            raise
        raise ValueError(f"norm stats file {file}: {prefix}: {error}") from error


def _load_lerobot_stats(file: Path) -> NormStats:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        loaded = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"norm stats file {file} is not a readable safetensors file: {error}") from error
    # Through torch, which reads bfloat16 (numpy does not: a bare TypeError before, found in review; a
    # LeRobot normalizer cast to a bf16 pipeline's dtype saves its stats so); floating point only.
    tensors: dict[str, np.ndarray] = {}
    for key, tensor in loaded.items():
        if tensor.dtype.is_floating_point:
            tensors[key] = tensor.to(torch.float32).numpy()
        elif key.endswith((".q01", ".q99")):
            raise ValueError(f"norm stats file {file}: {key} is {tensor.dtype}, not floating point quantiles")

    def feature(prefix: str) -> QuantileStats:
        for stat in ("q01", "q99"):
            if f"{prefix}.{stat}" not in tensors:
                raise ValueError(f"norm stats file {file} has no key {prefix}.{stat}")
        return _quantile_stats(
            file, prefix, tensors[f"{prefix}.q01"], tensors[f"{prefix}.q99"], convention="lerobot"
        )

    _check_lerobot_norm_modes(file)
    return NormStats(state=feature(LEROBOT_STATE_FEATURE), actions=feature(LEROBOT_ACTION_FEATURE))


def _check_lerobot_norm_modes(file: Path) -> None:
    """A LeRobot normalizer file holds every statistic (mean, std, min, max, quantiles) whatever the policy
    was trained with; the pipeline's JSON beside it (policy_preprocessor.json) names the mode per feature
    type. π0.5's is QUANTILES for state and actions; a checkpoint trained with another (MEAN_STD, MIN_MAX,
    QUANTILE10) would be fed out-of-range inputs here, so it is refused naming the mode. Without such a
    JSON (the file alone) nothing is checked."""
    for pipeline in sorted(file.parent.glob("*.json")):
        try:
            steps = json.loads(pipeline.read_text()).get("steps", [])
            norm_map = next(s["config"]["norm_map"] for s in steps if s.get("state_file") == file.name)
        except (OSError, ValueError, AttributeError, KeyError, TypeError, StopIteration):
            continue  # another JSON (config.json, ...), or a step without a mode
        for kind in ("STATE", "ACTION"):
            # LeRobot leaves a feature type its norm_map does not name unnormalised (IDENTITY): so here
            # (found in review: taken for QUANTILES, where the same map written out was refused)
            mode = (
                norm_map.get(kind, "IDENTITY")
                if isinstance(norm_map, dict)
                else f"an unreadable norm_map {norm_map!r}"
            )
            if mode != "QUANTILES":
                raise ValueError(
                    f"norm stats file {file}: {pipeline.name} normalises {kind} with {mode}; only QUANTILES "
                    "(π0.5's, q01/q99 onto [-1, 1]) is supported"
                )


def _load_openpi_stats(file: Path) -> NormStats:
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # ValueError: JSON's, a 5,000-digit number's
        raise ValueError(f"norm stats file {file} is not valid JSON: {error}") from error
    if not isinstance(document, dict) or not isinstance(document.get("norm_stats"), dict):
        raise ValueError(f"norm stats file {file} has no key norm_stats (an object)")
    stats = document["norm_stats"]

    def feature(name: str) -> QuantileStats:
        entry = stats.get(name)
        if not isinstance(entry, dict):
            raise ValueError(f"norm stats file {file} has no key norm_stats.{name} (an object)")
        for stat in ("q01", "q99"):
            # openpi writes null for quantiles it did not compute; that is as unusable as a missing key.
            if entry.get(stat) is None:
                raise ValueError(f"norm stats file {file} has no key norm_stats.{name}.{stat}")
        return _quantile_stats(file, f"norm_stats.{name}", entry["q01"], entry["q99"], convention="openpi")

    return NormStats(state=feature("state"), actions=feature("actions"))
