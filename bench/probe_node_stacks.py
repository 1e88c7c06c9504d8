"""Why is a node call's preprocessing sometimes slow? The demo (node + bag player) with every call's
preprocessing timed, and every thread's stack sampled while it runs.

The GPU soak (README, "A shift on the GPU") had calls whose preprocessing took 67-68 ms against ~2. This
runs the README's demo (`rmuscle_ros.node.replay_demo.run`, the bag player in its own process) with
`Policy.preprocess` wrapped: each call's wall time, the worker thread's CPU time and context switches,
and, while it runs, a sampler thread reading every thread's stack every `--sample-ms`. A call slower
than `--slow-ms` keeps its samples; the report says, per slow call, what the other threads were doing
(the innermost frames of the samples, counted). A thread holding the interpreter lock shows up there;
the sampler needs the lock too, so a thread holding it for long leaves gaps between samples.

    python bench/probe_node_stacks.py --seconds 15 --episodes 4 --param model.preset=pi05 --param model.random_weights=true \
        --param model.device=cuda --param model.backend=graph --param cpu_threads=0 --commit $(git rev-parse --short HEAD)

A probe, not a benchmark: the sampler perturbs what it measures (it takes the lock every sample).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pi05 import record_header
from rmuscle_ros.runtime.policy import Policy

FRAMES = 4  # innermost frames kept per thread and sample


class Sampler:
    """Samples every other thread's stack while `active`, from a daemon thread of its own."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.active = threading.Event()
        self.samples: list[dict[str, Any]] = []
        self._target = 0  # the thread whose call is being sampled (left out of the samples)
        threading.Thread(target=self._run, name="stack-sampler", daemon=True).start()

    def start(self) -> None:
        self.samples = []
        self._target = threading.get_ident()
        self._t0 = time.perf_counter()
        self.active.set()

    def stop(self) -> list[dict[str, Any]]:
        self.active.clear()
        return self.samples

    def _run(self) -> None:
        me = threading.get_ident()
        while True:
            self.active.wait()
            names = {t.ident: t.name for t in threading.enumerate()}
            stacks = {}
            for ident, frame in sys._current_frames().items():
                if ident in (me, self._target):
                    continue
                inner = traceback.extract_stack(frame)[-FRAMES:]
                stacks[names.get(ident, str(ident))] = [
                    f"{f.name} ({Path(f.filename).name}:{f.lineno})" for f in inner
                ]
            if self.active.is_set():
                self.samples.append(
                    {"ms": round((time.perf_counter() - self._t0) * 1e3, 2), "threads": stacks}
                )
            time.sleep(self.period_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="episode length")
    p.add_argument("--episodes", type=int, default=3, help="the warm-up, then repeats")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="a node parameter")
    p.add_argument("--slow-ms", type=float, default=10.0, help="keep the samples of calls slower than this")
    p.add_argument("--sample-ms", type=float, default=2.0)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--gpu", default="none", help="the GPU, for the record")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    overrides = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep:
            p.error(f"--param {item!r}: expected NAME=VALUE")
        overrides[name] = yaml.safe_load(value)

    from rmuscle_ros.node.replay_demo import run

    sampler = Sampler(args.sample_ms / 1e3)
    calls: list[dict[str, Any]] = []
    preprocess = Policy.preprocess

    def timed(self: Policy, obs: Any) -> Any:
        before = resource.getrusage(resource.RUSAGE_THREAD)
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        sampler.start()
        try:
            return preprocess(self, obs)
        finally:
            samples = sampler.stop()
            wall, cpu = (time.perf_counter() - wall0) * 1e3, (time.thread_time() - cpu0) * 1e3
            after = resource.getrusage(resource.RUSAGE_THREAD)
            call = {
                "call": len(calls),
                "wall_ms": round(wall, 3),
                "cpu_ms": round(cpu, 3),
                "voluntary_switches": after.ru_nvcsw - before.ru_nvcsw,
                "involuntary_switches": after.ru_nivcsw - before.ru_nivcsw,
            }
            if wall > args.slow_ms:
                call["samples"] = samples
            calls.append(call)

    Policy.preprocess = timed  # type: ignore[method-assign]
    try:
        summary = run(args.out / f"probe_node_stacks_{args.commit}_run", args.seconds, overrides=overrides,
                      episodes=args.episodes)  # fmt: skip
    finally:
        Policy.preprocess = preprocess  # type: ignore[method-assign]

    walls = sorted(c["wall_ms"] for c in calls)
    slow = [c for c in calls if "samples" in c]
    lines = [
        f"# Slow preprocessing in the node, with every thread's stack — commit `{args.commit}`",
        "",
        f"{len(calls)} preprocessing calls (warm-up included); median {walls[len(walls) // 2]:.2f} ms, "
        f"max {walls[-1]:.2f} ms; {len(slow)} over {args.slow_ms:g} ms. Demo: {summary['chunks']} chunks, "
        f"p50 {summary['latency_p50_ms']:.1f} ms, max {summary['latency_max_ms']:.1f} ms.",
        "",
    ]
    for c in sorted(slow, key=lambda c: -c["wall_ms"])[:10]:
        tops: Counter[str] = Counter()
        for sample in c["samples"]:
            for thread, frames in sample["threads"].items():
                tops[f"{thread}: {' < '.join(reversed(frames[-2:]))}"] += 1
        lines.append(
            f"- call {c['call']}: {c['wall_ms']:.1f} ms wall, {c['cpu_ms']:.1f} ms CPU, "
            f"{c['voluntary_switches']} voluntary / {c['involuntary_switches']} involuntary switches, "
            f"{len(c['samples'])} samples; most often: "
            + "; ".join(f"{what} ({n})" for what, n in tops.most_common(4))
        )
    record = record_header(args.gpu, args.commit) | {"results": {"calls": calls, "demo": {
        k: summary[k] for k in ("chunks", "latency_p50_ms", "latency_p99_ms", "latency_max_ms", "drops")}}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"probe_node_stacks_{args.commit}.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / f"probe_node_stacks_{args.commit}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
