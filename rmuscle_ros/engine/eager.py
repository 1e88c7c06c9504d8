"""The reference backend: `Pi05Model.sample_actions` as written, in float32 or bf16."""

from __future__ import annotations

import torch

from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_noise(noise: torch.Tensor, batch: int, horizon: int, action_dim: int) -> None:
    """ValueError unless `noise` is (batch, horizon, action_dim), batch the inputs' observations: every
    engine's check, and the Policy's (found in review: the exported engines returned fewer chunks than
    observations for a shorter noise batch)."""
    want = (batch, horizon, action_dim)
    if tuple(noise.shape) != want:  # another horizon ran and returned that many rows (found in review)
        raise ValueError(f"noise must be {want} (batch, horizon, action_dim), got {tuple(noise.shape)}")


class EagerEngine:
    name = "eager"

    def __init__(self, model: Pi05Model, *, device: torch.device, dtype: str = "float32") -> None:
        if dtype not in DTYPES:
            raise ValueError(f"eager dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.device = device
        self.model = model.to(device=device, dtype=DTYPES[dtype]).eval()

    def warmup(self) -> dict[str, float]:
        return {}

    @torch.no_grad()
    def sample_actions(self, inputs: ModelInputs, noise: torch.Tensor) -> torch.Tensor:
        check_noise(noise, inputs.tokens.shape[0], self.model.cfg.horizon, self.model.cfg.action_dim)
        return self.model.sample_actions(inputs.to(self.device), noise.to(self.device))
