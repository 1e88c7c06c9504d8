"""π0.5 in plain PyTorch, top to bottom as in the paper (Physical Intelligence, 2025).

    images ──SigLIP──► visual tokens ─┐
    prompt + discretised state ───────┴─► Gemma 2B prefix (once per call) ──► K/V per layer
    noise x₁ ──► 10 × [action expert (Gemma 300M, adaRMS time conditioning) attends prefix K/V]
             ──► Euler step x ← x + dt·v  ──► actions x₀

Module and parameter names inside each block follow the Hugging Face layout that LeRobot and openpi
checkpoints use, so `rmuscle_ros.models.checkpoint` maps keys by prefix only. This file is the
reference (the `eager` engine); the fast engines in `rmuscle_ros.engine` wrap it from outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rmuscle_ros.models.config import GemmaConfig, Pi05Config, VisionConfig

# openpi's attention mask value (a large negative finite float, not -inf, so fully masked rows stay finite).
MASK_VALUE = -2.3819763e38


@dataclass
class ModelInputs:
    """A batch as the network sees it (after preprocessing)."""

    images: Tensor  # (B, cameras, 3, 224, 224) float in [-1, 1]
    image_masks: Tensor  # (B, cameras) bool, False = camera missing (its tokens are not attended)
    tokens: Tensor  # (B, L) int64 prompt tokens (task + discretised state), right-padded
    token_mask: Tensor  # (B, L) bool, False = padding

    def to(self, device: torch.device | str) -> ModelInputs:
        return ModelInputs(
            *(t.to(device) for t in (self.images, self.image_masks, self.tokens, self.token_mask))
        )


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


# ─────────────────────────────────────────── 1. SigLIP vision tower ───────────────────────────────────────────


class SiglipAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.width, cfg.width)
        self.k_proj = nn.Linear(cfg.width, cfg.width)
        self.v_proj = nn.Linear(cfg.width, cfg.width)
        self.out_proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        heads = (b, n, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(heads).transpose(1, 2)  # (B, H, N, Dh)
        k = self.k_proj(x).view(heads).transpose(1, 2)
        v = self.v_proj(x).view(heads).transpose(1, 2)
        logits = (q @ k.transpose(-1, -2)).float() * self.head_dim**-0.5  # (B, H, N, N)
        out = logits.softmax(-1).to(v.dtype) @ v  # (B, H, N, Dh)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.width, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(gelu_tanh(self.fc1(x)))


class SiglipLayer(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.tokens_per_image, cfg.width)

    def forward(self, pixels: Tensor) -> Tensor:
        patches = self.patch_embedding(pixels)  # (B, W, 16, 16)
        tokens = patches.flatten(2).transpose(1, 2)  # (B, 256, W)
        return tokens + self.position_embedding.weight


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.depth))


class VisionTower(nn.Module):
    """SigLIP So400m/14 with learned position embeddings and no pooling head."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)

    def forward(self, pixels: Tensor) -> Tensor:
        """pixels (B, 3, 224, 224) in [-1, 1] -> (B, 256, width)."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


# ─────────────────────────────────────────── 2. Gemma building blocks ─────────────────────────────────────────


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x / rms(x), computed in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Gemma RMSNorm: the stored weight is a zero-initialised offset, the multiplier is (1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype), None


class AdaRMSNorm(nn.Module):
    """π0.5 adaptive RMSNorm: scale, shift and a residual gate predicted from the time embedding."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(dim, 3 * dim)

    def modulation(self, cond: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """cond (B, D) -> scale, shift, gate, each (B, 1, D)."""
        scale, shift, gate = self.dense(cond)[:, None, :].chunk(3, dim=-1)
        return scale, shift, gate

    def forward(self, x: Tensor, cond: Tensor) -> tuple[Tensor, Tensor]:
        scale, shift, gate = self.modulation(cond)
        normed = rms_normalize(x, self.eps) * (1.0 + scale.float()) + shift.float()
        return normed.to(x.dtype), gate.to(x.dtype)


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary position embedding, split-halves layout. x (B, H, N, Dh), positions (B, N) int."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.int64).float() / dim)
    angles = positions.float()[:, None, :, None] * inv_freq  # (B, 1, N, Dh/2)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Grouped-query attention. q (B, H, Nq, Dh); k, v (B, KVH, Nk, Dh); mask (B, Nq, Nk) bool.

    Returns (B, Nq, H·Dh). Logits and softmax in float32 as in openpi.
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # (B, H, Nq, Nk)
    logits = torch.where(mask[:, None], logits, MASK_VALUE)
    out = logits.softmax(-1).to(v.dtype) @ v  # (B, H, Nq, Dh)
    return out.transpose(1, 2).flatten(2)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.width, bias=False)

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, N, W) -> q (B, H, N, Dh), k and v (B, KVH, N, Dh), RoPE applied to q and k."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, -1, self.cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, -1, self.cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, -1, self.cfg.head_dim).transpose(1, 2)
        return rope(q, positions, self.cfg.rope_theta), rope(k, positions, self.cfg.rope_theta), v


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.up_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_dim, cfg.width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


def gated_residual(x: Tensor, y: Tensor, gate: Tensor | None) -> Tensor:
    return x + y if gate is None else x + y * gate


class GemmaLayer(nn.Module):
    """One decoder layer. `adaptive` layers (the action expert) use adaRMS norms and gated residuals."""

    def __init__(self, cfg: GemmaConfig, adaptive: bool) -> None:
        super().__init__()
        norm = AdaRMSNorm if adaptive else RMSNorm
        self.input_layernorm = norm(cfg.width, cfg.rms_norm_eps)
        self.self_attn = GemmaAttention(cfg)
        self.post_attention_layernorm = norm(cfg.width, cfg.rms_norm_eps)
        self.mlp = GemmaMLP(cfg)

    def norm(self, which: nn.Module, x: Tensor, cond: Tensor | None) -> tuple[Tensor, Tensor | None]:
        return which(x) if cond is None else which(x, cond)

    def attention_inputs(
        self, x: Tensor, positions: Tensor, cond: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Pre-attention norm and projections: q, k, v and the attention residual gate."""
        h, gate = self.norm(self.input_layernorm, x, cond)
        q, k, v = self.self_attn.qkv(h, positions)
        return q, k, v, gate

    def finish(self, x: Tensor, attn_out: Tensor, gate: Tensor | None, cond: Tensor | None) -> Tensor:
        """o-proj + (gated) residual, pre-FFN norm, GeGLU MLP + (gated) residual."""
        x = gated_residual(x, self.self_attn.o_proj(attn_out), gate)
        h, gate = self.norm(self.post_attention_layernorm, x, cond)
        return gated_residual(x, self.mlp(h), gate)


class GemmaStack(nn.Module):
    def __init__(self, cfg: GemmaConfig, adaptive: bool, vocab_size: int | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(vocab_size, cfg.width) if vocab_size else None
        self.layers = nn.ModuleList(GemmaLayer(cfg, adaptive) for _ in range(cfg.depth))
        self.norm = (AdaRMSNorm if adaptive else RMSNorm)(cfg.width, cfg.rms_norm_eps)


# ─────────────────────────────────────────────── 3. π0.5 ──────────────────────────────────────────────────────


@dataclass
class PrefixCache:
    """Per-layer K/V of the prefix, computed once per call and attended by every denoising step."""

    keys: list[Tensor]  # depth × (B, KVH, Lp, Dh)
    values: list[Tensor]
    pad_mask: Tensor  # (B, Lp) bool

    @property
    def valid_len(self) -> Tensor:  # (B,) number of attended prefix tokens: suffix positions start here
        return self.pad_mask.sum(-1)


def sincos_time_embedding(t: Tensor, dim: int, min_period: float, max_period: float) -> Tensor:
    """t (B,) in [0, 1] -> (B, dim) = [sin, cos] over geometrically spaced periods (computed in float64)."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (2 * math.pi / period)[None, :] * t[:, None].double()
    return torch.cat([angle.sin(), angle.cos()], dim=-1).to(t.dtype)


def euler_times(num_steps: int) -> list[float]:
    """Flow-matching integration times: t = 1, 1 - 1/N, ..., 1/N (t=1 is noise, t=0 data)."""
    return [1.0 - step / num_steps for step in range(num_steps)]


class Pi05Model(nn.Module):
    def __init__(self, cfg: Pi05Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg.vision)
        self.projector = nn.Linear(cfg.vision.width, cfg.vlm.width)
        self.llm = GemmaStack(cfg.vlm, adaptive=False, vocab_size=cfg.vocab_size)
        self.expert = GemmaStack(cfg.expert, adaptive=True, vocab_size=None)
        self.action_in_proj = nn.Linear(cfg.action_dim, cfg.expert.width)
        self.action_out_proj = nn.Linear(cfg.expert.width, cfg.action_dim)
        self.time_mlp_in = nn.Linear(cfg.expert.width, cfg.expert.width)
        self.time_mlp_out = nn.Linear(cfg.expert.width, cfg.expert.width)

    @property
    def dtype(self) -> torch.dtype:
        return self.projector.weight.dtype

    # 3.1 Prefix tokens: images, then the prompt -------------------------------------------------------------

    def embed_images(self, images: Tensor) -> Tensor:
        """images (B, C, 3, 224, 224) -> visual tokens (B, C·256, vlm width); tokens are not rescaled."""
        b, c = images.shape[:2]
        feats = self.vision_tower(images.flatten(0, 1).to(self.dtype))  # (B·C, 256, vision width)
        return self.projector(feats).view(b, c * feats.shape[1], -1)

    def embed_prefix(self, inputs: ModelInputs) -> tuple[Tensor, Tensor]:
        """-> embeddings (B, Lp, W) and pad mask (B, Lp), Lp = C·256 + L."""
        visual = self.embed_images(inputs.images)
        text = self.llm.embed_tokens(inputs.tokens) * math.sqrt(self.cfg.vlm.width)  # Gemma embedding scale
        per_image = self.cfg.vision.tokens_per_image
        image_pad = inputs.image_masks.repeat_interleave(per_image, dim=1)  # (B, C·256)
        return torch.cat([visual, text.to(visual.dtype)], dim=1), torch.cat(
            [image_pad, inputs.token_mask], dim=1
        )

    # 3.2 Prefill: the VLM runs once, bidirectionally over valid prefix tokens ---------------------------------

    def prefill(self, embs: Tensor, pad_mask: Tensor, positions: Tensor | None = None) -> PrefixCache:
        """`positions` (B, Lp), when given, are the RoPE positions `pad_mask.cumsum(-1) - 1` computed by the
        caller (the ONNX export computes them in float32: TensorRT's CumSum takes no integers)."""
        if positions is None:
            positions = pad_mask.cumsum(-1) - 1  # padding does not advance the position
        mask = pad_mask[:, None, :] & pad_mask[:, :, None]  # (B, Lp, Lp)
        keys, values = [], []
        x = embs
        for layer in self.llm.layers:
            q, k, v, gate = layer.attention_inputs(x, positions, None)
            keys.append(k)
            values.append(v)
            x = layer.finish(x, masked_attention(q, k, v, mask), gate, None)
        return PrefixCache(keys, values, pad_mask)

    # 3.3 Time conditioning for adaRMS ------------------------------------------------------------------------

    def time_conditioning(self, t: Tensor) -> Tensor:
        """t (B,) -> adaRMS condition (B, expert width): sin/cos embedding -> swish MLP."""
        emb = sincos_time_embedding(
            t, self.cfg.expert.width, self.cfg.time_min_period, self.cfg.time_max_period
        )
        h = F.silu(self.time_mlp_in(emb.to(self.dtype)))
        return F.silu(self.time_mlp_out(h))

    # 3.4 One denoising step: the action expert attends [prefix K/V ; its own K/V] ---------------------------

    def velocity(self, x_t: Tensor, t: Tensor, prefix: PrefixCache, cond: Tensor | None = None) -> Tensor:
        """x_t (B, H, action_dim) float32 at time t (B,) -> flow velocity v_t (B, H, action_dim) float32.

        `cond` is `time_conditioning(t)` when the caller has it already (the exported denoise graph holds
        it as a constant per step).
        """
        cond = self.time_conditioning(t) if cond is None else cond
        x = self.action_in_proj(x_t.to(self.dtype))  # (B, H, W_e); π0.5 has no time concat here
        b, horizon = x.shape[:2]
        positions = prefix.valid_len[:, None] + torch.arange(
            horizon, device=x.device
        )  # continue after prefix
        # Action tokens see every valid prefix token and each other; the prefix never sees them.
        mask = torch.cat([prefix.pad_mask, prefix.pad_mask.new_ones(b, horizon)], dim=1)[:, None, :]
        mask = mask.expand(b, horizon, -1)
        for layer, k_prefix, v_prefix in zip(self.expert.layers, prefix.keys, prefix.values, strict=True):
            q, k, v, gate = layer.attention_inputs(x, positions, cond)
            k, v = (
                torch.cat([k_prefix, k.to(k_prefix.dtype)], 2),
                torch.cat([v_prefix, v.to(v_prefix.dtype)], 2),
            )
            x = layer.finish(x, masked_attention(q, k.to(q.dtype), v.to(q.dtype), mask), gate, cond)
        x, _ = self.expert.norm(x, cond)
        return self.action_out_proj(x).float()

    # 3.5 Flow matching: Euler from t=1 (noise) to t=0 (actions) --------------------------------------------

    @torch.no_grad()
    def sample_actions(self, inputs: ModelInputs, noise: Tensor) -> Tensor:
        """noise (B, horizon, action_dim) -> actions (B, horizon, action_dim), normalised space, float32."""
        prefix = self.prefill(*self.embed_prefix(inputs))
        dt = -1.0 / self.cfg.num_steps
        x = noise.float()
        for t in euler_times(self.cfg.num_steps):
            t_batch = torch.full((x.shape[0],), t, dtype=torch.float32, device=x.device)
            x = x + dt * self.velocity(x, t_batch, prefix)
        return x
