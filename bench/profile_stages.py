"""Kernel-level profile of the graph engine's stages (run without graph capture so kernels are visible).

Prints, per stage (and variant), the kernels with the most device time: where the gap to the roofline
floor is. `--cache` builds the engine with rMuscle shapes and also profiles the cached prefill (Context
Cache) and the cached denoise (Action Cache), with a reference entry made from the loaded observation
and random sorted neuron masks: kernel times depend on shapes, not on which rows are selected.

    python bench/profile_stages.py --preset pi05 --stage denoise
    python bench/profile_stages.py --preset pi05 --cache
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pi05 import make_inputs, random_graph_engine
from rmuscle_ros.engine.fused import ContextRef
from rmuscle_ros.engine.graph import CacheShapes


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--prompt-tokens", type=int, default=50)
    p.add_argument("--stage", action="append", default=None, choices=["vision", "prefill", "denoise"])
    p.add_argument("--cache", action="store_true", help="also profile the cached prefill and denoise")
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    device = torch.device("cuda")
    engine, bucket = random_graph_engine(
        args.preset,
        device,
        prompt_tokens=args.prompt_tokens,
        use_cuda_graphs=False,
        cache=CacheShapes() if args.cache else None,
    )
    runs = [(stage, "dense") for stage in args.stage or ["vision", "prefill", "denoise"]]
    if args.cache:
        # A reference entry rebuilt from this very observation, and random neuron masks, sorted per (step,
        # layer), loaded as the runtime loads an entry that is not in the window.
        inputs, _ = make_inputs(engine.cfg, args.prompt_tokens, device, seed=0)  # random_graph_engine's
        entry = ContextRef.allocate(engine.cfg, device, engine.dtype)
        engine.rebuild_entry(inputs, entry, use_graphs=False)
        engine.rebuild_stream.synchronize()
        steps, depth, keep = engine.neurons.shape
        f = engine.cfg.expert.mlp_dim
        masks = torch.rand(steps, depth, f, device=device).argsort(-1)[..., :keep].sort(-1).values
        engine.load_reference(entry, masks.to(torch.int32))
        runs += [("prefill", "cached"), ("denoise", "cached")]
    for stage, variant in runs:
        for _ in range(3):
            engine.run_stage(stage, bucket, variant=variant)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.run_stage(stage, bucket, variant=variant)
            torch.cuda.synchronize()
        print(f"\n=== {stage} ({variant}) ===")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=90
            )
        )


if __name__ == "__main__":
    main()
