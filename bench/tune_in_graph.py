"""Tune the denoising loop's kernel configurations where they run: inside the captured denoise graph.

Isolated sweeps (tune_kernels.py) cannot see launch overlap (programmatic dependent launch) or the
caches as the chain leaves them. Here each candidate configuration of one kernel kind is set, the
full-size denoise graph is re-captured, and its replay is timed (median of --iters); the other kinds
keep their defaults. Also checks each candidate's actions against the default's (bf16 tolerance).
Writes bench/results/tune_in_graph_<gpu>.json.

    python bench/tune_in_graph.py --out bench/results
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import cuda_time_ms, random_graph_engine, record_header, save_results
from rmuscle_ros.engine import fused as fused_module
from rmuscle_ros.engine import triton_ops
from rmuscle_ros.engine.fused import gather_splits
from rmuscle_ros.engine.graph import CacheShapes

GRIDS: dict[str, dict[str, list[int]]] = {
    "attention": {
        "bm": [16, 32, 64],
        "bn": [32, 64],
        "max_splits": [4, 8, 16],
        "warps": [4, 8],
        "stages": [3],
    },
    "qkv_rope": {"bn": [16, 32], "bk": [64, 128, 256], "warps": [4, 8], "stages": [3, 4]},
    "linear_geglu": {"bn": [16, 32, 64], "bk": [64, 128, 256], "warps": [4], "stages": [3, 4]},
    "o_proj": {"splits": [2, 4, 8], "bn": [16, 32, 64], "bk": [64, 128], "warps": [4], "stages": [4]},
    "down_proj": {"splits": [4, 8, 16], "bn": [16, 32, 64], "bk": [64, 128], "warps": [4], "stages": [4]},
}
# The Action Cache's gathered kernels, tuned in the cached denoise graph (--cache RHO_P RHO_N).
CACHED_GRIDS: dict[str, dict[str, list[int]]] = {
    "gathered_geglu": {"bn": [16, 32], "bk": [128, 256, 512], "warps": [4, 8], "stages": [2, 3, 4]},
    "gathered_down": {"splits": [4, 8], "bn": [32, 64, 128], "bk": [64, 128], "warps": [4], "stages": [4]},
}


def configured_ops(kind: str, cfg: dict[str, int], fused) -> types.ModuleType:
    m = types.ModuleType("configured")
    for name in dir(triton_ops):
        setattr(m, name, getattr(triton_ops, name))
    kcfg = {k: v for k, v in cfg.items() if k != "splits"}
    e = fused.cfg.expert
    if kind == "gathered_geglu":
        m.linear_geglu = lambda a, w, out, **k: triton_ops.linear_geglu(
            a, w, out, config=kcfg if k.get("neurons") is not None else None, **k
        )
    elif kind == "gathered_down":
        m.linear = lambda a, w, s=1, config=None, **kw: triton_ops.linear(
            a, w, s, kcfg if kw.get("neurons") is not None else config, **kw
        )
    elif kind == "attention":
        m.attention = lambda *a, **k: triton_ops.attention(*a, config=kcfg, **k)
    elif kind == "qkv_rope":
        m.qkv_rope = lambda *a, **k: triton_ops.qkv_rope(*a, config=kcfg)
    elif kind == "linear_geglu":
        m.linear_geglu = lambda a, w, out, **k: triton_ops.linear_geglu(a, w, out, config=kcfg, **k)
    else:
        k_dim = e.num_heads * e.head_dim if kind == "o_proj" else e.mlp_dim

        def linear(a, w, s=1, config=None, **kw):
            return triton_ops.linear(a, w, s, kcfg if a.shape[1] == k_dim else config, **kw)

        m.linear = linear
    return m


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--only", action="append", choices=list(GRIDS) + list(CACHED_GRIDS), default=None)
    p.add_argument(
        "--cache", nargs=2, type=float, metavar=("RHO_P", "RHO_N"), default=None,
        help="tune the Action Cache's gathered kernels in the cached denoise graph (random reference entry)",
    )  # fmt: skip
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    device = torch.device("cuda")
    options = {"cache": CacheShapes(*args.cache)} if args.cache else {}
    engine, bucket = random_graph_engine(args.preset, device, **options)
    fused = engine.fused
    defaults = {"o_splits": fused.o_splits, "down_splits": fused.down_splits}
    variant = "cached" if args.cache else "dense"
    key = ("denoise", bucket, variant)
    grids = CACHED_GRIDS if args.cache else GRIDS
    if args.cache:  # a random entry: the kernels' cost does not depend on which neurons they read
        gen = torch.Generator(device).manual_seed(0)
        steps, depth, keep = engine.neurons.shape
        order = torch.rand(steps, depth, engine.cfg.expert.mlp_dim, device=device, generator=gen).argsort(-1)
        engine.neurons.copy_(order[..., :keep].sort(-1).values)

    def replay_ms() -> float:
        return statistics.median(
            cuda_time_ms(lambda: engine.run_stage("denoise", bucket, variant=variant), args.iters)
        )

    engine.run_stage("prefill", bucket)
    engine.run_stage("denoise", bucket, variant=variant)
    reference = engine.actions.clone()
    results: dict[str, dict] = {"default_ms": round(replay_ms(), 4)}
    print(f"default denoise replay: {results['default_ms']} ms", flush=True)
    kinds = [k for k in args.only or list(grids) if k in grids]
    for kind in kinds:
        rows = []
        grid = grids[kind]
        for values in itertools.product(*grid.values()):
            c = dict(zip(grid, values, strict=True))
            fused.ops = configured_ops(kind, c, fused)
            if kind == "gathered_down":
                fused_module.gather_splits = lambda selected, s=c["splits"]: s
            elif "splits" in c:
                setattr(fused, "o_splits" if kind == "o_proj" else "down_splits", c["splits"])
            try:
                engine._graphs[key] = engine._capture(engine._stage_fn("denoise", bucket, variant))
                engine.run_stage("denoise", bucket, variant=variant)
                err = ((engine.actions - reference).norm() / reference.norm()).item()
                row = {"config": c, "ms": round(replay_ms(), 4), "rel_err_vs_default": float(f"{err:.2e}")}
            except Exception as exc:  # a config the kernel cannot compile (shared memory, shapes)
                row = {"config": c, "error": f"{type(exc).__name__}: {str(exc)[:80]}"}
            rows.append(row)
            fused.ops = triton_ops
            fused.o_splits, fused.down_splits = defaults["o_splits"], defaults["down_splits"]
            fused_module.gather_splits = gather_splits
        ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        results[kind] = {"best": ok[:6], "failed": [r for r in rows if "error" in r][:6], "all": ok}
        print(f"{kind}: " + "; ".join(f"{r['ms']} ms {r['config']}" for r in ok[:4]), flush=True)
        engine._graphs[key] = engine._capture(engine._stage_fn("denoise", bucket, variant))
    gpu = torch.cuda.get_device_name(device)
    lines = [
        f"# Denoise kernel configurations tuned in the captured graph — {gpu}",
        "",
        f"Full `{args.preset}` {variant} denoise replay with the default configurations: {results['default_ms']} ms "
        f"(PDL {'on' if engine.pdl else 'off'}; median of {args.iters}). Best candidates per kernel kind, "
        "the other kinds at their defaults:",
        "",
        "| kernel kind | best ms | configuration |",
        "|---|---|---|",
    ]
    for kind in kinds:
        for row in results[kind]["best"][:3]:
            lines.append(f"| {kind} | {row['ms']} | `{row['config']}` |")
    record = {**record_header(gpu, args.commit), "preset": args.preset, "pdl": engine.pdl, "cache": args.cache,
              "results": results}  # fmt: skip
    stem = f"tune_in_graph_{gpu_tag(gpu)}{'_cached' if args.cache else ''}"
    save_results(args.out, stem, record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
