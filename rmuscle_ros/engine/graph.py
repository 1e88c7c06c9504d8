"""The fast exact backend: fused π0.5 (`engine.fused` + Triton kernels) in bf16, replayed as CUDA graphs.

Static shapes: one observation per call, `num_cameras` image slots (a missing camera is masked, not
removed) and the prompt padded to a *bucket* (a multiple of `bucket_step` tokens), so the padding that
is computed is at most `bucket_step - 1` tokens rather than the full 200-token capacity. Every bucket's
graphs are captured in `warmup()`, before the first live call; the three stages (vision, prefill,
denoise) are separate graphs replayed back to back, so the benchmark can time each one.

On Hopper and later the Triton kernels use programmatic dependent launch (`pdl`, see `triton_ops`):
each kernel prefetches its weights while the previous one finishes. `pdl=False` turns it off (the
benchmark measures both).

All tensors that cross a graph boundary live in buffers allocated here, outside the graphs' shared
memory pool, so graphs may be replayed in any order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rmuscle_ros.engine.fused import KV_ALIGN, FusedPi05, KVBuffers, pack_prompt, round_up
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model

log = logging.getLogger(__name__)

STAGES = ("vision", "prefill", "denoise")


def default_buckets(max_tokens: int, step: int) -> list[int]:
    """Prompt lengths a graph is captured for: step, 2·step, … up to max_tokens rounded up to 16."""
    top = round_up(max_tokens, 16)
    return sorted({min(b, top) for b in range(step, top + step, step)})


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
    ) -> None:
        from rmuscle_ros.engine import triton_ops  # CUDA-only import, deferred on purpose

        cfg = self.cfg = model.cfg
        self.device = device
        self.use_cuda_graphs = use_cuda_graphs
        self._triton_ops = triton_ops
        self.pdl = triton_ops.pdl_supported(device) if pdl is None else pdl
        if self.pdl and not triton_ops.pdl_supported(device):
            raise ValueError(
                f"programmatic dependent launch needs compute capability 9.0+, {device} has less"
            )
        self.fused = FusedPi05(model, device=device, dtype=torch.bfloat16, ops=triton_ops)
        self.fused.gelu_in_matmul = _cublaslt_gelu_is_tanh(device)
        self.buckets = sorted(buckets) if buckets else default_buckets(cfg.max_token_len, bucket_step)
        if any(b % 16 for b in self.buckets):
            raise ValueError(f"prompt buckets must be multiples of 16, got {self.buckets}")

        c, per_image = cfg.num_cameras, cfg.vision.tokens_per_image
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(shape, device=device, dtype=dtype)  # noqa: E731
        self.images = zeros(c, 3, cfg.vision.image_size, cfg.vision.image_size)
        self.image_mask = zeros(c, dtype=torch.bool)
        self.noise = zeros(cfg.horizon, cfg.action_dim)
        self.actions = zeros(cfg.horizon, cfg.action_dim)
        self.visual = zeros(c * per_image, cfg.vlm.width, dtype=torch.bfloat16)
        self.tokens = {b: zeros(b, dtype=torch.long) for b in self.buckets}
        self.token_mask = {b: zeros(b, dtype=torch.bool) for b in self.buckets}
        self.key_bias = {b: zeros(c * per_image + b) for b in self.buckets}
        capacity = round_up(c * per_image + max(self.buckets) + cfg.horizon, KV_ALIGN)
        self.kv = KVBuffers.allocate(cfg, capacity, device, torch.bfloat16)
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._pool: tuple[int, int] | None = None

    # ── the three stages, written against the static buffers ─────────────────────────────────────────────

    def _run_vision(self, bucket: int) -> None:  # the images do not depend on the prompt bucket
        self.fused.encode_images(self.images, self.visual)

    def _run_prefill(self, bucket: int) -> None:
        per_image = self.cfg.vision.tokens_per_image
        pad_mask = torch.cat([self.image_mask.repeat_interleave(per_image), self.token_mask[bucket]])
        self.key_bias[bucket].copy_(self.fused.prefill(self.visual, self.tokens[bucket], pad_mask, self.kv))

    def _run_denoise(self, bucket: int) -> None:
        self.fused.denoise(self.noise, self.key_bias[bucket], self.kv, self.actions)

    def _stage_fn(self, stage: str, bucket: int) -> Callable[[], None]:
        runner = {"vision": self._run_vision, "prefill": self._run_prefill, "denoise": self._run_denoise}[
            stage
        ]

        def run() -> None:
            with self._triton_ops.programmatic_launch(self.pdl):
                runner(bucket)

        return run

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad():
            fn()  # compile Triton kernels, create cuBLAS handles, settle the allocator
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), torch.no_grad():
            fn()
        self._pool = graph.pool()
        return graph

    # ── Engine API ───────────────────────────────────────────────────────────────────────────────────────

    def warmup(self) -> dict[str, float]:
        """Capture every stage for every bucket (the only place graphs are built). Returns seconds."""
        timings: dict[str, float] = {}
        if not self.use_cuda_graphs:
            return timings
        keys = [("vision", 0)] + [(stage, b) for b in self.buckets for stage in ("prefill", "denoise")]
        for key in keys:
            if key not in self._graphs:
                start = time.perf_counter()
                self._graphs[key] = self._capture(self._stage_fn(*key))
                timings[f"capture_{key[0]}_{key[1]}"] = time.perf_counter() - start
        torch.cuda.synchronize(self.device)
        log.info("graph engine: captured %d graphs in %.2f s", len(self._graphs), sum(timings.values()))
        return timings

    def load_inputs(self, inputs: ModelInputs, noise: torch.Tensor) -> int:
        """Copy one observation into the static buffers; returns the prompt bucket it uses."""
        if inputs.tokens.shape[0] != 1 or noise.shape[0] != 1:
            raise ValueError(
                f"the graph engine runs one observation per call, got batch {inputs.tokens.shape[0]}"
            )
        if tuple(inputs.images.shape[1:]) != tuple(self.images.shape):
            raise ValueError(
                f"images must be (1, {', '.join(map(str, self.images.shape))}), got {tuple(inputs.images.shape)}"
            )
        # Pack the prompt on the host: a handful of integers, and no small kernels or syncs on the GPU.
        token_row, mask_row = inputs.tokens[0].cpu(), inputs.token_mask[0].cpu()
        n = int(mask_row.sum())
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None:
            raise ValueError(f"prompt has {n} tokens, more than the largest bucket {self.buckets[-1]}")
        tokens, token_mask = pack_prompt(token_row, mask_row, bucket)
        self.images.copy_(inputs.images[0], non_blocking=True)
        self.image_mask.copy_(inputs.image_masks[0], non_blocking=True)
        self.tokens[bucket].copy_(tokens, non_blocking=True)
        self.token_mask[bucket].copy_(token_mask, non_blocking=True)
        self.noise.copy_(noise[0], non_blocking=True)
        return bucket

    def run_stage(self, stage: str, bucket: int, use_graph: bool = True) -> None:
        """Run one stage on the loaded inputs: a graph replay once captured, else the fused ops directly."""
        graph = self._graphs.get((stage, 0 if stage == "vision" else bucket)) if use_graph else None
        if graph is not None:
            graph.replay()
        else:
            with torch.no_grad():
                self._stage_fn(stage, bucket)()

    @torch.no_grad()
    def sample_actions(
        self, inputs: ModelInputs, noise: torch.Tensor, use_graphs: bool = True
    ) -> torch.Tensor:
        bucket = self.load_inputs(inputs, noise)
        for stage in STAGES:
            self.run_stage(stage, bucket, use_graphs)
        return self.actions.clone()[None]
