"""Analytic FLOPs and minimum bytes of one π0.5 call, per stage, for roofline floors and projections.

FLOPs count multiply-adds as 2. Bytes are the fewest a call must move through device memory: every
weight it uses read once (in `weight_bytes` per element), the images read, prefix K/V written once and
read once per denoising step. Activations that a perfect kernel would keep on chip are not counted, so
the floor is optimistic by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from rmuscle_ros.models.config import GemmaConfig, Pi05Config


@dataclass(frozen=True)
class StageCost:
    flops: float
    bytes: float

    def floor_s(self, peak_flops: float, bandwidth: float) -> float:
        """Roofline time: the larger of compute time and memory time (seconds)."""
        return max(self.flops / peak_flops, self.bytes / bandwidth)


def _gemma_layer_flops(g: GemmaConfig, n_q: int, n_kv: int, kv_only: bool = False) -> float:
    qkv_out = (g.num_heads + 2 * g.num_kv_heads) * g.head_dim
    if kv_only:
        return 2 * n_q * g.width * 2 * g.num_kv_heads * g.head_dim
    proj = 2 * n_q * g.width * qkv_out + 2 * n_q * g.num_heads * g.head_dim * g.width
    mlp = 2 * n_q * g.width * 3 * g.mlp_dim
    attn = 2 * 2 * n_q * n_kv * g.num_heads * g.head_dim
    return proj + mlp + attn


def _gemma_layer_params(g: GemmaConfig, kv_only: bool = False) -> int:
    kv = 2 * g.width * g.num_kv_heads * g.head_dim
    if kv_only:
        return kv
    return kv + 2 * g.width * g.num_heads * g.head_dim + 3 * g.width * g.mlp_dim


def call_cost(cfg: Pi05Config, prompt_tokens: int, weight_bytes: int = 2) -> dict[str, StageCost]:
    """Cost of one call with all `cfg.num_cameras` images and `prompt_tokens` computed prompt tokens."""
    v, g, e = cfg.vision, cfg.vlm, cfg.expert
    c, per_image = cfg.num_cameras, v.tokens_per_image
    n_img = c * per_image
    patch_in = 3 * v.patch_size**2
    vision_layer = (
        2 * per_image * v.width * 4 * v.width
        + 2 * per_image * v.width * 2 * v.mlp_dim
        + 2 * 2 * per_image * per_image * v.width
    )
    vision_flops = c * (
        v.depth * vision_layer + 2 * per_image * patch_in * v.width + 2 * per_image * v.width * g.width
    )
    vision_params = (
        v.depth * (4 * v.width**2 + 2 * v.width * v.mlp_dim) + patch_in * v.width + v.width * g.width
    )
    image_bytes = n_img * patch_in * 4  # float32 pixels
    vision = StageCost(
        vision_flops, vision_params * weight_bytes + image_bytes + n_img * g.width * weight_bytes
    )

    n = n_img + prompt_tokens
    kv_bytes = g.depth * 2 * n * g.num_kv_heads * g.head_dim * weight_bytes
    prefill_flops = (g.depth - 1) * _gemma_layer_flops(g, n, n) + _gemma_layer_flops(g, n, n, kv_only=True)
    prefill_params = (g.depth - 1) * _gemma_layer_params(g) + _gemma_layer_params(g, kv_only=True)
    prefill = StageCost(prefill_flops, prefill_params * weight_bytes + n * g.width * weight_bytes + kv_bytes)

    ha = cfg.horizon
    step_flops = e.depth * _gemma_layer_flops(e, ha, n + ha) + 2 * 2 * ha * cfg.action_dim * e.width
    step_bytes = e.depth * _gemma_layer_params(e) * weight_bytes + kv_bytes
    denoise = StageCost(cfg.num_steps * step_flops, cfg.num_steps * step_bytes)
    return {"vision": vision, "prefill": prefill, "denoise": denoise}


def total(costs: dict[str, StageCost]) -> StageCost:
    return StageCost(sum(c.flops for c in costs.values()), sum(c.bytes for c in costs.values()))


def rmuscle_cost(
    cfg: Pi05Config,
    prompt_tokens: int,
    rho_p: float,
    rho_n: float,
    anchors: int = 1,
    weight_bytes: int = 2,
    neuron_schedule: str = "uniform",
) -> dict[str, StageCost]:
    """Cost of one rMuscle call: the Context Cache recomputes the prefix FFNs for ceil(ρp·visual) + prompt
    rows and reads the reference entry (FFN inputs and outputs of the visual tokens); the Action Cache
    reads and multiplies, in each step after the anchors, the neurons the schedule keeps there
    (`step_neuron_counts`: ceil(ρn·F) rounded up to 128s in every step when uniform) of the expert's F."""
    from rmuscle_ros.engine.fused import rho_count, step_neuron_counts  # call_cost callers stay torch-free

    base = call_cost(cfg, prompt_tokens, weight_bytes)
    g, e = cfg.vlm, cfg.expert
    n_img, n = cfg.image_tokens, cfg.image_tokens + prompt_tokens
    recomputed = rho_count(rho_p, n_img) + prompt_tokens
    ffn_layers = g.depth - 1
    prefill = base["prefill"]
    if recomputed < n:  # ρp = 1 runs the dense prefill itself (no reference entry is read)
        prefill = StageCost(
            prefill.flops - ffn_layers * 2 * (n - recomputed) * g.width * 3 * g.mlp_dim,
            prefill.bytes + ffn_layers * 2 * n_img * g.width * weight_bytes,
        )
    counts = step_neuron_counts(rho_n, e.mlp_dim, cfg.num_steps, anchors, neuron_schedule)
    skipped = e.depth * sum(e.mlp_dim - c for c in counts)  # neuron-layer-steps not read
    denoise = StageCost(
        base["denoise"].flops - 2 * cfg.horizon * 3 * e.width * skipped,
        base["denoise"].bytes - 3 * e.width * skipped * weight_bytes,
    )
    return {"vision": base["vision"], "prefill": prefill, "denoise": denoise}
