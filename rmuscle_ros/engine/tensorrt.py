"""Backend `tensorrt`: the ONNX stages (`engine.onnx_export`) built into TensorRT engines, for a Jetson Thor.

**Not run on our machines.** TensorRT's libraries cannot be installed on the development machine or the
H200 we measure on. What runs here: the export (bfloat16 and float32), the float32 export through ONNX
Runtime against eager float32 with the same stage composition as below (`backend="onnxruntime"`, CPU
tests), and the engine cache's keys and files. What has not run anywhere: `build_plan` and
`TensorRTEngine` with a real TensorRT. On a Thor (JetPack ships TensorRT and its Python bindings) or in
`docker/Dockerfile.thor`, `python -m rmuscle_ros.engine.tensorrt --preset pi05 --checkpoint ...` builds
the engines and checks the result against eager bfloat16.

How a call runs: the observation is copied into input buffers of the engine's own, the three engines run on
one CUDA stream, vision, prefill, then the denoise step engine `num_steps` times, ping-ponging its state
between two buffers; the engine's stream starts after the caller's and the caller's stream waits for it at
the end (no host synchronisation: the caller's read of the actions is the one). The prompt runs at its
32-token bucket (`onnx_export.trim_prompt`), not at the 200 slots the policy pads it to; one optimisation
profile covers 1..`max_token_len` tokens, tuned for `opt_prompt_len`. Every buffer is allocated once at the
longest prompt, each tensor TensorRT is given starting on a 256-byte boundary (`setTensorAddress`'s
contract), and every shape and address TensorRT refuses is an error naming the tensor.

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
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rmuscle_ros.engine import engine_cache, onnx_export
from rmuscle_ros.engine.eager import check_noise
from rmuscle_ros.engine.onnx_export import batch_item, default_cache_dir, missing_packages
from rmuscle_ros.models.checkpoint import weights_fingerprint
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model

log = logging.getLogger(__name__)

PLAN_FORMAT = 2  # 2: the key holds the builder's code digest (plans of format 1 are built again)
# setTensorAddress: "The pointer must have at least 256-byte alignment" (TensorRT 10, NvInferRuntime.h).
ALIGN = 256
# The prompt length the engines are tuned for (the profile's opt; min 1 and max max_token_len stay). A
# prompt runs at its 32-token bucket, so opt is a bucket: 64 holds prompts of 33 to 64 tokens, which is
# where the 50-token prompt our benchmarks use falls, and where we expect an ALOHA prompt (task, 14
# discretised joint values at 1-2 PaliGemma tokens each, "Action:") to fall. That count is an estimate:
# PaliGemma's tokenizer is not on our machines. On a cell the node says at configure which bucket its
# prompt runs at (`Policy.prompt_tokens`); the node's `model.trt_opt_prompt_len` sets this (the same default).
OPT_PROMPT_LEN = 64


def import_tensorrt() -> Any:
    """The `tensorrt` module, or a RuntimeError that says where it comes from."""
    try:
        import tensorrt
    except ImportError as err:  # the same words as the engine's check at construction
        raise onnx_export.missing_packages_error("backend 'tensorrt'", ["tensorrt"]) from err
    return tensorrt


_LOGGER: tuple[Any, Any] | None = None  # (the tensorrt module, its logger)


def trt_logger(trt: Any) -> Any:
    """The process's one TensorRT logger (warnings and errors): TensorRT keeps the first logger a builder or
    runtime was given and warns when a later one differs (found in review: each build made its own)."""
    global _LOGGER
    if _LOGGER is None or _LOGGER[0] is not trt:
        _LOGGER = (trt, trt.Logger(trt.Logger.WARNING))
    return _LOGGER[1]


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
    builder: str  # builder_code_digest(): a change to how plans are built (flags, profiles) builds again

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]


def builder_code_digest() -> str:
    """sha256 (16 hex digits) of this module's source: the builder flags and optimisation profiles a plan
    was built with are its code (found in review: a change to them reused the old plans)."""
    return hashlib.sha256(Path(__file__).resolve().read_bytes()).hexdigest()[:16]


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
        onnx_export.mark_used(meta)  # for `python -m rmuscle_ros.engine.engine_cache prune`
        return data

    def store(self, key: PlanKey, data: bytes, build_seconds: float) -> Path:
        """Write the plan and its sidecar atomically (temporary files renamed into place); first delete
        the temporary files of writers killed mid-write (onnx_export.remove_dead_writers_leftovers)."""
        self.root.mkdir(parents=True, exist_ok=True)
        onnx_export.remove_dead_writers_leftovers(self.root)
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


def _missing_packages_error(what: str) -> RuntimeError | None:
    """The error naming what `what` needs that is not installed here, None if nothing is missing:
    TensorRT, and onnx and onnxscript even with every plan cached (the plans are found by the export's key,
    which holds onnx's version, read from its installed metadata; a second review found the key changed,
    and every cached plan missed, once onnx was uninstalled)."""
    missing = missing_packages(("tensorrt", *onnx_export.EXPORT_PACKAGES))
    return onnx_export.missing_packages_error(what, missing) if missing else None


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
    logger = trt_logger(trt)
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


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor starting on an ALIGN-byte boundary. CUDA's caching allocator
    returns 512-byte aligned blocks already; this does not depend on it (the CPU's allocator gives 64)."""
    numel = math.prod(shape)
    raw = torch.empty(numel + ALIGN // dtype.itemsize, dtype=dtype, device=device)
    skip = (-raw.data_ptr() % ALIGN) // dtype.itemsize
    return raw[skip : skip + numel].view(shape)


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

    def __init__(self, trt: Any, runtime: Any, plan: bytes, stage: str, path: Path | None = None) -> None:
        self.trt = trt
        self.stage = stage
        self.engine = runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            where = f" from {path}" if path is not None else ""
            raise RuntimeError(
                f"TensorRT could not deserialize the {stage} engine{where} (TensorRT's log above says why). "
                "Out of GPU memory: free some and configure again. Otherwise the plan does not load on this "
                f"TensorRT: delete {path if path is not None else 'the plan'} so that the next configure builds "
                "it again (or build afresh: python -m rmuscle_ros.engine.tensorrt --force-rebuild)"
            )
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        expected = set(onnx_export.INPUTS[stage]) | set(onnx_export.OUTPUTS[stage])
        if set(names) != expected or set(inputs) != set(onnx_export.INPUTS[stage]):
            raise RuntimeError(f"{stage} engine has tensors {sorted(names)}, expected {sorted(expected)}")
        self.dtypes = {n: torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}

    def enqueue(self, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], stream: int) -> None:
        """Bind every input (shape and address) and output (address), then enqueue on `stream`. TensorRT
        answers a shape outside the profile or a misaligned address with False (and keeps the previous
        binding): each is an error here, naming the tensor."""
        for name, tensor in feeds.items():
            self._check(name, tensor)
            shape = tuple(tensor.shape)
            if not self.context.set_input_shape(name, shape):
                raise RuntimeError(
                    f"{self.stage}.{name}: TensorRT refused the input shape {shape} "
                    "(outside the engine's optimisation profile?)"
                )
            self._bind(name, tensor)
        for name, tensor in outputs.items():
            self._check(name, tensor)
            shape = tuple(self.context.get_tensor_shape(name))
            if shape != tuple(tensor.shape):
                raise RuntimeError(
                    f"{self.stage}.{name}: engine output {shape}, buffer {tuple(tensor.shape)}"
                )
            self._bind(name, tensor)
        if not self.context.execute_async_v3(stream):
            raise RuntimeError(f"TensorRT failed to enqueue the {self.stage} engine")

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype != self.dtypes[name]:
            raise TypeError(f"{self.stage}.{name}: {tensor.dtype}, the engine takes {self.dtypes[name]}")
        if not tensor.is_contiguous():
            raise ValueError(f"{self.stage}.{name}: not contiguous; TensorRT reads dense row-major memory")

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        address = tensor.data_ptr()
        if not self.context.set_tensor_address(name, address):
            raise RuntimeError(
                f"{self.stage}.{name}: TensorRT refused the address {address:#x} ({address % ALIGN} bytes "
                f"past a {ALIGN}-byte boundary; it needs {ALIGN}-byte alignment)"
            )


class TensorRTEngine:
    name = "tensorrt"

    def __init__(
        self,
        model: Pi05Model,
        *,
        device: torch.device,
        cache_dir: str | os.PathLike[str] | None = None,
        opt_prompt_len: int = OPT_PROMPT_LEN,
        workspace_gib: float = 4.0,
        force_rebuild: bool = False,
    ) -> None:
        """cache_dir: exports (`onnx/`) and plans (`tensorrt/`); opt_prompt_len: the prompt length the
        engines are tuned for; force_rebuild: export and build again even if the caches match.

        Raises RuntimeError naming what is missing of TensorRT, onnx and onnxscript (the export's key,
        which finds the cached plans, holds onnx's version)."""
        missing = _missing_packages_error("backend 'tensorrt'")
        if missing is not None:
            raise missing
        self.trt = import_tensorrt()
        self.device = device
        self.cfg = model.cfg
        self.weights = weights_fingerprint(model)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        profile_shapes(self.cfg, "prefill", opt_prompt_len)  # validates it
        self.opt_prompt_len = opt_prompt_len
        self.workspace_bytes = int(workspace_gib * (1 << 30))
        self.force_rebuild = force_rebuild
        self.model = model.to(device=device, dtype=torch.bfloat16).eval()
        self.buckets = onnx_export.prompt_buckets(self.cfg)
        self._stages: dict[str, _StageEngine] = {}
        self._lease: Any = None  # engine_cache.hold's: this engine's version kept from pruning

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
            builder_code_digest(),
        )

    def _plan_keys(self) -> dict[str, PlanKey]:
        """Each stage's plan key; it follows from the export's key, which needs no export."""
        digest = onnx_export.export_key(self.cfg, self.weights, "bfloat16").digest()
        return {stage: self._plan_key(digest, stage) for stage in onnx_export.STAGES}

    def warmup(self) -> dict[str, float]:
        """Load the three engines (exporting and building whatever is not cached), allocate the buffers,
        run one call. Seconds each.

        The plans' keys follow from the export's key, which needs no export: with every plan cached, the
        export is neither made nor read (on a Thor, 6.5 GB).

        All or nothing: the engines are built and loaded into locals and run once before the engine takes
        them, and only then are the PyTorch weights released (the engines carry their own). A failure
        (a build, a load, the first call) leaves the engine as it was, weights kept, and the next warmup
        tries again, reusing the plans already stored. The price: the weights stay in memory during the
        builds (6.6 GB in bfloat16 at full size).
        """
        if self._stages:
            return {}
        trt = self.trt
        timings: dict[str, float] = {}
        cache = PlanCache(self.cache_dir / "tensorrt")
        keys = self._plan_keys()
        # This version and plan set stay out of `engine_cache prune` while this engine lives.
        key = asdict(keys["vision"])
        self._lease = engine_cache.hold(self.cache_dir, key["export"], engine_cache.plan_set(key))
        plans = {s: None if self.force_rebuild else cache.load(k) for s, k in keys.items()}
        export_dir: Path | None = None
        if any(plan is None for plan in plans.values()):
            start = time.perf_counter()
            export_dir = onnx_export.ensure_export(
                self.model, self.cache_dir / "onnx", weights=self.weights, force=self.force_rebuild
            )
            timings["export"] = time.perf_counter() - start
        runtime = trt.Runtime(trt_logger(trt))
        stages: dict[str, _StageEngine] = {}
        for stage, key in keys.items():
            start = time.perf_counter()
            plan = plans[stage]
            if plan is None:
                assert export_dir is not None and export_dir.name == key.export
                shapes = profile_shapes(self.cfg, stage, self.opt_prompt_len)
                plan = build_plan(trt, export_dir / f"{stage}.onnx", shapes, self.workspace_bytes)
                cache.store(key, plan, time.perf_counter() - start)
                log.info("built the %s engine in %.0f s", stage, time.perf_counter() - start)
            stages[stage] = _StageEngine(trt, runtime, plan, stage, cache.path(key))
            timings[f"engine_{stage}"] = time.perf_counter() - start
        self._allocate(stages)
        self._stages = stages
        start = time.perf_counter()
        try:
            blank = onnx_export.example_inputs(self.cfg, self.opt_prompt_len, self.device)
            noise = torch.zeros(1, self.cfg.horizon, self.cfg.action_dim, device=self.device)
            self.sample_actions(blank, noise)
            torch.cuda.current_stream(self.device).synchronize()  # an asynchronous failure surfaces here
        except BaseException:
            self._stages = {}
            raise
        timings["first_call"] = time.perf_counter() - start
        self.model = None  # type: ignore[assignment]
        torch.cuda.empty_cache()
        return timings

    def _allocate(self, stages: dict[str, _StageEngine]) -> None:
        """Every buffer once, at the longest prompt, each on an ALIGN-byte boundary; a call views the
        prefix of the length it needs, which starts where its buffer does."""
        cfg, dev = self.cfg, self.device
        vlm = cfg.vlm
        longest = cfg.image_tokens + cfg.max_token_len
        vision, prefill, denoise = (stages[s].dtypes for s in onnx_export.STAGES)
        c, s = cfg.num_cameras, cfg.vision.image_size
        # The observation is copied in (from the host, or from wherever batch item i sits in a batch).
        self._images = aligned_empty((1, c, 3, s, s), vision["images"], dev)
        self._image_masks = aligned_empty((1, c), prefill["image_masks"], dev)
        self._tokens = aligned_empty((1, cfg.max_token_len), prefill["tokens"], dev)
        self._token_mask = aligned_empty((1, cfg.max_token_len), prefill["token_mask"], dev)
        self._visual = aligned_empty((1, cfg.image_tokens, vlm.width), vision["visual"], dev)
        kv_numel = vlm.depth * vlm.num_kv_heads * longest * vlm.head_dim
        self._keys = aligned_empty((kv_numel,), prefill["keys"], dev)
        self._values = aligned_empty((kv_numel,), prefill["values"], dev)
        self._pad = aligned_empty((longest,), prefill["pad_mask"], dev)
        self._x = [aligned_empty((1, cfg.horizon, cfg.action_dim), denoise["x"], dev) for _ in range(2)]
        # Step k's index is row k of a (steps, ALIGN bytes) table, bound as its first element (1,): a row
        # per step puts each on its own boundary (a (steps, 1) table's rows are 8 bytes apart).
        step = denoise["step"]
        self._steps = aligned_empty((cfg.num_steps, ALIGN // step.itemsize), step, dev)
        self._steps.copy_(torch.arange(cfg.num_steps, dtype=step)[:, None].expand_as(self._steps))
        self._stream = torch.cuda.Stream(device=dev)

    def _load(self, inputs: ModelInputs) -> dict[str, torch.Tensor]:
        """Copy one observation (batch 1, prompt trimmed) into the input buffers, on the current stream.
        Returns the prefill's inputs by name: views of the buffers at the prompt's length."""
        for name, buffer, given in (
            ("images", self._images, inputs.images),
            ("image_masks", self._image_masks, inputs.image_masks),
        ):
            if given.shape != buffer.shape:
                raise ValueError(f"{name} must be {tuple(buffer.shape)}, got {tuple(given.shape)}")
        width = inputs.tokens.shape[1]
        if inputs.tokens.shape != (1, width) or inputs.token_mask.shape != (1, width):
            raise ValueError(
                f"tokens and token_mask must be (1, L), got {tuple(inputs.tokens.shape)} and "
                f"{tuple(inputs.token_mask.shape)}"
            )
        tokens, token_mask = self._tokens[:, :width], self._token_mask[:, :width]
        self._images.copy_(inputs.images)
        self._image_masks.copy_(inputs.image_masks)
        tokens.copy_(inputs.tokens)
        token_mask.copy_(inputs.token_mask)
        return {
            "visual": self._visual,
            "image_masks": self._image_masks,
            "tokens": tokens,
            "token_mask": token_mask,
        }

    def _call(self, inputs: ModelInputs, noise: torch.Tensor) -> torch.Tensor:
        """One observation (batch 1, prompt trimmed), noise (1, horizon, action_dim) -> its actions."""
        cfg, vlm = self.cfg, self.cfg.vlm
        prefill_inputs = self._load(inputs)
        lp = cfg.image_tokens + inputs.tokens.shape[1]
        kv_shape = (vlm.depth, 1, vlm.num_kv_heads, lp, vlm.head_dim)
        keys = self._keys[: math.prod(kv_shape)].view(kv_shape)
        values = self._values[: keys.numel()].view(kv_shape)
        pad = self._pad[:lp].view(1, lp)
        stream = self._stream.cuda_stream
        self._stages["vision"].enqueue({"images": self._images}, {"visual": self._visual}, stream)
        self._stages["prefill"].enqueue(
            prefill_inputs, {"keys": keys, "values": values, "pad_mask": pad}, stream
        )
        self._x[0].copy_(noise)
        for step in range(cfg.num_steps):
            src, dst = self._x[step % 2], self._x[(step + 1) % 2]
            self._stages["denoise"].enqueue(
                {"x": src, "step": self._steps[step, :1], "keys": keys, "values": values, "pad_mask": pad},
                {"x_next": dst},
                stream,
            )
        return self._x[cfg.num_steps % 2].clone()

    @torch.no_grad()
    def sample_actions(self, inputs: ModelInputs, noise: torch.Tensor) -> torch.Tensor:
        """inputs (B observations, on any device), noise (B, horizon, action_dim) -> actions, float32.
        Each observation runs alone, its prompt at its bucket (`onnx_export.trim_prompt`)."""
        if not self._stages:
            self.warmup()
        check_noise(noise, inputs.tokens.shape[0], self.cfg.horizon, self.cfg.action_dim)
        noise = noise.to(self.device, torch.float32)
        # Trimmed where the prompt is (the policy's is on the host), then moved as before: the copies into
        # the engine's buffers below are then device to device, queued on its stream without a host wait.
        items = [
            onnx_export.trim_prompt(batch_item(inputs, i), self.buckets).to(self.device)
            for i in range(noise.shape[0])
        ]
        chunks = []
        # The caller's stream, asked before the context below makes the engine's stream current (inside it,
        # the engine's stream waited on itself, and the input copies were not ordered after the caller's
        # preprocessing: found in review).
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for i, item in enumerate(items):
                chunks.append(self._call(item, noise[i : i + 1]))
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return torch.cat(chunks)


# The check's bound on the engines' relative L2 against eager bfloat16: a setting, not a measurement. For
# scale, the graph engine measured 4.6e-3 against eager bf16 at `pi05` on the H200 (README, "Performance").
MAX_ERROR = 2e-2


def main(argv: list[str] | None = None) -> int:
    """Build the engines for a checkpoint and compare one call with eager bfloat16 (run on the Thor).
    Exit status 1 when the relative L2 error is above --max-error (or not finite), 0 otherwise."""
    from rmuscle_ros.models.checkpoint import load_model
    from rmuscle_ros.models.config import PRESETS, get_preset

    p = argparse.ArgumentParser(
        description="Build π0.5's TensorRT engines and check them against eager bf16."
    )
    p.add_argument("--preset", default="pi05", choices=sorted(PRESETS))
    p.add_argument("--checkpoint", help="model.safetensors (LeRobot/openpi); random weights when absent")
    p.add_argument("--cache-dir", default=str(default_cache_dir()))
    p.add_argument("--opt-prompt-len", type=int, default=OPT_PROMPT_LEN)
    p.add_argument("--force-rebuild", action="store_true")
    p.add_argument(
        "--max-error",
        type=float,
        default=MAX_ERROR,
        help=f"fail (exit 1) above this relative L2 against eager bf16 (default {MAX_ERROR:g})",
    )
    args = p.parse_args(argv)
    # What would fail after the model's load (minutes at full size), first (found in review: a traceback
    # there, or on a machine without CUDA an AssertionError while loading)
    cfg = get_preset(args.preset)
    try:
        profile_shapes(cfg, "prefill", args.opt_prompt_len)  # validates it, as the engine does
    except ValueError as e:
        p.error(f"--opt-prompt-len: {e}")
    missing = _missing_packages_error("the tensorrt backend")
    if missing is not None:
        p.error(str(missing))
    if not torch.cuda.is_available():
        p.error("the tensorrt backend needs a CUDA GPU; none is visible here")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from rmuscle_ros.engine.eager import EagerEngine

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
    error = float((ours - ref).norm() / ref.norm())
    print(f"tensorrt vs eager bf16: relative L2 {error:.2e} (bound {args.max_error:g})")
    times = []
    for _ in range(20):
        start = time.perf_counter()
        engine.sample_actions(inputs, noise)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(f"tensorrt call: median {1e3 * sorted(times)[len(times) // 2]:.2f} ms over {len(times)}")
    if not error <= args.max_error:  # NaN fails too
        print(f"FAILED: relative L2 {error:.2e} above {args.max_error:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
