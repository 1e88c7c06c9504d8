"""Execution backends for π0.5, picked by name from one dispatch table.

Backends are imported lazily, so a CPU-only machine never imports CUDA-only modules (Triton kernels,
CUDA-graph code). Asking for a backend the hardware cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model


class Engine(Protocol):
    """Runs the model: normalised inputs + noise -> normalised action chunk."""

    name: str

    def warmup(self) -> dict[str, float]:
        """Compile/capture whatever the backend needs; returns named timings in seconds."""
        ...

    def sample_actions(self, inputs: ModelInputs, noise: torch.Tensor) -> torch.Tensor:
        """inputs for one or more observations, noise (B, horizon, action_dim) -> (B, horizon, action_dim) f32."""
        ...


# name -> (module, class, needs CUDA)
BACKENDS: dict[str, tuple[str, str, bool]] = {
    "eager": ("rmuscle_ros.engine.eager", "EagerEngine", False),
    "graph": ("rmuscle_ros.engine.graph", "GraphEngine", True),
    # The graph engine's computation on any device without graphs (CPU: float32 PyTorch definitions).
    "fused": ("rmuscle_ros.engine.graph", "GraphEngine", False),
    # The exported ONNX stages (engine.onnx_export) run by ONNX Runtime on the CPU: checks an export.
    "onnxruntime": ("rmuscle_ros.engine.onnx_runtime", "OnnxRuntimeEngine", False),
    # The same stages as TensorRT engines (Jetson Thor). Not run on our machines: see engine/tensorrt.py.
    "tensorrt": ("rmuscle_ros.engine.tensorrt", "TensorRTEngine", True),
}
# Backends that build from an ONNX export and keep it (and their engines) in a cache directory.
EXPORTED = ("onnxruntime", "tensorrt")


def create_engine(name: str, model: Pi05Model, device: str | torch.device, **options: Any) -> Engine:
    """Build backend `name` for `model` on `device` (the model is moved/converted as the backend needs)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, cls, needs_cuda = BACKENDS[name]
    device = torch.device(device)
    if needs_cuda and (device.type != "cuda" or not torch.cuda.is_available()):
        raise RuntimeError(
            f"backend {name!r} needs a CUDA GPU (device {device}, CUDA available: {torch.cuda.is_available()}); "
            "use backend 'eager' on the CPU"
        )
    if device.type == "cuda" and not torch.cuda.is_available():  # any backend: say so, not torch's assert
        raise RuntimeError(f"device {device}: no CUDA GPU here (PyTorch sees none); use device 'cpu'")
    return getattr(importlib.import_module(module), cls)(model, device=device, **options)
