"""Compile the graph engine's Triton kernels for a GPU on a machine without one: Hopper (sm_90a, the H200
we measure on) or a Jetson Thor (sm_110a, the reference deployment).

Run by test_kernels_compile.py in a child process (Triton's interpreter must be off here). Each wrapper
in `triton_ops` is called as the engine calls it (`engine/fused.py`), on CPU tensors of the full-size
`pi05` shapes and under PDL; the kernel launches are recorded instead of run, and each distinct
specialization is compiled through ptxas, with PDL and without (`graph-nopdl`). The interpreter tests
check what the kernels compute; this checks that the compiler accepts them (it rejects code the
interpreter runs, e.g. a name defined under a branch on a runtime value and used after it).

    python test/kernels_compile.py             # sm_90a; one line per kernel, exit status 1 on a failure
    TRITON_PTXAS_BLACKWELL_PATH=<CUDA 13's ptxas> python test/kernels_compile.py --arch 110   # the Thor

Triton 3.6's own ptxas does not know sm_110a (`triton_ops.assembler_problem`); the tests take CUDA 13's
from the `nvidia-cuda-nvcc` wheel (`make venv` installs it).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rmuscle_ros.engine import triton_ops as T
from rmuscle_ros.engine.fused import gather_splits, keep_neuron_count, rho_count, split_k
from rmuscle_ros.engine.ops import Prefetch
from rmuscle_ros.models.config import get_preset

OPTIONS = ("num_warps", "num_stages", "launch_pdl", "enable_fp_fusion")
bf16, f32, i32, i64 = torch.bfloat16, torch.float32, torch.int32, torch.int64


def engine_calls() -> None:
    """Every Triton wrapper with the full-size shapes and options the engine uses (see fused.py)."""
    cfg = get_preset("pi05")
    v, g, e = cfg.vision, cfg.vlm, cfg.expert
    t = lambda *shape, dtype=bf16: torch.empty(*shape, dtype=dtype)  # noqa: E731
    # vision: 3 cameras × 256 tokens
    nv = cfg.image_tokens
    res, h = t(nv, v.width, dtype=f32), t(nv, v.width)
    T.add_norm(res, None, h, eps=1e-6, rms=False)
    T.packed_attention(t(nv, 3 * v.width), cfg.num_cameras, v.num_heads)
    T.add_norm(res, t(nv, v.width), h, eps=1e-6, rms=False, y_bias=t(v.width, dtype=f32))
    # prefill: the visual tokens and a 64-token prompt bucket
    lp = nv + 64
    res, h = t(lp, g.width, dtype=f32), t(lp, g.width)
    dq, dkv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    q, k, vv = t(lp, dq), t(g.num_kv_heads, lp, g.head_dim), t(g.num_kv_heads, lp, g.head_dim)
    cos, sin = t(lp, g.head_dim // 2, dtype=f32), t(lp, g.head_dim // 2, dtype=f32)
    T.add_norm(res, None, h, eps=1e-6, rms=True)
    T.rope_qkv(t(lp, dq + 2 * dkv), cos, sin, q, k, vv, g.num_heads, g.num_kv_heads)
    T.attention(q, k, vv, t(lp, dtype=f32), g.num_heads)
    T.add_norm(res, t(lp, g.width), h, eps=1e-6, rms=True)
    gate_up = t(2 * g.mlp_dim, g.width)
    T.linear_geglu(h, gate_up, t(lp, g.mlp_dim))
    # the Context Cache: 2 stacked reference entries, one picked by a slot on the device
    keep = rho_count(0.4, nv)
    ref_in, ref_out = t(2, nv, g.width), t(2, nv, g.width)
    slot = torch.zeros(1, dtype=i64)
    drift, rows, inv = t(nv, dtype=f32), torch.zeros(keep + lp - nv, dtype=i64), t(lp, dtype=i32)
    T.add_norm(res, t(lp, g.width), h, eps=1e-6, rms=True, drift_ref=ref_in, drift_out=drift, ref_slot=slot,
               drift_scale=t(g.width, dtype=f32))  # fmt: skip
    T.context_select(drift, keep, lp, rows, inv, t(lp, dtype=f32))  # with the call's key bias, as the engine
    # the match stage's pick among 20 window entries
    T.window_match(t(cfg.num_cameras, g.width, dtype=f32), t(20, cfg.num_cameras * g.width, dtype=f32),
                   torch.ones(20, dtype=torch.bool), slot, t(2, dtype=f32))  # fmt: skip
    T.linear_geglu(t(keep + lp - nv, g.width), gate_up, t(keep + lp - nv, g.mlp_dim))
    T.add_norm(
        res, t(keep + lp - nv, g.width), h, eps=1e-6, rms=True, y_rows=inv, y_alt=ref_out, ref_slot=slot
    )
    # the denoising loop: 50 action tokens attending the prefix K/V (capacity padded to 16)
    ha, cap = cfg.horizon, -(-(lp + cfg.horizon) // 16) * 16
    kv_k, kv_v = t(e.num_kv_heads, cap, e.head_dim), t(e.num_kv_heads, cap, e.head_dim)
    res, h, x = t(ha, e.width, dtype=f32), t(ha, e.width), t(ha, cfg.action_dim, dtype=f32)
    mod = {"mul": t(e.width, dtype=f32), "add": t(e.width, dtype=f32)}
    step = {"euler_w": t(cfg.action_dim, e.width, dtype=f32), "euler_b": t(cfg.action_dim, dtype=f32),
            "in_w": t(e.width, cfg.action_dim, dtype=f32), "in_b": t(e.width, dtype=f32), "eps": 1e-6}  # fmt: skip
    T.action_step(x, res=res, out=h, **mod, **step)
    T.action_step(x, h=h, res=res, out=h, **mod, **step)
    T.action_step(x, h=h, **step)
    eq = e.num_heads * e.head_dim
    q = t(ha, eq)
    T.qkv_rope(h, t(eq + 2 * e.num_kv_heads * e.head_dim, e.width), t(ha, e.head_dim // 2, dtype=f32),
               t(ha, e.head_dim // 2, dtype=f32), q, kv_k[:, lp : lp + ha], kv_v[:, lp : lp + ha],
               e.num_heads, e.num_kv_heads)  # fmt: skip
    gate_up, down, down_t = t(2 * e.mlp_dim, e.width), t(e.width, e.mlp_dim), t(e.mlp_dim, e.width)
    sel = keep_neuron_count(0.5, e.mlp_dim)
    idx = torch.arange(sel, dtype=i32) * 2
    for ahead in (
        Prefetch(whole=gate_up),
        Prefetch(rows=idx, tables=((gate_up, 0), (gate_up, e.mlp_dim))),
    ):
        attn = T.attention(q, kv_k, kv_v, t(cap, dtype=f32), e.num_heads, prefetch=ahead)
    gate = {"gate": t(e.width, dtype=f32), **mod, "res_ready": True}
    T.add_norm(res, T.linear(attn, t(e.width, eq), split_k(eq)), h, eps=1e-6, rms=True, **gate)
    act, act_anchor, y_anchor = t(ha, e.mlp_dim), t(ha, e.mlp_dim), t(ha, e.width, dtype=f32)
    T.linear_geglu(h, gate_up, act)
    y = T.linear(act, down, split_k(e.mlp_dim))
    T.add_norm(res, y, h, eps=1e-6, rms=True, y_store=y_anchor, **gate)
    T.neuron_scores(act, act_anchor, t(e.mlp_dim, dtype=f32))  # a recording denoise's scores
    delta = t(ha, sel)
    T.linear_geglu(h, gate_up, delta, neurons=idx, anchor=act_anchor)
    y = T.linear(delta, down_t, gather_splits(sel), neurons=idx)
    T.add_norm(res, y, h, eps=1e-6, rms=True, y_base=y_anchor, **gate)
    T.add_norm(
        res, y_anchor, h, eps=1e-6, rms=True, **gate
    )  # the ramp's step of 0 neurons: the anchor's output


def record_launches() -> list[tuple[JITFunction, dict[str, object], dict[str, object]]]:
    """(kernel, its arguments by name, launch options) of every launch `engine_calls` makes."""
    launches = []

    def record(self: JITFunction, grid: object):
        def launch(*args: object, **kwargs: object) -> None:
            named = dict(zip(self.arg_names, args, strict=False)) | {
                k: v for k, v in kwargs.items() if k not in OPTIONS
            }
            launches.append((self, named, {k: v for k, v in kwargs.items() if k in OPTIONS}))

        return launch

    original = JITFunction.__getitem__
    JITFunction.__getitem__ = record
    try:
        with T.programmatic_launch(True):
            engine_calls()
    finally:
        JITFunction.__getitem__ = original
    return launches


def specialize(kernel: JITFunction, named: dict[str, object]) -> tuple[dict, dict, dict]:
    """(constexprs, signature, attributes) as Triton's launcher specializes them: integers equal to 1
    become constants, and pointers and integers divisible by 16 say so. Without those hints the compiler
    neither vectorizes nor pipelines the loads, and would compile other code than the GPU runs."""
    constexprs = {p.name: named[p.name] for p in kernel.params if p.is_constexpr and p.name in named}
    signature, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            continue
        kind, spec = native_specialize_impl(
            BaseBackend, named[p.name], p.is_const, not p.do_not_specialize, True
        )
        signature[p.name] = kind
        if kind == "constexpr":
            constexprs[p.name] = named[p.name]
        elif isinstance(spec, str):
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    return constexprs, signature, attrs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--arch", type=int, default=90, help="compute capability as one number: 90 (H200), 110 (Thor)"
    )
    target = GPUTarget("cuda", p.parse_args().arch, 32)
    compiled, failed = set(), 0
    shared: dict[str, int] = {}  # kernel -> the most shared memory one of its programs needs, bytes
    mma: Counter[str] = Counter()  # tensor-core instruction families in the PTX
    for kernel, named, options in record_launches():
        for pdl in (True, False):
            constexprs, signature, attrs = specialize(kernel, named)
            if "PDL" in constexprs:
                constexprs["PDL"] = pdl
            opts = dict(options) | {"launch_pdl": pdl}
            key = (
                kernel.fn.__name__,
                repr(sorted(signature.items())),
                repr(sorted(constexprs.items())),
                repr(opts),
            )
            if key in compiled:
                continue
            compiled.add(key)
            try:
                binary = compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=opts)
                name = kernel.fn.__name__
                shared[name] = max(shared.get(name, 0), binary.metadata.shared)
                mma.update(
                    re.findall(
                        r"^\s*(?:@!?%p\d+\s+)?(tcgen05\.mma|wgmma\.mma_async|mma\.sync)\b",
                        binary.asm["ptx"],
                        re.M,
                    )
                )
                print(f"ok   {name} PDL={pdl}")
            except Exception as exc:  # report every failure, then fail
                failed += 1
                print(f"FAIL {kernel.fn.__name__} PDL={pdl}: {type(exc).__name__}: {str(exc)[:2000]}")
    if shared:
        top = max(shared, key=shared.__getitem__)
        print(f"largest shared memory per program: {shared[top]} bytes ({top})")
        print(
            "tensor-core instructions: " + (", ".join(f"{k} ×{n}" for k, n in sorted(mma.items())) or "none")
        )
    print(
        f"{len(compiled) - failed} of {len(compiled)} kernel specializations compiled for sm_{target.arch}a"
    )
    return 1 if failed or not compiled else 0


if __name__ == "__main__":
    sys.exit(main())
