"""π0.5 model dimensions as frozen, validated dataclasses, plus the named presets.

Dimensions follow openpi's `gemma.py` / `siglip.py` (see ../shared/reference/pi05_architecture.md):
SigLIP So400m/14 vision tower, Gemma 2B prefix ("VLM"), Gemma 300M action expert.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

PALIGEMMA_VOCAB_SIZE = 257_152


def _require_int(owner: str, **values: int) -> None:
    """Shape fields: a float (a YAML `3.0`) or bool would only fail later, deep inside the model build."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


def _require_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(f"{owner}.{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class VisionConfig:
    """SigLIP encoder: pre-LN ViT with learned position embeddings and tanh-GELU MLPs."""

    width: int = 1152
    depth: int = 27
    mlp_dim: int = 4304
    num_heads: int = 16
    patch_size: int = 14
    image_size: int = 224
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _require_int(
            "vision",
            width=self.width,
            depth=self.depth,
            mlp_dim=self.mlp_dim,
            num_heads=self.num_heads,
            patch_size=self.patch_size,
            image_size=self.image_size,
        )
        _require_positive("vision", layer_norm_eps=self.layer_norm_eps)
        if self.width % self.num_heads:
            raise ValueError(f"vision.width {self.width} is not divisible by num_heads {self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"vision.image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class GemmaConfig:
    """One Gemma stack: RMSNorm(1+w), RoPE, GQA attention, GeGLU MLP."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        _require_int(
            "gemma",
            width=self.width,
            depth=self.depth,
            mlp_dim=self.mlp_dim,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        _require_positive("gemma", rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"gemma.num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"gemma.head_dim must be even for RoPE, got {self.head_dim}")


GEMMA_2B = GemmaConfig(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1, head_dim=256)
GEMMA_300M = GemmaConfig(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256)
GEMMA_7B = GemmaConfig(width=3072, depth=28, mlp_dim=24_576, num_heads=16, num_kv_heads=16, head_dim=256)


@dataclass(frozen=True)
class Pi05Config:
    """Everything that fixes the shapes of a π0.5 model."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    vlm: GemmaConfig = GEMMA_2B
    expert: GemmaConfig = GEMMA_300M
    vocab_size: int = PALIGEMMA_VOCAB_SIZE
    action_dim: int = 32  # padded action/state width the heads are built for
    horizon: int = 50  # actions per chunk
    num_steps: int = 10  # Euler flow-matching steps
    max_token_len: int = 200  # prompt capacity (task text + discretised state)
    num_cameras: int = 3  # image slots: base_0_rgb, left_wrist_0_rgb, right_wrist_0_rgb
    time_min_period: float = 4e-3
    time_max_period: float = 4.0

    def __post_init__(self) -> None:
        for name, kind in (("vision", VisionConfig), ("vlm", GemmaConfig), ("expert", GemmaConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(
                    f"model.{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__} "
                    "(from_dict builds it from a dict)"
                )
        _require_int(
            "model",
            vocab_size=self.vocab_size,
            action_dim=self.action_dim,
            horizon=self.horizon,
            num_steps=self.num_steps,
            max_token_len=self.max_token_len,
            num_cameras=self.num_cameras,
        )
        _require_positive("model", time_min_period=self.time_min_period, time_max_period=self.time_max_period)
        if self.time_min_period >= self.time_max_period:
            raise ValueError(
                f"model.time_min_period ({self.time_min_period}) must be below time_max_period "
                f"({self.time_max_period}): the sin/cos time embedding spans min..max"
            )
        # Joint attention concatenates prefix and suffix heads, so the two stacks must agree.
        for attr in ("depth", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self.vlm, attr) != getattr(self.expert, attr):
                raise ValueError(
                    f"vlm.{attr} ({getattr(self.vlm, attr)}) must equal expert.{attr} "
                    f"({getattr(self.expert, attr)}): prefix and suffix share one attention per layer"
                )
        if self.expert.width % 2:
            raise ValueError("expert.width must be even (sin/cos time embedding)")
        if not 1 <= self.num_cameras <= 3:
            raise ValueError(f"num_cameras must be 1..3 (π0.5 image slots), got {self.num_cameras}")

    @property
    def image_tokens(self) -> int:
        return self.num_cameras * self.vision.tokens_per_image

    def replace(self, **changes: Any) -> Pi05Config:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Pi05Config:
        """Build from a nested dict ({"vision": {...}, "vlm": {...}, "expert": {...}, ...})."""
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(Pi05Config)}
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        vision = _sub_config(VisionConfig, "vision", d.pop("vision", {}))
        vlm = _sub_config(GemmaConfig, "vlm", d.pop("vlm")) if "vlm" in d else GEMMA_2B
        expert = _sub_config(GemmaConfig, "expert", d.pop("expert")) if "expert" in d else GEMMA_300M
        return Pi05Config(vision=vision, vlm=vlm, expert=expert, **d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _sub_config(kind: type, name: str, d: Any) -> Any:
    """Build the nested `kind` for field `name` of a dict config, naming the field on any error."""
    if not isinstance(d, dict):
        raise ValueError(f"model.{name} must be a mapping of {kind.__name__} fields, got {d!r}")
    unknown = set(d) - {f.name for f in dataclasses.fields(kind)}
    if unknown:
        raise ValueError(f"unknown model.{name} config keys: {sorted(unknown)}")
    try:
        return kind(**d)
    except (TypeError, ValueError) as e:  # a missing required field is a TypeError
        raise ValueError(f"model.{name}: {e}") from e


TINY_VOCAB_SIZE = 320  # the built-in byte tokenizer's vocabulary (rmuscle_ros.models.tokenizer)

PRESETS: dict[str, Pi05Config] = {
    # openpi pi05 (pi05_base / pi05_aloha): SigLIP So400m + Gemma 2B + Gemma 300M expert.
    "pi05": Pi05Config(),
    # Scaling study: Gemma 7B prefix and an expert of the same size (MHA, 16 KV heads).
    "pi05-7b": Pi05Config(vlm=GEMMA_7B, expert=GEMMA_7B),
    # Same structure, small widths: CPU tests and the demo. Image geometry stays real (224², patch 14).
    "tiny": Pi05Config(
        vision=VisionConfig(width=64, depth=2, mlp_dim=128, num_heads=2),
        vlm=GemmaConfig(width=128, depth=2, mlp_dim=256, num_heads=8, num_kv_heads=1, head_dim=16),
        expert=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=16),
        vocab_size=TINY_VOCAB_SIZE,
    ),
    # Between the two, for fidelity experiments a trained `tiny` cannot answer (its expert FFN has 128
    # neurons a layer, π0.5's 4,096): 4 layers each, 1,024 expert neurons a layer; trains in minutes on
    # one GPU and runs a closed-loop episode in seconds on a CPU (bench/sim_success.py).
    "small": Pi05Config(
        vision=VisionConfig(width=128, depth=4, mlp_dim=512, num_heads=4),
        vlm=GemmaConfig(width=256, depth=4, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32),
        expert=GemmaConfig(width=256, depth=4, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32),
        vocab_size=TINY_VOCAB_SIZE,
    ),
}


def get_preset(name: str) -> Pi05Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
