"""Triton kernels for the graph engine's fused operators (CUDA; `TRITON_INTERPRET=1` runs them on CPU).

Each function has the same signature and meaning as its definition in `rmuscle_ros.engine.ops`.
Only imported by the graph engine on a CUDA device (and by the interpreter-mode tests).
"""

from __future__ import annotations

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
    stride_out,
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
        0 if y is None else y.stride(0),
        out.stride(0),
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


# Attention goes through PyTorch's fused SDPA kernels (flash / memory-efficient / cuDNN).
attention = ops.attention
