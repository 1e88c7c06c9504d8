"""π0.5 as ONNX graphs, one per stage (vision, prefill, denoise): the input of the `tensorrt` backend.

The stages are the graph engine's:

    vision   images (1, C, 3, 224, 224) float32                        -> visual (1, C·256, W)
    prefill  visual, image_masks (1, C), tokens (1, L), token_mask (1, L) -> keys, values
             (depth, 1, KV heads, C·256 + L, head dim) and pad_mask (1, C·256 + L)
    denoise  x (1, horizon, action_dim) float32, step (1,) int64, keys, values, pad_mask -> x_next
             (one Euler step; the runner replays it `num_steps` times from the noise)

Batch 1 (the node's calls are single observations), the cameras fixed by the config, the prompt length
dynamic (1..`max_token_len`), so one export serves every prompt. Every step's adaRMS condition is a
constant table in the denoise graph: the integration times are fixed.

The graphs come from `torch.onnx.export` (the torch.export-based exporter) run on the reference model's
own methods, so an export is `Pi05Model` as the eager engine runs it; nothing is written twice. Weights
go to external data files: ONNX's protobuf limit is 2 GB and full-size `pi05` is 6.6 GB in bf16.

An export directory holds `<stage>.onnx` (+ `.onnx.data`) and `manifest.json`: format version, weights
fingerprint, model config, dtype, opset, exporter versions and a hash of the source files that define the
graphs, and each file's size and sha256.
`ensure_export` reuses a directory only when its manifest matches (keyed by content, not by path), and
writes a new one beside it and renames it into place, so an interrupted export never leaves a directory
that looks complete.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rmuscle_ros.engine.eager import DTYPES
from rmuscle_ros.engine.graph import bucket_for, default_buckets
from rmuscle_ros.models.config import Pi05Config
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model, PrefixCache, euler_times

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STAGES = ("vision", "prefill", "denoise")
# Opset 20: the first with Gelu, and the newest TensorRT 10's parser reads (9 to 20 in onnx-tensorrt's
# operator matrix, release 10.1; TensorRT 11 reads up to 25).
OPSET = 20
MANIFEST = "manifest.json"
# The source files whose code the exported graphs are: the export key hashes them (graph_code_digest).
GRAPH_SOURCES = (Path(__file__).resolve(), Path(__file__).resolve().parents[1] / "models" / "pi05.py")

INPUTS = {
    "vision": ("images",),
    "prefill": ("visual", "image_masks", "tokens", "token_mask"),
    "denoise": ("x", "step", "keys", "values", "pad_mask"),
}
OUTPUTS = {
    "vision": ("visual",),
    "prefill": ("keys", "values", "pad_mask"),
    "denoise": ("x_next",),
}


class ExportError(RuntimeError):
    """An export directory that cannot be used: missing, from another model, or damaged."""


# ───────────────────────────────────────────── optional packages ────────────────────────────────────────────

# How to get each optional package the exported backends use (pyproject.toml: the `onnx` extra has onnx and
# onnxscript, what torch.onnx's exporter writes and translates with; onnxruntime is only in `dev`).
INSTALL = {
    # Named outright, not as the `onnx` extra: a colcon-built package's metadata carries no extras, so
    # `pip install 'rmuscle_ros[onnx]'` installed nothing on a Thor (found in review).
    "onnx": "pip install 'onnx>=1.17' 'onnxscript>=0.3'",
    "onnxscript": "pip install 'onnx>=1.17' 'onnxscript>=0.3'",
    "onnxruntime": "pip install onnxruntime (it is in rmuscle_ros's dev extra)",
    "tensorrt": "TensorRT's Python bindings (on a Jetson Thor they come with JetPack; in a container, build "
    "docker/Dockerfile.thor; the development and H200 machines cannot install TensorRT: use backend "
    "'graph' there)",
}
EXPORT_PACKAGES = ("onnx", "onnxscript")


def missing_packages(names: Sequence[str]) -> list[str]:
    """Those of `names` that cannot be imported here, found without importing them."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken install, or a module without a spec
            found = False
        if not found:
            missing.append(name)
    return missing


def missing_packages_error(what: str, missing: Sequence[str]) -> RuntimeError:
    """The error for `what` (e.g. "backend 'onnxruntime'") needing `missing`: each package and how to get it."""
    hints = dict.fromkeys(INSTALL[name] for name in missing)  # one line for onnx and onnxscript together
    return RuntimeError(f"{what} needs {', '.join(missing)}, not installed here: {'; '.join(hints)}")


def package_version(name: str) -> str:
    """The installed distribution's version, read without importing it; "not installed" if absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# ───────────────────────────────────────────── the three stages ─────────────────────────────────────────────


def layer_norm_float32(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    """`norm(x)` computed in float32 from elementary operations and cast back to x's dtype, as PyTorch's
    LayerNorm computes a bfloat16 input (VisionStage says why the export spells it out)."""
    h = x.float()
    centred = h - h.mean(-1, keepdim=True)
    variance = (centred * centred).mean(-1, keepdim=True)
    out = centred * torch.rsqrt(variance + norm.eps) * norm.weight.float() + norm.bias.float()
    return out.to(x.dtype)


class VisionStage(nn.Module):
    """SigLIP and the projector, as `Pi05Model.embed_images`, with the patch embedding as one matmul.

    The matmul over each image's 14×14 patches is the Conv2d's arithmetic. It keeps the graph within
    opset 20 in bfloat16: ONNX's Conv types allow bfloat16 only from opset 22, and TensorRT 10's parser
    reads opsets 9 to 20 (onnx-tensorrt's operator matrix, release 10.1).

    Its LayerNorms are explicit float32 operations (`layer_norm_float32`), not ONNX LayerNormalization
    nodes: those take the bfloat16 input with a float32 stash_type, and TensorRT's parser imports them by
    setting the layer's compute precision, a call a strongly typed network (how the `tensorrt` backend
    builds the bfloat16 export) rejects (NvInfer.h, release 10.13; found in review, not run on TensorRT).
    """

    def __init__(self, model: Pi05Model) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> Tensor:
        b, c = images.shape[:2]
        tower, vision = self.model.vision_tower, self.model.cfg.vision
        conv = tower.embeddings.patch_embedding
        p, n = vision.patch_size, vision.image_size // vision.patch_size
        x = images.flatten(0, 1).to(self.model.dtype)  # (B·C, 3, 224, 224)
        x = x.reshape(-1, 3, n, p, n, p).permute(0, 2, 4, 1, 3, 5)  # (B·C, 16, 16, 3, 14, 14)
        patches = x.reshape(-1, n * n, 3 * p * p)  # (B·C, 256, 588), each patch in the kernel's order
        x = patches @ conv.weight.reshape(conv.out_channels, -1).T + conv.bias
        x = x + tower.embeddings.position_embedding.weight
        for layer in tower.encoder.layers:  # SiglipLayer.forward, its norms as explicit float32 operations
            x = x + layer.self_attn(layer_norm_float32(x, layer.layer_norm1))
            x = x + layer.mlp(layer_norm_float32(x, layer.layer_norm2))
        feats = layer_norm_float32(x, tower.post_layernorm)  # (B·C, 256, vision width)
        return self.model.projector(feats).view(b, c * feats.shape[1], -1)


class PrefillStage(nn.Module):
    def __init__(self, model: Pi05Model) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, visual: Tensor, image_masks: Tensor, tokens: Tensor, token_mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        m = self.model
        text = m.llm.embed_tokens(tokens) * (m.cfg.vlm.width**0.5)  # Gemma embedding scale, as embed_prefix
        image_pad = image_masks.repeat_interleave(m.cfg.vision.tokens_per_image, dim=1)  # (1, C·256)
        embs = torch.cat([visual, text.to(visual.dtype)], dim=1)
        pad_mask = torch.cat([image_pad, token_mask], dim=1)  # (1, Lp)
        # The model's positions, counted in float32 (exact far beyond Lp): TensorRT's CumSum takes no integers.
        positions = pad_mask.float().cumsum(-1) - 1
        cache = m.prefill(embs, pad_mask, positions=positions)
        return torch.stack(cache.keys), torch.stack(cache.values), pad_mask  # (depth, 1, KVH, Lp, Dh)


class DenoiseStep(nn.Module):
    """One Euler step x ← x + dt·v(x, t_step); the adaRMS condition of every step is a constant table.

    One step, not the unrolled loop: a tenth of the graph (export time is tracing time, ~linear in it),
    and the runner replays it `num_steps` times with the same buffers.
    """

    def __init__(self, model: Pi05Model) -> None:
        super().__init__()
        self.model = model
        with torch.no_grad():
            times = torch.tensor(euler_times(model.cfg.num_steps), device=model.projector.weight.device)
            cond = torch.cat([model.time_conditioning(t[None]) for t in times])  # (steps, expert width)
        self.register_buffer("cond", cond, persistent=False)

    def forward(self, x: Tensor, step: Tensor, keys: Tensor, values: Tensor, pad_mask: Tensor) -> Tensor:
        """x (1, horizon, action_dim) float32, step (1,) int64 in [0, num_steps) -> x after that step."""
        prefix = PrefixCache(list(keys.unbind(0)), list(values.unbind(0)), pad_mask)
        cond = self.cond.index_select(0, step)  # (1, expert width)
        t = torch.ones(1, device=x.device)  # unused: velocity takes the condition as given
        return x + (-1.0 / self.model.cfg.num_steps) * self.model.velocity(x, t, prefix, cond=cond)


def stage_modules(model: Pi05Model) -> dict[str, nn.Module]:
    stages = {"vision": VisionStage(model), "prefill": PrefillStage(model), "denoise": DenoiseStep(model)}
    return {name: stage.eval() for name, stage in stages.items()}


def example_inputs(cfg: Pi05Config, prompt_len: int, device: torch.device) -> ModelInputs:
    """A batch-1 observation of the export's shapes (values do not matter: the graphs do not branch on them)."""
    c, s = cfg.num_cameras, cfg.vision.image_size
    return ModelInputs(
        images=torch.zeros(1, c, 3, s, s, device=device),
        image_masks=torch.ones(1, c, dtype=torch.bool, device=device),
        tokens=torch.zeros(1, prompt_len, dtype=torch.int64, device=device),
        token_mask=torch.ones(1, prompt_len, dtype=torch.bool, device=device),
    )


StageRunner = Callable[[str, dict[str, Tensor]], dict[str, Tensor]]
"""Runs one stage: (stage name, its inputs by name) -> its outputs by name (PyTorch, ONNX Runtime, TensorRT)."""


def sample_actions_by_stage(run: StageRunner, inputs: ModelInputs, noise: Tensor, num_steps: int) -> Tensor:
    """One observation through vision, prefill and `num_steps` denoising steps: `sample_actions` by stage.

    inputs of batch 1, noise (1, horizon, action_dim) -> actions (1, horizon, action_dim) float32.
    """
    visual = run("vision", {"images": inputs.images})["visual"]
    prefix = run(
        "prefill",
        {
            "visual": visual,
            "image_masks": inputs.image_masks,
            "tokens": inputs.tokens,
            "token_mask": inputs.token_mask,
        },
    )
    kv = {name: prefix[name] for name in ("keys", "values", "pad_mask")}
    x = noise.float()
    for step in range(num_steps):
        index = torch.tensor([step], dtype=torch.int64, device=x.device)
        x = run("denoise", {"x": x, "step": index, **kv})["x_next"]
    return x


def torch_runner(stages: dict[str, nn.Module]) -> StageRunner:
    """The stage modules themselves, in PyTorch: the reference the exported graphs are checked against."""

    def run(stage: str, feeds: dict[str, Tensor]) -> dict[str, Tensor]:
        with torch.no_grad():
            out = stages[stage](*(feeds[name] for name in INPUTS[stage]))
        return dict(zip(OUTPUTS[stage], out if isinstance(out, tuple) else (out,), strict=True))

    return run


def stage_examples(model: Pi05Model, prompt_len: int = 16) -> dict[str, tuple[Tensor, ...]]:
    """Each stage's positional inputs from one call of the model on a blank observation (export examples)."""
    device = model.projector.weight.device
    stages = stage_modules(model)
    reference = torch_runner(stages)
    seen: dict[str, tuple[Tensor, ...]] = {}

    def record(stage: str, feeds: dict[str, Tensor]) -> dict[str, Tensor]:
        seen.setdefault(stage, tuple(feeds[name] for name in INPUTS[stage]))
        return reference(stage, feeds)

    noise = torch.zeros(1, model.cfg.horizon, model.cfg.action_dim, device=device)
    sample_actions_by_stage(record, example_inputs(model.cfg, prompt_len, device), noise, 1)
    return seen


# ───────────────────────────────────────────── export and manifest ──────────────────────────────────────────


@dataclass(frozen=True)
class ExportKey:
    """What an export depends on: a directory is reused only if all of it matches."""

    format_version: int
    weights: str  # rmuscle_ros.models.checkpoint.weights_fingerprint(model)
    config: dict[str, Any]  # Pi05Config.to_dict()
    dtype: str
    opset: int
    torch: str
    onnx: str
    onnxscript: str  # it translates torch's graph to ONNX
    onnx_ir: str  # torch.onnx's exporter and its optimisation passes are built on it (review: not keyed)
    # sha256 of the source files that define the exported graphs (GRAPH_SOURCES): a code update that
    # changes them makes a new export, and new engines, instead of reusing the old ones (found in review)
    code: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def dtype_name(model: Pi05Model) -> str:
    """The export dtype a model is in ("float32" or "bfloat16"); any other is refused by name."""
    for name, dtype in DTYPES.items():
        if model.dtype == dtype:
            return name
    raise ValueError(f"the ONNX export takes a float32 or bfloat16 model, got {model.dtype}")


def default_cache_dir() -> Path:
    """Where exports and engines are kept unless a directory is given: $XDG_CACHE_HOME/rmuscle_ros."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rmuscle_ros"


def batch_item(inputs: ModelInputs, i: int) -> ModelInputs:
    """Observation i of a batch, still batched (1, ...): the exported stages take one observation."""
    return ModelInputs(
        *(t[i : i + 1] for t in (inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask))
    )


# The graph engine's prompt bucket (engine.graph, its default bucket_step): the exported engines run a
# prompt at the smallest bucket holding its last valid token, not at the 200 slots the policy pads it to.
PROMPT_BUCKET_STEP = 32


def prompt_buckets(cfg: Pi05Config) -> list[int]:
    """The prompt lengths the exported engines run at: the graph engine's buckets, capped at max_token_len."""
    return sorted({min(b, cfg.max_token_len) for b in default_buckets(cfg.max_token_len, PROMPT_BUCKET_STEP)})


def trim_prompt(inputs: ModelInputs, buckets: Sequence[int]) -> ModelInputs:
    """A batch-1 observation with its prompt cut after the last valid token, rounded up to the smallest of
    `buckets` (never longer than it was): tokens and token_mask (1, L) -> (1, width), views, no copy.

    The actions do not change: padding after the last valid token is masked out of every key and moves no
    position (positions count valid tokens), so it only ever computes its own rows, which nothing reads.
    Interior padding is kept. Reads the mask on the host (a GPU mask is read back first).
    """
    if inputs.tokens.shape[0] != 1:
        raise ValueError(f"trim_prompt takes one observation, got batch {inputs.tokens.shape[0]}")
    valid = inputs.token_mask[0].nonzero()
    last = int(valid[-1]) + 1 if valid.numel() else 0
    bucket = bucket_for(buckets, last)
    if bucket is None:
        raise ValueError(f"the prompt's last valid token is number {last}, past the longest ({buckets[-1]})")
    width = min(bucket, inputs.tokens.shape[1])
    return ModelInputs(
        inputs.images, inputs.image_masks, inputs.tokens[:, :width], inputs.token_mask[:, :width]
    )


def export_key(cfg: Pi05Config, weights: str, dtype: str) -> ExportKey:
    """The key of an export, computed without exporting or importing onnx (its version is read from its
    installed metadata): the tensorrt backend finds its cached plans from it. Without onnx installed the
    key says "not installed" and matches no export made with onnx, so both backends require onnx."""
    if dtype not in DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return ExportKey(
        FORMAT_VERSION,
        weights,
        cfg.to_dict(),
        dtype,
        OPSET,
        torch.__version__,
        package_version("onnx"),
        package_version("onnxscript"),
        package_version("onnx-ir"),
        graph_code_digest(),
    )


def graph_code_digest() -> str:
    """sha256 (16 hex digits) of GRAPH_SOURCES' bytes: this module (the stages) and the model they run."""
    h = hashlib.sha256()
    for path in GRAPH_SOURCES:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _export_stage(
    module: nn.Module, args: tuple[Tensor, ...], stage: str, path: Path, cfg: Pi05Config
) -> None:
    from torch.export import Dim

    prompt = Dim("prompt", min=1, max=cfg.max_token_len)
    prefix = Dim("prefix", min=cfg.image_tokens + 1, max=cfg.image_tokens + cfg.max_token_len)
    dynamic = {
        "vision": None,
        "prefill": {"visual": None, "image_masks": None, "tokens": {1: prompt}, "token_mask": {1: prompt}},
        "denoise": {
            "x": None,
            "step": None,
            "keys": {3: prefix},
            "values": {3: prefix},
            "pad_mask": {1: prefix},
        },
    }[stage]
    with torch.no_grad(), warnings.catch_warnings():
        # Both axes of a pair share one constraint, so the exporter keeps one name and says so, per stage.
        warnings.filterwarnings("ignore", message=r".*axis name: \w+ will not be used")
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            input_names=list(INPUTS[stage]),
            output_names=list(OUTPUTS[stage]),
            opset_version=OPSET,
            dynamic_shapes=dynamic,
            optimize=True,
            verbose=False,
        )
    if program is None:
        raise ExportError(f"torch.onnx.export returned no program for {stage}")
    # The weights to one file beside the graph, `<stage>.onnx.data`: ONNX's protobuf limit is 2 GB.
    program.save(str(path), external_data=True)


def export_model(
    model: Pi05Model, out_dir: str | os.PathLike[str], *, weights: str, prompt_len: int = 16
) -> Path:
    """Export `model` (already in the export dtype, on any device) into `out_dir`, which must not exist.

    `weights` is the model's fingerprint (rmuscle_ros.models.checkpoint.weights_fingerprint), recorded in
    the manifest. `prompt_len` is only the example's length; the graphs take any length up to
    `max_token_len`. Returns the directory.
    """
    missing = missing_packages(EXPORT_PACKAGES)
    if missing:
        raise missing_packages_error("the ONNX export", missing)
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(
            f"{out} exists; export into a new directory (ensure_export replaces atomically)"
        )
    key = export_key(model.cfg, weights, dtype_name(model))
    model = model.eval()
    stages = stage_modules(model)
    examples = stage_examples(model, prompt_len)
    out.mkdir(parents=True)
    files: dict[str, dict[str, Any]] = {}
    seconds: dict[str, float] = {}
    for stage in STAGES:
        start = time.perf_counter()
        _export_stage(stages[stage], examples[stage], stage, out / f"{stage}.onnx", model.cfg)
        seconds[stage] = round(time.perf_counter() - start, 2)
        log.info("exported %s in %.1f s", stage, seconds[stage])
    for path in sorted(out.iterdir()):
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {
        "key": asdict(key),
        "digest": key.digest(),
        "stages": {s: {"inputs": list(INPUTS[s]), "outputs": list(OUTPUTS[s])} for s in STAGES},
        "files": files,
        "export_seconds": seconds,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return out


def read_manifest(export_dir: str | os.PathLike[str], *, verify: bool = True) -> dict[str, Any]:
    """The manifest of an export directory, its files checked (sizes always, sha256 when `verify`).

    Raises ExportError naming the first missing or altered file.
    """
    root = Path(export_dir)
    path = root / MANIFEST
    if not path.is_file():
        raise ExportError(f"{root} is not an ONNX export: no {MANIFEST}")
    try:
        manifest = json.loads(path.read_text())
        version = manifest["key"]["format_version"]
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise ExportError(f"{path}: unreadable manifest ({err})") from err
    if version != FORMAT_VERSION:
        raise ExportError(f"{path}: export format {version}, this version reads {FORMAT_VERSION}")
    for name, meta in files.items():
        file = root / name
        if not file.is_file():
            raise ExportError(f"{root}: {name} is missing")
        if file.stat().st_size != meta["bytes"] or (verify and _sha256(file) != meta["sha256"]):
            raise ExportError(f"{root}: {name} does not match its manifest (altered or truncated)")
    return manifest


def ensure_export(
    model: Pi05Model, cache_dir: str | os.PathLike[str], *, weights: str, force: bool = False
) -> Path:
    """An export of `model` under `cache_dir/<digest>`, made if missing, damaged or `force`d.

    The digest covers the weights fingerprint, config, dtype, opset and exporter versions, so another
    model or toolchain gets its own directory. A damaged directory is reported and replaced.
    """
    key = export_key(model.cfg, weights, dtype_name(model))
    root = Path(cache_dir)
    target = root / key.digest()

    def usable() -> bool:
        if not target.exists():
            return False
        try:
            manifest = read_manifest(target)
        except ExportError as err:
            log.warning("%s; exporting again", err)
            return False
        if manifest["key"] != asdict(key):
            log.warning("%s was exported for another model or toolchain; exporting again", target)
            return False
        mark_used(target / MANIFEST)
        return True

    if not force and usable():
        return target
    # One exporter of a digest at a time (found in review: two nodes starting on an empty cache each
    # exported, and the second deleted the first's folder while its TensorRT build read it, or failed to
    # rename onto it): the second waits, then finds the first's export.
    with _export_lock(root, key.digest()):
        if not force and usable():
            return target
        remove_dead_writers_leftovers(root)
        staging = Path(tempfile.mkdtemp(prefix=f".{key.digest()}.{os.getpid()}.", dir=root))
        staging.rmdir()
        try:
            export_model(model, staging, weights=weights)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    return target


@contextlib.contextmanager
def _export_lock(root: Path, digest: str) -> Iterator[None]:
    """An exclusive lock on `root/.<digest>.lock` (a hidden name: neither an export nor a writer's
    leftover to `engine_cache`), held while one process checks, exports and renames that digest."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / f".{digest}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def mark_used(path: Path) -> None:
    """Set `path`'s modification time to now: the last use of an export (its manifest) or a plan (its
    sidecar), which `engine_cache prune` keeps the most recent of. A read-only cache is left as it is."""
    try:
        os.utime(path)
    except OSError as err:
        log.debug("engine cache: cannot mark %s used: %s", path, err)


# A writer's staging entry untouched this long, whose pid is gone or is this process's own, is a leftover.
# Export staging is written file by file (minutes at full size) and a plan's temporary file in one go, so
# a live writer in another pid namespace sharing the folder (another container) touches its entries well
# within it; in a container each run may be pid 1, so a pid alone cannot tell a killed run from this one.
LEFTOVER_QUIET_S = 3600.0


def remove_dead_writers_leftovers(root: Path) -> list[Path]:
    """Delete what a writer killed mid-write left in `root`: the hidden entries named with its pid
    (`.<name>.<pid>.tmp` plan files, `.<digest>.<pid>.<random>` export folders), when they were written
    before this host booted, or when their pid is gone or is this process's and they have been untouched
    for LEFTOVER_QUIET_S. Returns them. Found in review: a process killed while it wrote kept its staging
    files for good (an export's is 6.5 GB at full size); and in the closing review, that a bare pid test
    kept a killed container run's files (pid 1 again) and would delete a live writer's in another pid
    namespace."""
    from rmuscle_ros.cache.lock import boot_time, pid_exists

    removed, booted, now = [], boot_time(), time.time()
    for entry in root.glob(".*") if root.is_dir() else ():
        parts = entry.name[1:].split(".")
        pids = [int(p) for p in parts[1:] if p.isdigit()]
        if not pids:
            continue
        pid = pids[-1] if entry.name.endswith(".tmp") else pids[0]
        try:
            written = entry.lstat().st_mtime
        except OSError:
            continue
        gone = pid == os.getpid() or not pid_exists(pid)
        if not (written < booted or (gone and now - written > LEFTOVER_QUIET_S)):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as err:
            log.warning(
                "engine cache: %s, left by a writer that is gone, could not be removed: %s", entry, err
            )
            continue
        log.info("engine cache: removed %s, left by a writer that is gone", entry)
        removed.append(entry)
    return removed


def main(argv: list[str] | None = None) -> None:
    from rmuscle_ros.models.checkpoint import load_model, weights_fingerprint
    from rmuscle_ros.models.config import PRESETS, get_preset

    p = argparse.ArgumentParser(description="Export π0.5's vision, prefill and denoise stages to ONNX.")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--checkpoint", help="model.safetensors (LeRobot/openpi); random weights when absent")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="a new directory")
    args = p.parse_args(argv)
    # Before the model loads (minutes at full size); found in review: tracebacks after it
    if Path(args.out).exists():
        p.error(f"--out {args.out}: exists; name a new directory")
    missing = missing_packages(EXPORT_PACKAGES)
    if missing:
        p.error(str(missing_packages_error("the export", missing)))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        model = load_model(get_preset(args.preset), args.checkpoint, device=args.device)
    except (ValueError, OSError, RuntimeError) as e:  # CheckpointError, a missing file, no such device
        p.error(str(e))
    weights = weights_fingerprint(model)  # of the loaded weights, before any dtype conversion
    model = model.to(DTYPES[args.dtype])
    out = export_model(model, args.out, weights=weights)
    print(json.dumps(read_manifest(out, verify=False)["files"], indent=1))


if __name__ == "__main__":
    main()
