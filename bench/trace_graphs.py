"""Where each stage graph's replay time goes, kernel by kernel, as the graph really runs (with PDL);
and the same for a whole `sample_actions` call (input copies, then the one-graph call).

A kernel-level trace (CUPTI, through torch.profiler) of one replay of each stage's CUDA graph. With
programmatic dependent launch a kernel starts before its predecessor ends and waits, so raw kernel
durations overlap. Each kernel is charged instead with the part of the timeline it ends: from the end of
the kernel before it (or its own start, if later) to its own end. Idle time between kernels is charged to
the kernel after it as `gap`. Charged time plus gaps add up to the replay's span. In the tail graph
(and so in `sample_actions`) the denoise's first step runs on a second stream alongside the prefill
(`GraphEngine.overlap_first_step`): its kernels are charged only the time by which they extend the
timeline, so a fully hidden kernel is charged nothing. The stage graphs run on one stream.

    python bench/trace_graphs.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import make_inputs, random_graph_engine, record_header, save_results
from rmuscle_ros.engine.graph import CacheShapes
from rmuscle_ros.models.config import get_preset


def kernel_events(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every GPU kernel and memory operation, in start order."""
    events = [
        (e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in trace["traceEvents"]
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    ]
    return sorted(events, key=lambda e: e[1])


def traced_events(run) -> list[tuple[str, float, float]]:
    """kernel_events of one call of `run` (already warm) under the profiler, after the GPU went idle."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return kernel_events(json.loads(path.read_text()))


def _timeline(events: list[tuple[str, float, float]]):
    """Each event with the time the GPU was busy until before it (the latest end of the earlier events)."""
    busy = events[0][1]
    for name, start, stop in events:
        yield name, start, stop, busy
        busy = max(busy, stop)


def idle_gaps(events: list[tuple[str, float, float]]) -> list[dict]:
    """Every stretch with no GPU work between the first event and the last: its µs, where it starts
    (µs from the first event) and the kernel it ends with."""
    t0 = events[0][1]
    return [
        {"us": round(start - busy, 1), "at_us": round(busy - t0, 1), "before": short(name)}
        for name, start, _, busy in _timeline(events)
        if start > busy
    ]


def _charged(events: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Each event's short name, charged µs and the idle gap before it (see the module docstring)."""
    return [
        (short(name), max(0.0, stop - max(start, busy)), max(0.0, start - busy))
        for name, start, stop, busy in _timeline(events)
    ]


def charge(events: list[tuple[str, float, float]]) -> dict:
    """Per kernel name: count, charged µs, gap µs before it (see the module docstring); and the span."""
    rows: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "charged_us": 0.0, "gap_us": 0.0})
    for name, charged, gap in _charged(events):
        row = rows[name]
        row["count"] += 1
        row["gap_us"] += gap
        row["charged_us"] += charged
    span = max(stop for _, _, stop in events) - events[0][1]
    return {"span_us": span, "kernels": len(events), "by_kernel": dict(rows)}


LAYER_KERNELS = ("qkv_rope", "_attention", "_skinny_matmul", "_add_norm")


def layer_step_positions(events: list[tuple[str, float, float]], steps: int, depth: int) -> list[dict] | None:
    """The denoising loop's time by position within a layer-step, for the first step (the Action Cache's
    dense anchor) and for the later steps: each layer-step runs the same kernels in the same order (QKV,
    attention, its combine, o, residual+norm, gate/up, down, residual+norm), so the i-th of them is the
    same operator every time. Charged µs (as in `charge`) per layer-step, averaged. None when the kernels
    do not repeat per layer-step (e.g. a fallback backend)."""
    layer = [c for c in _charged(events) if any(k in c[0] for k in LAYER_KERNELS)]
    if not layer or len(layer) % (steps * depth):
        return None
    period, per_step = len(layer) // (steps * depth), len(layer) // steps
    rows = []
    for pos in range(period):
        first = layer[pos:per_step:period]
        later = layer[per_step + pos :: period]
        rows.append({
            "position": pos,
            "kernel": first[0][0],
            "first_step_us": sum(c[1] for c in first) / len(first),
            "later_steps_us": sum(c[1] for c in later) / max(1, len(later)),
            "gap_us": sum(c[2] for c in layer[pos::period]) / len(layer[pos::period]),
        })  # fmt: skip
    return rows


def sequence(events: list[tuple[str, float, float]]) -> list[dict]:
    """The events in start order: name, start (µs from the first), duration, idle gap before it."""
    t0 = events[0][1]
    return [
        {"name": short(name), "start_us": round(start - t0, 2), "dur_us": round(stop - start, 2),
         "gap_us": round(max(0.0, start - busy), 2)}
        for name, start, stop, busy in _timeline(events)
    ]  # fmt: skip


def short(name: str) -> str:
    """cuBLAS/cuDNN names without their template arguments, Triton names as they are."""
    return name.split("(")[0].split("<")[0][:90]


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--prompt-tokens", type=int, default=50)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--rows", type=int, default=14)
    p.add_argument(
        "--cache", nargs=2, type=float, metavar=("RHO_P", "RHO_N"), default=None,
        help="also trace the cached prefill and denoise graphs at these ratios (random reference entry)",
    )  # fmt: skip
    p.add_argument(
        "--order", action="append", default=[], metavar="STAGE",
        help="also list this stage's first --order-events events in order, with the gap before each",
    )  # fmt: skip
    p.add_argument("--order-events", type=int, default=40)
    args = p.parse_args()
    device = torch.device("cuda")
    options = {"cache": CacheShapes(*args.cache)} if args.cache else {}
    engine, bucket = random_graph_engine(args.preset, device, prompt_tokens=args.prompt_tokens, **options)
    cfg = get_preset(args.preset)
    inputs, noise = make_inputs(cfg, args.prompt_tokens, device, 0)
    runs = {stage: lambda s=stage: engine.run_stage(s, bucket) for stage in ("vision", "prefill", "denoise")}
    if args.cache:  # a random entry: the kernels' cost does not depend on which rows or neurons they read
        gen = torch.Generator(device).manual_seed(0)
        engine.ctx_ref.ffn_in.normal_(generator=gen)
        engine.ctx_ref.ffn_out.normal_(generator=gen)
        steps, depth, keep = engine.neurons.shape
        order = torch.rand(steps, depth, cfg.expert.mlp_dim, device=device, generator=gen).argsort(-1)
        engine.neurons.copy_(order[..., :keep].sort(-1).values)
        for stage in ("prefill", "denoise"):
            runs[f"{stage} cached"] = lambda s=stage: engine.run_stage(s, bucket, variant="cached")
    # the whole call as bench_pi05 times it: begin_load, the vision graph, finish_load, the tail graph
    runs["sample_actions"] = lambda: engine.sample_actions(inputs, noise)
    stages = {}
    for stage, run in runs.items():
        for _ in range(3):
            run()
        events = traced_events(run)
        stages[stage] = charge(events) if events else {"error": "no kernels traced inside the graph"}
        if stage.startswith("denoise") and events:
            stages[stage]["layer_step"] = layer_step_positions(events, cfg.num_steps, cfg.expert.depth)
        if stage in args.order and events:
            stages[stage]["sequence"] = sequence(events[: args.order_events])
    gpu = torch.cuda.get_device_name(device)
    lines = [
        f"# Stage graphs kernel by kernel — {gpu}",
        "",
        f"`{args.preset}`, one replay per stage, and one whole `sample_actions` call.",
        "",
    ]
    for stage, r in stages.items():
        if "error" in r:
            lines += [f"## {stage}: {r['error']}", ""]
            continue
        lines += [
            f"## {stage}: span {r['span_us'] / 1e3:.3f} ms, {r['kernels']} kernels",
            "",
            "| kernel | count | charged µs | per call µs | gap µs |",
            "|---|---|---|---|---|",
        ]
        top = sorted(r["by_kernel"].items(), key=lambda kv: -(kv[1]["charged_us"] + kv[1]["gap_us"]))
        for name, k in top[: args.rows]:
            lines.append(
                f"| {name} | {k['count']} | {k['charged_us']:.1f} | {k['charged_us'] / k['count']:.2f} "
                f"| {k['gap_us']:.1f} |"
            )
        lines.append("")
        if r.get("layer_step"):
            lines += [
                f"{stage}, per layer-step by position (charged µs, mean over layers):",
                "",
                "| # | kernel | first step | later steps | gap |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| {e['position']} | {e['kernel']} | {e['first_step_us']:.2f} | {e['later_steps_us']:.2f} "
                f"| {e['gap_us']:.2f} |"
                for e in r["layer_step"]
            ]
            lines.append("")
        if "sequence" in r:
            lines += [
                f"{stage} in order:",
                "",
                "| kernel | start µs | µs | gap before µs |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {e['name']} | {e['start_us']} | {e['dur_us']} | {e['gap_us']} |" for e in r["sequence"]
            ]
            lines.append("")
    record = {
        **record_header(gpu, args.commit),
        "preset": args.preset,
        "cache": args.cache,
        "results": stages,
    }
    stem = f"trace_graphs_{gpu_tag(gpu)}{'_cached' if args.cache else ''}_{args.commit}"
    save_results(args.out, stem, record, "\n".join(lines))


if __name__ == "__main__":
    main()
