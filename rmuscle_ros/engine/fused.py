"""π0.5 rewritten for static shapes and fused operators: the computation the graph engine captures.

Built once from a loaded `Pi05Model`, it folds what is constant per model into the weights:
- Gemma RMSNorm (1 + w) multipliers into the next projections (q/k/v and gate/up);
- SigLIP LayerNorm affine terms into the next projections (qkv, fc1, multimodal projector);
- q, k, v and gate, up concatenated into one matrix each (one matmul instead of three / two);
- the adaRMS scale, shift and gate of every (denoising step, expert layer): the step times are fixed
  (t = 1, 0.9, …), so the whole time-conditioning path is precomputed;
- the Euler step size into the action output head (x ← x + h·(dt·W)ᵀ + dt·b).
The residual stream is float32, matmuls run in `dtype` (bf16 on the GPU). The prefix's last layer only
computes K/V: nothing reads its attention or MLP output.

rMuscle (DESIGN.md §4) enters here as optional arguments, so the cached computation is the dense one with
a few operators swapped, on any backend:
- `prefill(context=...)`: the Context Cache. Per layer, the visual tokens whose FFN input drifted least
  (squared L2, the pre-FFN norm's (1 + w) scale included) from the reference entry copy the reference's
  FFN output; the top `keep` (ties to the earlier token; the visual rows of a camera missing from the
  call last), and every prompt token, are recomputed. The norm before the FFN also measures the drift,
  `context_select` ranks it, the FFN runs on the gathered rows only, and the norm after it reads each
  row's output from that compact result or from the reference. `prefill(record=...)` writes a reference
  entry (the FFN inputs and outputs of the visual tokens) instead, from a dense call: that is how the
  sliding window is rebuilt from a library observation.
- `denoise(action=...)`: the Action Cache. Dense anchor step(s), then each expert FFN reads only the
  selected neurons' weights and adds its change onto the anchor's output. `denoise(record_masks=...)`
  runs dense and writes the top-ρn neurons by contribution score per (step, layer): what a recorded
  episode stores for later cached calls.
Without those arguments the computation is exactly the dense one (same operators, same order).

The operators come from an ops module (`ops` = PyTorch definitions, `triton_ops` = fused kernels) so the
same code runs on the CPU in tests and under CUDA-graph capture on the GPU. Batch size is 1.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from rmuscle_ros.engine.ops import Prefetch
from rmuscle_ros.models.config import Pi05Config
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model, euler_times, sincos_time_embedding

NEG_INF = -1e30  # additive mask for keys that must not be attended (finite, so masked rows stay finite)
KV_ALIGN = 16  # key lengths padded to this multiple: aligned masks keep the fused SDPA kernels eligible
# The patch matmul's K (3·p·p = 588 at p = 14) padded with zero columns to this multiple: 588 bf16 are not
# 16-byte aligned rows, and cuBLAS then falls back to a slow kernel (H200: 15.6 µs for 1 GFLOP,
# bench/results/trace_graphs_h200_cached_e4a7bca_cached).
PATCH_K_ALIGN = 16


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class VisionLayer:
    qkv_w: Tensor  # (3·Wv, Wv), LayerNorm-1 affine folded in
    qkv_b: Tensor
    out_w: Tensor
    out_b: Tensor
    fc1_w: Tensor  # LayerNorm-2 affine folded in
    fc1_b: Tensor
    fc2_w: Tensor
    fc2_b: Tensor


@dataclass
class GemmaLayerWeights:
    qkv_w: Tensor  # ((H + 2·KVH)·Dh, W), pre-attention RMSNorm (1+w) folded in for the prefix
    o_w: Tensor
    gate_up_w: Tensor  # (2·F, W), pre-FFN RMSNorm (1+w) folded in for the prefix
    down_w: Tensor


@dataclass
class StepModulation:
    """adaRMS terms for every (step, expert layer), float32: norm(x)·mul + add, residual += y·gate."""

    attn_mul: Tensor  # (steps, depth, We) = 1 + scale of the pre-attention norm
    attn_add: Tensor
    attn_gate: Tensor
    ffn_mul: Tensor
    ffn_add: Tensor
    ffn_gate: Tensor
    final_mul: Tensor  # (steps, We)
    final_add: Tensor


@dataclass
class ContextRef:
    """One reference entry of the Context Cache: per prefix layer that has an FFN (depth − 1), the FFN
    input as the engine holds it (normalised, before the pre-FFN norm's (1 + w), which is folded into the
    FFN's weights; the drift scales by it, `FusedPi05.ffn_in_scale`) and the FFN output of the visual
    tokens, in the engine's dtype."""

    ffn_in: Tensor  # (depth − 1, C·256, W)
    ffn_out: Tensor

    @staticmethod
    def allocate(
        cfg: Pi05Config, device: torch.device, dtype: torch.dtype, layers: int | None = None
    ) -> ContextRef:
        """Zero-filled; `layers` (default depth − 1) = 0 gives an empty entry, for an engine whose Context
        Cache is off (ρp = 1: nothing reads or rebuilds one)."""
        shape = (cfg.vlm.depth - 1 if layers is None else layers, cfg.image_tokens, cfg.vlm.width)
        return ContextRef(
            torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
        )

    def copy_(self, other: ContextRef) -> ContextRef:
        self.ffn_in.copy_(other.ffn_in, non_blocking=True)
        self.ffn_out.copy_(other.ffn_out, non_blocking=True)
        return self

    @property
    def nbytes(self) -> int:
        return 2 * self.ffn_in.numel() * self.ffn_in.element_size()


@dataclass
class ContextCache:
    """Context Cache arguments of a prefill: the matched reference entry and how many visual tokens to
    recompute per layer (ceil(ρp · C·256)). With `slot`, `ref` holds stacked entries (S, depth − 1, C·256,
    W) and slot (1,) int64, on the device, picks the matched one: read where it lies, no copy."""

    ref: ContextRef
    keep: int
    slot: Tensor | None = None


@dataclass
class ActionCache:
    """Action Cache arguments of a denoise: steps < anchors run dense (the last one is the anchor); a later
    step s updates counts[s] neurons, neurons[s, i, :counts[s]] of layer i (sorted, int32), and adds their
    change onto the anchor's FFN output. counts[s] = F (every neuron) runs step s dense; 0 adds nothing
    (the step reuses the anchor's FFN output). counts None: every later step updates S (the tensor's
    width), the uniform schedule."""

    neurons: Tensor  # (steps, depth, S) int32
    anchors: int = 1
    counts: tuple[int, ...] | None = None  # per denoising step (`step_neuron_counts`)


def rho_count(rho: float, n: int) -> int:
    """How many of n items a fraction ρ keeps: ceil(ρ·n), at least 1 (exact for ρ·n integral)."""
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"a keep fraction must be in (0, 1], got {rho}")
    return max(1, min(n, math.ceil(rho * n - 1e-9)))


NEURON_BLOCK = 128  # the gathered Action Cache kernels read the selected neurons in blocks of this many


def keep_neuron_count(rho_n: float, mlp_dim: int) -> int:
    """How many expert neurons the Action Cache updates: ceil(ρn·F), rounded up to a multiple of 128 where
    F is (any other count would leave the gathered kernels for PyTorch gathers, several times slower on
    the H200); narrower (test) models keep exactly ceil(ρn·F)."""
    n = rho_count(rho_n, mlp_dim)
    if mlp_dim % NEURON_BLOCK == 0 and mlp_dim >= 8 * NEURON_BLOCK:
        n = min(mlp_dim, round_up(n, NEURON_BLOCK))
    return n


NEURON_SCHEDULES = ("uniform", "ramp")


def step_neuron_counts(
    rho_n: float, mlp_dim: int, steps: int, anchors: int, schedule: str
) -> tuple[int, ...]:
    """How many expert neurons each denoising step updates; the anchor steps (the first `anchors`) run
    dense (mlp_dim). Both schedules update ρn of the neurons on average over the later steps:

    - "uniform": every later step keeps `keep_neuron_count(ρn, F)` (DESIGN.md §4, the published method);
    - "ramp": the kept share grows linearly over the later steps, from 2ρn − b to b = min(1, 2ρn) (0 → 1 at
      ρn = 0.5). A neuron left out keeps its anchor-step value, and by the last steps the expert's
      activations have moved furthest from the anchor's, so that is where updating them pays: on a trained
      `small` at ρn = 0.5 the ramp cut the chunk's error against dense from 0.033 to 0.009
      (bench/probe_step_schedule.py; bench/HISTORY.md, "The Action Cache's step schedule").

    Counts are rounded to the nearest whole 128-neuron block where F is a multiple of 128 of at least 8
    blocks (as `keep_neuron_count`), to the nearest neuron otherwise. A step may keep all neurons (it runs
    dense) or none (it reuses the anchor's FFN output)."""
    if schedule not in NEURON_SCHEDULES:
        raise ValueError(f"neuron_schedule must be one of {NEURON_SCHEDULES}, got {schedule!r}")
    if not 0.0 < rho_n <= 1.0:
        raise ValueError(f"rho_n must be in (0, 1], got {rho_n}")
    later = steps - anchors
    if schedule == "uniform" or later == 1:
        return (mlp_dim,) * anchors + (keep_neuron_count(rho_n, mlp_dim),) * later
    top = min(1.0, 2 * rho_n)
    low = 2 * rho_n - top
    unit = NEURON_BLOCK if mlp_dim % NEURON_BLOCK == 0 and mlp_dim >= 8 * NEURON_BLOCK else 1
    shares = [low + (top - low) * j / (later - 1) for j in range(later)]
    return (mlp_dim,) * anchors + tuple(
        min(mlp_dim, math.floor(f * mlp_dim / unit + 0.5) * unit) for f in shares
    )


def gather_splits(selected: int) -> int:
    """Split-K for the gathered down-projection over `selected` neurons: up to 8 slices of whole 128-neuron
    blocks, at least 2 blocks each. The last slice may hold fewer blocks than the others (the kernel masks
    it), so an odd block count gets as many programs as an even one: ρn = 0.7 keeps 23 of 32 blocks at full
    size, which once ran unsplit, 16 programs each streaming all 23 blocks."""
    blocks = selected // NEURON_BLOCK if selected % NEURON_BLOCK == 0 else 0
    if blocks < 4:
        return 1
    per_slice = -(-blocks // min(8, blocks // 2))
    return -(-blocks // per_slice)  # no empty slice


@dataclass
class KVBuffers:
    """Per-layer K/V for one call: prefix rows [0, Lp) then the action rows, padded to KV_ALIGN."""

    keys: list[Tensor]  # depth × (KVH, capacity, Dh)
    values: list[Tensor]

    @staticmethod
    def allocate(cfg: Pi05Config, capacity: int, device: torch.device, dtype: torch.dtype) -> KVBuffers:
        shape = (cfg.vlm.num_kv_heads, capacity, cfg.vlm.head_dim)
        # Zero-filled: padded slots are masked, but 0·NaN would still poison the softmax·V product.
        return KVBuffers(
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.vlm.depth)],
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.vlm.depth)],
        )


@dataclass
class PrefillState:
    """The prefill's residual stream between layers (float32) and its normalised rows (the next layer's
    input), for `rows` prefix rows at most: what a prefill run in slices carries from one to the next."""

    residual: Tensor  # (rows, W) float32
    normed: Tensor  # (rows, W) in the engine's dtype

    @staticmethod
    def allocate(cfg: Pi05Config, rows: int, device: torch.device, dtype: torch.dtype) -> PrefillState:
        w = cfg.vlm.width
        return PrefillState(
            torch.empty(rows, w, device=device), torch.empty(rows, w, device=device, dtype=dtype)
        )


def pack_prompt_into(
    tokens: np.ndarray, mask: np.ndarray, out_tokens: np.ndarray, out_mask: np.ndarray
) -> int:
    """One prompt row -> out_tokens (bucket,) with the valid tokens first, zeros after; out_mask marks them.
    Returns how many are valid. Exact for any padding layout: positions and attention only ever see valid
    tokens, in order. NumPy: a few µs on the host per call, where the same in torch ops takes tens."""
    valid = tokens[mask.astype(bool, copy=False)]
    n, bucket = valid.shape[0], out_tokens.shape[0]
    if n > bucket:
        raise ValueError(f"prompt has {n} tokens, more than the bucket of {bucket}")
    out_tokens[:n], out_tokens[n:] = valid, 0
    out_mask[:n], out_mask[n:] = True, False
    return n


def pack_prompt(tokens: Tensor, mask: Tensor, bucket: int) -> tuple[Tensor, Tensor]:
    """pack_prompt_into for tensors: returns (tokens (bucket,) int64, mask (bucket,) bool) on tokens' device."""
    out_tokens, out_mask = np.zeros(bucket, np.int64), np.zeros(bucket, np.bool_)
    pack_prompt_into(tokens.cpu().numpy(), mask.cpu().numpy(), out_tokens, out_mask)
    return torch.from_numpy(out_tokens).to(tokens.device), torch.from_numpy(out_mask).to(tokens.device)


ROPE_FIRST_POSITION = -1  # padding rows before a call's first real token sit at position -1


@dataclass(frozen=True)
class CallLayout:
    """Where one call's tokens sit, for the prefill and the denoising loop (see `call_layout`).

    rope_rows (Lp + horizon,) int64: the RoPE table row of each prefix token, then of each action token
    (row = position − ROPE_FIRST_POSITION). key_bias (round_up(Lp + horizon, KV_ALIGN),) float32 over
    [prefix; actions; padding]: 0 for the keys attended (real prefix tokens, every action), else NEG_INF.
    """

    rope_rows: Tensor
    key_bias: Tensor

    def to(self, device: torch.device) -> CallLayout:
        return CallLayout(self.rope_rows.to(device), self.key_bias.to(device))


def call_layout(pad_mask: np.ndarray, horizon: int) -> CallLayout:
    """The layout of a call from its prefix pad mask (Lp,) bool ([image tokens; prompt], True = real), as
    host tensors (see call_layout_into)."""
    lp = pad_mask.shape[0]
    rows, key_bias = np.empty(lp + horizon, np.int64), np.empty(round_up(lp + horizon, KV_ALIGN), np.float32)
    call_layout_into(pad_mask, horizon, rows, key_bias)
    return CallLayout(torch.from_numpy(rows), torch.from_numpy(key_bias))


def call_layout_into(pad_mask: np.ndarray, horizon: int, rope_rows: np.ndarray, key_bias: np.ndarray) -> None:
    """Write a call's CallLayout into NumPy arrays. Prefix positions count the real tokens before each row
    (padding repeats the previous position); the actions follow the real prefix. On the host: ~30 µs per
    call on a 2-core CI machine, where the same torch ops inside the graphs were ~35 small kernels
    (bench/results/trace_graphs_h200_f604ba8 against …_d9fae05)."""
    lp = pad_mask.shape[0]
    real = np.cumsum(pad_mask, dtype=np.int64)
    rope_rows[:lp] = real - 1 - ROPE_FIRST_POSITION
    rope_rows[lp:] = real[-1] + np.arange(horizon) - ROPE_FIRST_POSITION
    key_bias[:] = NEG_INF
    key_bias[:lp][pad_mask] = 0.0
    key_bias[lp : lp + horizon] = 0.0  # actions attend each other bidirectionally


def split_k(k: int, slice_len: int = 512, max_splits: int = 8) -> int:
    """How many K slices a few-row matmul uses: slices of 512 (tuned on an H200), at most 8."""
    return min(max_splits, k // slice_len) if k % slice_len == 0 and k >= slice_len else 1


def _fold_rms(weight: Tensor, norm_weight: Tensor) -> Tensor:
    """W · diag(1 + w): the Gemma norm multiplier applied to the input columns."""
    return weight * (1.0 + norm_weight)[None, :]


def _fold_layer_norm(weight: Tensor, bias: Tensor | None, ln: torch.nn.LayerNorm) -> tuple[Tensor, Tensor]:
    """W·(γ⊙n + β) + b = (W·diag γ)·n + (W·β + b)."""
    folded_b = weight @ ln.bias + (0 if bias is None else bias)
    return weight * ln.weight[None, :], folded_b


def rope_tables(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """positions (N,) int -> cos, sin (N, head_dim/2) float32 for split-halves RoPE."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


class FusedPi05:
    """Static-shape π0.5 forward with folded weights. See the module docstring."""

    def __init__(self, model: Pi05Model, *, device: torch.device | str, dtype: torch.dtype, ops: ModuleType):
        self.cfg = model.cfg
        self.device, self.dtype, self.ops = torch.device(device), dtype, ops
        self.gelu_in_matmul = False  # set by the graph engine once cuBLASLt's GELU epilogue is verified
        self.first_step_pdl = False  # see denoise(kv_ready=...)
        # The expert's o- and down-projections have few output columns: split K so the weight streams
        # through every SM (the partial products are summed, in a fixed order, by add_norm).
        e = self.cfg.expert
        self.o_splits = split_k(e.num_heads * e.head_dim)
        self.down_splits = split_k(e.mlp_dim)
        with torch.no_grad():
            self._prepare(model)
            # RoPE cos/sin of every position a call can use: a call gathers its rows (CallLayout.rope_rows)
            positions = torch.arange(
                ROPE_FIRST_POSITION, self.cfg.image_tokens + self.cfg.max_token_len + self.cfg.horizon,
                device=self.device,
            )  # fmt: skip
            g = self.cfg.vlm
            self.vlm_rope = rope_tables(positions, g.head_dim, g.rope_theta)
            self.expert_rope = rope_tables(positions, e.head_dim, e.rope_theta)
        self.down_t: list[Tensor] | None = None  # K-major expert down-projections, for the Action Cache

    def prepare_action_cache(self) -> int:
        """Build what the Action Cache reads: each expert layer's down-projection stored K-major (F, We), so
        that a selected neuron's output weights are one contiguous row, and their column norms for the
        contribution scores. Returns the extra bytes held (a one-time copy, never per call)."""
        if self.down_t is None:
            self.down_t = [layer.down_w.t().contiguous() for layer in self.expert_layers]
            self.down_norms = torch.stack([layer.down_w.float().norm(dim=0) for layer in self.expert_layers])
        return sum(t.numel() * t.element_size() for t in self.down_t) + self.down_norms.numel() * 4

    # ── weight preparation (float32 arithmetic, then cast) ──────────────────────────────────────────────

    def _to(self, t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        return t.detach().to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def _prepare(self, model: Pi05Model) -> None:
        cfg = self.cfg
        f32 = lambda t: t.detach().float()  # noqa: E731
        vt = model.vision_tower
        conv, pos = vt.embeddings.patch_embedding, vt.embeddings.position_embedding
        # The patch convolution as a matmul: (Wv, 3, p, p) -> (Wv, 3·p·p), patch vectors in (channel, row,
        # col) order, then zero columns up to PATCH_K_ALIGN. Its bias and the position embeddings are added
        # together, so one float32 table.
        patch_w = conv.weight.reshape(conv.weight.shape[0], -1)
        self.patch_k = patch_w.shape[1]
        self.patch_w = self._to(F.pad(patch_w, (0, round_up(self.patch_k, PATCH_K_ALIGN) - self.patch_k)))
        self.patch_table = self._to(f32(pos.weight) + f32(conv.bias), torch.float32)  # (T, Wv)
        self.vision_layers = []
        for layer in vt.encoder.layers:
            a = layer.self_attn
            ln1, ln2 = _as_f32(layer.layer_norm1), _as_f32(layer.layer_norm2)
            qkv_w, qkv_b = _fold_layer_norm(*_stack_rows(a.q_proj, a.k_proj, a.v_proj), ln1)
            fc1_w, fc1_b = _fold_layer_norm(*_stack_rows(layer.mlp.fc1), ln2)
            self.vision_layers.append(
                VisionLayer(
                    self._to(qkv_w),
                    self._to(qkv_b),
                    self._to(a.out_proj.weight),
                    self._to(a.out_proj.bias, torch.float32),
                    self._to(fc1_w),
                    self._to(fc1_b),
                    self._to(layer.mlp.fc2.weight),
                    self._to(layer.mlp.fc2.bias, torch.float32),
                )
            )
        proj_w, proj_b = _fold_layer_norm(*_stack_rows(model.projector), _as_f32(vt.post_layernorm))
        self.proj_w, self.proj_b = self._to(proj_w), self._to(proj_b)

        self.embed = self._to(model.llm.embed_tokens.weight)
        self.prefix_layers = []
        # Each prefix layer's pre-FFN norm scale (1 + w), folded into gate_up_w: the Context Cache scales its
        # drift by it, so that it ranks the FFN input's own change (DESIGN §4; found in review: it ranked the
        # normalised residual's, before the scale)
        self.ffn_in_scale: list[Tensor] = []
        for layer in model.llm.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.ffn_in_scale.append(
                self._to(1.0 + f32(layer.post_attention_layernorm.weight), torch.float32)
            )
            qkv, _ = _stack_rows(att.q_proj, att.k_proj, att.v_proj)
            gate_up, _ = _stack_rows(mlp.gate_proj, mlp.up_proj)
            self.prefix_layers.append(
                GemmaLayerWeights(
                    self._to(_fold_rms(qkv, f32(layer.input_layernorm.weight))),
                    self._to(att.o_proj.weight),
                    self._to(_fold_rms(gate_up, f32(layer.post_attention_layernorm.weight))),
                    self._to(mlp.down_proj.weight),
                )
            )

        self.expert_layers = []
        for layer in model.expert.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.expert_layers.append(
                GemmaLayerWeights(
                    self._to(_stack_rows(att.q_proj, att.k_proj, att.v_proj)[0]),
                    self._to(att.o_proj.weight),
                    self._to(_stack_rows(mlp.gate_proj, mlp.up_proj)[0]),
                    self._to(mlp.down_proj.weight),
                )
            )
        self.modulation = self._precompute_modulation(model)
        dt = -1.0 / cfg.num_steps
        self.action_in_w = self._to(model.action_in_proj.weight, torch.float32)
        self.action_in_b = self._to(model.action_in_proj.bias, torch.float32)
        self.euler_w = self._to(f32(model.action_out_proj.weight) * dt, torch.float32)
        self.euler_b = self._to(f32(model.action_out_proj.bias) * dt, torch.float32)

    def _precompute_modulation(self, model: Pi05Model) -> StepModulation:
        """Run the time MLP and every adaRMS projection for the fixed Euler times, in float32."""
        cfg = self.cfg
        mlp_in, mlp_out = _as_f32(model.time_mlp_in), _as_f32(model.time_mlp_out)
        times = torch.tensor(euler_times(cfg.num_steps), dtype=torch.float32, device=mlp_in.weight.device)
        emb = sincos_time_embedding(times, cfg.expert.width, cfg.time_min_period, cfg.time_max_period)
        cond = F.silu(mlp_out(F.silu(mlp_in(emb))))  # (steps, We)

        def terms(norms: list[torch.nn.Module]) -> tuple[Tensor, Tensor, Tensor]:
            stacked = torch.stack([_as_f32(n.dense)(cond) for n in norms], dim=1)  # (steps, depth, 3·We)
            scale, shift, gate = stacked.chunk(3, dim=-1)
            return 1.0 + scale, shift, gate

        attn = terms([layer.input_layernorm for layer in model.expert.layers])
        ffn = terms([layer.post_attention_layernorm for layer in model.expert.layers])
        final_mul, final_add, _ = terms([model.expert.norm])
        f = lambda t: self._to(t, torch.float32)  # noqa: E731
        return StepModulation(
            *map(f, attn), *map(f, ffn), final_mul=f(final_mul[:, 0]), final_add=f(final_add[:, 0])
        )

    # ── forward stages ───────────────────────────────────────────────────────────────────────────────────

    def embed_patches(self, images: Tensor) -> Tensor:
        """images (C, 3, S, S) -> (C·T, Wv) float32 tokens, T = (S/p)² patches per image in row-major order.

        The p×p, stride-p patch convolution as one matmul over patches: three kernels on the GPU (gather and
        cast the pixels, the matmul, add the bias + position table) where cuDNN's convolution needs layout
        transforms around it and separate casts and adds after; plus a memset of the padding columns when
        3·p·p is padded (PATCH_K_ALIGN).
        """
        v = self.cfg.vision
        c, p, g = images.shape[0], v.patch_size, v.image_size // v.patch_size
        k, kp = self.patch_k, self.patch_w.shape[1]
        shape, kw = (c * g * g, kp), {"device": self.device, "dtype": self.dtype}
        pixels = torch.zeros(shape, **kw) if kp > k else torch.empty(shape, **kw)  # (C·T, 3·p·p + pad)
        # (C, 3, g, p, g, p) -> (C, g, g, 3, p, p): one copy gathers the patches in the weight's order, cast.
        patches_in = pixels[:, :k].unflatten(0, (c, g, g)).unflatten(-1, (3, p, p))
        patches_in.copy_(images.reshape(c, 3, g, p, g, p).permute(0, 2, 4, 1, 3, 5))
        # Matmul in `dtype`, then one mixed-dtype add writes the float32 residual stream (the table broadcast
        # over cameras). addmm/baddbmm would need the table in `dtype` too, and copy a 2-D bias into the
        # output with a kernel of its own before the GEMM: no fewer kernels, and a bf16-rounded table.
        res = torch.empty(c * g * g, v.width, device=self.device, dtype=torch.float32)
        patches = (pixels @ self.patch_w.t()).view(c, g * g, v.width)
        torch.add(patches, self.patch_table, out=res.view(c, g * g, v.width))
        return res

    def encode_images(self, images: Tensor, out: Tensor) -> Tensor:
        """images (C, 3, S, S) in [-1, 1] -> out (C·T, W) visual tokens in `dtype`, T patches per image."""
        v = self.cfg.vision
        ops = self.ops
        c = images.shape[0]
        res = self.embed_patches(images)  # (C·T, Wv) float32 residual stream
        n = res.shape[0]
        h = torch.empty(n, v.width, device=self.device, dtype=self.dtype)
        ops.add_norm(res, None, h, eps=v.layer_norm_eps, rms=False)
        for layer in self.vision_layers:
            qkv = torch.addmm(layer.qkv_b, h, layer.qkv_w.t())  # (N, 3·Wv)
            attn = ops.packed_attention(qkv, c, v.num_heads)  # each image attends within itself
            ops.add_norm(res, attn @ layer.out_w.t(), h, eps=v.layer_norm_eps, rms=False, y_bias=layer.out_b)
            ops.add_norm(
                res, self.vision_mlp(layer, h), h, eps=v.layer_norm_eps, rms=False, y_bias=layer.fc2_b
            )
        return torch.addmm(self.proj_b, h, self.proj_w.t(), out=out)

    def vision_mlp(self, layer: VisionLayer, h: Tensor) -> Tensor:
        """SigLIP's MLP over the rows of h (N, Wv), normalised: fc1, tanh-GELU, fc2 without its bias (the
        residual add after it adds that)."""
        if self.gelu_in_matmul:  # cuBLASLt bias + tanh-GELU epilogue
            act = torch._addmm_activation(layer.fc1_b, h, layer.fc1_w.t(), use_gelu=True)
        else:
            act = F.gelu(torch.addmm(layer.fc1_b, h, layer.fc1_w.t()), approximate="tanh")
        return act @ layer.fc2_w.t()

    def prefill(
        self,
        visual: Tensor,
        tokens: Tensor,
        layout: CallLayout,
        kv: KVBuffers,
        *,
        context: ContextCache | None = None,
        record: ContextRef | None = None,
        layers: range | None = None,
        state: PrefillState | None = None,
        kv_ready: Sequence[torch.cuda.Event] | None = None,
    ) -> None:
        """Run the VLM over [visual tokens; prompt tokens] and write every layer's K/V into `kv`.

        visual (C·256, W); tokens (L,) int64; layout: this call's (Lp = C·256 + L prefix rows).
        context: run the FFNs with the Context Cache; record: write this call's visual FFN inputs/outputs
        (a dense call: the two cannot be combined).
        layers: run only these layers, with `state` carrying the residual stream from the slice before (a
        rebuild in slices, which live calls may run between); the slice from layer 0 embeds the prompt.
        kv_ready: one CUDA event per layer, recorded once that layer's K/V are written (for a denoising
        loop on another stream that starts its first step before the prefill ends; see `denoise`).
        """
        if context is not None and record is not None:
            raise ValueError("prefill: record= stores dense FFN outputs, it cannot run with context=")
        depth = len(self.prefix_layers)
        layers = range(depth) if layers is None else layers
        if layers != range(depth) and state is None:
            raise ValueError("prefill: a slice of the layers needs a state to carry the residual stream")
        g = self.cfg.vlm
        ops = self.ops
        nv = visual.shape[0]
        lp = nv + tokens.shape[0]
        if state is None:
            state = PrefillState.allocate(self.cfg, lp, self.device, self.dtype)
        res, h = state.residual[:lp], state.normed[:lp]  # float32 residual stream; its norm, the FFN input
        cos, sin = (t.index_select(0, layout.rope_rows[:lp]) for t in self.vlm_rope)
        key_bias = layout.key_bias[:lp]
        q = torch.empty(lp, g.num_heads * g.head_dim, device=self.device, dtype=self.dtype)
        if layers.start == 0:
            res[:nv] = visual
            torch.mul(self.embed[tokens].float(), math.sqrt(g.width), out=res[nv:])
            ops.add_norm(res, None, h, eps=g.rms_norm_eps, rms=True)
        if context is not None:  # per-layer scratch of the Context Cache, fixed shapes
            nv = context.ref.ffn_in.shape[-2]
            pick = {} if context.slot is None else {"ref_slot": context.slot}
            drift = torch.empty(nv, device=self.device)  # (Nv,) float32
            rows = torch.empty(context.keep + lp - nv, device=self.device, dtype=torch.long)
            inv = torch.empty(lp, device=self.device, dtype=torch.int32)
        last = depth - 1
        for i in layers:
            layer = self.prefix_layers[i]
            k, v = kv.keys[i][:, :lp], kv.values[i][:, :lp]
            ops.rope_qkv(h @ layer.qkv_w.t(), cos, sin, q, k, v, g.num_heads, g.num_kv_heads)
            if kv_ready is not None:
                kv_ready[i].record()
            if i == last:
                break  # only the last layer's K/V is ever read
            attn = ops.attention(q, k, v, key_bias, g.num_heads)
            if context is None:
                ops.add_norm(res, attn @ layer.o_w.t(), h, eps=g.rms_norm_eps, rms=True)
                y, y_rows = self._prefix_ffn(h, layer), {}
            else:  # the norm also measures each visual row's drift from the reference's FFN input
                ref_in = context.ref.ffn_in[i] if context.slot is None else context.ref.ffn_in[:, i]
                ref_out = context.ref.ffn_out[i] if context.slot is None else context.ref.ffn_out[:, i]
                ops.add_norm(
                    res, attn @ layer.o_w.t(), h, eps=g.rms_norm_eps, rms=True,
                    drift_ref=ref_in, drift_out=drift, drift_scale=self.ffn_in_scale[i], **pick,
                )  # fmt: skip
                y = self._context_cached_ffn(h, layer, drift, context.keep, rows, inv, key_bias)
                # the rows not recomputed read the reference's
                y_rows = {"y_rows": inv, "y_alt": ref_out, **pick}
            if record is not None:
                nv = record.ffn_in.shape[1]
                record.ffn_in[i].copy_(h[:nv])
                record.ffn_out[i].copy_(y[:nv])
            ops.add_norm(res, y, h, eps=g.rms_norm_eps, rms=True, **y_rows)

    def _prefix_ffn(self, x: Tensor, layer: GemmaLayerWeights) -> Tensor:
        act = torch.empty(x.shape[0], layer.down_w.shape[1], device=self.device, dtype=self.dtype)
        return self.ops.linear_geglu(x, layer.gate_up_w, act) @ layer.down_w.t()

    def _context_cached_ffn(
        self,
        h: Tensor,
        layer: GemmaLayerWeights,
        drift: Tensor,
        keep: int,
        rows: Tensor,
        inv: Tensor,
        key_bias: Tensor,
    ) -> Tensor:
        """The FFN of the rows the Context Cache recomputes, compact: (keep + Lp − Nv, W).

        h (Lp, W) = [visual; prompt] FFN inputs; drift (Nv,) the visual rows' squared-L2 drift from the
        reference's FFN inputs. Recomputed: the `keep` visual rows that drifted most, then every prompt row
        (`ops.context_select` writes their indices into rows, and each row of h's position among them,
        or −1, into inv: what the next add_norm reads y through). key_bias (Lp,), the call's: the rows of
        a camera missing from the call rank last (nothing attends them).
        """
        self.ops.context_select(drift, keep, h.shape[0], rows, inv, key_bias)
        return self._prefix_ffn(torch.index_select(h, 0, rows), layer)

    def denoise(
        self,
        noise: Tensor,
        layout: CallLayout,
        kv: KVBuffers,
        out: Tensor,
        *,
        action: ActionCache | None = None,
        record_masks: Tensor | None = None,
        record_counts: Sequence[int] | None = None,
        record_anchors: int = 1,
        kv_ready: Sequence[torch.cuda.Event] | None = None,
    ) -> Tensor:
        """10 Euler steps of the action expert attending the prefix K/V. noise, out (horizon, action_dim) f32.

        action: run the expert FFNs with the Action Cache. record_masks (steps, depth, S) int32: run dense
        and write, for every step s after the first record_anchors (the Action Cache's dense anchor steps,
        `ActionCache.anchors`), the record_counts[s] neurons (default S; none for a step that keeps 0 or all
        of them) with the largest contribution score (|a_s − a_anchor| summed over the chunk, times
        ‖W_down[:, j]‖; the anchor: the last anchor step, whose activations a cached step adds its change
        onto), sorted, into record_masks[s, :, :count].
        kv_ready: the prefill's per-layer events (`prefill`), when the prefill is still running on another
        stream: the first step's layer i waits only for layer i's K/V, so the first step runs alongside the
        prefill instead of after it. Every later step comes after the first, hence after every event."""
        cfg, e = self.cfg, self.cfg.expert
        ops, mod = self.ops, self.modulation
        ha = cfg.horizon
        lp, capacity, key_bias = layout.rope_rows.shape[0] - ha, layout.key_bias.shape[0], layout.key_bias
        cos, sin = (t.index_select(0, layout.rope_rows[lp:]) for t in self.expert_rope)
        h = torch.empty(ha, e.width, device=self.device, dtype=self.dtype)
        q = torch.empty(ha, e.num_heads * e.head_dim, device=self.device, dtype=self.dtype)
        act = torch.empty(ha, e.mlp_dim, device=self.device, dtype=self.dtype)
        anchors = 0
        if action is not None or record_masks is not None:
            if self.down_t is None:
                raise RuntimeError("call prepare_action_cache() before running the Action Cache")
            # Recording ranks against the anchor a cached call will use: with 2 anchors, step 1's (found in
            # review: masks recorded against step 0 picked the neurons that moved since the wrong step).
            anchors = action.anchors if action is not None else record_anchors
            if not 1 <= anchors < cfg.num_steps:
                raise ValueError(f"Action Cache anchors must be in 1..{cfg.num_steps - 1}, got {anchors}")
            depth = len(self.expert_layers)
            act_anchor = torch.empty(depth, ha, e.mlp_dim, device=self.device, dtype=self.dtype)
            y_anchor = torch.empty(depth, ha, e.width, device=self.device)
            if record_masks is not None:  # every (step, layer)'s scores, ranked all at once after the loop
                scores = torch.zeros(cfg.num_steps, depth, e.mlp_dim, device=self.device)
            if action is not None:
                counts = action.counts or (e.mlp_dim,) * anchors + (action.neurons.shape[-1],) * (
                    cfg.num_steps - anchors
                )
                # per kept count: the selected neurons' activations, and the down-projection's split
                delta = {c: torch.empty(ha, c, device=self.device, dtype=self.dtype)
                         for c in set(counts[anchors:]) if 0 < c < e.mlp_dim}  # fmt: skip
                sel_splits = {c: gather_splits(c) for c in delta}  # about as many programs as dense
        last = len(self.expert_layers) - 1
        x_t = out.copy_(noise)
        res = torch.empty(ha, e.width, device=self.device)  # float32 residual stream of the action tokens
        step_args = {"euler_w": self.euler_w, "euler_b": self.euler_b, "in_w": self.action_in_w,
                     "in_b": self.action_in_b, "eps": e.rms_norm_eps}  # fmt: skip
        ops.action_step(x_t, res=res, out=h, mul=mod.attn_mul[0, 0], add=mod.attn_add[0, 0], **step_args)
        # Alongside the prefill (kv_ready), the first step's kernels may launch one by one instead: under PDL
        # each launches while its predecessor runs and holds SM slots while it waits, slots the prefill's GEMMs
        # could use (`first_step_pdl`).
        serial_first_step = (
            kv_ready is not None and not self.first_step_pdl and hasattr(ops, "programmatic_launch")
        )
        for s in range(cfg.num_steps):
            launch = contextlib.ExitStack()
            if s == 0 and serial_first_step:
                launch.enter_context(ops.programmatic_launch(False))
            with launch:
                # a step keeping every neuron runs dense: the same result, with the dense kernels
                cached = action is not None and s >= anchors and counts[s] < e.mlp_dim
                for i, layer in enumerate(self.expert_layers):
                    if s == 0 and kv_ready is not None:
                        torch.cuda.current_stream(self.device).wait_event(kv_ready[i])
                    k, v = kv.keys[i][:, :capacity], kv.values[i][:, :capacity]
                    ops.qkv_rope(h, layer.qkv_w, cos, sin, q, k[:, lp : lp + ha], v[:, lp : lp + ha],
                                 e.num_heads, e.num_kv_heads)  # fmt: skip
                    # The FFN's gate/up weights (or the Action Cache's rows of them) start streaming into L2
                    # during the attention: the FFN's own kernel would start them too late to hide them. (The
                    # down-projection's too measured no faster: bench/results/dev_prefetch_ahead_h200_94aca68.)
                    if cached and counts[s] == 0:
                        ahead = None  # no FFN weights read in this step
                    elif cached:
                        gate_up = ((layer.gate_up_w, 0), (layer.gate_up_w, e.mlp_dim))
                        ahead = Prefetch(rows=action.neurons[s, i, : counts[s]], tables=gate_up)
                    else:
                        ahead = Prefetch(whole=layer.gate_up_w)
                    attn = ops.attention(q, k, v, key_bias, e.num_heads, prefetch=ahead)
                    # res_ready: the residual was last written by the previous residual+norm (or step kernel), three
                    # or more kernels back, so both residual+norms may read it before their PDL wait
                    # (bench/results/trace_graphs_h200_cached_a58c3bc_res: denoise 6.17 -> 5.98 ms, cached 5.91 -> 5.82).
                    ops.add_norm(
                        res, ops.linear(attn, layer.o_w, self.o_splits), h, eps=e.rms_norm_eps, rms=True,
                        gate=mod.attn_gate[s, i], mul=mod.ffn_mul[s, i], add=mod.ffn_add[s, i], res_ready=True,
                    )  # fmt: skip
                    nxt_mul = mod.final_mul[s] if i == last else mod.attn_mul[s, i + 1]
                    nxt_add = mod.final_add[s] if i == last else mod.attn_add[s, i + 1]
                    norm = {
                        "eps": e.rms_norm_eps,
                        "rms": True,
                        "gate": mod.ffn_gate[s, i],
                        "mul": nxt_mul,
                        "add": nxt_add,
                        "res_ready": True,
                    }
                    if anchors and s < anchors:  # dense anchor step: keep its activations and FFN output
                        ops.linear_geglu(h, layer.gate_up_w, act_anchor[i])
                        y = ops.linear(act_anchor[i], layer.down_w, self.down_splits)
                        ops.add_norm(res, y, h, y_store=y_anchor[i], **norm)
                    elif cached and counts[s] == 0:  # the anchor's FFN output as it is
                        # as y: y_base without y added nothing, and the step dropped the layer's FFN output
                        # (found in review; the ramp's first step after the anchor, the default schedule)
                        ops.add_norm(res, y_anchor[i], h, **norm)
                    elif cached:  # only the selected neurons, added onto the anchor
                        c = counts[s]
                        idx = action.neurons[s, i, :c]
                        ops.linear_geglu(h, layer.gate_up_w, delta[c], neurons=idx, anchor=act_anchor[i])
                        y = ops.linear(delta[c], self.down_t[i], sel_splits[c], neurons=idx)
                        ops.add_norm(res, y, h, y_base=y_anchor[i], **norm)
                    else:
                        ops.linear_geglu(h, layer.gate_up_w, act)
                        ops.add_norm(res, ops.linear(act, layer.down_w, self.down_splits), h, **norm)
                        if record_masks is not None:
                            ops.neuron_scores(act, act_anchor[i], scores[s, i])
                if s + 1 < cfg.num_steps:  # x ← x + dt·v, then the next step's input and first norm
                    ops.action_step(x_t, h=h, res=res, out=h, mul=mod.attn_mul[s + 1, 0],
                                    add=mod.attn_add[s + 1, 0], **step_args)  # fmt: skip
                else:
                    ops.action_step(x_t, h=h, **step_args)
        if record_masks is not None:
            counts = record_counts or (record_masks.shape[-1],) * cfg.num_steps
            self._top_neurons(scores, counts, anchors, record_masks)
        return x_t

    def _top_neurons(self, scores: Tensor, counts: Sequence[int], anchors: int, out: Tensor) -> None:
        """out[s, i, :counts[s]] (int32) = the counts[s] neurons of (step s, layer i) with the largest
        contribution score (scores × ‖W_down[:, j]‖; cache.sparse_ffn), sorted, for every step from `anchors`
        on that keeps some but not all; the rest of out is left as it is, or holds F past a step's count.
        A fixed number of kernels for all (step, layer)s, not a top-k and a sort for each (162 at pi05),
        which made a recorded call twice as slow (README)."""
        f = self.cfg.expert.mlp_dim
        steps = [s for s in range(anchors, len(counts)) if 0 < counts[s] < f]
        if not steps:
            return
        first, last = steps[0], steps[-1] + 1
        weighted = scores[first:last] * self.down_norms
        if all(counts[s] == counts[first] for s in range(first, last)):  # one count (uniform): one top-k
            ranked = torch.topk(weighted, counts[first], sorted=False).indices
            out[first:last, :, : counts[first]].copy_(ranked.sort().values)
            return
        # Counts per step: every step's neurons ranked best first; past a step's count an index F, which
        # sorts last, so one sort by index leaves each step's own neurons first.
        ranked = torch.sort(weighted, dim=-1, descending=True, stable=True).indices[..., : out.shape[-1]]
        for s in range(first, last):
            ranked[s - first, :, counts[s] if 0 < counts[s] < f else 0 :] = f
        out[first:last].copy_(ranked.sort().values)

    @torch.no_grad()
    def run(self, inputs: ModelInputs, noise: Tensor, bucket: int) -> Tensor:
        """One observation through the three stages without graph capture (CPU tests, debugging).

        inputs: batch 1; noise (1, horizon, action_dim). Returns (horizon, action_dim) float32.
        """
        cfg = self.cfg
        layout, kv = self.run_prefix(inputs, bucket)
        out = torch.empty(cfg.horizon, cfg.action_dim, device=self.device)
        return self.denoise(noise[0].to(self.device).float(), layout, kv, out)

    @torch.no_grad()
    def run_prefix(self, inputs: ModelInputs, bucket: int) -> tuple[CallLayout, KVBuffers]:
        """Vision and the dense prefill of one observation (batch 1) in fresh buffers: the call's layout
        and K/V, what `denoise` reads (`run`; probes that denoise one prefix several ways)."""
        cfg = self.cfg
        tokens, token_mask = pack_prompt(inputs.tokens[0], inputs.token_mask[0], bucket)
        pad_mask = torch.cat(
            [inputs.image_masks[0].repeat_interleave(cfg.vision.tokens_per_image), token_mask]
        )
        layout = call_layout(pad_mask.cpu().numpy(), cfg.horizon).to(self.device)
        kv = KVBuffers.allocate(cfg, layout.key_bias.shape[0], self.device, self.dtype)
        visual = torch.empty(cfg.image_tokens, cfg.vlm.width, device=self.device, dtype=self.dtype)
        self.encode_images(inputs.images[0].to(self.device), visual)
        self.prefill(visual, tokens.to(self.device), layout, kv)
        return layout, kv


def _as_f32(module: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of a small module (norms, time MLP) for exact precomputation."""
    return copy.deepcopy(module).float()


def _stack_rows(*linears: torch.nn.Linear) -> tuple[Tensor, Tensor | None]:
    """Weights (and biases) of several projections of one input as a single float32 matrix."""
    weight = torch.cat([lin.weight.detach().float() for lin in linears])
    if linears[0].bias is None:
        return weight, None
    return weight, torch.cat([lin.bias.detach().float() for lin in linears])
