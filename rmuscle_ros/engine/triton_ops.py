"""Triton kernels for the graph engine's fused operators (CUDA; `TRITON_INTERPRET=1` runs them on CPU).

Each function has the same signature and meaning as its definition in `rmuscle_ros.engine.ops`.
Only imported by the graph engine on a CUDA device (and by the interpreter-mode tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from rmuscle_ros.engine import ops

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _add_norm_kernel(
    res_ptr,
    y_ptr,
    y_bias_ptr,
    gate_ptr,
    mul_ptr,
    add_ptr,
    out_ptr,
    D,
    eps,
    stride_res,
    stride_y,
    stride_y_split,
    stride_out,
    Y_SPLITS: tl.constexpr,
    HAS_Y: tl.constexpr,
    HAS_Y_BIAS: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_MUL: tl.constexpr,
    HAS_ADD: tl.constexpr,
    RMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < D
    x = tl.load(res_ptr + row * stride_res + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_Y:
        y = tl.load(y_ptr + row * stride_y + cols, mask=valid, other=0.0).to(tl.float32)
        for split in range(1, Y_SPLITS):  # split-K partial products, summed in a fixed order
            y += tl.load(y_ptr + split * stride_y_split + row * stride_y + cols, mask=valid, other=0.0)
        if HAS_Y_BIAS:
            y += tl.load(y_bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        if HAS_GATE:
            y *= tl.load(gate_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        x += y
        tl.store(res_ptr + row * stride_res + cols, x, mask=valid)
    if RMS:
        h = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    else:
        centred = tl.where(valid, x - tl.sum(x, axis=0) / D, 0.0)
        h = centred * tl.rsqrt(tl.sum(centred * centred, axis=0) / D + eps)
    if HAS_MUL:
        h *= tl.load(mul_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_ADD:
        h += tl.load(add_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, h.to(out_ptr.dtype.element_ty), mask=valid)


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
) -> Tensor:
    n, d = res.shape
    block = triton.next_power_of_2(d)
    _add_norm_kernel[(n,)](
        res,
        res if y is None else y,
        res if y_bias is None else y_bias,
        res if gate is None else gate,
        res if mul is None else mul,
        res if add is None else add,
        out,
        d,
        eps,
        res.stride(0),
        0 if y is None else y.stride(-2),
        y.stride(0) if y is not None and y.ndim == 3 else 0,
        out.stride(0),
        Y_SPLITS=y.shape[0] if y is not None and y.ndim == 3 else 1,
        HAS_Y=y is not None,
        HAS_Y_BIAS=y_bias is not None,
        HAS_GATE=gate is not None,
        HAS_MUL=mul is not None,
        HAS_ADD=add is not None,
        RMS=rms,
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
    )
    return out


@triton.jit
def _geglu_kernel(gu_ptr, out_ptr, F, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < F
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + F + cols, mask=valid, other=0.0).to(tl.float32)
    # gelu_tanh(g) = 0.5·g·(1 + tanh(z)) = g·sigmoid(2z), z = √(2/π)·(g + 0.044715·g³)
    z = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
    out = g * tl.sigmoid(2.0 * z) * u
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=valid)


def geglu(gate_up: Tensor, out: Tensor) -> Tensor:
    n, f = out.shape
    block = 1024
    _geglu_kernel[(n, triton.cdiv(f, block))](gate_up, out, f, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out


@triton.jit
def _rope_qkv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    stride_qkv,
    stride_cs,
    stride_q,
    stride_k_head,
    stride_k_tok,
    stride_v_head,
    stride_v_tok,
    H: tl.constexpr,
    KVH: tl.constexpr,
    HALF: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1 query heads, then KVH key heads, then KVH value heads
    offs = tl.arange(0, HALF)
    src = qkv_ptr + tok * stride_qkv + head * 2 * HALF
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    if head < H + KVH:
        c = tl.load(cos_ptr + tok * stride_cs + offs)
        s = tl.load(sin_ptr + tok * stride_cs + offs)
        r1 = x1 * c - x2 * s
        r2 = x2 * c + x1 * s
        if head < H:
            dst = q_ptr + tok * stride_q + head * 2 * HALF
            tl.store(dst + offs, r1.to(q_ptr.dtype.element_ty))
            tl.store(dst + HALF + offs, r2.to(q_ptr.dtype.element_ty))
        else:
            dst = k_ptr + (head - H) * stride_k_head + tok * stride_k_tok
            tl.store(dst + offs, r1.to(k_ptr.dtype.element_ty))
            tl.store(dst + HALF + offs, r2.to(k_ptr.dtype.element_ty))
    else:
        dst = v_ptr + (head - H - KVH) * stride_v_head + tok * stride_v_tok
        tl.store(dst + offs, x1.to(v_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, x2.to(v_ptr.dtype.element_ty))


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
    n = qkv.shape[0]
    half = cos.shape[-1]
    if half & (half - 1) or qkv.stride(-1) != 1 or q_out.stride(-1) != 1 or k_out.stride(-1) != 1:
        return ops.rope_qkv(qkv, cos, sin, q_out, k_out, v_out, num_heads, num_kv_heads)
    _rope_qkv_kernel[(n, num_heads + 2 * num_kv_heads)](
        qkv,
        cos,
        sin,
        q_out,
        k_out,
        v_out,
        qkv.stride(0),
        cos.stride(0),
        q_out.stride(0),
        k_out.stride(0),
        k_out.stride(1),
        v_out.stride(0),
        v_out.stride(1),
        H=num_heads,
        KVH=num_kv_heads,
        HALF=half,
    )


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    stats_ptr,
    N,
    Lk,
    scale,
    stride_q,
    stride_k_head,
    stride_k_tok,
    stride_v_head,
    stride_v_tok,
    stride_out,
    G: tl.constexpr,
    DH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    SPLIT: tl.constexpr,
    KEYS_PER_SPLIT: tl.constexpr,
):
    """Flash attention over one K/V head for a block of its G·N query rows (query heads folded into rows).

    With SPLIT, each program covers one slice of the keys and writes an unnormalised partial result plus
    its running max and denominator; `_attention_combine_kernel` merges the slices (flash-decoding).
    """
    kv_head = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)  # row r = (head-in-group r // N, token r % N)
    split = tl.program_id(2)
    row_ok = rows < G * N
    head = kv_head * G + rows // N
    tok = rows % N
    d = tl.arange(0, DH)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q + head[:, None] * DH + d[None, :], mask=row_ok[:, None], other=0.0
    )
    m_i = tl.full([BM], -1e30, tl.float32)  # finite: a fully masked block must not produce inf - inf
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DH], tl.float32)
    start = split * KEYS_PER_SPLIT
    stop = tl.minimum(start + KEYS_PER_SPLIT, Lk)
    for n0 in range(0, KEYS_PER_SPLIT, BN):
        cols = start + n0 + tl.arange(0, BN)
        col_ok = cols < stop
        k = tl.load(
            k_ptr + kv_head * stride_k_head + cols[:, None] * stride_k_tok + d[None, :],
            mask=col_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k)) * scale
        s += tl.load(bias_ptr + cols, mask=col_ok, other=-1e30)[None, :]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(
            v_ptr + kv_head * stride_v_head + cols[:, None] * stride_v_tok + d[None, :],
            mask=col_ok[:, None],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if SPLIT:
        flat = kv_head * G * N + rows  # partials are indexed by (split, global row)
        total = tl.num_programs(0) * G * N
        tl.store(part_ptr + (split * total + flat)[:, None] * DH + d[None, :], acc, mask=row_ok[:, None])
        tl.store(stats_ptr + (2 * split) * total + flat, m_i, mask=row_ok)
        tl.store(stats_ptr + (2 * split + 1) * total + flat, l_i, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        dst = out_ptr + tok[:, None] * stride_out + head[:, None] * DH + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attention_combine_kernel(
    part_ptr, stats_ptr, out_ptr, N, total, num_splits, stride_out, SPLITS_P2: tl.constexpr, DH: tl.constexpr
):
    row = tl.program_id(0)  # global row = kv_head·G·N + head-in-group·N + token = head·N + token
    head = row // N
    tok = row % N
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < num_splits
    m = tl.load(stats_ptr + (2 * s) * total + row, mask=s_ok, other=-1e30)
    l_s = tl.load(stats_ptr + (2 * s + 1) * total + row, mask=s_ok, other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))
    d = tl.arange(0, DH)
    acc = tl.load(part_ptr + (s[:, None] * total + row) * DH + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + tok * stride_out + head * DH + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _skinny_matmul_kernel(
    a_ptr, w_ptr, c_ptr, M, N, stride_a, stride_w, stride_c, stride_c_split,
    K_PER_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GEGLU: tl.constexpr,
):  # fmt: skip
    """c[split] = a[:, K-slice] @ w[:, K-slice]ᵀ for a few rows of `a`: streams the weight once.

    With GEGLU, w is [W_gate; W_up] (2N rows) and c = gelu_tanh(a W_gateᵀ) * (a W_upᵀ), (M, N).
    """
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    split = tl.program_id(1)
    rows = tl.arange(0, BM)
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K_PER_SPLIT, BK):
        ks = split * K_PER_SPLIT + k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=rows[:, None] < M, other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=cols[:, None] < N, other=0.0)
        acc += tl.dot(a, tl.trans(w))
        if GEGLU:
            w_up = tl.load(
                w_ptr + (N + cols)[:, None] * stride_w + ks[None, :], mask=cols[:, None] < N, other=0.0
            )
            acc_up += tl.dot(a, tl.trans(w_up))
    if GEGLU:
        z = SQRT_2_OVER_PI * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * z) * acc_up
    dst = c_ptr + split * stride_c_split + rows[:, None] * stride_c + cols[None, :]
    tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _launch_skinny(
    a: Tensor, w: Tensor, c: Tensor, n: int, splits: int, geglu: bool, cfg: dict[str, int]
) -> None:
    _skinny_matmul_kernel[(triton.cdiv(n, cfg["bn"]), splits)](
        a, w, c, a.shape[0], n, a.stride(0), w.stride(0), c.stride(-2), c.stride(0) if splits > 1 else 0,
        K_PER_SPLIT=a.shape[1] // splits, BM=max(16, triton.next_power_of_2(a.shape[0])), BN=cfg["bn"],
        BK=cfg["bk"], GEGLU=geglu, num_warps=cfg["warps"], num_stages=cfg["stages"],
    )  # fmt: skip


def _skinny_ok(a: Tensor, w: Tensor, splits: int, bk: int) -> bool:
    return a.shape[0] <= 64 and a.shape[1] % (splits * bk) == 0 and a.stride(-1) == 1 and w.stride(-1) == 1


def linear(a: Tensor, w: Tensor, splits: int = 1, config: dict[str, int] | None = None) -> Tensor:
    """a (M, K) @ w (N, K)ᵀ. Few rows (the denoising steps): a weight-streaming Triton kernel, returning
    `splits` float32 partial products (splits, M, N) when splits > 1 (summed by `add_norm`), else (M, N)
    in a's dtype. Many rows: cuBLAS. Default launch configs come from bench/tune_kernels.py on an H200."""
    m, n = a.shape[0], w.shape[0]
    # One config serves the expert's qkv, o (split 4), gate/up and down (split 8): within 4 % of the best
    # per shape in bench/results/triton_tuning_h200_hbm.json, and 1.0-1.7x faster than cuBLAS there.
    cfg = {"bn": 32, "bk": 128, "warps": 4, "stages": 4} | (config or {})
    if not _skinny_ok(a, w, splits, cfg["bk"]):
        return ops.linear(a, w, splits)
    shape = (splits, m, n) if splits > 1 else (m, n)
    c = torch.empty(shape, device=a.device, dtype=torch.float32 if splits > 1 else a.dtype)
    _launch_skinny(a, w, c, n, splits, False, cfg)
    return c


def linear_geglu(a: Tensor, gate_up: Tensor, out: Tensor, config: dict[str, int] | None = None) -> Tensor:
    """out (M, F) = gelu_tanh(a W_gateᵀ) * (a W_upᵀ), gate_up = [W_gate; W_up] (2F, K), in one kernel."""
    cfg = {"bn": 32, "bk": 128, "warps": 4, "stages": 4} | (config or {})  # 7.2 µs vs 9.4 unfused (H200)
    if not _skinny_ok(a, gate_up, 1, cfg["bk"]):
        return ops.linear_geglu(a, gate_up, out)
    _launch_skinny(a, gate_up, out, out.shape[1], 1, True, cfg)
    return out


@triton.jit
def _skinny_qkv_rope_kernel(
    a_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, M,
    stride_a, stride_w, stride_cs, stride_q, stride_k_head, stride_k_tok, stride_v_head, stride_v_tok,
    K: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """QKV projection with RoPE in the epilogue, for a few rows. Each program owns BN rotation pairs of
    one head: columns d and d + Dh/2, so the rotation needs nothing from other programs."""
    blocks_per_head: tl.constexpr = HALF // BN
    head = tl.program_id(0) // blocks_per_head
    d = (tl.program_id(0) % blocks_per_head) * BN + tl.arange(0, BN)  # index within the first half
    cols = head * 2 * HALF + d
    rows = tl.arange(0, BM)
    acc1 = tl.zeros([BM, BN], tl.float32)
    acc2 = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=rows[:, None] < M, other=0.0)
        w1 = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :])
        w2 = tl.load(w_ptr + (cols + HALF)[:, None] * stride_w + ks[None, :])
        acc1 += tl.dot(a, tl.trans(w1))
        acc2 += tl.dot(a, tl.trans(w2))
    row_ok = rows[:, None] < M
    if head < H + KVH:
        c = tl.load(cos_ptr + rows[:, None] * stride_cs + d[None, :], mask=row_ok, other=0.0)
        s = tl.load(sin_ptr + rows[:, None] * stride_cs + d[None, :], mask=row_ok, other=0.0)
        r1 = acc1 * c - acc2 * s
        r2 = acc2 * c + acc1 * s
        if head < H:
            dst = q_ptr + rows[:, None] * stride_q + head * 2 * HALF + d[None, :]
            tl.store(dst, r1.to(q_ptr.dtype.element_ty), mask=row_ok)
            tl.store(dst + HALF, r2.to(q_ptr.dtype.element_ty), mask=row_ok)
        else:
            dst = k_ptr + (head - H) * stride_k_head + rows[:, None] * stride_k_tok + d[None, :]
            tl.store(dst, r1.to(k_ptr.dtype.element_ty), mask=row_ok)
            tl.store(dst + HALF, r2.to(k_ptr.dtype.element_ty), mask=row_ok)
    else:
        dst = v_ptr + (head - H - KVH) * stride_v_head + rows[:, None] * stride_v_tok + d[None, :]
        tl.store(dst, acc1.to(v_ptr.dtype.element_ty), mask=row_ok)
        tl.store(dst + HALF, acc2.to(v_ptr.dtype.element_ty), mask=row_ok)


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
    config: dict[str, int] | None = None,
) -> None:
    half = cos.shape[-1]
    cfg = {"bn": 16, "bk": 128, "warps": 4, "stages": 4} | (config or {})
    if (
        not _skinny_ok(a, w_qkv, 1, cfg["bk"])
        or half % cfg["bn"]
        or q_out.stride(-1) != 1
        or k_out.stride(-1) != 1
        or v_out.stride(-1) != 1
    ):
        return ops.qkv_rope(a, w_qkv, cos, sin, q_out, k_out, v_out, num_heads, num_kv_heads)
    grid = ((num_heads + 2 * num_kv_heads) * (half // cfg["bn"]),)
    _skinny_qkv_rope_kernel[grid](
        a, w_qkv, cos, sin, q_out, k_out, v_out, a.shape[0],
        a.stride(0), w_qkv.stride(0), cos.stride(0), q_out.stride(0),
        k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
        K=a.shape[1], H=num_heads, KVH=num_kv_heads, HALF=half,
        BM=max(16, triton.next_power_of_2(a.shape[0])), BN=cfg["bn"], BK=cfg["bk"],
        num_warps=cfg["warps"], num_stages=cfg["stages"],
    )  # fmt: skip


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # interpreter mode: pretend to be an H100/H200
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention(
    q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, num_heads: int, config: dict[str, int] | None = None
) -> Tensor:
    n = q.shape[0]
    kvh, lk, dh = k.shape
    group = num_heads // kvh
    if dh & (dh - 1) or dh < 16 or k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        return ops.attention(q, k, v, key_bias, num_heads)
    out = torch.empty(n, num_heads * dh, device=q.device, dtype=q.dtype)
    if group * n <= 1024:  # denoising steps: few query rows, split the keys (H200: 10.2 µs vs 54 for SDPA)
        cfg = {"bm": 32, "bn": 64, "warps": 4, "stages": 3, "max_splits": 8}
    else:  # prefill (H200: 27 µs vs 55 for SDPA)
        cfg = {"bm": 64, "bn": 32, "warps": 4, "stages": 3, "max_splits": 1}
    cfg |= config or {}
    bm, bn = cfg["bm"], cfg["bn"]
    row_blocks = triton.cdiv(group * n, bm)
    # Few query rows (the denoising steps): split the keys so that every SM has work (flash-decoding).
    splits = min(max(1, _sm_count(q.device) // (kvh * row_blocks)), triton.cdiv(lk, bn), cfg["max_splits"])
    keys_per_split = triton.cdiv(triton.cdiv(lk, splits), bn) * bn
    splits = triton.cdiv(lk, keys_per_split)
    split = splits > 1
    total = kvh * group * n
    part = torch.empty(splits, total, dh, device=q.device, dtype=torch.float32) if split else out
    stats = torch.empty(2 * splits, total, device=q.device, dtype=torch.float32) if split else out
    _attention_kernel[(kvh, row_blocks, splits)](
        q, k, v, key_bias, out, part, stats, n, lk, dh**-0.5,
        q.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
        G=group, DH=dh, BM=bm, BN=bn, SPLIT=split, KEYS_PER_SPLIT=keys_per_split,
        num_warps=cfg["warps"], num_stages=cfg["stages"],
    )  # fmt: skip
    if split:
        _attention_combine_kernel[(total,)](
            part, stats, out, n, total, splits, out.stride(0),
            SPLITS_P2=triton.next_power_of_2(splits), DH=dh, num_warps=4,
        )  # fmt: skip
    return out
