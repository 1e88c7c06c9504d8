"""The tail graph (prefill + denoise) with the denoising loop's first step run alongside the prefill, or
after it: same process, same inputs, replays alternated.

The first denoising step's layer i needs only the prefill's layer i K/V, so the engine's tail graph runs
the denoise on a stream of its own and lets that step follow the prefill layer by layer
(`GraphEngine(overlap_first_step=True)`, the default on a GPU), its stream one priority step below the
prefill's. This probe captures, beside the engine's own tail graphs, the same tails serial (prefill, then
denoise: the engine before `overlap_first_step`) and overlapped with the denoise's stream at the
prefill's priority or at the lowest, and with the first step's kernels launched one by one instead of
under programmatic dependent launch (`FusedPi05.first_step_pdl`). It checks that
all give the same actions bit for bit, and times each (CUDA events, median of --iters interleaved
rounds), dense and cached (ρ --rho-p / --rho-n, a random reference entry and masks: the kernels' cost
does not depend on which rows and neurons they pick).

    python bench/probe_overlap_first_step.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import random_graph_engine, record_header, save_results, time_interleaved
from rmuscle_ros.engine.graph import CacheShapes, GraphEngine


def capture_tail(
    engine: GraphEngine,
    bucket: int,
    variant: str,
    stream: torch.cuda.Stream | None,
    first_step_pdl: bool | None = None,
):
    """The tail graph captured with the denoise on `stream` (None: serial, after the prefill), its first
    step's kernels launched under PDL or one by one (None: as the engine's)."""
    saved = engine._denoise_stream, engine.fused.first_step_pdl
    engine._denoise_stream = stream
    if first_step_pdl is not None:
        engine.fused.first_step_pdl = first_step_pdl
    try:
        return engine._capture(engine._stage_fn("tail", bucket, variant))
    finally:
        engine._denoise_stream, engine.fused.first_step_pdl = saved


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--rho-p", type=float, default=0.4)
    p.add_argument("--rho-n", type=float, default=0.5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    device = torch.device("cuda")
    engine, bucket = random_graph_engine(args.preset, device, cache=CacheShapes(args.rho_p, args.rho_n))
    if not engine.overlap_first_step:
        raise SystemExit("the engine was built without overlap_first_step: nothing to compare")
    gen = torch.Generator(device).manual_seed(0)
    steps, depth, keep = engine.neurons.shape
    order = torch.rand(steps, depth, engine.cfg.expert.mlp_dim, device=device, generator=gen).argsort(-1)
    engine.neurons.copy_(order[..., :keep].sort(-1).values)
    engine.ctx_ref.ffn_in.normal_(generator=gen)
    engine.ctx_ref.ffn_out.normal_(generator=gen)
    engine.run_stage("vision", bucket)

    lowest, highest = torch.cuda.Stream.priority_range()
    others = {  # the denoise's stream at the prefill's priority (live graphs are captured at the highest),
        # and at the lowest
        "overlap_same_priority": torch.cuda.Stream(device, priority=highest),
        "overlap_lowest_priority": torch.cuda.Stream(device, priority=lowest),
    }
    # the engine's first step launched the other way: under PDL, or one by one
    flip_pdl = "overlap_first_step_" + ("one_by_one" if engine.fused.first_step_pdl else "under_pdl")
    results: dict[str, dict] = {}
    checks: dict[str, bool] = {}
    runs = {}
    for variant in ("dense", "cached"):
        graphs = {
            "serial": capture_tail(engine, bucket, variant, None),
            "overlap": engine._graphs[("tail", bucket, variant)],
            **{name: capture_tail(engine, bucket, variant, stream) for name, stream in others.items()},
            flip_pdl: capture_tail(
                engine,
                bucket,
                variant,
                engine._denoise_stream,
                first_step_pdl=not engine.fused.first_step_pdl,
            ),
        }
        actions = {}
        for name, graph in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            actions[name] = engine.actions.clone()
            runs[f"{variant}_{name}"] = graph.replay
        for name in sorted(graphs.keys() - {"serial"}):
            checks[f"{variant}_{name}_equals_serial"] = bool(torch.equal(actions[name], actions["serial"]))
    medians = time_interleaved(runs, args.iters, cuda=True)
    for name, ms in medians.items():
        variant = name.split("_", 1)[0]
        serial = medians[f"{variant}_serial"]
        results[name] = {"median_ms": round(ms, 4), "saved_ms": round(serial - ms, 4)}
    ratio = {
        kind: round(medians[f"dense_{kind}"] / medians[f"cached_{kind}"], 4)
        for kind in ("serial", "overlap", *others, flip_pdl)
    }
    gpu = torch.cuda.get_device_name(device)
    lines = [
        f"# The tail graph with the first denoising step alongside the prefill — {gpu}",
        "",
        f"`{args.preset}`, commit `{args.commit}`, command `python bench/probe_overlap_first_step.py`; tail graph "
        f"replays (prefill + denoise), CUDA events, medians of {args.iters} interleaved rounds; cached at "
        f"ρp {args.rho_p}, ρn {args.rho_n} (random reference entry and masks). Actions bit-identical to the "
        f"serial tail: {'yes' if all(checks.values()) else 'NO: ' + str(checks)}.",
        "",
        "| tail | ms | saved vs serial, ms |",
        "|---|---|---|",
        *(f"| {name} | {r['median_ms']} | {r['saved_ms']} |" for name, r in results.items()),
        "",
        "Dense / cached tail: " + ", ".join(f"{k} {v}×" for k, v in ratio.items()) + ".",
    ]
    record = {**record_header(gpu, args.commit), "preset": args.preset, "rho_p": args.rho_p, "rho_n": args.rho_n,
              "bit_identical": checks, "tail_ratio_dense_over_cached": ratio, "results": results}  # fmt: skip
    save_results(args.out, f"probe_overlap_first_step_{gpu_tag(gpu)}_{args.commit}", record,
                 "\n".join(lines) + "\n")  # fmt: skip
    if not all(checks.values()):
        raise SystemExit(f"actions differ from the serial tail: {checks}")


if __name__ == "__main__":
    main()
