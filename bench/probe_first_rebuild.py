"""Where does the time of the rebuild parts after an episode reset go? The first part after the library
gained its first episode took 520 ms on the H200 in the node's GPU cache test (`tiny`, graph backend),
against ~2 ms for the parts after it (README, "rMuscle"); the same on this CPU took 13 ms. This runs
what the node does, without ROS: a policy records a dense episode, resets, and rebuilds the window part
by part as a motion window does; then a cached episode with a motion window after each call, and a
second reset and its refill, for comparison.

Each part is timed on the host in pieces: the library call's load (`ReferenceLibrary.load_call`; the whole
episode, `RMuscle._episode`, before `749f817`), the rebuild's
inputs going into the rebuild lane (`GraphEngine.begin_rebuild`), the part queued (`rebuild_step`), and
the wait for the GPU to finish it. Also the reset itself (`Policy.reset_episode`: the library's write and
the retriever's refresh).

    python bench/probe_first_rebuild.py --commit $(git rev-parse --short HEAD)      # tiny, graph, CUDA
    python bench/probe_first_rebuild.py --device cpu --backend fused               # a smoke run

A probe, not a benchmark: one run, every figure a single measurement.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import record_header, save_results
from rmuscle_ros.cache.runtime import RMuscleConfig
from rmuscle_ros.runtime.policy import Policy, PolicyConfig, synthetic_observation


class Stopwatch:
    """Milliseconds spent in wrapped methods since the last `take`."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, owner: Any, name: str, label: str) -> None:
        method: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + (time.perf_counter() - start) * 1e3

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, {}
        return {k: round(v, 3) for k, v in spent.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="graph")
    p.add_argument("--calls", type=int, default=4, help="calls in the recorded episode")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    library = tempfile.mkdtemp(prefix="rmuscle_probe_")
    cfg = PolicyConfig(preset=args.preset, device=args.device, backend=args.backend, random_weights=True)
    policy = Policy(cfg, cache=RMuscleConfig(library_path=library, rebuilds_per_tick=20))
    policy.warmup()
    rmuscle = policy.rmuscle
    assert rmuscle is not None
    watch = Stopwatch()
    watch.wrap(rmuscle.library, "load_call", "call_load_ms")
    watch.wrap(rmuscle.engine, "begin_rebuild", "begin_rebuild_ms")
    watch.wrap(rmuscle.engine, "rebuild_step", "rebuild_step_ms")
    observations = [synthetic_observation(cfg, "pick", seed=i) for i in range(args.calls)]

    def refill(after: str) -> list[dict[str, Any]]:
        parts = []
        while True:
            start = time.perf_counter()
            queued, done = policy.rebuild_cache_slice(wait=False)
            queued_at = time.perf_counter()
            sync()
            end = time.perf_counter()
            if not queued:
                return parts
            parts.append({
                "after": after,
                "part": len(parts),
                "completed_an_entry": done,
                "host_ms": round((queued_at - start) * 1e3, 3),
                "gpu_wait_ms": round((end - queued_at) * 1e3, 3),
                "total_ms": round((end - start) * 1e3, 3),
                **watch.take(),
            })  # fmt: skip

    rows: list[dict[str, Any]] = []
    resets: dict[str, float] = {}
    modes: dict[str, list[str]] = {}
    for episode in ("recorded", "cached"):
        modes[episode] = []
        for obs in observations:
            modes[episode].append(policy.infer(obs).cache_mode)
            if episode == "cached":  # its motion windows, as the node runs them after each call
                rows += refill(f"{episode} call {len(modes[episode]) - 1}")
        sync()
        watch.take()
        start = time.perf_counter()
        policy.reset_episode()
        sync()
        resets[episode] = round((time.perf_counter() - start) * 1e3, 3)
        rows += refill(f"the reset after the {episode} episode")
    policy.close()

    device = torch.cuda.get_device_name() if cuda else "CPU"
    record = {
        **record_header(device, args.commit),
        "preset": args.preset,
        "backend": args.backend,
        "calls": args.calls,
        "modes": modes,
        "results": {"reset_ms": resets, "parts": rows},
    }
    keys = ("host_ms", "call_load_ms", "begin_rebuild_ms", "rebuild_step_ms", "gpu_wait_ms", "total_ms")
    lines = [
        f"# Rebuild parts after an episode reset, `{args.preset}` ({args.backend}) — {device}",
        "",
        f"commit `{args.commit}`, command `{record['command']}`; one run. The reset itself (the library's "
        f"write, the retriever's refresh): {resets['recorded']} ms after the recorded episode, "
        f"{resets['cached']} ms after the cached one. Call modes: recorded {modes['recorded']}, cached "
        f"{modes['cached']}.",
        "",
        "| after | part | completes an entry | " + " | ".join(keys) + " |",
        "|---|---|---|" + "---|" * len(keys),
        *(
            f"| {r['after']} | {r['part']} | {r['completed_an_entry']} | "
            + " | ".join(str(r.get(k, 0.0)) for k in keys)
            + " |"
            for r in rows
        ),
    ]
    where = "cpu" if not cuda else gpu_tag(device)
    save_results(
        args.out, f"probe_first_rebuild_{args.preset}_{where}_{args.commit}", record, "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
