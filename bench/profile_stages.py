"""Kernel-level profile of the graph engine's stages (run without graph capture so kernels are visible).

Prints, per stage, the kernels with the most device time: where the gap to the roofline floor is.

    python bench/profile_stages.py --preset pi05 --stage denoise
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pi05 import random_graph_engine


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--prompt-tokens", type=int, default=50)
    p.add_argument("--stage", action="append", default=None, choices=["vision", "prefill", "denoise"])
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    device = torch.device("cuda")
    engine, bucket = random_graph_engine(
        args.preset, device, prompt_tokens=args.prompt_tokens, use_cuda_graphs=False
    )
    for stage in args.stage or ["vision", "prefill", "denoise"]:
        for _ in range(3):
            engine.run_stage(stage, bucket)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.run_stage(stage, bucket)
            torch.cuda.synchronize()
        print(f"\n=== {stage} ===")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=90
            )
        )


if __name__ == "__main__":
    main()
