"""The fast exact backend: fused π0.5 (`engine.fused` + Triton kernels) in bf16, replayed as CUDA graphs.

Static shapes: one observation per call, `num_cameras` image slots (a missing camera is masked, not
removed) and the prompt padded to a *bucket* (a multiple of `bucket_step` tokens), so the padding that
is computed is at most `bucket_step - 1` tokens rather than the full 200-token capacity. Every bucket's
graphs are captured in `warmup()`, before the first live call: each of the three stages (vision,
prefill, denoise) as a graph of its own (the benchmark times each one), and the *tail* (prefill +
denoise) as one more. A call is two replays, vision then the tail: its inputs are loaded in two steps
(`begin_load`, `finish_load`) so that the host packs the prompt and the call's layout while the GPU runs
vision, instead of the GPU waiting for the host at the start of every call. Inside the tail the denoise
runs on a stream of its own, and its first step follows the prefill layer by layer (`overlap_first_step`).

On Hopper and later the Triton kernels use programmatic dependent launch (`pdl`, see `triton_ops`):
each kernel prefetches its weights while the previous one finishes. `pdl=False` turns it off (the
benchmark measures both).

With `cache` (rMuscle shapes) the engine also captures the cached variants — prefill with the Context
Cache, denoise with the Action Cache — and a dense denoise that records Action Cache masks, all reading
and writing static buffers (the reference entries and `ref_slot`, `neurons`, `recorded_masks`). A
second set of buffers, the *rebuild lane*, reconstructs reference entries (vision + a recording prefill
on a library observation) on a low-priority CUDA stream with its own graph memory pool, in
`CacheShapes.rebuild_slices` graphs that live calls may run between. ρ = 1 selects the dense graphs
themselves: that is what makes ρ = 1 exact.

The reference entries are stacked (`ReferenceWindow`): the sliding window's (`CacheShapes.window`), then
`ctx_ref`, which `load_reference` copies a standalone entry into. The cached prefill reads the one that
`ref_slot` (on the device) names, in place: `load_window_entry` and the match stage only set the slot.
With `CacheShapes.match` the engine also captures a *match* graph (vision, then the most similar usable
entry picked on the GPU), so that a cached call (match, then the cached tail) needs no host round trip
between vision and prefill.

All tensors that cross a graph boundary live in buffers allocated here, outside the graphs' shared
memory pool, so graphs may be replayed in any order.

On a CPU device the same engine runs the PyTorch definitions in float32 without graphs (backend
"fused"): the CPU tests and the demo use it for rMuscle.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from rmuscle_ros.engine import ops as torch_ops
from rmuscle_ros.engine.fused import (
    KV_ALIGN,
    NEURON_SCHEDULES,
    ActionCache,
    CallLayout,
    ContextCache,
    ContextRef,
    FusedPi05,
    KVBuffers,
    PrefillState,
    call_layout_into,
    pack_prompt_into,
    rho_count,
    round_up,
    step_neuron_counts,
)
from rmuscle_ros.models.config import Pi05Config
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model

log = logging.getLogger(__name__)

STAGES = ("vision", "prefill", "denoise")
VARIANTS = {
    "vision": ("dense",),
    "prefill": ("dense", "cached"),
    "denoise": ("dense", "cached", "record"),
    # Prefill + denoise in one graph: a call is vision (or match), then this. Cached: with cache shapes;
    # record: the dense prefill and the recording denoise (a call of a dense episode).
    "tail": ("dense", "cached", "record"),
    # With CacheShapes.match: vision, then the best usable window entry picked and loaded on the GPU.
    "match": ("cached",),
}


def default_buckets(max_tokens: int, step: int) -> list[int]:
    """Prompt lengths a graph is captured for: step, 2·step, … up to max_tokens rounded up to 16."""
    top = round_up(max_tokens, 16)
    return sorted({min(b, top) for b in range(step, top + step, step)})


def bucket_for(buckets: Sequence[int], n: int) -> int | None:
    """The smallest of `buckets` (ascending) that holds a prompt of `n` tokens; None if none does."""
    return next((b for b in buckets if b >= n), None)


def _cublaslt_gelu_is_tanh(device: torch.device) -> bool:
    """Whether cuBLASLt's fused bias+GELU epilogue computes the tanh approximation SigLIP uses."""
    gen = torch.Generator(device=device).manual_seed(0)
    a, w, b = (torch.randn(s, device=device, generator=gen) for s in ((64, 128), (256, 128), (256,)))
    try:
        fused = torch._addmm_activation(b, a, w.t(), use_gelu=True)
    except RuntimeError:
        return False
    pre = torch.addmm(b, a, w.t())
    err_tanh = (fused - F.gelu(pre, approximate="tanh")).abs().max().item()
    err_erf = (fused - F.gelu(pre)).abs().max().item()
    return err_tanh < 1e-4 < err_erf


@dataclass(frozen=True)
class CacheShapes:
    """What fixes the cached graphs' shapes: keep fractions and the number of dense anchor steps."""

    rho_p: float = 0.4  # Context Cache: fraction of the filled slots' visual tokens recomputed per layer
    rho_n: float = 0.5  # Action Cache: fraction of expert neurons updated per step, on average
    anchors: int = 1  # dense denoising steps before the Action Cache takes over
    neuron_schedule: str = "uniform"  # how ρn spreads over the steps (`step_neuron_counts`)
    window: int = 0  # reference entries the engine holds, stacked (ReferenceWindow; 0: none)
    match: bool = False  # also capture the match and tail graphs (matching on the GPU; needs a window)
    # A rebuild in this many graphs, each a bounded wait for a live call queued behind it: vision, then
    # the prefill's layers in even groups (`rebuild_slices`); 1: one graph per entry.
    rebuild_slices: int = 1
    # How many image slots a cell fills (the policy's cameras, in whichever slots: camera_slots); 0: all the
    # model's. ρp counts the visual rows of these; rows of a slot not filled in a call (its present mask)
    # rank last (recomputed only past the rest).
    cameras: int = 0

    def __post_init__(self) -> None:
        for name in ("rho_p", "rho_n"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if self.anchors < 1:
            raise ValueError(f"anchors must be >= 1, got {self.anchors}")
        if self.neuron_schedule not in NEURON_SCHEDULES:
            raise ValueError(
                f"neuron_schedule must be one of {NEURON_SCHEDULES}, got {self.neuron_schedule!r}"
            )
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.match and not self.window:
            raise ValueError("matching on the GPU needs a window (window >= 1)")
        if self.rebuild_slices < 1:
            raise ValueError(f"rebuild_slices must be >= 1, got {self.rebuild_slices}")
        if isinstance(self.cameras, bool) or not isinstance(self.cameras, int) or self.cameras < 0:
            raise ValueError(f"cameras must be an int >= 0 (0: all the model's slots), got {self.cameras!r}")

    def keep_tokens(self, cfg: Pi05Config) -> int:
        """Visual rows the Context Cache recomputes per layer: ceil(ρp · the filled slots' rows); with all of
        those, every visual row (the dense prefill: ρp = 1 stays bit-for-bit dense with slots unfilled)."""
        if self.cameras > cfg.num_cameras:
            raise ValueError(f"cameras: the model has {cfg.num_cameras} image slots, got {self.cameras}")
        rows = (self.cameras or cfg.num_cameras) * cfg.vision.tokens_per_image
        keep = rho_count(self.rho_p, rows)
        return cfg.image_tokens if keep >= rows else keep

    def step_neurons(self, cfg: Pi05Config) -> tuple[int, ...]:
        """Expert neurons each denoising step updates (F: the step runs dense)."""
        return step_neuron_counts(
            self.rho_n, cfg.expert.mlp_dim, cfg.num_steps, self.anchors, self.neuron_schedule
        )

    def keep_neurons(self, cfg: Pi05Config) -> int:
        """The masks' width: the most neurons a step gathers (F when no step does)."""
        f = cfg.expert.mlp_dim
        return max((c for c in self.step_neurons(cfg) if 0 < c < f), default=f)

    def action_cache(self, cfg: Pi05Config) -> bool:
        """Whether any step runs with the Action Cache (keeps fewer than all neurons)."""
        return min(self.step_neurons(cfg)) < cfg.expert.mlp_dim


def rebuild_slices(slices: int, depth: int) -> list[tuple[bool, range]]:
    """A rebuild's parts, in order: (runs vision, prefill layers). One slice: vision and every layer. More:
    vision alone, then the layers in `slices − 1` groups of near-equal size (fewer if there are fewer
    layers)."""
    if slices == 1:
        return [(True, range(depth))]
    groups = min(slices - 1, depth)
    bounds = [round(depth * k / groups) for k in range(groups + 1)]
    return [(True, range(0))] + [(False, range(a, b)) for a, b in itertools.pairwise(bounds)]


@dataclass
class ReferenceWindow:
    """The sliding window's entries, stacked so that a kernel can pick one by an index on the device.

    Entry i: the Context Cache reference (`ref(i)`), the Action Cache masks `neurons[i]`, and the unit
    retrieval descriptor `keys[i]` it is matched by; `usable[i]` says whether the next call may pick it.
    """

    ffn_in: Tensor  # (S, depth − 1, C·256, W)
    ffn_out: Tensor
    neurons: Tensor  # (S, steps, expert depth, kept neurons) int32
    keys: Tensor  # (S, C·W) float32, unit rows
    usable: Tensor  # (S,) bool

    @staticmethod
    def allocate(
        cfg: Pi05Config,
        size: int,
        mask_shape: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        context: bool = True,
    ) -> ReferenceWindow:
        """`context` False (the Context Cache off, ρp = 1): entries hold no FFN states, only masks and keys."""
        ref = (size, cfg.vlm.depth - 1 if context else 0, cfg.image_tokens, cfg.vlm.width)
        return ReferenceWindow(
            torch.zeros(ref, device=device, dtype=dtype),
            torch.zeros(ref, device=device, dtype=dtype),
            torch.zeros((size, *mask_shape), device=device, dtype=torch.int32),
            torch.zeros(size, cfg.num_cameras * cfg.vlm.width, device=device),
            torch.zeros(size, device=device, dtype=torch.bool),
        )

    def __len__(self) -> int:
        return self.keys.shape[0]

    def ref(self, i: int) -> ContextRef:
        return ContextRef(self.ffn_in[i], self.ffn_out[i])

    def head(self, size: int) -> ReferenceWindow:
        """The first `size` entries (views)."""
        return ReferenceWindow(
            *(t[:size] for t in (self.ffn_in, self.ffn_out, self.neurons, self.keys, self.usable))
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ffn_in, self.ffn_out, self.neurons, self.keys))


class _Staging:
    """Small tensors that travel to the device together: views into one host buffer and into its device
    twin, so one copy moves them all instead of one host call per tensor.

    The host buffer starts pageable: the copy stages it at once (the buffer is free again when `upload`
    returns) and never waits for the stream — right for the rebuild lane, whose calls queue up behind
    each other's graphs. `pin()` moves it into pinned memory: the upload is then a DMA in stream order
    that the host does not wait for, and the next write waits for the previous upload (`writable`)."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        self._offsets, size = {}, 0
        for name, (shape, dtype) in specs.items():
            self._offsets[name] = size = round_up(size, 8)  # every view starts 8-byte aligned
            size += math.prod(shape) * dtype.itemsize
        self._specs = specs
        self.host = torch.zeros(size, dtype=torch.uint8)
        self.device = torch.zeros(size, dtype=torch.uint8, device=device)
        self.on_device = self._views(self.device)
        self._host_views()
        # Pinned only: the event of the last upload, which the next write waits for (allocated by `pin`,
        # recorded again by each upload), and whether one is in flight.
        self._uploaded: torch.cuda.Event | None = None
        self._upload_pending = False

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, (shape, dtype) in self._specs.items():
            n = math.prod(shape) * dtype.itemsize
            out[name] = buf[self._offsets[name] : self._offsets[name] + n].view(dtype).view(shape)
        return out

    def _host_views(self) -> None:
        self.on_host = self._views(self.host)
        self._arrays = {name: t.numpy() for name, t in self.on_host.items()}  # NumPy views, same memory

    def pin(self) -> None:
        """Move the host buffer into pinned memory (CUDA devices only)."""
        self.host = self.host.pin_memory()
        self._host_views()
        self._uploaded = torch.cuda.Event()

    def writable(self) -> dict[str, np.ndarray]:
        """The host buffer as NumPy views, once the previous upload no longer reads it."""
        if self._upload_pending:
            assert self._uploaded is not None  # pinned
            self._uploaded.synchronize()
            self._upload_pending = False
        return self._arrays

    def upload(self) -> None:
        self.device.copy_(self.host, non_blocking=True)
        if self._uploaded is not None:  # pinned
            self._uploaded.record()
            self._upload_pending = True


@dataclass(frozen=True)
class _Pending:
    """An observation between `begin_load` and `finish_load`: what the host still has to pack."""

    bucket: int
    token_row: np.ndarray
    mask_row: np.ndarray
    image_mask: np.ndarray
    noise: torch.Tensor | None


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a NumPy array: a view for a host tensor, a (synchronising) copy from a GPU."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


class _Lane:
    """Static buffers for one stream of calls (the live lane, or the rebuild lane)."""

    def __init__(self, cfg: Pi05Config, buckets: list[int], device: torch.device, dtype: torch.dtype) -> None:
        c, per_image = cfg.num_cameras, cfg.vision.tokens_per_image
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(shape, device=device, dtype=dtype)  # noqa: E731
        self.images = zeros(c, 3, cfg.vision.image_size, cfg.vision.image_size)
        self.actions = zeros(cfg.horizon, cfg.action_dim)
        self.visual = zeros(c * per_image, cfg.vlm.width, dtype=dtype)
        self.descriptor = zeros(c, cfg.vlm.width)  # retrieval descriptor: mean visual token per camera
        # 1 for each camera the call has, 0 for a missing one: loaded with the images (the vision and match
        # stages run before the rest of the call's inputs arrive), so the descriptor leaves out missing ones.
        # The device's only copy of the call's camera flags: the kernels see missing cameras through the
        # layout's key bias, which the host builds from its own copy.
        self.present = zeros(c)
        # The per-call inputs but the images, written on the host by the engine's _load: the noise, and per
        # prompt bucket the packed prompt and the call's layout (where its tokens sit).
        specs = {"noise": ((cfg.horizon, cfg.action_dim), torch.float32)}
        for b in buckets:
            lp_h = c * per_image + b + cfg.horizon
            specs |= {f"tokens{b}": ((b,), torch.long), f"token_mask{b}": ((b,), torch.bool),
                      f"rope_rows{b}": ((lp_h,), torch.long), f"key_bias{b}": ((round_up(lp_h, KV_ALIGN),), torch.float32)}  # fmt: skip
        self.staging = _Staging(specs, device)
        v = self.staging.on_device
        self.noise = v["noise"]
        self.tokens = {b: v[f"tokens{b}"] for b in buckets}
        self.token_mask = {b: v[f"token_mask{b}"] for b in buckets}
        self.layout = {b: CallLayout(v[f"rope_rows{b}"], v[f"key_bias{b}"]) for b in buckets}
        capacity = round_up(c * per_image + max(buckets) + cfg.horizon, KV_ALIGN)
        self.kv = KVBuffers.allocate(cfg, capacity, device, dtype)
        self.pending: _Pending | None = None  # between begin_load and finish_load


class GraphEngine:
    name = "graph"

    def __init__(
        self,
        model: Pi05Model,
        *,
        device: torch.device,
        buckets: list[int] | None = None,
        bucket_step: int = 32,
        use_cuda_graphs: bool = True,
        pdl: bool | None = None,
        cache: CacheShapes | None = None,
        overlap_first_step: bool | None = None,
        kernel_cache_dir: str | None = None,
    ) -> None:
        """kernel_cache_dir (GPU): where Triton keeps the compiled kernels (`triton_ops.keep_kernels_in`);
        None leaves Triton's own choice (TRITON_CACHE_DIR, else ~/.triton/cache)."""
        cfg = self.cfg = model.cfg
        self.device = device = torch.device(device)
        cuda = device.type == "cuda"
        self.kernel_cache_dir: str | None = None  # where Triton keeps this engine's compiled kernels, if set
        ops: ModuleType
        if cuda:
            from rmuscle_ros.engine import triton_ops  # CUDA-only import, deferred on purpose

            ops = triton_ops
            major, minor = torch.cuda.get_device_capability(device)
            problem = triton_ops.assembler_problem(10 * major + minor)
            if problem is not None:  # said now, not as a ptxas error in the warm-up's first kernel
                raise RuntimeError(f"the graph engine cannot compile its kernels for {device}: {problem}")
            if kernel_cache_dir is not None:
                self.kernel_cache_dir = triton_ops.keep_kernels_in(kernel_cache_dir)
            self.pdl = triton_ops.pdl_supported(device) if pdl is None else pdl
            if self.pdl and not triton_ops.pdl_supported(device):
                raise ValueError(
                    f"programmatic dependent launch needs compute capability 9.0+, {device} has less"
                )
        else:
            ops, self.pdl, self.name = torch_ops, False, "fused"
        self._triton_ops = ops if cuda else None
        # CUDA stream priorities: a lower number is a higher priority (e.g. 0 lowest, -5 highest)
        lowest, highest = torch.cuda.Stream.priority_range() if cuda else (0, 0)
        self.use_cuda_graphs = use_cuda_graphs and cuda
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.fused = FusedPi05(model, device=device, dtype=self.dtype, ops=ops)
        self.fused.gelu_in_matmul = cuda and _cublaslt_gelu_is_tanh(device)
        self.buckets = sorted(buckets) if buckets else default_buckets(cfg.max_token_len, bucket_step)
        if any(b % 16 for b in self.buckets):
            raise ValueError(f"prompt buckets must be multiples of 16, got {self.buckets}")

        self.live = _Lane(cfg, self.buckets, device, self.dtype)
        # Names of the live buffers kept as attributes: the benchmark and tests read them directly.
        self.images, self.noise = self.live.images, self.live.noise
        self.actions, self.visual, self.kv = self.live.actions, self.live.visual, self.live.kv
        self.tokens, self.token_mask, self.layout = self.live.tokens, self.live.token_mask, self.live.layout

        self.cache = cache
        self.rebuild: _Lane | None = None
        self.window: ReferenceWindow | None = None
        self.usable_writes = 0  # how many times `set_usable` has written the window's usable flags
        self.live_stream = self.rebuild_stream = self.side_stream = None  # with a cache on a GPU (below)
        self.context_cache = False  # whether the cached prefill reads reference entries (ρp < 1)
        if cache is not None:
            self.cache_bytes = self.fused.prepare_action_cache()
            self.keep_tokens, self.keep_neurons = cache.keep_tokens(cfg), cache.keep_neurons(cfg)
            self.step_neurons = cache.step_neurons(cfg)
            self.action_cache = cache.action_cache(cfg)
            # At ρp = 1 the cached prefill is the dense one and reads no reference: the entries hold no FFN
            # states (102 MB each at pi05) and a window entry needs no rebuild, only its masks and retrieval
            # key, which the library has. The Action Cache alone then costs no GPU work between calls.
            self.context_cache = self.keep_tokens < cfg.image_tokens
            mask_shape = (cfg.num_steps, cfg.expert.depth, self.keep_neurons)
            # The entries the cached prefill reads, stacked: the window's (the first `cache.window`), then
            # one more, `ctx_ref`, that `load_reference` copies a standalone entry into. `ref_slot`, on the
            # device, says which one a call reads: picking a window entry copies nothing.
            refs = ReferenceWindow.allocate(
                cfg, cache.window + 1, mask_shape, device, self.dtype, context=self.context_cache
            )
            self._ref_stack = ContextRef(refs.ffn_in, refs.ffn_out)
            self.ctx_ref = refs.ref(cache.window)
            self.ref_slot = torch.full((1,), cache.window, device=device, dtype=torch.int64)
            self.neurons = torch.zeros(mask_shape, device=device, dtype=torch.int32)  # cached denoise
            self.recorded_masks = torch.zeros(mask_shape, device=device, dtype=torch.int32)  # record
            # The rebuild lane: vision and a recording prefill of a library observation, in parts
            # (`rebuild_parts`; none without a Context Cache, and no lane).
            self.rebuild_parts: list[tuple[bool, range]] = []
            if self.context_cache:
                self.rebuild = _Lane(cfg, self.buckets, device, self.dtype)
                self.rebuilt_ref = ContextRef.allocate(cfg, device, self.dtype)  # output of the rebuild lane
                self.rebuild_parts = rebuild_slices(cache.rebuild_slices, cfg.vlm.depth)
                # The residual stream between a sliced rebuild's graphs, outside every graph's memory pool.
                rows = cfg.image_tokens + max(self.buckets)
                self.rebuild_state = PrefillState.allocate(cfg, rows, device, self.dtype)
            self._rebuilding: tuple[int, int, ContextRef] | None = None  # (bucket, next part, out)
            # Rebuilds on the lowest-priority stream; live calls should run on `live_stream` (the highest),
            # so that the GPU schedules a live call's kernels first whenever both have work queued. (That
            # orders what is launched eagerly on them; the graphs' kernels take the priority of the stream
            # they were captured on: `_capture_streams`, below.)
            self.rebuild_stream = torch.cuda.Stream(device, priority=lowest) if cuda else None
            self.live_stream = torch.cuda.Stream(device, priority=highest) if cuda else None
            # Work of a live call that its result does not wait for (retrieval's similarities, when the GPU
            # picks the entry): beside the live stream, at its priority, so it stays off the call's path.
            self.side_stream = torch.cuda.Stream(device, priority=highest) if cuda else None
            self.cache_bytes += 2 * self.ctx_ref.nbytes + 2 * self.neurons.numel() * 4
            if cache.window:
                self.window = refs.head(cache.window)
                self.match_out = torch.zeros(2, device=device)  # [entry index, its similarity]
                # Pinned on a GPU: read back without a sync (written by the match graph, or by the runtime)
                self.match_host = torch.zeros(2, pin_memory=cuda)
                self.descriptor_host = torch.zeros(cfg.num_cameras, cfg.vlm.width, pin_memory=cuda)
                self.cache_bytes += self.window.nbytes
        self._graphs: dict[tuple[str, int, str], torch.cuda.CUDAGraph] = {}
        self._pools: dict[str, tuple[int, int] | None] = {"live": None, "rebuild": None}
        # The tail graph's denoising loop runs on a stream of its own, from the start of the graph: its
        # first step's layer i waits only for the prefill's layer i K/V (one event per layer), so that
        # step runs alongside the prefill. One priority step below the prefill, so that its small kernels
        # take only the SMs the prefill leaves idle and do not delay the prefill's GEMMs. (PyTorch
        # instantiates graphs with cudaGraphInstantiateFlagUseNodePriority: a kernel keeps the priority of
        # the stream it was captured on.) On the H200 this saved 0.40 ms per dense tail and 0.30 per cached
        # one, the first step's kernels launched one by one (`FusedPi05.first_step_pdl`); with the denoise
        # above the prefill, 0.19–0.21 (bench/results/probe_overlap_first_step_h200_*).
        # The actions are the same bit for bit: the same kernels, the same inputs.
        overlap_first_step = self.use_cuda_graphs if overlap_first_step is None else overlap_first_step
        if overlap_first_step and not self.use_cuda_graphs:
            raise ValueError("overlap_first_step needs the CUDA graph engine (a CUDA device, cuda graphs on)")
        self.overlap_first_step = overlap_first_step
        self._denoise_stream: torch.cuda.Stream | None = None
        self._kv_ready: list[torch.cuda.Event] = []
        below_highest = highest + 1 if highest < lowest else highest
        if overlap_first_step:
            self._denoise_stream = torch.cuda.Stream(device, priority=below_highest)
            self._kv_ready = [torch.cuda.Event() for _ in range(cfg.vlm.depth)]
        # For the same reason, the stream a graph is replayed on does not set its kernels' priority: each
        # pool's graphs are captured on a stream at the priority their kernels should have. Live calls at
        # the highest (the tail's denoise one step below, above), rebuilds at the lowest. Before, every
        # graph was captured at the default priority, the lowest: a live call's kernels did not take
        # precedence over a rebuild's running beside them (`concurrent_rebuilds`).
        self._capture_streams: dict[str, torch.cuda.Stream] = {}
        if self.use_cuda_graphs:
            self._capture_streams = {
                "live": torch.cuda.Stream(device, priority=highest),
                "rebuild": torch.cuda.Stream(device, priority=lowest),
            }

    # ── the stages, written against a lane's static buffers ──────────────────────────────────────────────

    def _run_vision(self, lane: _Lane) -> None:
        self.fused.encode_images(lane.images, lane.visual)
        if self.cache is None:
            return  # no retrieval: no descriptor
        c = self.cfg.num_cameras
        # one reduction kernel, accumulating in float32 (no float32 copy of the visual tokens first)
        torch.mean(
            lane.visual.view(c, -1, lane.visual.shape[-1]), 1, dtype=torch.float32, out=lane.descriptor
        )
        # A missing camera's row is 0: its black filler image is the same in every call, and counted it added
        # the same agreement to every similarity (found in review: a one-camera cell's scene cosine c gave
        # (c + 3.74) / 4.74, so the 0.8 threshold passed any c >= 0.05).
        lane.descriptor.mul_(lane.present[:, None])

    def _run_prefill(self, lane: _Lane, bucket: int, variant: str, **kw: Any) -> None:
        if variant == "cached" and self.keep_tokens < self.cfg.image_tokens:
            kw["context"] = ContextCache(self._ref_stack, self.keep_tokens, slot=self.ref_slot)
        self.fused.prefill(lane.visual, lane.tokens[bucket], lane.layout[bucket], lane.kv, **kw)

    def _run_denoise(self, lane: _Lane, bucket: int, variant: str, **kw: Any) -> None:
        if variant == "cached" and self.action_cache:
            kw["action"] = ActionCache(self.neurons, self.cache.anchors, self.step_neurons)
        elif variant == "record":
            kw["record_masks"], kw["record_counts"] = self.recorded_masks, self.step_neurons
            kw["record_anchors"] = self.cache.anchors
        self.fused.denoise(lane.noise, lane.layout[bucket], lane.kv, lane.actions, **kw)

    def _run_tail(self, lane: _Lane, bucket: int, variant: str) -> None:
        """Prefill then denoise; with `overlap_first_step`, the denoise on its own stream from the start,
        its first step following the prefill layer by layer (see __init__)."""
        prefill_variant = "dense" if variant == "record" else variant
        side = self._denoise_stream
        if side is None:
            self._run_prefill(lane, bucket, prefill_variant)
            self._run_denoise(lane, bucket, variant)
            return
        main = torch.cuda.current_stream(self.device)
        side.wait_stream(main)  # the call's inputs, loaded before the graph
        self._run_prefill(lane, bucket, prefill_variant, kv_ready=self._kv_ready)
        with torch.cuda.stream(side):
            self._run_denoise(lane, bucket, variant, kv_ready=self._kv_ready)
        main.wait_stream(side)

    def _run_match(self) -> None:
        """Pick the usable window entry most similar to this call's descriptor and load it into the cached
        graphs' inputs, all on the device; the pick and the descriptor are copied to pinned host memory."""
        w = self.window
        # the cached prefill reads the picked entry where it lies, through ref_slot
        self.fused.ops.window_match(self.live.descriptor, w.keys, w.usable, self.ref_slot, self.match_out)
        if self.action_cache:
            torch.index_select(w.neurons, 0, self.ref_slot, out=self.neurons[None])
        self.match_host.copy_(self.match_out, non_blocking=True)
        self.descriptor_host.copy_(self.live.descriptor, non_blocking=True)

    def _run_rebuild(self, bucket: int, part: int) -> None:
        vision, layers = self.rebuild_parts[part]
        lane = self.rebuild
        if vision:
            self._run_vision(lane)
        if layers:
            self.fused.prefill(lane.visual, lane.tokens[bucket], lane.layout[bucket], lane.kv,
                               record=self.rebuilt_ref, layers=layers, state=self.rebuild_state)  # fmt: skip

    def _stage_fn(self, stage: str, bucket: int, variant: str = "dense") -> Callable[[], None]:
        if stage == "vision":
            runner = lambda: self._run_vision(self.live)  # noqa: E731
        elif stage == "prefill":
            runner = lambda: self._run_prefill(self.live, bucket, variant)  # noqa: E731
        elif stage == "denoise":
            runner = lambda: self._run_denoise(self.live, bucket, variant)  # noqa: E731
        elif stage == "rebuild":  # variant "slice<i>": the rebuild's part i
            runner = lambda: self._run_rebuild(bucket, int(variant.removeprefix("slice")))  # noqa: E731
        elif stage == "match":

            def runner() -> None:
                self._run_vision(self.live)
                self._run_match()
        elif stage == "tail":

            def runner() -> None:
                self._run_tail(self.live, bucket, variant)
        else:
            raise ValueError(f"unknown stage {stage!r}")

        # The rebuild lane's recording prefill launches kernels serially. It copies activations out with
        # memory-copy nodes right after kernels that let their dependents launch early, and no GPU test has
        # yet compared it with PDL against without. (The all-zero entry first seen on the H200 and blamed on
        # this was a stream race, fixed in `rebuild_entry`.) It is off the latency path. The recording
        # denoise runs in every call of a dense episode, so it takes PDL like the dense one: it writes its
        # scores with kernels, and gives the same masks and actions as serial launches (a GPU test).
        pdl = self.pdl and stage != "rebuild"

        def run() -> None:
            if self._triton_ops is None:
                return runner()
            with self._triton_ops.programmatic_launch(pdl):
                runner()

        return run

    def _capture(self, fn: Callable[[], None], pool: str = "live") -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad():
            fn()  # compile Triton kernels, create cuBLAS handles, settle the allocator
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        stream = self._capture_streams.get(pool)  # its kernels' priority (see __init__)
        with torch.cuda.graph(graph, pool=self._pools[pool], stream=stream), torch.no_grad():
            fn()
        self._pools[pool] = graph.pool()
        return graph

    def _graph_keys(self) -> list[tuple[str, int, str]]:
        keys = [("vision", 0, "dense")]
        if self.cache is not None and self.cache.match:
            keys += [("match", 0, "cached")]
        for b in self.buckets:
            keys += [("prefill", b, "dense"), ("denoise", b, "dense"), ("tail", b, "dense")]
            if self.cache is not None:
                keys += [("prefill", b, "cached"), ("denoise", b, "cached"), ("denoise", b, "record")]
                keys += [("tail", b, "cached"), ("tail", b, "record")]
                keys += [("rebuild", b, f"slice{i}") for i in range(len(self.rebuild_parts))]
        return keys

    # ── Engine API ───────────────────────────────────────────────────────────────────────────────────────

    def warmup(self) -> dict[str, float]:
        """Capture every stage for every bucket (the only place graphs are built). Returns seconds."""
        timings: dict[str, float] = {}
        if not self.use_cuda_graphs:
            return timings
        captured = []
        for key in self._graph_keys():
            if key not in self._graphs:
                start = time.perf_counter()
                pool = "rebuild" if key[0] == "rebuild" else "live"
                self._graphs[key] = self._capture(self._stage_fn(*key), pool)
                captured.append(key)
                timings[f"capture_{key[0]}_{key[1]}_{key[2]}"] = time.perf_counter() - start
        # A graph's first replay takes longer than the next ones: on the H200 the first cached call's tail
        # took 12.1 ms against 9.5 (bench/results/dev_first_call_h200_355b3eb). So each runs once here, on
        # the stream that will replay it (its stage ran eagerly at capture, so its inputs are valid).
        for key in captured:
            stream = self.rebuild_stream if key[0] == "rebuild" else self.live_stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._graphs[key].replay()
        torch.cuda.synchronize(self.device)
        log.info("graph engine: captured %d graphs in %.2f s", len(self._graphs), sum(timings.values()))
        return timings

    def _begin_load(
        self, lane: _Lane, inputs: ModelInputs, noise: torch.Tensor | None, usable: list[bool] | None = None
    ) -> int:
        """Validate one observation, queue its images' copy (and `usable`'s), and keep the rest for
        `_finish_load`. Returns the prompt bucket. Nothing is launched when the input is bad.

        On the call's critical path: the GPU idles until vision is launched after this returns. Its host
        time is mostly the host's state (a thread that has just waited for the GPU runs every step several
        times slower); queuing the images' copy before reading the prompt measured no different on the
        H200 (interleaved, whole call 13.88 vs 13.89 ms), so the prompt is checked first."""
        batches = {name: t.shape[0] for name, t in vars(inputs).items()} | (
            {"noise": noise.shape[0]} if noise is not None else {}
        )
        if set(batches.values()) != {1}:  # found in review: extra image rows were dropped without a word
            raise ValueError(f"the graph engine runs one observation per call, got batches {batches}")
        if lane is self.live and noise is None:  # it would reuse the previous call's noise (found in review)
            raise ValueError("noise: a live call needs its noise, (1, horizon, action_dim)")
        if inputs.tokens.shape != inputs.token_mask.shape:
            raise ValueError(
                f"tokens {tuple(inputs.tokens.shape)} and token_mask {tuple(inputs.token_mask.shape)} differ"
            )
        if inputs.tokens.dtype.is_floating_point or inputs.tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be integer ids, got {inputs.tokens.dtype}")
        if noise is not None and noise.shape[1:] != lane.noise.shape:
            raise ValueError(
                f"noise must be (1, {', '.join(map(str, lane.noise.shape))}), got {tuple(noise.shape)}"
            )
        if inputs.image_masks.shape[1:] != lane.present.shape:
            raise ValueError(
                f"image_masks must be (1, {lane.present.shape[0]}), got {tuple(inputs.image_masks.shape)}"
            )
        if inputs.images.shape[1:] != lane.images.shape:
            raise ValueError(
                f"images must be (1, {', '.join(map(str, lane.images.shape))}), got {tuple(inputs.images.shape)}"
            )
        if usable is not None:
            self._check_usable(usable)
        # The prompt decides the bucket, so it is read now (a prompt on the GPU is read back here, before
        # this call launches anything: bench_pi05's graph-device-inputs).
        token_row, mask_row = _host_array(inputs.tokens[0]), _host_array(inputs.token_mask[0])
        valid = token_row[mask_row.astype(bool)]
        if valid.size and not (valid.min() >= 0 and valid.max() < self.cfg.vocab_size):
            # on a GPU an id past the embedding is a device-side assert, which ends the process's CUDA
            raise ValueError(
                f"tokens: ids must be in 0..{self.cfg.vocab_size - 1}, got {valid.min()}..{valid.max()}"
            )
        bucket = self._bucket(mask_row)
        lane.images.copy_(inputs.images[0], non_blocking=True)  # from pinned memory: a DMA, no host wait
        image_mask = _host_array(inputs.image_masks[0])
        if self.cache is not None:  # the descriptor's cameras, beside the images (from pageable memory: a
            # few bytes the driver stages at once, so the array may go as soon as this returns)
            lane.present.copy_(torch.from_numpy(image_mask.astype(np.float32)), non_blocking=True)
        if usable is not None:
            self.set_usable(usable)
        lane.pending = _Pending(bucket, token_row, mask_row, image_mask, noise)
        return bucket

    def _bucket(self, mask_row: np.ndarray) -> int:
        """The smallest prompt bucket holding the prompt's valid tokens; ValueError if none does."""
        n = int(np.count_nonzero(mask_row))
        bucket = bucket_for(self.buckets, n)
        # max_token_len too: the RoPE tables hold that many prompt rows, and the top bucket (rounded up
        # to 16) may hold more (201-208 of 200 ran past them; found in review)
        if n > self.cfg.max_token_len:
            raise ValueError(f"prompt has {n} tokens, more than the model's {self.cfg.max_token_len}")
        if bucket is None:
            raise ValueError(f"prompt has {n} tokens, more than the largest bucket {self.buckets[-1]}")
        return bucket

    def _finish_load(self, lane: _Lane) -> None:
        """Pack the prompt, the call's layout and the noise begun by `_begin_load` into the lane's staging
        buffer on the host, and upload it (one copy, queued after whatever was launched in between)."""
        p = lane.pending
        if p is None:
            raise RuntimeError("finish_load without begin_load: no observation is being loaded")
        lane.pending = None
        host, b = lane.staging.writable(), p.bucket
        pack_prompt_into(p.token_row, p.mask_row, host[f"tokens{b}"], host[f"token_mask{b}"])
        pad_mask = np.concatenate(
            [np.repeat(p.image_mask.astype(bool), self.cfg.vision.tokens_per_image), host[f"token_mask{b}"]]
        )
        call_layout_into(pad_mask, self.cfg.horizon, host[f"rope_rows{b}"], host[f"key_bias{b}"])
        noise_on_host = p.noise is not None and not p.noise.is_cuda
        if noise_on_host:
            lane.staging.on_host["noise"].copy_(p.noise[0])
        lane.staging.upload()
        if p.noise is not None and not noise_on_host:  # after the upload, which writes the lane's noise too
            lane.noise.copy_(p.noise[0], non_blocking=True)

    def set_usable(self, usable: list[bool]) -> None:
        """Which window entries the match stage may pick, from the next match on: one copy, queued on the
        current stream (from pageable memory, so the flags may change again at once)."""
        self._check_usable(usable)
        assert self.window is not None  # checked
        self.window.usable.copy_(torch.tensor(usable, dtype=torch.bool), non_blocking=True)
        # lets a caller that keeps the flags in place see that someone else wrote them
        self.usable_writes += 1

    def _check_usable(self, usable: list[bool]) -> None:
        if self.window is None or len(usable) != len(self.window):
            raise ValueError(
                f"usable must flag each of the window's entries, got {len(usable)} for "
                f"{0 if self.window is None else len(self.window)}"
            )

    def begin_load(self, inputs: ModelInputs, noise: torch.Tensor, usable: list[bool] | None = None) -> int:
        """First half of loading one observation into the live buffers: validates it (a bad one raises
        ValueError and changes nothing), queues the images' copy — all the vision and match stages read —
        and returns the prompt bucket. Launch vision (or match), then call `finish_load`: the host then
        packs the prompt while the GPU works. `usable`: which window entries the match stage may pick."""
        return self._begin_load(self.live, inputs, noise, usable)

    def finish_load(self) -> None:
        """Second half of loading (see `begin_load`): the prompt, layout and noise, read by the prefill
        and denoise stages."""
        self._finish_load(self.live)

    def load_inputs(self, inputs: ModelInputs, noise: torch.Tensor, usable: list[bool] | None = None) -> int:
        """Copy one observation into the live buffers (`begin_load` + `finish_load`); returns the prompt
        bucket it uses."""
        bucket = self.begin_load(inputs, noise, usable)
        self.finish_load()
        return bucket

    def run_stage(self, stage: str, bucket: int, use_graph: bool = True, variant: str = "dense") -> None:
        """Run one stage on the loaded inputs: a graph replay once captured, else the fused ops directly.
        (Rebuilds have their own lane and API: `begin_rebuild`, `rebuild_step`.)"""
        if variant not in VARIANTS.get(stage, ()):
            raise ValueError(f"stage {stage!r} has no variant {variant!r}")
        if variant != "dense" and self.cache is None:
            raise RuntimeError(f"the {variant} {stage} needs an engine built with cache shapes")
        if stage == "match" and self.window is None:
            raise RuntimeError(f"the {stage} stage needs an engine built with a window (CacheShapes.window)")
        key = (stage, 0 if stage in ("vision", "match") else bucket, variant)
        graph = self._graphs.get(key) if use_graph else None
        if graph is not None:
            graph.replay()
        else:
            with torch.no_grad():
                self._stage_fn(stage, bucket, variant)()

    def descriptor(self) -> torch.Tensor:
        """The retrieval descriptor of the loaded observation (after the vision stage): (cameras, W) f32.
        Computed by engines built with cache shapes only."""
        if self.cache is None:
            raise RuntimeError("the retrieval descriptor is computed by engines built with cache shapes only")
        return self.live.descriptor

    def load_reference(self, ref: ContextRef, neurons: torch.Tensor) -> None:
        """Copy a reference entry and its Action Cache masks into the cached graphs' input buffers (an entry
        that is not in the window; `load_window_entry` reads a window entry in place)."""
        if self.cache is None:
            raise RuntimeError("load_reference needs an engine built with cache shapes")
        # At ρ = 1 the dense graph runs and reads neither buffer: skip the copy (ctx_ref is 102 MB).
        if self.keep_tokens < self.cfg.image_tokens:
            self.ctx_ref.copy_(ref)
            self.ref_slot.fill_(self.cache.window)
        if self.action_cache:
            self.neurons.copy_(neurons, non_blocking=True)

    def load_window_entry(self, index: int) -> None:
        """Make window entry `index` the cached graphs' reference: the prefill reads it where it lies (no
        copy of its 102 MB at full size); its Action Cache masks are copied."""
        if self.window is None:
            raise RuntimeError("load_window_entry needs an engine built with a window (CacheShapes.window)")
        if not 0 <= index < len(self.window):
            raise IndexError(f"window entry {index} of {len(self.window)}")
        if self.keep_tokens < self.cfg.image_tokens:
            self.ref_slot.fill_(index)
        if self.action_cache:
            self.neurons.copy_(self.window.neurons[index])

    @torch.no_grad()
    def begin_rebuild(self, inputs: ModelInputs, out: ContextRef) -> int:
        """Start reconstructing the reference entry of a library observation into `out` (a window slot):
        its inputs go into the rebuild lane, on the low-priority stream, and nothing runs yet. Then
        `rebuild_step` runs the rebuild's parts one by one; live calls may run between them. Returns the
        number of parts: 0 without a Context Cache (ρp = 1), whose entries hold nothing to rebuild (the
        next `rebuild_step` returns True at once). A rebuild still in progress is dropped."""
        if self.cache is None:
            raise RuntimeError("rebuilds need an engine built with cache shapes")
        self._rebuilding = None
        if self.rebuild is None:  # ρp = 1: no FFN states to reconstruct; `out` is left as it is
            self._rebuilding = (0, 0, out)
            return 0
        stream = self.rebuild_stream
        if stream is not None:  # ordered after the caller's earlier work (e.g. the allocation of `out`)
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            bucket = self._begin_load(self.rebuild, inputs, None)
            self._finish_load(self.rebuild)
        self._rebuilding = (bucket, 0, out)
        return len(self.rebuild_parts)

    @torch.no_grad()
    def rebuild_step(self, use_graphs: bool = True) -> bool:
        """Queue the next part of the rebuild in progress (see `begin_rebuild`) on the low-priority stream,
        without waiting for it. Returns True once the last part, and the entry's copy into its slot, are
        queued (`rebuild_stream.synchronize()` waits)."""
        if self._rebuilding is None:
            raise RuntimeError("rebuild_step without begin_rebuild: no rebuild is in progress")
        bucket, part, out = self._rebuilding
        if not self.rebuild_parts:  # nothing to reconstruct (begin_rebuild): done at once
            self._rebuilding = None
            return True
        stream = self.rebuild_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            graph = self._graphs.get(("rebuild", bucket, f"slice{part}")) if use_graphs else None
            if graph is not None:
                graph.replay()
            else:
                self._stage_fn("rebuild", bucket, f"slice{part}")()
            done = part + 1 == len(self.rebuild_parts)
            if done:
                out.copy_(self.rebuilt_ref)
        self._rebuilding = None if done else (bucket, part + 1, out)
        return done

    def abandon_rebuild(self) -> None:
        """Drop the rebuild in progress: its parts update the lane's state in place, so after one that
        raised partway the next `begin_rebuild` must start the entry over (found in review: re-running
        the failed part applied a layer's update twice, and the entry came out wrong yet usable)."""
        self._rebuilding = None

    def rebuild_entry(self, inputs: ModelInputs, out: ContextRef, use_graphs: bool = True) -> None:
        """Reconstruct the reference entry of a library observation into `out` (a window slot): vision and
        a recording prefill on the rebuild lane, every part queued at once on the low-priority stream;
        returns without waiting (`rebuild_stream.synchronize()` waits)."""
        self.begin_rebuild(inputs, out)
        while not self.rebuild_step(use_graphs):
            pass

    @torch.no_grad()
    def sample_actions(
        self, inputs: ModelInputs, noise: torch.Tensor, use_graphs: bool = True
    ) -> torch.Tensor:
        """One observation (batch 1) -> actions (1, horizon, action_dim): vision, then the tail, with the
        host's share of loading the inputs done while vision runs."""
        bucket = self.begin_load(inputs, noise)
        self.run_stage("vision", bucket, use_graphs)
        self.finish_load()
        self.run_stage("tail", bucket, use_graphs)
        return self.actions.clone()[None]
