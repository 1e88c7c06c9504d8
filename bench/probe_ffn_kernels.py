"""The denoising loop's FFN kernels alone, at the action expert's full shapes: is a kernel slow by itself,
or is it waiting for its weights?

Each variant (the dense gate/up + GeGLU, the Action Cache's gathered one at ρn, the two down-projections,
and a few launch configurations of the gathered gate/up) is captured as one CUDA graph of --launches
back-to-back launches, replayed --iters times; µs per kernel = replay time / launches, median. Each is
timed twice:

- hot: every launch reads the same weights, which stay in L2;
- cold: the launches cycle through --copies copies of the weights (more than the L2 holds), so each
  launch fetches its weights from HBM.

The activations (50 rows) are the same tensor throughout, hot in L2 as they are in the engine. Then all
of it again with programmatic dependent launch, as the engine launches them. Inside the denoise graph the
same kernels are charged more (bench/trace_graphs.py): the difference is what the neighbouring kernels
and the weights' arrival add.

    python bench/probe_ffn_kernels.py --commit $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import cuda_time_ms, record_header, save_results
from rmuscle_ros.engine import triton_ops
from rmuscle_ros.engine.fused import gather_splits, keep_neuron_count, split_k
from rmuscle_ros.models.config import get_preset

# Launch configurations of the gathered gate/up tried besides the default (BN columns, BK, stages).
GATHERED_CONFIGS = {
    "gathered_gate_up_bn16": {"bn": 16},
    "gathered_gate_up_bn16_bk512_s2": {"bn": 16, "bk": 512, "stages": 2},
    "gathered_gate_up_bn16_bk1024_s1": {"bn": 16, "bk": 1024, "stages": 1},  # one dot over all of K
}


def variants(
    preset: str, rho_n: float, copies: int, device: torch.device, rows: int | None = None
) -> dict[str, Callable[[int], None]]:
    """name -> run(i): one launch reading weight copy i. rows: activation rows (default: the horizon)."""
    e = get_preset(preset).expert
    horizon = rows or get_preset(preset).horizon
    gen = torch.Generator(device).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    f, width, sel = e.mlp_dim, e.width, keep_neuron_count(rho_n, e.mlp_dim)
    gate_up = [rand(2 * f, width, scale=0.02) for _ in range(copies)]
    down = [rand(width, f, scale=0.02) for _ in range(copies)]
    down_t = [d.t().contiguous() for d in down]  # K-major, as FusedPi05.prepare_action_cache keeps it
    neurons = torch.randperm(f, generator=gen, device=device)[:sel].sort().values.to(torch.int32)
    h, anchor, delta = rand(horizon, width), rand(horizon, f), rand(horizon, sel)
    act = torch.empty(horizon, f, device=device, dtype=torch.bfloat16)
    out = torch.empty(horizon, sel, device=device, dtype=torch.bfloat16)

    def gathered_gate_up(config: dict[str, int] | None) -> Callable[[int], None]:
        return lambda i: triton_ops.linear_geglu(
            h, gate_up[i], out, neurons=neurons, anchor=anchor, config=config
        )

    runs = {
        "dense_gate_up": lambda i: triton_ops.linear_geglu(h, gate_up[i], act),
        "gathered_gate_up": gathered_gate_up(None),
        "dense_down": lambda i: triton_ops.linear(act, down[i], split_k(f)),
        "gathered_down": lambda i: triton_ops.linear(delta, down_t[i], gather_splits(sel), neurons=neurons),
    }
    runs |= {name: gathered_gate_up(cfg) for name, cfg in GATHERED_CONFIGS.items()}
    return runs


def per_kernel_us(run: Callable[[int], None], cold: bool, copies: int, launches: int, iters: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(3, copies)):  # compile and warm up outside the capture
            run(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(launches):
            run(j % copies if cold else 0)
    # replay time per launch, in µs
    times = [ms * 1000 / launches for ms in cuda_time_ms(graph.replay, iters, warmup=0)]
    return round(statistics.median(times), 3)


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--rho-n", type=float, default=0.5)
    p.add_argument("--copies", type=int, default=16, help="weight copies cycled through when cold")
    p.add_argument("--launches", type=int, default=96, help="launches per captured graph")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        help="activation rows (default: the horizon, 50); fewer rows shrink the tile every program re-reads",
    )
    p.add_argument(
        "--name", default=None, help="results file stem (default probe_ffn_kernels_<gpu>_<commit>)"
    )
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_ffn_kernels times Triton kernels on a GPU: no CUDA device here")
    device = torch.device("cuda")
    runs = variants(args.preset, args.rho_n, args.copies, device, args.rows)
    results: dict[str, dict[str, float | str]] = {}
    for pdl in (False, True):
        with triton_ops.programmatic_launch(pdl):
            for name, run in runs.items():
                key = f"{name}_pdl" if pdl else name
                try:
                    results[key] = {
                        cold_or_hot: per_kernel_us(run, cold, args.copies, args.launches, args.iters)
                        for cold_or_hot, cold in (("hot_us", False), ("cold_us", True))
                    }
                except Exception as exc:  # a configuration the kernel cannot compile (shared memory)
                    results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:100]}"}
                print(f"[probe] {key}: {results[key]}", flush=True)
    gpu = torch.cuda.get_device_name(device)
    record = record_header(gpu, args.commit) | {
        "setting": {
            "preset": args.preset,
            "rho_n": args.rho_n,
            "copies": args.copies,
            "launches": args.launches,
            "iters": args.iters,
            "rows": args.rows or get_preset(args.preset).horizon,
        },
        "results": results,
    }
    lines = [
        f"# The denoise's FFN kernels alone — {gpu}, `{args.preset}`",
        "",
        f"commit `{args.commit}`, command `{record['command']}`; ρn = {args.rho_n}; µs per kernel, median of "
        f"{args.iters} replays of {args.launches} launches. Hot: the same weights every launch (in L2); cold: "
        f"{args.copies} copies cycled (from HBM). Activation rows: {record['setting']['rows']}.",
        "",
        "| kernel | hot µs | cold µs | hot µs, PDL | cold µs, PDL |",
        "|---|---|---|---|---|",
    ]
    for name in runs:
        cells = [results[key].get(col, results[key].get("error", "–")) for key in (name, f"{name}_pdl")
                 for col in ("hot_us", "cold_us")]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(str(c) for c in cells) + " |")
    stem = args.name or f"probe_ffn_kernels_{gpu_tag(gpu)}_{args.commit}"
    save_results(args.out, stem, record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
