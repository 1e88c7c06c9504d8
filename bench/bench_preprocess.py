"""Host-side preprocessing per call (CPU): camera images to the model's input, and the whole
`Policy.preprocess` (images, state, prompt), in one process on the same observation.

Variants for one 480x640 camera image: `two_steps` (resize_with_pad, then image_to_model: the uint8
(224, 224, 3) intermediate) and `one_step` (image_to_model_padded, the path the policy takes); both give
the same tensor bit for bit (checked here and in test/test_transforms.py). Then `policy_preprocess`:
three such cameras, the state and the prompt. Medians of --iters calls, wall clock, torch threads as set.

    python bench/bench_preprocess.py --commit $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pi05 import record_header, save_results
from rmuscle_ros.runtime.policy import Observation, Policy, PolicyConfig
from rmuscle_ros.runtime.transforms import image_to_model, image_to_model_padded, resize_with_pad


def median_ms(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (the cell's host may have more)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    image = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    if not torch.equal(image_to_model(resize_with_pad(image)), image_to_model_padded(image)):
        raise RuntimeError("the one-step image path differs from the two steps")
    policy = Policy(PolicyConfig(backend="fused"))
    obs = Observation({c: image for c in policy.cfg.cameras}, np.zeros(14, np.float32), "stack the cups")
    results = {
        "two_steps": {
            "median_ms": round(median_ms(lambda: image_to_model(resize_with_pad(image)), args.iters), 3)
        },
        "one_step": {"median_ms": round(median_ms(lambda: image_to_model_padded(image), args.iters), 3)},
        "policy_preprocess": {"median_ms": round(median_ms(lambda: policy.preprocess(obs), args.iters), 3)},
    }
    cpu = platform.processor() or platform.machine()
    record = {
        **record_header(f"none (CPU: {cpu}, {os.cpu_count()} cores)", args.commit),
        "setting": {
            "image": [480, 640, 3],
            "cameras": len(policy.cfg.cameras),
            "torch_threads": args.threads,
            "iters": args.iters,
        },
        "results": results,
    }
    lines = [
        f"# Host preprocessing — CPU ({cpu}, {os.cpu_count()} cores, {args.threads} torch threads)",
        "",
        f"commit `{args.commit}`; one 480x640 camera image, then `Policy.preprocess` with "
        f"{len(policy.cfg.cameras)} of them; medians of {args.iters} calls (wall clock).",
        "",
        "| variant | median ms |",
        "|---|---|",
        *(f"| {k} | {v['median_ms']} |" for k, v in results.items()),
        "",
        "`two_steps` and `one_step` give the same tensor bit for bit; the policy uses `one_step`.",
    ]
    save_results(args.out, f"preprocess_cpu_{args.commit}", record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
