"""Where the denoising graph's time goes: re-capture it with one kind of kernel replaced by nothing.

Each variant's actions are meaningless; only the replay time is of interest. The time a kernel kind
costs *inside the graph* (its own run time plus the launch gap it adds, minus any overlap) is the
dense replay time minus the replay time without it. Prints a table and writes JSON to --out.

    python bench/ablate_denoise.py --out bench/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import cuda_time_ms, random_graph_engine, record_header, save_results
from rmuscle_ros.engine import triton_ops
from rmuscle_ros.models.config import get_preset

KINDS = ("qkv_rope", "attention", "o_proj", "linear_geglu", "down_proj", "add_norm", "action_step")
# attention without split-KV (no combine kernel); the step kernel 256 features at a time (not whole rows);
# every kind removed
EXTRA = ("attention_unsplit", "action_step_chunked", "all")


def ablated_ops(kinds: set[str], fused) -> types.ModuleType:
    """triton_ops with the given kernel kinds replaced by returning a preallocated buffer of the right shape."""
    m = types.ModuleType("ablated")
    for name in dir(triton_ops):
        setattr(m, name, getattr(triton_ops, name))
    cache: dict[tuple, torch.Tensor] = {}

    def buf(shape, dtype, device):
        key = (tuple(shape), dtype)
        if key not in cache:
            cache[key] = torch.zeros(shape, dtype=dtype, device=device)
        return cache[key]

    e = fused.cfg.expert
    dropped_k = {e.num_heads * e.head_dim for k in kinds if k == "o_proj"} | {
        e.mlp_dim for k in kinds if k == "down_proj"
    }
    if "qkv_rope" in kinds:
        m.qkv_rope = lambda *a, **k: None
    if "action_step" in kinds:  # the kernel between denoising steps
        m.action_step = lambda x, **k: x
    if "attention" in kinds:
        m.attention = lambda q, *a, **k: q
    if "action_step_chunked" in kinds:
        m.action_step = lambda x, **k: triton_ops.action_step(x, config={"row_max": 0}, **k)
    if "attention_unsplit" in kinds:
        m.attention = lambda *a, **k: triton_ops.attention(*a, config={"max_splits": 1}, **k)
    if dropped_k:

        def linear(a, w, s=1, *args, **kw):
            if a.shape[1] in dropped_k:
                shape = (s, a.shape[0], w.shape[0]) if s > 1 else (a.shape[0], w.shape[0])
                return buf(shape, torch.float32 if s > 1 else a.dtype, a.device)
            return triton_ops.linear(a, w, s, *args, **kw)

        m.linear = linear
    if "linear_geglu" in kinds:
        m.linear_geglu = lambda a, w, out, **k: out
    if "add_norm" in kinds:
        m.add_norm = lambda res, y, out, **k: out
    return m


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    device = torch.device("cuda")
    cfg = get_preset(args.preset)
    engine, bucket = random_graph_engine(args.preset, device)
    results = {}

    def time_denoise() -> float:
        return statistics.median(cuda_time_ms(lambda: engine.run_stage("denoise", bucket), args.iters))

    results["dense"] = time_denoise()
    real_ops = engine.fused.ops
    for kind in KINDS + EXTRA:
        engine.fused.ops = ablated_ops(set(KINDS) if kind == "all" else {kind}, engine.fused)
        key = ("denoise", bucket, "dense")
        engine._graphs.pop(key)
        engine._graphs[key] = engine._capture(engine._stage_fn(*key))
        results[f"without {kind}"] = time_denoise()
    engine.fused.ops = real_ops
    steps, depth = cfg.num_steps, cfg.expert.depth
    lines = [
        f"# Denoise graph by kernel kind — {torch.cuda.get_device_name(device)}",
        "",
        f"Full `{args.preset}` denoise graph replay, {steps} steps × {depth} layers: dense "
        f"{results['dense']:.3f} ms (median of {args.iters}). A kind's cost is the dense replay time minus the "
        "replay time with that kind of kernel replaced by nothing.",
        "",
        "| kernel kind | ms in graph | µs per layer-step |",
        "|---|---|---|",
    ]
    rows = {}
    for kind in KINDS + EXTRA:
        cost = results["dense"] - results[f"without {kind}"]
        per = cost * 1e3 / (steps * depth)
        rows[kind] = {"ms": round(cost, 3), "us_per_layer_step": round(per, 2)}
        lines.append(f"| {kind} | {cost:.3f} | {per:.2f} |")
    record = {
        **record_header(torch.cuda.get_device_name(device), args.commit),
        "replay_ms": results,
        "kinds": rows,
    }
    save_results(args.out, f"ablate_denoise_{gpu_tag(torch.cuda.get_device_name(device))}", record,
                 "\n".join(lines) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
