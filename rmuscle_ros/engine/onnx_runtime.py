"""Backend `onnxruntime`: the exported ONNX stages (`engine.onnx_export`) run by ONNX Runtime on the CPU.

It is how an export is checked on a machine without TensorRT: the `tensorrt` backend runs the same three
graphs through the same composition (`onnx_export.sample_actions_by_stage`), so this backend agreeing
with `eager` float32 checks the export and the composition; only the TensorRT build itself is left.
ONNX Runtime's CPU kernels do not cover bfloat16, so this backend exports and runs float32. A prompt runs
at its bucket (`onnx_export.trim_prompt`), as in the `tensorrt` backend.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from rmuscle_ros.engine import engine_cache, onnx_export
from rmuscle_ros.engine.eager import check_noise
from rmuscle_ros.engine.onnx_export import batch_item, default_cache_dir
from rmuscle_ros.models.checkpoint import weights_fingerprint
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model


def open_sessions(export_dir: Path, threads: int = 0) -> dict[str, Any]:
    """One ONNX Runtime CPU session per exported stage; threads: intra-op threads (0 = its default)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return {
        stage: ort.InferenceSession(
            str(export_dir / f"{stage}.onnx"), options, providers=["CPUExecutionProvider"]
        )
        for stage in onnx_export.STAGES
    }


def session_runner(sessions: dict[str, Any]) -> onnx_export.StageRunner:
    """The sessions as a stage runner: inputs by name (any device) in, CPU tensors out."""

    def run(stage: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        outputs = sessions[stage].run(None, {n: feeds[n].cpu().numpy() for n in onnx_export.INPUTS[stage]})
        return {n: torch.from_numpy(o) for n, o in zip(onnx_export.OUTPUTS[stage], outputs, strict=True)}

    return run


class OnnxRuntimeEngine:
    name = "onnxruntime"

    def __init__(
        self,
        model: Pi05Model,
        *,
        device: torch.device,
        cache_dir: str | os.PathLike[str] | None = None,
        threads: int = 0,
        force_export: bool = False,
    ) -> None:
        """cache_dir: where the export is kept (under `onnx/<digest>`); threads: ONNX Runtime's intra-op
        threads (0 = its default); force_export: export again even if a matching export exists."""
        if device.type != "cpu":
            raise ValueError(f"backend 'onnxruntime' runs on the CPU, got device {device}")
        self.device = device
        self.cfg = model.cfg
        self.weights = weights_fingerprint(model)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        # onnx and onnxscript make the export, and the key that finds a cached one holds onnx's version.
        missing = onnx_export.missing_packages(("onnxruntime", *onnx_export.EXPORT_PACKAGES))
        if missing:
            raise onnx_export.missing_packages_error("backend 'onnxruntime'", missing)
        self.model = model.float().eval()
        self.buckets = onnx_export.prompt_buckets(self.cfg)
        self.threads = threads
        self.force_export = force_export
        self.export_dir: Path | None = None
        self._sessions: dict[str, Any] = {}
        self._run: onnx_export.StageRunner | None = None

    def warmup(self) -> dict[str, float]:
        """Export (or reuse a matching export), open one session per stage, run one call. Seconds each."""
        timings: dict[str, float] = {}
        start = time.perf_counter()
        # The export stays out of `engine_cache prune` while this engine lives.
        digest = onnx_export.export_key(self.cfg, self.weights, onnx_export.dtype_name(self.model)).digest()
        self._lease = engine_cache.hold(self.cache_dir, digest)
        self.export_dir = onnx_export.ensure_export(
            self.model, self.cache_dir / "onnx", weights=self.weights, force=self.force_export
        )
        timings["export"] = time.perf_counter() - start
        start = time.perf_counter()
        self._sessions = open_sessions(self.export_dir, self.threads)
        self._run = session_runner(self._sessions)
        timings["sessions"] = time.perf_counter() - start
        start = time.perf_counter()
        blank = onnx_export.example_inputs(self.cfg, 8, self.device)
        self.sample_actions(blank, torch.zeros(1, self.cfg.horizon, self.cfg.action_dim))
        timings["first_call"] = time.perf_counter() - start
        return timings

    @torch.no_grad()
    def sample_actions(self, inputs: ModelInputs, noise: torch.Tensor) -> torch.Tensor:
        check_noise(noise, inputs.tokens.shape[0], self.cfg.horizon, self.cfg.action_dim)
        if not self._sessions:
            self.warmup()
        inputs = inputs.to(self.device)
        assert self._run is not None
        chunks = [
            onnx_export.sample_actions_by_stage(
                self._run,
                onnx_export.trim_prompt(batch_item(inputs, i), self.buckets),
                noise[i : i + 1].float().cpu(),
                self.cfg.num_steps,
            )
            for i in range(noise.shape[0])
        ]
        return torch.cat(chunks)
