"""Compare the denoising loop's layer-step positions between two `trace_graphs.py` results (e.g. a branch
against `main`), for each denoise stage both traced: µs per layer-step in the steps after the first.

    python bench/compare_traces.py bench/results/trace_graphs_h200_cached_c27e56a.json OTHER.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def layer_step_deltas(a: dict, b: dict) -> dict[str, list[dict]]:
    """Per denoise stage traced in both: each position's later-steps µs in a and in b, and b − a."""
    out: dict[str, list[dict]] = {}
    for stage, ra in a["results"].items():
        rb = b["results"].get(stage, {})
        if not (ra.get("layer_step") and rb.get("layer_step")):
            continue
        out[stage] = [
            {"position": pa["position"], "kernel": pa["kernel"], "a_us": pa["later_steps_us"],
             "b_us": pb["later_steps_us"], "delta_us": pb["later_steps_us"] - pa["later_steps_us"]}
            for pa, pb in zip(ra["layer_step"], rb["layer_step"], strict=True)
        ]  # fmt: skip
        out[stage].append({"position": "span", "kernel": "graph, ms", "a_us": ra["span_us"] / 1e3,
                           "b_us": rb["span_us"] / 1e3, "delta_us": (rb["span_us"] - ra["span_us"]) / 1e3})  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = p.parse_args()
    a, b = (json.loads(path.read_text()) for path in (args.a, args.b))
    for stage, rows in layer_step_deltas(a, b).items():
        print(f"\n{stage}: `{a['commit']}` → `{b['commit']}` (µs per layer-step, steps after the first)\n")
        print("| # | kernel | a | b | b − a |\n|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['position']} | {r['kernel']} | {r['a_us']:.2f} | {r['b_us']:.2f} | {r['delta_us']:+.2f} |"
            )


if __name__ == "__main__":
    main()
