"""Would the Context Cache pay in SigLIP's MLPs (issue #4: "in scope if it pays: measure it")? An upper
bound of what it could save per call, measured.

For every vision layer, the engine's own MLP (`FusedPi05.vision_mlp`: fc1, tanh-GELU, fc2) runs over all
C·T visual rows (dense), and over ρ·C·T rows only (cached). That is the least a cached MLP has to do: it
leaves out the drift ranking, gathering the kept rows, reading the reference's output for the others,
and the retrieval descriptor (vision's output today, so the real design would also have to move it
earlier), so `dense_ms - cached_ms` bounds the saving from above. The vision stage's graph
is timed too, for scale. Each variant is one CUDA graph of all layers; the graphs are replayed
interleaved, timed with CUDA events (wall clock on a CPU smoke run), medians.

    python bench/probe_vision_mlp.py --commit $(git rev-parse --short HEAD)
    python bench/probe_vision_mlp.py --device cpu --preset tiny --iters 2   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import make_inputs, random_model, record_header, save_results, time_interleaved
from rmuscle_ros.engine import create_engine
from rmuscle_ros.engine.fused import FusedPi05, rho_count
from rmuscle_ros.models.config import get_preset


def mlp_variants(fused: FusedPi05, rhos: list[float], seed: int = 0) -> dict[str, Callable[[], None]]:
    """'dense': every layer's MLP over all visual rows; 'cached_<ρ>': over the first ρ of them (which
    rows does not change the cost)."""
    cfg = fused.cfg
    n = cfg.num_cameras * cfg.vision.tokens_per_image
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, cfg.vision.width, generator=gen).to(fused.device, fused.dtype)

    def mlps(rows: torch.Tensor) -> None:
        for layer in fused.vision_layers:
            fused.vision_mlp(layer, rows)

    variants = {"dense": lambda: mlps(h)}
    for rho in rhos:
        kept = h[: rho_count(rho, n)]
        variants[f"cached_{rho:g}"] = lambda kept=kept: mlps(kept)
    return variants


def as_graphs(runs: dict[str, Callable[[], None]], device: torch.device) -> dict[str, Callable[[], None]]:
    """Each run captured as a CUDA graph (as the engine runs vision), replayed by the returned callables."""
    graphs = {}
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for run in runs.values():  # warm-up outside capture: cuBLAS picks its kernels, workspaces allocate
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    for name, run in runs.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graphs[name] = graph.replay
    return graphs


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="pi05")
    p.add_argument(
        "--rho", type=float, action="append", default=None, help="ρp values (default 0.2, 0.4, 0.6)"
    )
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    rhos = args.rho or [0.2, 0.4, 0.6]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = get_preset(args.preset)
    model = random_model(cfg, device, 0)
    engine = create_engine("graph" if cuda else "fused", model, device)
    inputs, noise = make_inputs(cfg, 50 if cfg.max_token_len >= 50 else 8, device, 0)
    bucket = engine.load_inputs(inputs, noise)
    engine.warmup()
    runs = mlp_variants(engine.fused, rhos)
    if cuda:
        runs = as_graphs(runs, device)
    runs["vision_stage"] = lambda: engine.run_stage("vision", bucket)
    ms = time_interleaved(runs, args.iters, cuda)
    print(f"[probe] {ms}", flush=True)
    results = {"vision_stage": {"median_ms": ms["vision_stage"]}, "mlps_dense": {"median_ms": ms["dense"]}}
    for rho in rhos:
        cached = ms[f"cached_{rho:g}"]
        results[f"mlps_cached_rho{rho:g}"] = {
            "median_ms": cached,
            "rho_p": rho,
            "saving_upper_bound_ms": round(ms["dense"] - cached, 3),
        }
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    record = {
        **record_header(gpu, args.commit),
        "preset": args.preset,
        "layers": cfg.vision.depth,
        "visual_rows": cfg.num_cameras * cfg.vision.tokens_per_image,
        "results": results,
    }
    lines = [
        f"# SigLIP MLPs dense vs over ρ of the rows — {gpu}, `{args.preset}`",
        "",
        f"commit `{args.commit}`, command `{record['command']}`; medians of {args.iters} interleaved replays; "
        f"{record['layers']} layers, {record['visual_rows']} visual rows. The cached rows are the MLPs over ρ "
        "of the rows and nothing else (bench/probe_vision_mlp.py): their saving is an upper bound.",
        "",
        "| variant | median ms | saving (upper bound) ms |",
        "|---|---|---|",
        *(f"| {k} | {v['median_ms']} | {v.get('saving_upper_bound_ms', '–')} |" for k, v in results.items()),
    ]
    save_results(args.out, f"probe_vision_mlp_{gpu_tag(gpu)}_{args.commit}", record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
