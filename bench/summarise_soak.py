"""Latency of the node's soak runs (`bench/device_run.sh … node_soak`), from the chunks they recorded.

Each run is the demo as a shift (`python -m rmuscle_ros.demo --episodes 8 --seconds 15` at full size on
a GPU), whose published ActionChunks were recorded to `<run folder>/action_chunks`. This reads each run's
chunks (their `inference_latency_s` and `cache_mode`) and writes one table of them:

    python bench/summarise_soak.py --run "player in the node's process=/path/to/node_soak_9cfec2d" \
        --run "player in its own process=/path/to/node_soak_a5b7355" --gpu "NVIDIA H200" --commit a5b7355

The slowest calls' breakdown (preprocess, GPU span) is not in the chunks: the demo prints it from the
node's stats (`node_soak_<commit>.txt` beside the run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.bench_pi05 import record_header, save_results
from rmuscle_ros.cache.runtime import MODES  # indexed by ActionChunk's cache_mode code
from rmuscle_ros.node.bags import read_messages

TOPIC = "/rmuscle_node/action_chunk"


def summarise(folder: Path) -> dict[str, object]:
    chunks = [m for _, m in read_messages(folder / "action_chunks", TOPIC)]
    if not chunks:
        raise ValueError(f"{folder}: no chunks recorded on {TOPIC}")
    ms = np.array([c.inference_latency_s * 1e3 for c in chunks])
    modes = np.array([MODES[c.cache_mode] for c in chunks])
    row: dict[str, object] = {
        "chunks": len(chunks),
        "episodes": len({c.episode_id for c in chunks}),
        "median_ms": float(np.median(ms)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "over_25_ms": int((ms > 25).sum()),
        "hit_rate": float((modes == "cached").mean()),
    }
    for mode in ("cached", "dense"):
        if (modes == mode).any():
            row[f"{mode}_median_ms"] = float(np.median(ms[modes == mode]))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--run", action="append", required=True, metavar="NAME=FOLDER", help="a soak run (repeatable)"
    )
    p.add_argument("--gpu", required=True, help="the GPU the runs ran on")
    p.add_argument("--commit", required=True)
    p.add_argument("--name", default=None, help="results file stem (default node_soak_pi05_<commit>)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    results = {}
    for item in args.run:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            p.error(f"--run {item!r}: expected NAME=FOLDER")
        results[name] = summarise(Path(folder))
    record = record_header(args.gpu, args.commit) | {"results": results}
    lines = [
        f"# The node's soak runs, π0.5 `pi05` — {args.gpu}, {record['date']}",
        "",
        f"commit `{args.commit}`, command `{record['command']}`",
        "",
        "Latency per published chunk (the node's `inference_latency_s`: `Policy.infer`, wall clock), read from",
        "the chunks each run recorded.",
        "",
        "| run | chunks (episodes) | p50 ms | p90 ms | p99 ms | max ms | calls over 25 ms | cached p50 | dense p50 | hit rate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['chunks']} ({r['episodes']}) | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | "
            f"{r['p99_ms']:.1f} | {r['max_ms']:.1f} | {r['over_25_ms']} | {r.get('cached_median_ms', float('nan')):.1f} | "
            f"{r.get('dense_median_ms', float('nan')):.1f} | {r['hit_rate']:.2f} |"
        )
    save_results(args.out, args.name or f"node_soak_pi05_{args.commit}", record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
