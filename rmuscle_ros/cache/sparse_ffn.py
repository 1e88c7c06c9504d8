"""The two rMuscle approximations of a GeGLU FFN, as plain PyTorch (the reference for later kernels).

Context Cache (VLM prefill): recompute the FFN only for the visual tokens whose FFN input drifted most
from the reference entry at the same position (top ρp), plus every text/state token; copy the
reference FFN output for the rest.

Action Cache (denoising loop): after a dense anchor step, update only the selected neurons S:
    out_t = out_anchor + W_down[:, S] · (a_t[S] − a_anchor[S]),   a = gelu_tanh(x W_gateᵀ) ⊙ (x W_upᵀ)
where S holds the top ρn neurons by contribution score, |Δa_j| summed over tokens times ‖W_down[:, j]‖.

Exactness by construction: ρ = 1 takes the dense path itself, so the result is bit-identical to dense
on the same backend (a subset matmul could round differently from the full one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def geglu_activations(x: Tensor, w_gate: Tensor, w_up: Tensor) -> Tensor:
    """x (N, W), w_gate/w_up (F, W) -> a (N, F)."""
    return F.gelu(x @ w_gate.t(), approximate="tanh") * (x @ w_up.t())


def dense_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    return geglu_activations(x, w_gate, w_up) @ w_down.t()


# ── Context Cache ────────────────────────────────────────────────────────────────────────────────────


def select_drifted_tokens(
    x_visual: Tensor, ref_visual: Tensor, rho: float, scale: Tensor | None = None
) -> Tensor:
    """Indices of the ceil(ρ·N) visual tokens whose FFN input moved most (L2) from the reference. (N, W) -> (k,).
    `scale` (W,): a per-channel factor of the FFN input not in `x` (the engine's normalised rows lack the
    norm's (1 + w), folded into the FFN's weights)."""
    k = max(1, int(torch.ceil(torch.tensor(rho * x_visual.shape[0])).item()))
    diff = x_visual.float() - ref_visual.float()
    drift = (diff if scale is None else diff * scale.float()).norm(dim=-1)
    return torch.topk(drift, k, sorted=False).indices.sort().values


def context_cached_ffn(
    x: Tensor,
    num_visual: int,
    ref_in: Tensor,
    ref_out: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    rho: float,
) -> Tensor:
    """x (N, W) = [visual tokens | text tokens]; ref_in/ref_out (num_visual, W): the reference entry's FFN
    input and output at the same visual positions. Returns the FFN output (N, W)."""
    if rho >= 1.0:
        return dense_ffn(x, w_gate, w_up, w_down)
    out = torch.empty_like(x)
    out[:num_visual] = ref_out
    selected = select_drifted_tokens(x[:num_visual], ref_in, rho)
    out[selected] = dense_ffn(x[selected], w_gate, w_up, w_down)
    out[num_visual:] = dense_ffn(x[num_visual:], w_gate, w_up, w_down)
    return out


def captured_change(
    x: Tensor,
    ref_in: Tensor,
    ref_out: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    rho: float,
    scale: Tensor | None = None,
) -> float:
    """Fidelity probe: the fraction of the visual tokens' FFN-output change (‖out − ref_out‖²) that the top-ρ
    drifted tokens account for (published: top 40 % capture ≈ 80 %)."""
    change = (dense_ffn(x, w_gate, w_up, w_down) - ref_out).float().pow(2).sum(-1)
    selected = select_drifted_tokens(x, ref_in, rho, scale)
    return (change[selected].sum() / change.sum().clamp_min(1e-30)).item()


# ── Action Cache ─────────────────────────────────────────────────────────────────────────────────────


def contribution_scores(act: Tensor, act_anchor: Tensor, w_down: Tensor) -> Tensor:
    """Per-neuron contribution of the change since the anchor: Σ_tokens |Δa_j| · ‖W_down[:, j]‖. -> (F,)."""
    return (act - act_anchor).abs().float().sum(0) * w_down.float().norm(dim=0)


def top_neurons(scores: Tensor, rho: float) -> Tensor:
    """Indices of the ceil(ρ·F) highest-scoring neurons, sorted (a gather-friendly order)."""
    k = max(1, int(torch.ceil(torch.tensor(rho * scores.shape[0])).item()))
    return torch.topk(scores, k, sorted=False).indices.sort().values


def action_cached_ffn(
    x: Tensor,
    neurons: Tensor,
    act_anchor: Tensor,
    out_anchor: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    rho: float,
) -> Tensor:
    """out_anchor + W_down[:, S](a[S] − a_anchor[S]), reading only the selected rows/columns of the weights.

    x (N, W); neurons (k,) = S; act_anchor (N, F), out_anchor (N, W) from the dense anchor step.
    """
    if rho >= 1.0:
        return dense_ffn(x, w_gate, w_up, w_down)
    act_s = geglu_activations(x, w_gate[neurons], w_up[neurons])  # (N, k): only S's weight rows are read
    return out_anchor + (act_s - act_anchor[:, neurons]) @ w_down[:, neurons].t()


def kept_contribution(scores: Tensor, rho: float) -> float:
    """Fidelity probe: fraction of the total contribution score the top ρ neurons keep (published 84.4 % at ρn = 0.5)."""
    return (scores[top_neurons(scores, rho)].sum() / scores.sum().clamp_min(1e-30)).item()


def mask_overlap(a: Tensor, b: Tensor) -> float:
    """|S_a ∩ S_b| / |S_a| for two neuron index sets (published: same task ≈ 86 %, cross-task ≈ 71 %)."""
    return len(set(a.tolist()) & set(b.tolist())) / max(1, len(a))
