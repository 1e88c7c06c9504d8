"""The fused operators of the graph engine, as plain PyTorch.

Each function here is the *definition* of a fused kernel in `triton_ops.py`: the graph engine calls the
Triton version on CUDA and these on the CPU, so the CPU test suite checks the engine's weight folding and
data layout, and GPU tests check each kernel against its definition. All 2-D operands are row-major
(tokens × features); the graph engine runs one observation at a time (batch 1), so per-feature vectors
(gates, adaRMS scale/shift) are 1-D.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def add_norm(
    res: Tensor,
    y: Tensor | None,
    out: Tensor,
    *,
    eps: float,
    rms: bool,
    y_bias: Tensor | None = None,
    gate: Tensor | None = None,
    mul: Tensor | None = None,
    add: Tensor | None = None,
    y_base: Tensor | None = None,
    y_store: Tensor | None = None,
    y_rows: Tensor | None = None,
    y_alt: Tensor | None = None,
    drift_ref: Tensor | None = None,
    drift_out: Tensor | None = None,
    ref_slot: Tensor | None = None,
    res_ready: bool = False,
    drift_scale: Tensor | None = None,
) -> Tensor:
    """Residual update then normalisation, in one pass over the row.

    res (N, D) float32 residual stream, updated in place: res += (y_base + y + y_bias) * gate; y is (N, D)
    or (splits, N, D) partial products to be summed; y_store, if given, receives y_base + y + y_bias
    before the gate (the Action Cache keeps the anchor step's FFN output this way; y_base adds it back).
    out (N, D) = norm(res) * mul + add, where norm is RMSNorm (`rms`) or LayerNorm without affine
    (affine terms are folded into the next matmul). Missing optional terms are identity.

    Context Cache terms: with y_rows (N,) int32 and y_alt (Nv, D), y holds only some rows (the FFN output of
    the recomputed rows) and residual row r reads y[y_rows[r]], or y_alt[r] where y_rows[r] < 0 (only
    rows r < Nv may be negative). With drift_ref (Nv, D) and drift_out (Nv,) float32: drift_out[r] =
    Σ_d (out[r, d] − drift_ref[r, d])², from out as stored (in its dtype), for the first Nv rows. With
    ref_slot (1,) int64: y_alt and drift_ref are stacks (S, Nv, D) and slot ref_slot[0] is the one read.
    drift_scale (D,) float32: each channel's difference is scaled by it before squaring (the Context Cache
    measures the drift of the FFN input itself, norm(res) · (1 + w), whose (1 + w) is folded into the FFN's
    weights and so not in `out`).
    res_ready: a scheduling hint for the Triton kernel (res may be read before its PDL wait); no effect here.
    """
    if y_rows is not None and y_alt is None:
        raise ValueError("add_norm: y_rows needs y_alt, the rows read where y_rows is negative")
    if y is None and (y_base is not None or y_store is not None):
        raise ValueError("add_norm: y_base and y_store go with y (without it nothing is added or stored)")
    if ref_slot is not None:  # pick the reference entry on the device (no host read of the slot)
        y_alt = None if y_alt is None else y_alt.index_select(0, ref_slot)[0]
        drift_ref = None if drift_ref is None else drift_ref.index_select(0, ref_slot)[0]
    if y is not None:
        delta = y.float() if y.ndim == 2 else y.float().sum(0)  # (splits, N, D): split-K partials
        if y_rows is not None:
            idx = y_rows.long()
            nv = y_alt.shape[0]
            delta = delta[idx.clamp_min(0)]  # (N, D)
            delta[:nv] = torch.where(idx[:nv, None] >= 0, delta[:nv], y_alt.float())
        if y_base is not None:
            delta = delta + y_base.float()
        if y_bias is not None:
            delta = delta + y_bias.float()
        if y_store is not None:
            y_store.copy_(delta)
        if gate is not None:
            delta = delta * gate.float()
        res += delta
    x = res.float()
    if rms:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    else:
        h = F.layer_norm(x, x.shape[-1:], eps=eps)
    if mul is not None:
        h = h * mul.float()
    if add is not None:
        h = h + add.float()
    out.copy_(h)
    if drift_ref is not None:
        nv = drift_ref.shape[0]
        diff = out[:nv].float() - drift_ref.float()
        if drift_scale is not None:
            diff = diff * drift_scale.float()
        drift_out.copy_(diff.pow(2).sum(-1))
    return out


def context_select(
    drift: Tensor, keep: int, num_rows: int, rows_out: Tensor, inv_out: Tensor, key_bias: Tensor | None = None
) -> None:
    """The Context Cache's choice of rows to recompute: the `keep` visual rows that drifted most, then
    every prompt row.

    drift (Nv,) float32, the visual rows' squared-L2 drift (NaN counts as +inf); 0 ≤ keep ≤ Nv;
    num_rows = Lp, the prefix length (Nv visual rows, then the prompt rows). Visual row r has rank
    #{j : drift[j] > drift[r], or drift[j] == drift[r] and j < r} (descending, ties to the lower row).
    rows_out (keep + Lp − Nv,) int64: rows_out[rank(r)] = r for the visual rows of rank < keep, then
    rows_out[keep + t] = Nv + t. inv_out (Lp,) int32: row r's position in rows_out, −1 for the visual rows
    not chosen (`add_norm(y_rows=...)` reads those from the reference instead).
    key_bias: the call's layout's key bias over (at least) the visual rows; a row not attended (< 0: its
    camera is missing from the call, or no camera fills its slot) ranks after every attended row, as if its
    drift were −inf: nothing reads its keys, so recomputing it would only take budget from the cameras
    that are there (found in review: in the one-camera sim, 233 of a layer's 308 recomputed rows).
    """
    nv = drift.shape[0]
    _check_context_select(nv, keep, num_rows, rows_out, inv_out, key_bias)
    # posinf kept +inf (nan_to_num's default makes it float32's max, below a NaN: found in review)
    key = torch.nan_to_num(drift.float(), nan=math.inf, posinf=math.inf)
    if key_bias is not None:
        key = torch.where(key_bias[:nv] < 0, -math.inf, key)
    rows_out[:keep] = torch.sort(key, descending=True, stable=True).indices[:keep]
    rows_out[keep:] = torch.arange(nv, num_rows, device=drift.device)
    inv_out.fill_(-1)
    inv_out[rows_out] = torch.arange(rows_out.shape[0], device=drift.device, dtype=inv_out.dtype)


def window_match(
    descriptor: Tensor, keys: Tensor, usable: Tensor, slot_out: Tensor, match_out: Tensor
) -> None:
    """The match stage's pick among the window's entries, all on the device (no host round trip).

    descriptor (C, W) float32, this call's retrieval descriptor; keys (S, C·W) float32 unit rows; usable
    (S,) bool. The similarity of entry i is keys[i] · d / ‖d‖ for usable entries, −2 for the others and for
    a NaN. slot_out (1,) int64 gets the best entry (the first of equal maxima), match_out (2,) float32
    [that index, its similarity]; with nothing usable, entry 0 at −2 (the runtime then runs dense).
    """
    d = descriptor.reshape(-1).float()
    sims = keys.float() @ d * torch.rsqrt((d * d).sum().clamp_min(1e-24))
    sims = torch.where(usable & ~sims.isnan(), sims, -2.0)
    best = sims.argmax()  # the first of equal maxima
    slot_out.copy_(best.view(1))
    torch.stack([best.float(), sims.max()], out=match_out)


def _check_context_select(
    nv: int, keep: int, num_rows: int, rows_out: Tensor, inv_out: Tensor, key_bias: Tensor | None
) -> None:
    if not 0 <= keep <= nv <= num_rows:
        raise ValueError(f"context_select needs 0 <= keep <= Nv <= num_rows, got {keep}, {nv}, {num_rows}")
    if key_bias is not None and not key_bias.is_floating_point():  # a bool mask would mask nothing
        raise ValueError(
            f"context_select: key_bias must be the layout's float key bias, got {key_bias.dtype}"
        )
    if key_bias is not None and key_bias.device != rows_out.device:
        raise ValueError(f"context_select: key_bias is on {key_bias.device}, the rows on {rows_out.device}")
    if key_bias is not None and (key_bias.dim() != 1 or key_bias.shape[0] < nv):
        raise ValueError(
            f"context_select: key_bias must be 1-D over at least the {nv} visual rows, got {tuple(key_bias.shape)}"
        )
    if rows_out.shape != (keep + num_rows - nv,) or inv_out.shape != (num_rows,):
        raise ValueError(
            f"context_select: rows_out must be ({keep + num_rows - nv},) and inv_out ({num_rows},), "
            f"got {tuple(rows_out.shape)} and {tuple(inv_out.shape)}"
        )


def linear(a: Tensor, w: Tensor, splits: int = 1, *, neurons: Tensor | None = None) -> Tensor:
    """a (M, K) @ w (N, K)ᵀ -> (M, N); with splits > 1, float32 partial products over K slices of
    ceil(K / splits) (the last may be shorter), stacked (slices, M, N).

    With `neurons` (K,) the weight is instead K-major, w (K_full, N), and only its rows `neurons` are
    read: a @ w[neurons] (the Action Cache's down-projection over the selected neurons).
    """
    w_nk = w if neurons is None else w[neurons.long()].t()  # (N, K)
    if splits == 1:
        return a @ w_nk.t()
    size = -(-a.shape[1] // splits)  # the last slice may be shorter
    return torch.stack(
        [
            (a_s.float() @ w_s.t().float())
            for a_s, w_s in zip(a.split(size, 1), w_nk.split(size, 1), strict=True)
        ]
    )


def linear_geglu(
    a: Tensor,
    gate_up: Tensor,
    out: Tensor,
    *,
    neurons: Tensor | None = None,
    anchor: Tensor | None = None,
) -> Tensor:
    """out (M, F) = gelu_tanh(a W_gateᵀ) * (a W_upᵀ), gate_up = [W_gate; W_up] (2F, K).

    With `neurons` (S,): only those neurons, reading only their rows of W_gate and W_up; out is (M, S).
    With `anchor` (M, F) too: out = act[:, S] − anchor[:, S], the Action Cache's change since the anchor.
    """
    if neurons is None:
        pre = a @ gate_up.t()
    else:
        f = gate_up.shape[0] // 2
        idx = neurons.long()
        pre = a @ gate_up[torch.cat([idx, idx + f])].t()
    if anchor is None:
        return geglu(pre, out)
    act = geglu(pre, torch.empty(out.shape, dtype=torch.float32, device=out.device))
    out.copy_(act - (anchor if neurons is None else anchor[:, neurons.long()]).float())
    return out


def neuron_scores(act: Tensor, anchor: Tensor, out: Tensor) -> Tensor:
    """act, anchor (N, F) -> out (F,) float32: Σ over the N rows of |act − anchor|, computed in float32.
    The Action Cache's contribution score of each neuron before its ‖W_down[:, j]‖ factor
    (cache.sparse_ffn.contribution_scores), taken by a recording denoise at every step after the anchor."""
    out.copy_((act.float() - anchor.float()).abs().sum(0))
    return out


def geglu(gate_up: Tensor, out: Tensor) -> Tensor:
    """gate_up (N, 2F) = [x W_gate | x W_up] -> out (N, F) = gelu_tanh(gate) * up, computed in float32."""
    f = out.shape[-1]
    g, u = gate_up[:, :f].float(), gate_up[:, f:].float()
    out.copy_(F.gelu(g, approximate="tanh") * u)
    return out


def rope_qkv(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_out: Tensor,
    k_out: Tensor,
    v_out: Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Split a fused QKV projection, rotate q and k (split-halves RoPE) and scatter to attention buffers.

    qkv (N, (H + 2·KVH)·Dh); cos, sin (N, Dh/2) float32; q_out (N, H·Dh);
    k_out, v_out (KVH, N, Dh) — views into the layer's K/V buffers at the right token offset.
    """
    n = qkv.shape[0]
    dh = q_out.shape[-1] // num_heads
    heads = qkv.view(n, num_heads + 2 * num_kv_heads, dh).float()
    x1, x2 = heads[..., : dh // 2], heads[..., dh // 2 :]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    q_out.copy_(rotated[:, :num_heads].reshape(n, -1))
    k_out.copy_(rotated[:, num_heads : num_heads + num_kv_heads].transpose(0, 1))
    v_out.copy_(heads[:, num_heads + num_kv_heads :].transpose(0, 1))


def qkv_rope(
    a: Tensor,
    w_qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_out: Tensor,
    k_out: Tensor,
    v_out: Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """The QKV projection a (N, W) @ w_qkvᵀ followed by `rope_qkv` (one kernel on the GPU)."""
    rope_qkv(a @ w_qkv.t(), cos, sin, q_out, k_out, v_out, num_heads, num_kv_heads)


@dataclass(frozen=True)
class Prefetch:
    """Weights that later kernels will read, for a kernel to start fetching into the GPU's L2 cache ahead
    of them. A hint with no effect on any result: the definitions here ignore it, and the split attention's
    combine kernel carries it out (so an unsplit attention drops it).

    whole: a tensor read whole. rows with tables (at most 2): rows `offset + rows[j]` of each
    (matrix, offset) (the Action Cache's selected neurons in the gate and up halves of a gate/up weight)."""

    whole: Tensor | None = None
    rows: Tensor | None = None
    tables: tuple[tuple[Tensor, int], ...] = ()

    def __post_init__(self) -> None:
        if len(self.tables) > 2:
            raise ValueError(f"Prefetch: at most 2 row tables, got {len(self.tables)}")


def attention(
    q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, num_heads: int, prefetch: Prefetch | None = None
) -> Tensor:
    """Attention of N queries over Lk keys with an additive key mask.

    q (N, H·Dh); k, v (KVH, Lk, Dh); key_bias (Lk,) 0 for attended keys, a large negative number for
    masked ones. Returns (N, H·Dh). Dispatches to PyTorch's fused SDPA kernels on CUDA. `prefetch` is a
    hint for the Triton kernel (see Prefetch).
    """
    n = q.shape[0]
    kvh, lk, dh = k.shape
    qh = q.view(1, n, num_heads, dh).transpose(1, 2)  # (1, H, N, Dh), a strided view
    if kvh == num_heads:
        kh, vh = k[None], v[None]
    elif kvh == 1:  # multi-query: broadcast the single K/V head without a copy
        kh, vh = k[None].expand(1, num_heads, lk, dh), v[None].expand(1, num_heads, lk, dh)
    else:
        group = num_heads // kvh
        kh, vh = k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None]
    bias = key_bias.to(q.dtype).view(1, 1, 1, lk).expand(1, num_heads, n, lk)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias)  # (1, H, N, Dh)
    return out.transpose(1, 2).reshape(n, num_heads * dh)


def packed_attention(qkv: Tensor, batch: int, num_heads: int) -> Tensor:
    """Unmasked self-attention of `batch` sequences packed in one QKV matmul output (the SigLIP encoder).

    qkv (B·T, 3·H·Dh), each row [q | k | v] with the heads in order. Returns (B·T, H·Dh).
    """
    n, width = qkv.shape[0], qkv.shape[1] // 3
    q, k, v = qkv.view(batch, n // batch, 3, num_heads, width // num_heads).unbind(2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).reshape(n, width)


def action_step(
    x: Tensor,
    *,
    h: Tensor | None = None,
    euler_w: Tensor | None = None,
    euler_b: Tensor | None = None,
    res: Tensor | None = None,
    out: Tensor | None = None,
    in_w: Tensor | None = None,
    in_b: Tensor | None = None,
    eps: float = 1e-6,
    mul: Tensor | None = None,
    add: Tensor | None = None,
) -> Tensor:
    """The action expert's work between two denoising steps, per action token (one kernel on the GPU).

    x (Ha, A) float32 noisy actions, updated in place. With `h` (Ha, We), the expert's final-norm output:
    the Euler update x += h·euler_wᵀ + euler_b (euler_w (A, We) and euler_b (A,) already scaled by dt).
    With `res`: the next step's input projection res (Ha, We) float32 = x·in_wᵀ + in_b (in_w (We, A)),
    and out (Ha, We) = RMSNorm(res)·mul + add, the first expert layer's adaRMS-modulated input.
    """
    if h is not None:
        x += h.float() @ euler_w.t() + euler_b
    if res is not None:
        res.copy_(x @ in_w.t() + in_b)
        add_norm(res, None, out, eps=eps, rms=True, mul=mul, add=add)
    return x
