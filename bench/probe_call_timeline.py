"""Where an end-to-end call's time goes outside its stage graphs: a dense call against a cached one.

`bench_rmuscle` times a cached call (`RMuscle.infer`) at ~0.41 ms more than its match and cached-tail
graphs replayed alone, and a dense call at ~0.22 ms more than vision and the dense tail alone
(`…/rmuscle_pi05_h200_2c542df`). This probe says where the difference lies: on the host before the GPU
starts, between the stages on the GPU, in the stages themselves (run in the call against alone), or
after the last stage.

Three calls, alternated round by round on the same observation (the `bench_rmuscle` scenario: a
recorded reference episode, a live repeat primed so that the timed calls are served cached):
- `dense_engine`: the engine's dense call (begin_load, vision, finish_load, tail), as `bench_rmuscle`'s
  dense figure;
- `cached_engine`: the engine's cached call launched the same way (begin_load, match, finish_load, cached
  tail): the GPU work of a cached call without the runtime's host work;
- `cached_runtime`: `RMuscle.infer`, every call checked to be served cached;
At 35d0631 a fourth call, `cached_runtime_lean`, ran `RMuscle.infer` with its stream handling as it is
now (events allocated once, the live stream set without `torch.cuda.stream`'s context manager): 0.09 ms
less wall time, the same chunk bit for bit (`…/probe_call_timeline_pi05_h200_35d0631`). That is the
runtime's own code since (`_LiveStream`), and the candidate is gone from this probe.

Each stage launch is wrapped: its host time, and CUDA events before and after it on the stream it runs
on. Per call (medians over --iters rounds): wall clock; host ms until the first stage is launched; GPU
ms from the call's start event to the first stage's start (the GPU idle for the host), each stage's GPU
ms in the call, the gaps between stages, and from the last stage's end to the call's end event. And the
host's steps (`host_<step>_entry_ms` from the call's start, `host_<step>_ms` long; of a step called more
than once in a call, its first call): before the first launch, the runtime's `_infer` (entered after the
streams' waits and the call's start event), its `_push_usable`, the engine's `begin_load` and the token
row's read within it (`_host_array`'s first call); and after it, `finish_load` (the prompt packed while
vision or match runs). The wrappers stay in place until the process ends (the stages alone, timed last,
go through `run_stage` only). The first run (`…/probe_call_timeline_pi05_h200_9ebd6d3`) predates these steps.

    python bench/probe_call_timeline.py --out bench/results --commit $(git rev-parse --short HEAD)
    python bench/probe_call_timeline.py --device cpu --preset tiny --iters 2 --calls 3   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pi05 import random_model, record_header, save_results
from bench.bench_rmuscle import Bench, device_ms
from rmuscle_ros.engine import graph as graph_module
from rmuscle_ros.models.config import get_preset


class HostMark:
    """A CUDA timing event's interface on the host clock, for a CPU smoke run (where a stage's launch is its
    run): `record()` notes the time, `elapsed_time(later)` the ms between two marks."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, later: HostMark) -> float:
        return (later.t - self.t) * 1e3

    def synchronize(self) -> None:
        pass


def mark(device: torch.device) -> torch.cuda.Event | HostMark:
    return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else HostMark()


class StageClock:
    """Wraps `engine.run_stage` to note each launch's host time and to put timing events around it on the
    current stream; `take()` returns the launches of the call just made."""

    def __init__(self, engine) -> None:
        self.engine, self.launches = engine, []
        run_stage = engine.run_stage

        def timed(stage: str, bucket: int, use_graph: bool = True, variant: str = "dense") -> None:
            before, after = mark(engine.device), mark(engine.device)
            host = time.perf_counter()
            before.record()
            run_stage(stage, bucket, use_graph=use_graph, variant=variant)
            after.record()
            self.launches.append((f"{stage}_{variant}", host, before, after))

        engine.run_stage = timed

        self.stamps: list[tuple[str, float, float]] = []

    def stamp(self, owner: object, attr: str, label: str) -> None:
        """Note the host entry and exit times of `owner.attr` (a method or a module's function)."""
        fn = getattr(owner, attr)

        def stamped(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.stamps.append((label, t, time.perf_counter()))

        setattr(owner, attr, stamped)

    def take(self) -> tuple[list, list]:
        out, stamps, self.launches, self.stamps = self.launches, self.stamps, [], []
        return out, stamps


def timed_call(call: Callable[[], object], clock: StageClock) -> dict[str, float]:
    """One call from an idle GPU: its wall ms and its timeline (see the module's docstring)."""
    device = clock.engine.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, end = mark(device), mark(device)
    t0 = time.perf_counter()
    start.record()
    call()
    end.record()
    end.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    launches, stamps = clock.take()
    row = {
        "wall_ms": wall,
        "gpu_span_ms": start.elapsed_time(end),
        "host_to_first_launch_ms": (launches[0][1] - t0) * 1e3,
    }
    row["gpu_idle_before_first_stage_ms"] = start.elapsed_time(launches[0][2])
    for i, (name, _, before, after) in enumerate(launches):
        row[f"{name}_ms"] = before.elapsed_time(after)
        if i + 1 < len(launches):
            row[f"gap_after_{name}_ms"] = after.elapsed_time(launches[i + 1][2])
    for label, entry, leave in stamps:  # the first of each label's calls in this call
        if f"host_{label}_entry_ms" not in row:
            row[f"host_{label}_entry_ms"], row[f"host_{label}_ms"] = (entry - t0) * 1e3, (leave - entry) * 1e3
    row["after_last_stage_ms"] = launches[-1][3].elapsed_time(end)
    row["wall_minus_gpu_span_ms"] = wall - row["gpu_span_ms"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--prompt-tokens", type=int, default=50)
    p.add_argument("--calls", type=int, default=8, help="calls per episode")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--rho-p", type=float, default=0.4)
    p.add_argument("--rho-n", type=float, default=0.5)
    p.add_argument("--schedule", default="ramp")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--name", default=None)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script (tiny)")
    args = p.parse_args()
    args.pdl, args.concurrent_rebuilds, args.concurrent_rebuild_graphs = True, False, False  # as Bench reads
    device = torch.device(args.device)
    cfg = get_preset(args.preset)
    model = random_model(cfg, device, 0)
    bench = Bench(model, args.rho_p, args.rho_n, args, device, args.schedule)
    bench.record_reference()
    bench.live_episode()
    obs = bench.live_obs[len(bench.live_obs) // 2]
    bench._prime(obs, True)
    e, rt = bench.engine, bench.runtime

    def cached_engine() -> None:
        bucket = e.begin_load(obs, bench.noise)
        e.run_stage("match", bucket, variant="cached")
        e.finish_load()
        e.run_stage("tail", bucket, variant="cached")

    def cached_runtime() -> None:
        _, info = bench.runtime_call(obs)
        if info.mode != "cached":
            raise RuntimeError(f"a timed runtime call ran {info.mode}: {info}")

    calls = {"dense_engine": lambda: bench.dense_call(obs), "cached_engine": cached_engine,
             "cached_runtime": cached_runtime}  # fmt: skip
    clock = StageClock(e)
    # the host's steps: before the first launch the runtime's own (its _infer starts after the streams'
    # waits and the call's start event), the engine's begin_load and within it the token row's read; after
    # it, finish_load
    clock.stamp(rt, "_infer", "runtime_infer")
    clock.stamp(rt, "_push_usable", "push_usable")
    clock.stamp(e, "begin_load", "begin_load")
    clock.stamp(e, "finish_load", "finish_load")
    clock.stamp(graph_module, "_host_array", "host_array")
    for fn in calls.values():  # warm-up
        for _ in range(3):
            timed_call(fn, clock)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in calls}
    for _ in range(args.iters):
        for name, fn in calls.items():
            rows[name].append(timed_call(fn, clock))
    if rt.match_reruns:
        raise RuntimeError(f"{rt.match_reruns} cached calls ran again dense")
    results = {
        name: {k: round(statistics.median(r[k] for r in samples), 4) for k in samples[0]}
        for name, samples in rows.items()
    }
    # the stages alone, for comparison (CUDA events, median of --iters replays, inputs loaded)
    del e.run_stage  # the class's again
    bucket = e.load_inputs(obs, bench.noise)
    e.load_window_entry(next(s.index for s in rt.window if s.key is not None))
    alone = {}
    for stage, variant in (("vision", "dense"), ("tail", "dense"), ("match", "cached"), ("tail", "cached")):
        alone[f"{stage}_{variant}_ms"] = round(
            device_ms(lambda s=stage, v=variant: e.run_stage(s, bucket, variant=v), args.iters, device), 4
        )
    cuda = device.type == "cuda"
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    record = record_header(gpu, args.commit) | {
        "setting": {"preset": args.preset, "rho_p": args.rho_p, "rho_n": args.rho_n, "schedule": args.schedule,
                    "iters": args.iters, "prompt_tokens": args.prompt_tokens},
        "results": results, "stages_alone": alone,
    }  # fmt: skip
    keys = sorted({k for r in results.values() for k in r}, key=lambda k: (not k.startswith("wall"), k))
    lines = [
        f"# A call's timeline outside its stage graphs, `{args.preset}` — {record['gpu']}",
        "",
        f"commit `{args.commit}`, command `{record['command']}`; medians of {args.iters} rounds, the calls "
        f"alternated, each from an idle {'GPU' if cuda else 'CPU engine (host clock: a launch is its run)'}; "
        f"ρp {args.rho_p}, ρn {args.rho_n} ({args.schedule}).",
        "",
        "| ms | " + " | ".join(results) + " |",
        "|---|" + "---|" * len(results),
        *(f"| {k} | " + " | ".join(str(r.get(k, "")) for r in results.values()) + " |" for k in keys),
        "",
        f"Stages alone ({'CUDA events' if cuda else 'wall clock'}, median of replays): "
        + ", ".join(f"{k} {v}" for k, v in alone.items()),
        "",
    ]
    save_results(
        args.out, args.name or f"probe_call_timeline_{args.preset}_{args.commit}", record, "\n".join(lines)
    )


if __name__ == "__main__":
    main()
