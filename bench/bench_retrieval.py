"""What rMuscle's retrieval costs on the host per call, by library size (issue #4: retrieval and alignment).

`Retriever.query` on `pi05`-sized descriptors (3 cameras × 2048), episodes of `--calls` calls, three
situations:
- `aligned`: every episode aligned (the lookahead's rows only), as in the calls of a cached episode;
- `first_call`: right after a reset, every episode scanned whole, as on an episode's first call;
- `fallback`: the episode fell back to dense; the similarity it reports scans the whole library;
- `task_change`: the prompt's task changed (`Retriever.restrict` to that task's episodes, here half the
  library, alternating between two halves), without the query after it (a first call over those episodes).

This is the host path, which CPU engines take: on a GPU engine the similarities are one matrix-vector
product on the GPU (`bench_rmuscle.py --library-episodes` times both there). With matching on the host,
`aligned` sits on a cached call's critical path (between vision and the cached stages); the runtime
queues a call's dense stages first when retrieval would scan the whole library (an episode's first call,
a fallback episode), so there it runs while the engine works. Medians of `--iters` queries; synthetic
descriptors (only their count and size matter).

    python bench/bench_retrieval.py --commit $(git rev-parse --short HEAD) --out bench/results
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pi05 import record_header, save_results
from rmuscle_ros.cache.retrieval import RetrievalConfig, Retriever

CAMERAS, WIDTH = 3, 2048  # pi05: the mean visual token per camera, Gemma 2B's width


def timed(run, iters: int) -> float:
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(samples), 3)


def measure(episodes: int, calls: int, iters: int, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((CAMERAS, WIDTH)).astype(np.float32)
    library = {
        e: (base + 0.1 * rng.standard_normal((calls, CAMERAS, WIDTH))).astype(np.float32)
        for e in range(episodes)
    }
    query = (base + 0.1 * rng.standard_normal((CAMERAS, WIDTH))).astype(np.float32)
    retriever = Retriever(RetrievalConfig(), library)
    retriever.query(query)  # aligns every episode

    def first_call() -> None:
        retriever.reset()
        retriever.query(query)

    out = {
        "aligned_ms": timed(lambda: retriever.query(query), iters),
        "first_call_ms": timed(first_call, iters),
    }
    halves = [list(range(0, episodes, 2)), list(range(1, episodes, 2))]
    turn = iter(range(1 << 30))
    out["task_change_ms"] = timed(lambda: retriever.restrict(halves[next(turn) % 2]), iters)
    retriever.restrict(None)
    retriever.fallback = True
    out["fallback_ms"] = timed(lambda: retriever.query(query), iters)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--calls", type=int, default=30, help="calls per library episode")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    results = {f"episodes_{n}": measure(n, args.calls, args.iters) for n in args.episodes}
    cpu = f"{platform.machine()} {platform.processor() or ''}".strip()
    record = {**record_header(f"cpu ({cpu})", args.commit), "calls_per_episode": args.calls,
              "descriptor": [CAMERAS, WIDTH], "results": results}  # fmt: skip
    lines = [
        f"# Retrieval per call by library size — CPU ({cpu})",
        "",
        f"commit `{args.commit}`, command `{record['command']}`; episodes of {args.calls} calls, descriptors "
        f"{CAMERAS} × {WIDTH} float32; medians of {args.iters} queries.",
        "",
        "| library episodes | aligned ms | first call ms | fallback ms | task change ms |",
        "|---|---|---|---|---|",
        *(
            f"| {k.split('_')[1]} | {v['aligned_ms']} | {v['first_call_ms']} | {v['fallback_ms']} "
            f"| {v['task_change_ms']} |"
            for k, v in results.items()
        ),
    ]
    save_results(args.out, f"retrieval_cpu_{args.commit}", record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
