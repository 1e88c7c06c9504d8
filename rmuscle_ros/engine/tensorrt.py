"""Backend `tensorrt`: the ONNX stages (`engine.onnx_export`) built into TensorRT engines, for a Jetson Thor.

**Not run on our machines.** TensorRT's libraries cannot be installed on the development machine or the
H200 we measure on. What runs here: the export (bfloat16 and float32), the float32 export through ONNX
Runtime against eager float32 with the same stage composition as below (`backend="onnxruntime"`, CPU
tests), and the engine cache's keys and files. What has not run anywhere: `build_plan` and
`TensorRTEngine` with a real TensorRT. On a Thor (JetPack ships TensorRT and its Python bindings) or in
`docker/Dockerfile.thor`, `python -m rmuscle_ros.engine.tensorrt --preset pi05 --checkpoint ...` builds
the engines and checks the result against eager bfloat16.

How a call runs: the three engines on one CUDA stream, vision, prefill, then the denoise step engine
`num_steps` times, ping-ponging its state between two buffers, with one synchronisation at the end.
The prompt length is dynamic: one optimisation profile covers 1..`max_token_len` tokens, tuned for
`opt_prompt_len`. Every buffer is allocated once at the longest prompt.

The ONNX graphs are exported in bfloat16 and built as strongly typed networks, so TensorRT keeps the
exported types (bfloat16 weights and activations, float32 attention softmax and norms, as `eager`
bfloat16 computes them) instead of picking precisions per layer.

Engines are cached by content (style guide, 7): the key is the export's digest (weights fingerprint,
model config, dtype, opset, exporter versions), the stage, TensorRT's version, the GPU's name and compute
capability and the builder options. A plan file is written beside its JSON sidecar (key and sha256) and
renamed into place; a plan whose bytes do not match its sidecar is reported and rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rmuscle_ros.engine import onnx_export
from rmuscle_ros.engine.onnx_export import batch_item, default_cache_dir
from rmuscle_ros.models.checkpoint import weights_fingerprint
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model

log = logging.getLogger(__name__)

PLAN_FORMAT = 1


def import_tensorrt() -> Any:
    """The `tensorrt` module, or a RuntimeError that says where it comes from."""
    try:
        import tensorrt
    except ImportError as err:
        raise RuntimeError(
            "backend 'tensorrt' needs TensorRT's Python bindings (`import tensorrt` failed): on a Jetson Thor "
            "they come with JetPack; in a container, build docker/Dockerfile.thor. The development and H200 "
            "machines cannot install TensorRT: use backend 'graph' there."
        ) from err
    return tensorrt


# ─────────────────────────────────────────────── the engine cache ───────────────────────────────────────────


@dataclass(frozen=True)
class PlanKey:
    """Everything a serialized engine depends on; a cached plan is used only if all of it matches."""

    format: int
    export: str  # onnx_export.ExportKey.digest()
    stage: str
    tensorrt: str
    gpu: str
    capability: str  # "11.0" on a Thor
    opt_prompt_len: int
    workspace_bytes: int

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]


class PlanCache:
    """Serialized engines on disk: `<stage>-<digest>.plan` + `.json` (the key and the plan's sha256)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, key: PlanKey) -> Path:
        return self.root / f"{key.stage}-{key.digest()}.plan"

    def load(self, key: PlanKey) -> bytes | None:
        """The cached plan for `key`, or None if there is none or it does not match its sidecar (logged)."""
        plan, meta = self.path(key), self.path(key).with_suffix(".json")
        if not plan.is_file() or not meta.is_file():
            return None
        try:
            sidecar = json.loads(meta.read_text())
            data = plan.read_bytes()
        except (OSError, ValueError) as err:
            log.warning("engine cache: %s unreadable (%s); building again", plan, err)
            return None
        if sidecar.get("key") != asdict(key) or sidecar.get("sha256") != hashlib.sha256(data).hexdigest():
            log.warning(
                "engine cache: %s does not match its sidecar (altered or truncated); building again", plan
            )
            return None
        return data

    def store(self, key: PlanKey, data: bytes, build_seconds: float) -> Path:
        """Write the plan and its sidecar atomically (temporary files renamed into place)."""
        self.root.mkdir(parents=True, exist_ok=True)
        plan = self.path(key)
        sidecar = {
            "key": asdict(key),
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "build_seconds": round(build_seconds, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        for path, payload in (
            (plan, data),
            (plan.with_suffix(".json"), json.dumps(sidecar, indent=1).encode()),
        ):
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(payload)
            tmp.replace(path)
        return plan


# ─────────────────────────────────────────────── building ───────────────────────────────────────────────────


def profile_shapes(cfg: Any, stage: str, opt_prompt_len: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shapes of each dynamic input of `stage` (cfg: Pi05Config); the rest are static."""
    if not 1 <= opt_prompt_len <= cfg.max_token_len:
        raise ValueError(f"opt_prompt_len must be in 1..{cfg.max_token_len}, got {opt_prompt_len}")
    lengths = (1, opt_prompt_len, cfg.max_token_len)
    if stage == "prefill":
        return {name: tuple((1, n) for n in lengths) for name in ("tokens", "token_mask")}
    if stage == "denoise":
        prefix = tuple(cfg.image_tokens + n for n in lengths)
        kv = tuple((cfg.vlm.depth, 1, cfg.vlm.num_kv_heads, p, cfg.vlm.head_dim) for p in prefix)
        return {"keys": kv, "values": kv, "pad_mask": tuple((1, p) for p in prefix)}
    return {}


def build_plan(
    trt: Any, onnx_path: Path, shapes: dict[str, tuple[tuple[int, ...], ...]], workspace_bytes: int
) -> bytes:
    """Parse one exported stage and build its engine as a strongly typed network. Raises on any error."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)  # always on in 11
    network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # reads the external data beside the file
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if shapes:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path} (see its log above)")
    return bytes(plan)


# ─────────────────────────────────────────────── running ────────────────────────────────────────────────────


def torch_dtype(trt: Any, dtype: Any) -> torch.dtype:
    table = {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.BF16: torch.bfloat16,
        trt.DataType.INT32: torch.int32,
        trt.DataType.INT64: torch.int64,
        trt.DataType.BOOL: torch.bool,
    }
    if dtype not in table:
        raise RuntimeError(f"engine tensor of TensorRT type {dtype} has no torch equivalent here")
    return table[dtype]


class _StageEngine:
    """One deserialized engine with its context; tensors are bound by address before each enqueue."""

    def __init__(self, trt: Any, runtime: Any, plan: bytes, stage: str) -> None:
        self.trt = trt
        self.stage = stage
        self.engine = runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize the {stage} engine")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        expected = set(onnx_export.INPUTS[stage]) | set(onnx_export.OUTPUTS[stage])
        if set(names) != expected or set(inputs) != set(onnx_export.INPUTS[stage]):
            raise RuntimeError(f"{stage} engine has tensors {sorted(names)}, expected {sorted(expected)}")
        self.dtypes = {n: torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}

    def enqueue(self, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], stream: int) -> None:
        for name, tensor in feeds.items():
            if tensor.dtype != self.dtypes[name]:
                raise TypeError(f"{self.stage}.{name}: {tensor.dtype}, the engine takes {self.dtypes[name]}")
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        for name, tensor in outputs.items():
            shape = tuple(self.context.get_tensor_shape(name))
            if shape != tuple(tensor.shape):
                raise RuntimeError(
                    f"{self.stage}.{name}: engine output {shape}, buffer {tuple(tensor.shape)}"
                )
            self.context.set_tensor_address(name, tensor.data_ptr())
        if not self.context.execute_async_v3(stream):
            raise RuntimeError(f"TensorRT failed to enqueue the {self.stage} engine")


class TensorRTEngine:
    name = "tensorrt"

    def __init__(
        self,
        model: Pi05Model,
        *,
        device: torch.device,
        cache_dir: str | os.PathLike[str] | None = None,
        opt_prompt_len: int = 64,
        workspace_gib: float = 4.0,
        force_rebuild: bool = False,
    ) -> None:
        """cache_dir: exports (`onnx/`) and plans (`tensorrt/`); opt_prompt_len: the prompt length the
        engines are tuned for; force_rebuild: export and build again even if the caches match."""
        self.trt = import_tensorrt()
        self.device = device
        self.cfg = model.cfg
        self.weights = weights_fingerprint(model)
        self.model = model.to(device=device, dtype=torch.bfloat16).eval()
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        profile_shapes(self.cfg, "prefill", opt_prompt_len)  # validates it
        self.opt_prompt_len = opt_prompt_len
        self.workspace_bytes = int(workspace_gib * (1 << 30))
        self.force_rebuild = force_rebuild
        self._stages: dict[str, _StageEngine] = {}

    def _plan_key(self, export_digest: str, stage: str) -> PlanKey:
        major, minor = torch.cuda.get_device_capability(self.device)
        return PlanKey(
            PLAN_FORMAT,
            export_digest,
            stage,
            self.trt.__version__,
            torch.cuda.get_device_name(self.device),
            f"{major}.{minor}",
            self.opt_prompt_len,
            self.workspace_bytes,
        )

    def warmup(self) -> dict[str, float]:
        """Load the three engines (exporting and building whatever is not cached), allocate the buffers,
        run one call. Seconds each.

        The plans' keys follow from the export's key, which needs no export: with every plan cached, the
        export is neither made nor read (on a Thor, 6.5 GB). Once: the PyTorch weights are released
        afterwards (the engines carry their own).
        """
        if self._stages:
            return {}
        trt = self.trt
        timings: dict[str, float] = {}
        digest = onnx_export.export_key(self.cfg, self.weights, "bfloat16").digest()
        cache = PlanCache(self.cache_dir / "tensorrt")
        keys = {stage: self._plan_key(digest, stage) for stage in onnx_export.STAGES}
        plans = {s: None if self.force_rebuild else cache.load(k) for s, k in keys.items()}
        export_dir: Path | None = None
        if any(plan is None for plan in plans.values()):
            start = time.perf_counter()
            export_dir = onnx_export.ensure_export(
                self.model, self.cache_dir / "onnx", weights=self.weights, force=self.force_rebuild
            )
            timings["export"] = time.perf_counter() - start
        # The engines do not need the PyTorch weights; keeping them would double the GPU memory.
        self.model = None  # type: ignore[assignment]
        torch.cuda.empty_cache()
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        for stage, key in keys.items():
            start = time.perf_counter()
            plan = plans[stage]
            if plan is None:
                assert export_dir is not None and export_dir.name == digest
                shapes = profile_shapes(self.cfg, stage, self.opt_prompt_len)
                plan = build_plan(trt, export_dir / f"{stage}.onnx", shapes, self.workspace_bytes)
                cache.store(key, plan, time.perf_counter() - start)
                log.info("built the %s engine in %.0f s", stage, time.perf_counter() - start)
            self._stages[stage] = _StageEngine(trt, runtime, plan, stage)
            timings[f"engine_{stage}"] = time.perf_counter() - start
        self._allocate()
        start = time.perf_counter()
        blank = onnx_export.example_inputs(self.cfg, self.opt_prompt_len, self.device)
        self.sample_actions(blank, torch.zeros(1, self.cfg.horizon, self.cfg.action_dim, device=self.device))
        timings["first_call"] = time.perf_counter() - start
        return timings

    def _allocate(self) -> None:
        """Every buffer once, at the longest prompt; a call views the prefix of the length it needs."""
        cfg, dev = self.cfg, self.device
        vlm = cfg.vlm
        longest = cfg.image_tokens + cfg.max_token_len
        dt = self._stages["prefill"].dtypes
        self._visual = torch.empty(
            1, cfg.image_tokens, vlm.width, dtype=self._stages["vision"].dtypes["visual"], device=dev
        )
        kv_numel = vlm.depth * vlm.num_kv_heads * longest * vlm.head_dim
        self._keys = torch.empty(kv_numel, dtype=dt["keys"], device=dev)
        self._values = torch.empty(kv_numel, dtype=dt["values"], device=dev)
        self._pad = torch.empty(longest, dtype=torch.bool, device=dev)
        self._x = [torch.empty(1, cfg.horizon, cfg.action_dim, device=dev) for _ in range(2)]
        self._steps = torch.arange(cfg.num_steps, dtype=torch.int64, device=dev)[:, None]  # (steps, 1)
        self._stream = torch.cuda.Stream(device=dev)

    def _call(self, inputs: ModelInputs, noise: torch.Tensor) -> torch.Tensor:
        cfg, vlm = self.cfg, self.cfg.vlm
        lp = cfg.image_tokens + inputs.tokens.shape[1]
        kv_shape = (vlm.depth, 1, vlm.num_kv_heads, lp, vlm.head_dim)
        keys = self._keys[: kv_shape[0] * vlm.num_kv_heads * lp * vlm.head_dim].view(kv_shape)
        values = self._values[: keys.numel()].view(kv_shape)
        pad = self._pad[:lp].view(1, lp)
        stream = self._stream.cuda_stream
        self._stages["vision"].enqueue({"images": inputs.images}, {"visual": self._visual}, stream)
        self._stages["prefill"].enqueue(
            {
                "visual": self._visual,
                "image_masks": inputs.image_masks,
                "tokens": inputs.tokens,
                "token_mask": inputs.token_mask,
            },
            {"keys": keys, "values": values, "pad_mask": pad},
            stream,
        )
        self._x[0].copy_(noise)
        for step in range(cfg.num_steps):
            src, dst = self._x[step % 2], self._x[(step + 1) % 2]
            self._stages["denoise"].enqueue(
                {"x": src, "step": self._steps[step], "keys": keys, "values": values, "pad_mask": pad},
                {"x_next": dst},
                stream,
            )
        return self._x[cfg.num_steps % 2].clone()

    @torch.no_grad()
    def sample_actions(self, inputs: ModelInputs, noise: torch.Tensor) -> torch.Tensor:
        if not self._stages:
            self.warmup()
        inputs = inputs.to(self.device)
        noise = noise.to(self.device, torch.float32)
        chunks = []
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            for i in range(noise.shape[0]):
                chunks.append(self._call(batch_item(inputs, i), noise[i : i + 1]))
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return torch.cat(chunks)


def main(argv: list[str] | None = None) -> None:
    """Build the engines for a checkpoint and compare one call with eager bfloat16 (run on the Thor)."""
    from rmuscle_ros.models.checkpoint import load_model
    from rmuscle_ros.models.config import get_preset

    p = argparse.ArgumentParser(
        description="Build π0.5's TensorRT engines and check them against eager bf16."
    )
    p.add_argument("--preset", default="pi05")
    p.add_argument("--checkpoint", help="model.safetensors (LeRobot/openpi); random weights when absent")
    p.add_argument("--cache-dir", default=str(default_cache_dir()))
    p.add_argument("--opt-prompt-len", type=int, default=64)
    p.add_argument("--force-rebuild", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from rmuscle_ros.engine.eager import EagerEngine

    cfg = get_preset(args.preset)
    device = torch.device("cuda")
    engine = TensorRTEngine(
        load_model(cfg, args.checkpoint, device="cuda"),
        device=device,
        cache_dir=args.cache_dir,
        opt_prompt_len=args.opt_prompt_len,
        force_rebuild=args.force_rebuild,
    )
    print(json.dumps({k: round(v, 2) for k, v in engine.warmup().items()}))
    eager = EagerEngine(load_model(cfg, args.checkpoint, device="cuda"), device=device, dtype="bfloat16")
    gen = torch.Generator().manual_seed(0)
    inputs = onnx_export.example_inputs(cfg, args.opt_prompt_len, torch.device("cpu"))
    inputs.images.uniform_(-1, 1, generator=gen)
    inputs.tokens.random_(0, cfg.vocab_size, generator=gen)
    noise = torch.randn(1, cfg.horizon, cfg.action_dim, generator=gen)
    ours = engine.sample_actions(inputs, noise).cpu()
    ref = eager.sample_actions(inputs, noise).float().cpu()
    print(f"tensorrt vs eager bf16: relative L2 {float((ours - ref).norm() / ref.norm()):.2e}")
    times = []
    for _ in range(20):
        start = time.perf_counter()
        engine.sample_actions(inputs, noise)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(f"tensorrt call: median {1e3 * sorted(times)[len(times) // 2]:.2f} ms over {len(times)}")


if __name__ == "__main__":
    main()
