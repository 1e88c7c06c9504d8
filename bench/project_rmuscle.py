"""Roofline projection of rMuscle vs dense for π0.5 and its 7B scaling variant (no GPU needed).

From the analytic FLOPs and minimum bytes per call (`engine/cost.py`), each target's floor is
max(FLOPs / peak, bytes / bandwidth) per stage. These are *projections*, not measurements: they bound
what an engine at the roofline would gain, and show where the gain comes from (the Context Cache cuts
prefill FLOPs, which matters where the prefill is compute-bound; the Action Cache cuts denoise bytes,
which matters where the denoise is bandwidth-bound). The H200 row uses the ceilings measured by
bench_rmuscle.py (--ceilings-from); the other peaks are assumptions stated in the output.

    python bench/project_rmuscle.py --ceilings-from bench/results/rmuscle_pi05_h200_2026-11-30_83f9ef2.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rmuscle_ros.engine.cost import call_cost, rmuscle_cost
from rmuscle_ros.models.config import get_preset

# Bandwidths from issue #4; compute peaks are assumptions (dense bf16 tensor throughput, float32
# accumulate): RTX 4090 from NVIDIA's Ada whitepaper figure, Thor a placeholder to be replaced by a
# measured ceiling on the device.
TARGETS = {"rtx4090": {"tb_s": 1.0, "tflops": 165.0}, "thor": {"tb_s": 0.273, "tflops": 250.0}}


def floors(costs: dict, tflops: float, tb_s: float) -> dict[str, float]:
    return {k: c.floor_s(tflops * 1e12, tb_s * 1e12) * 1e3 for k, c in costs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ceilings-from", type=Path, default=None, help="a bench_rmuscle/bench_pi05 JSON")
    p.add_argument("--prompt-tokens", type=int, default=50)
    p.add_argument("--rho-p", type=float, default=0.4)
    p.add_argument("--rho-n", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    targets = dict(TARGETS)
    measured: set[str] = set()  # targets whose ceilings a benchmark measured (the rest are assumed)
    if args.ceilings_from:
        c = json.loads(args.ceilings_from.read_text())["ceilings"]
        targets = {"h200_measured_ceilings": {"tb_s": c["copy_tb_s"], "tflops": c["bf16_tflops"]}} | targets
        measured.add("h200_measured_ceilings")
    rows = []
    for preset in ("pi05", "pi05-7b"):
        cfg = get_preset(preset)
        dense = call_cost(cfg, args.prompt_tokens)
        cached = rmuscle_cost(cfg, args.prompt_tokens, args.rho_p, args.rho_n)
        for name, t in targets.items():
            fd, fc = floors(dense, t["tflops"], t["tb_s"]), floors(cached, t["tflops"], t["tb_s"])
            rows.append(
                {
                    "preset": preset,
                    "target": name,
                    "ceilings": t,
                    "ceilings_source": "measured" if name in measured else "assumed",
                    "dense_floor_ms": {k: round(v, 3) for k, v in fd.items()}
                    | {"total": round(sum(fd.values()), 3)},
                    "rmuscle_floor_ms": {k: round(v, 3) for k, v in fc.items()}
                    | {"total": round(sum(fc.values()), 3)},
                    "floor_ratio": round(sum(fd.values()) / sum(fc.values()), 3),
                }
            )
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "kind": "projection from the analytic cost model; not measured",
        "setting": {
            "prompt_tokens": args.prompt_tokens,
            "rho_p": args.rho_p,
            "rho_n": args.rho_n,
            "anchors": 1,
        },
        "results": rows,
    }
    lines = [
        "# rMuscle roofline projection (not measured)",
        "",
        f"ρp = {args.rho_p}, ρn = {args.rho_n}, 1 anchor step, 3 cameras, {args.prompt_tokens} prompt tokens. "
        "Floor = max(FLOPs/peak, bytes/bandwidth) per stage, summed. Peaks other than the H200's measured "
        "ceilings are assumptions.",
        "",
        "| preset | target | ceilings | TB/s | TFLOP/s | dense floor ms (vision/prefill/denoise) | rMuscle floor ms | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d, c = r["dense_floor_ms"], r["rmuscle_floor_ms"]
        lines.append(
            f"| {r['preset']} | {r['target']} | {r['ceilings_source']} | {r['ceilings']['tb_s']:.3g} | "
            f"{r['ceilings']['tflops']:.4g} | "
            f"{d['total']} ({d['vision']}/{d['prefill']}/{d['denoise']}) | "
            f"{c['total']} ({c['vision']}/{c['prefill']}/{c['denoise']}) | {r['floor_ratio']} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rmuscle_projection.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "rmuscle_projection.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
