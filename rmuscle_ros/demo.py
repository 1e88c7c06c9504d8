"""The README's first command: load a policy from config/demo.yaml and run it on synthetic observations.

    python -m rmuscle_ros.demo [--config config/demo.yaml]

Prints the action chunk's shape and the latency of each call (median and p90 over the calls after
warm-up). The defaults need no files and no GPU: the `tiny` preset on the CPU with seeded weights.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rmuscle_ros.runtime.policy import Policy, PolicyConfig, synthetic_observation

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config" / "demo.yaml"
POLICY_KEYS = {f for f in PolicyConfig.__dataclass_fields__}


def load_demo_config(path: Path) -> tuple[PolicyConfig, dict[str, Any]]:
    """Split the YAML into PolicyConfig fields and demo settings (prompt, calls); unknown keys are errors."""
    raw = yaml.safe_load(path.read_text()) or {}
    demo_keys = {"prompt", "calls"}
    unknown = set(raw) - POLICY_KEYS - demo_keys
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {sorted(unknown)}")
    policy = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k in POLICY_KEYS}
    return PolicyConfig(**policy), {
        "prompt": raw.get("prompt", "do the task"),
        "calls": int(raw.get("calls", 20)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--calls", type=int, default=None, help="override the number of timed calls")
    args = p.parse_args(argv)
    cfg, demo = load_demo_config(args.config)
    calls = args.calls or demo["calls"]

    print(
        f"[demo] preset {cfg.preset}, backend {cfg.backend} ({cfg.dtype}) on {cfg.device}, cameras {list(cfg.cameras)}"
    )
    policy = Policy(cfg)
    warm = policy.warmup(demo["prompt"])
    print(f"[demo] warm-up {warm['warmup_total'] * 1e3:.0f} ms")
    latencies = []
    for i in range(calls):
        chunk = policy.infer(synthetic_observation(cfg, demo["prompt"], seed=i))
        latencies.append(chunk.latency_s * 1e3)
    assert np.isfinite(chunk.actions).all()
    p90 = statistics.quantiles(latencies, n=10)[-1] if len(latencies) > 1 else latencies[0]
    print(
        f"[demo] action chunk {chunk.actions.shape[0]} x {chunk.actions.shape[1]} (horizon x action dim), "
        f"prompt {chunk.prompt_tokens} tokens"
    )
    print(
        f"[demo] latency over {calls} calls: median {statistics.median(latencies):.1f} ms, p90 {p90:.1f} ms"
    )
    print(f"[demo] first actions: {np.array2string(chunk.actions[0, :7], precision=3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
