"""Which live graph hangs when it replays alongside rebuild graphs (README: "A live call while rebuilds run
on the GPU hangs the H200"; cause not found).

Each case runs in a child process with a time limit, since a hang never returns: the child builds a
`pi05` graph engine with cache shapes, then 20 times queues two rebuild-graph replays on the low-priority
stream and right after them one live replay (a stage graph, or the same stage launched kernel by kernel)
on the high-priority stream, and waits for both. A case reports `ok` with the median ms of the live
replay's round, `hung` when the child ran out of time, or the child's error. Cases may also set
environment variables, e.g. `CUBLAS_WORKSPACE_CONFIG=:0:0` (cuBLAS without a workspace: if the hang goes
away with it, the graphs' shared cuBLAS workspace is the cause).

    python bench/probe_rebuild_overlap.py --commit $(git rev-parse --short HEAD) --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import make_inputs, random_graph_engine, record_header, save_results
from rmuscle_ros.engine.fused import ContextRef
from rmuscle_ros.engine.graph import CacheShapes
from rmuscle_ros.models.config import get_preset

NO_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}
# name -> (live stage, variant, live as a graph replay, extra environment)
CASES: dict[str, tuple[str, str, bool, dict[str, str]]] = {
    "rebuilds_only": ("none", "dense", True, {}),
    "vision": ("vision", "dense", True, {}),
    "prefill": ("prefill", "dense", True, {}),
    "denoise": ("denoise", "dense", True, {}),
    "tail_cached": ("tail", "cached", True, {}),
    "tail_cached_no_graph": ("tail", "cached", False, {}),
    "vision_no_cublas_workspace": ("vision", "dense", True, NO_WORKSPACE),
    "tail_cached_no_cublas_workspace": ("tail", "cached", True, NO_WORKSPACE),
}


@torch.no_grad()
def child(case: str, rounds: int) -> dict[str, float]:
    stage, variant, use_graph, _ = CASES[case]
    device = torch.device("cuda")
    engine, bucket = random_graph_engine("pi05", device, cache=CacheShapes(0.4, 0.5))
    cfg = get_preset("pi05")
    inputs, _ = make_inputs(cfg, 50, device, 1)
    inputs = inputs.to("cpu")  # as the runtime hands a library observation to a rebuild
    out = ContextRef.allocate(cfg, device, engine.dtype)
    live, low = engine.live_stream, engine.rebuild_stream
    assert live is not None and low is not None
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        for _ in range(2):
            engine.rebuild_entry(inputs, out)  # graph replays on the low-priority stream
        start = time.perf_counter()
        if stage != "none":
            with torch.cuda.stream(live):
                engine.run_stage(stage, bucket, use_graph=use_graph, variant=variant)
            live.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        low.synchronize()
    return {"live_round_ms": round(statistics.median(times), 3)}


def run_case(case: str, rounds: int, timeout_s: float) -> dict[str, object]:
    env = os.environ | CASES[case][3]
    cmd = [sys.executable, __file__, "--child", case, "--rounds", str(rounds)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "hung", "after_s": timeout_s}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"status": "error", "rc": proc.returncode, "stderr": proc.stderr.strip().splitlines()[-3:]}
    return {"status": "ok", "s": round(time.perf_counter() - start, 1), **json.loads(lines[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", choices=list(CASES), default=None, help=argparse.SUPPRESS)
    p.add_argument("--case", action="append", choices=list(CASES), default=None, help="default: all")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--timeout-s", type=float, default=60.0, help="per case, engine build included")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rounds)), flush=True)
        return
    results = {}
    for case in args.case or list(CASES):
        results[case] = run_case(case, args.rounds, args.timeout_s)
        print(f"[probe] {case}: {results[case]}", flush=True)
    gpu = torch.cuda.get_device_name(0)
    record = {**record_header(gpu, args.commit), "rounds": args.rounds, "timeout_s": args.timeout_s,
              "cases": {k: {"live": v[0], "variant": v[1], "graph": v[2], "env": v[3]} for k, v in CASES.items()},
              "results": results}  # fmt: skip
    lines = [
        f"# Live replays alongside rebuild graphs — {gpu}",
        "",
        f"commit `{args.commit}`, command `{record['command']}`. Per case: {args.rounds} rounds of two rebuild "
        "replays (low-priority stream) then one live replay (high-priority stream); a child process with "
        f"{args.timeout_s:g} s, engine build included.",
        "",
        "| case | live | graph | env | status | live round ms |",
        "|---|---|---|---|---|---|",
        *(
            f"| {k} | {CASES[k][0]} {CASES[k][1]} | {CASES[k][2]} | {CASES[k][3] or '–'} | {r['status']} | "
            f"{r.get('live_round_ms', '–')} |"
            for k, r in results.items()
        ),
    ]
    save_results(args.out, f"probe_rebuild_overlap_{gpu_tag(gpu)}_{args.commit}", record,
                 "\n".join(lines) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
