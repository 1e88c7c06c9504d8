"""Load π0.5 weights from a LeRobot / openpi PyTorch `model.safetensors` (never pickle).

Accepted layouts (see ../shared/reference/pi05_architecture.md §2):
- keys with or without LeRobot's `model.` prefix;
- the token embedding stored as `…language_model.embed_tokens.weight`, or only as the tied
  `…paligemma.lm_head.weight` copy (openpi's converter deduplicates tied tensors);
- `…lm_head.weight` tensors, which inference never uses, are accepted and ignored.
Anything else unexpected, missing or mis-shaped is a `CheckpointError` naming the first offending key.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from rmuscle_ros.models.config import Pi05Config
from rmuscle_ros.models.pi05 import Pi05Model

# Our module prefix -> the checkpoint's (Hugging Face PaliGemma + Gemma expert) prefix.
KEY_PREFIXES: tuple[tuple[str, str], ...] = (
    ("vision_tower.", "paligemma_with_expert.paligemma.model.vision_tower.vision_model."),
    ("projector.", "paligemma_with_expert.paligemma.model.multi_modal_projector.linear."),
    ("llm.", "paligemma_with_expert.paligemma.model.language_model."),
    ("expert.", "paligemma_with_expert.gemma_expert.model."),
)
LEROBOT_PREFIX = "model."
TIED_EMBEDDING_KEY = "paligemma_with_expert.paligemma.lm_head.weight"
IGNORED_KEYS = frozenset({TIED_EMBEDDING_KEY, "paligemma_with_expert.gemma_expert.lm_head.weight"})
# Older openpi PyTorch exports name the pi05 time MLP like pi0's.
LEGACY_ALIASES = {"time_mlp_in.": "action_time_mlp_in.", "time_mlp_out.": "action_time_mlp_out."}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded into the configured model."""


def checkpoint_key(ours: str) -> str:
    """Map one of our parameter names to the checkpoint's name (without the `model.` prefix)."""
    for mine, theirs in KEY_PREFIXES:
        if ours.startswith(mine):
            return theirs + ours[len(mine) :]
    return ours


class _Reader:
    """Read-only view of a safetensors file with the LeRobot prefix stripped."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise CheckpointError(f"checkpoint not found: {path}")
        try:
            self._file = safe_open(str(path), framework="pt")
            raw_keys = list(self._file.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(
                f"{path} is not a readable safetensors file (corrupt or truncated?): {e}"
            ) from e
        self.path = path
        self._names = {k.removeprefix(LEROBOT_PREFIX): k for k in raw_keys}

    @property
    def names(self) -> set[str]:
        return set(self._names)

    def __contains__(self, key: str) -> bool:
        return key in self._names

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(self._names[key]).get_shape())

    def tensor(self, key: str) -> torch.Tensor:
        try:
            return self._file.get_tensor(self._names[key])
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{self.path}: tensor {self._names[key]!r} cannot be read: {e}") from e


def _resolve(reader: _Reader, ours: str) -> str | None:
    """The checkpoint key holding our parameter `ours`, or None."""
    key = checkpoint_key(ours)
    if key in reader:
        return key
    if key.endswith("language_model.embed_tokens.weight") and TIED_EMBEDDING_KEY in reader:
        return TIED_EMBEDDING_KEY
    for new, old in LEGACY_ALIASES.items():
        if key.startswith(new) and old + key[len(new) :] in reader:
            return old + key[len(new) :]
    return None


def load_state(model: Pi05Model, path: str | os.PathLike[str]) -> None:
    """Copy every parameter of `model` from the checkpoint at `path`, converting dtype, checking shapes."""
    reader = _Reader(Path(path))
    params = dict(model.named_parameters())
    plan: dict[str, str] = {}
    for name, param in params.items():
        key = _resolve(reader, name)
        if key is None:
            raise CheckpointError(f"{path}: missing tensor {checkpoint_key(name)!r} (for {name})")
        if reader.shape(key) != tuple(param.shape):
            raise CheckpointError(
                f"{path}: tensor {key!r} has shape {list(reader.shape(key))}, the model expects "
                f"{list(param.shape)}; is the model config (preset/dims) right for this checkpoint?"
            )
        plan[name] = key
    unexpected = sorted(reader.names - set(plan.values()) - IGNORED_KEYS)
    if unexpected:
        hint = (
            " (a π0 checkpoint? π0.5 has no state_proj)" if any("state_proj" in k for k in unexpected) else ""
        )
        raise CheckpointError(
            f"{path}: {len(unexpected)} unexpected tensor(s), first {unexpected[0]!r}{hint}; "
            "refusing to load a checkpoint of another architecture"
        )
    with torch.no_grad():
        for name, key in plan.items():
            tensor = reader.tensor(key)
            if not torch.isfinite(tensor).all():
                raise CheckpointError(f"{path}: tensor {key!r} contains NaN or Inf")
            params[name].copy_(tensor)


def iter_checkpoint_tensors(
    model: Pi05Model, prefix: str = LEROBOT_PREFIX
) -> Iterator[tuple[str, torch.Tensor]]:
    """Our parameters under the checkpoint's names (LeRobot layout), e.g. to write test checkpoints."""
    for name, param in model.state_dict().items():
        yield prefix + checkpoint_key(name), param


def save_checkpoint(model: Pi05Model, path: str | os.PathLike[str], *, lerobot_prefix: bool = True) -> None:
    """Write `model` as a `model.safetensors` in the LeRobot/openpi key layout."""
    from safetensors.torch import save_file

    tensors = {
        k: v.detach().contiguous().cpu()
        for k, v in iter_checkpoint_tensors(model, LEROBOT_PREFIX if lerobot_prefix else "")
    }
    save_file(
        tensors, str(path), metadata={"format": "pt", "rmuscle_ros_config": json.dumps(model.cfg.to_dict())}
    )


def init_random_(model: nn.Module, seed: int) -> None:
    """Seeded, non-degenerate random weights: N(0, 1/fan_in) matrices, N(0, 0.1²) vectors.

    Unlike zero-initialised norms and adaRMS layers, this exercises every term (used for `tiny`
    without a checkpoint and for full-size benchmarks, which have no trained weights here).
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            std = 0.1 if param.ndim == 1 else param[0].numel() ** -0.5
            noise = torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32)
            param.copy_(noise * std)


def weights_fingerprint(model: nn.Module) -> str:
    """A content hash of every parameter (name, shape, dtype and a strided sample of values).

    Cheap enough for a 3.3 B-parameter model at configure time; caches key on it.
    """
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            sample = flat[::step].float().cpu().numpy().tobytes()
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:".encode())
            h.update(sample)
    return h.hexdigest()[:16]


def load_model(
    cfg: Pi05Config, checkpoint: str | os.PathLike[str] | None = None, *, seed: int = 0, device: str = "cpu"
) -> Pi05Model:
    """Build the model for `cfg`: weights from `checkpoint`, or seeded random weights when it is None.

    The module is built on `device` and allocated once. With a checkpoint it is created without
    initialisation (meta device) and filled from the file. With random weights PyTorch's own
    initialisation runs on `device`, and `init_random_` overwrites it: built on the CPU and then moved,
    the full-size model's took 37-53 s on a 2-core CPU (1-2 threads). (The meta device would skip it, but
    its initialisers import torch._dynamo and Triton, which the CPU path never loads.)
    """
    if checkpoint is None:
        with torch.device(device):
            model = Pi05Model(cfg)
        init_random_(model, seed)
        return model.eval()
    with torch.device("meta"):
        model = Pi05Model(cfg)
    model = model.to_empty(device=device)
    load_state(model, checkpoint)
    return model.eval()
