"""What a window entry's rebuild reads from the library on the host: one call's rows
(`ReferenceLibrary.load_call`, since `749f817`) against the whole episode file (`ReferenceLibrary.load`,
what the rebuild's first part read before for an episode not kept in memory).

Episodes of `pi05` shapes (3 cameras of 224×224, 64 prompt tokens, the Action Cache's masks at ρn = 0.5:
10 steps × 18 expert layers × 2048 of 4096 neurons, int16), written through `ReferenceLibrary.add` into
`--dir` (the system's temporary folder by default: put it on the disk the cell's library lives on). Each
read is timed on the host, wall clock; the page cache holds the file after its write, so these are warm
reads (a cold disk is slower still). Medians of `--iters` reads.

    python bench/bench_episode_read.py --commit $(git rev-parse --short HEAD) --out bench/results
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pi05 import record_header, save_results
from rmuscle_ros.cache.library import Episode, LibraryKey, ReferenceLibrary

CAMERAS, IMAGE, TOKENS, WIDTH = 3, 224, 64, 2048
STEPS, DEPTH, KEPT = 10, 18, 2048  # pi05's denoising steps, expert layers, neurons kept at rho_n 0.5


def pi05_episode(calls: int, seed: int = 0) -> Episode:
    rng = np.random.default_rng(seed)
    return Episode(
        descriptors=rng.standard_normal((calls, CAMERAS, WIDTH)).astype(np.float32),
        images=rng.integers(0, 256, (calls, CAMERAS, IMAGE, IMAGE, 3), dtype=np.uint8),
        tokens=rng.integers(0, 257_000, (calls, TOKENS)),
        token_mask=np.ones((calls, TOKENS), dtype=np.bool_),
        action_masks=rng.integers(0, 4096, (calls, STEPS, DEPTH, KEPT)).astype(np.int16),
        image_masks=np.ones((calls, CAMERAS), dtype=np.bool_),
    )


def timed(run, iters: int) -> list[float]:
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, nargs="+", default=[30, 100], help="calls per episode")
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--dir", type=Path, default=None, help="where the library is written (a temporary folder)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--name", default=None)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    if args.iters < 1 or any(c < 1 for c in args.calls):
        p.error("--iters and --calls must be at least 1")

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="rmuscle_read_", dir=args.dir) as folder:
        key = LibraryKey("bench", {"cameras": CAMERAS})
        library = ReferenceLibrary.open(Path(folder), key, max_bytes=1 << 40, max_episodes=1 << 20)
        try:
            for calls in args.calls:
                episode_id = library.add(pi05_episode(calls), {"task": "bench"})
                size = library.entries[episode_id].bytes
                whole = timed(partial(library.load, episode_id), args.iters)
                one = timed(partial(library.load_call, episode_id, calls // 2), args.iters)
                for variant, samples in (("whole_episode", whole), ("one_call", one)):
                    results[f"{variant}_{calls}_calls"] = {
                        "median_ms": round(statistics.median(samples), 3),
                        "min_ms": round(min(samples), 3),
                        "max_ms": round(max(samples), 3),
                        "file_mib": round(size / 2**20, 1),
                    }
        finally:
            library.close()

    host = f"{platform.processor() or platform.machine()} host"
    record = {**record_header(host, args.commit), "iters": args.iters, "results": results}
    lines = [
        f"# A rebuild's library read, `pi05`-shaped episodes — {host}",
        "",
        f"commit `{args.commit}`, command `{record['command']}`. Wall clock on the host, warm page cache, "
        f"medians of {args.iters} reads.",
        "",
        "| variant | file MiB | median ms | min ms | max ms |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {r['file_mib']} | {r['median_ms']} | {r['min_ms']} | {r['max_ms']} |"
            for name, r in results.items()
        ),
    ]
    save_results(args.out, args.name or f"episode_read_{args.commit}", record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
