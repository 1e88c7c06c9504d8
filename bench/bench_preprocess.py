"""Preprocessing per call: on the host (CPU), camera images to the model's input, and the whole
`Policy.preprocess` (images, state, prompt), in one process on the same observation.

Variants for one 480x640 camera image: `two_steps` (resize_with_pad, then image_to_model: the uint8
(224, 224, 3) intermediate) and `one_step` (image_to_model_padded); both give the same tensor bit for bit
(checked here and in test/test_transforms.py). For three such cameras: `cameras_one_by_one` (one_step per
camera, the policy's path until 2026-12-01) and `cameras_batched` (images_to_model_padded, one batch, the
policy's path on a CPU; the same tensors bit for bit), each alone and `with_busy_thread`: another thread
runs Python the whole time, so each PyTorch operation that hands over the interpreter lock waits up to the
switch interval (5 ms) to get it back, which is what a node's executor thread busy with frames can do
to its worker. Then `policy_preprocess`: three cameras, the state and the prompt. With a GPU, the same on
the GPU (`gpu_variants`). Medians of --iters calls (fewer with the busy thread), wall clock, torch threads
as set.

    python bench/bench_preprocess.py --commit $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import record_header, save_results
from rmuscle_ros.runtime.policy import Observation, Policy, PolicyConfig
from rmuscle_ros.runtime.transforms import (
    ImageUploads,
    image_to_model,
    image_to_model_padded,
    images_to_model_padded,
    resize_with_pad,
)


def median_ms(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def with_busy_thread(fn: Callable[[], object], iters: int) -> float:
    """median_ms of fn while another thread runs pure Python without a pause."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        return median_ms(fn, iters, warmup=2)
    finally:
        stop.set()
        thread.join()


def gpu_variants(
    cameras: dict[int, np.ndarray], on_cpu: torch.Tensor, obs: Observation, iters: int
) -> dict[str, dict[str, float]]:
    """The three cameras to the model's input on the GPU, each call waited for: the host path then a copy,
    and the upload with the resampling on the GPU (alone and beside a busy thread); Policy.preprocess."""
    device = torch.device("cuda")
    pinned, on_gpu = torch.empty(on_cpu.shape, pin_memory=True), torch.empty(on_cpu.shape, device=device)
    uploads, one_by_one = ImageUploads(device), ImageUploads(device, graphs=False)
    eager_out = torch.empty(on_cpu.shape, device=device)

    def host_then_copy() -> None:
        images_to_model_padded(cameras, pinned)
        on_gpu.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    def gpu() -> None:
        images_to_model_padded(cameras, on_gpu, uploads)
        torch.cuda.synchronize()

    def gpu_launches_one_by_one() -> None:
        images_to_model_padded(cameras, eager_out, one_by_one)
        torch.cuda.synchronize()

    gpu()
    gpu()  # the second call replays the graph the first captured
    gpu_launches_one_by_one()
    diff = (on_gpu.cpu() - on_cpu).abs()
    if not torch.equal(on_gpu, eager_out):
        raise RuntimeError("the graph's resampling differs from the same operations launched one by one")
    policy = Policy(PolicyConfig(backend="fused", device="cuda"))
    policy.preprocess(obs)

    def policy_gpu() -> None:
        policy.preprocess(obs)
        torch.cuda.synchronize()

    return {
        "cameras_host_then_copy": {"median_ms": round(median_ms(host_then_copy, iters), 3)},
        "cameras_gpu": {
            "median_ms": round(median_ms(gpu, iters), 3),
            "max_abs_diff": diff.max().item(),
            "fraction_differing": float(f"{(diff > 0).float().mean().item():.3g}"),
        },
        "cameras_gpu_launches_one_by_one": {"median_ms": round(median_ms(gpu_launches_one_by_one, iters), 3)},
        "cameras_gpu_with_busy_thread": {"median_ms": round(with_busy_thread(gpu, max(iters // 3, 5)), 3)},
        "cameras_gpu_launches_one_by_one_with_busy_thread": {
            "median_ms": round(with_busy_thread(gpu_launches_one_by_one, max(iters // 3, 5)), 3)
        },
        "policy_preprocess_gpu": {"median_ms": round(median_ms(policy_gpu, iters), 3)},
    }


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
    cameras = {
        slot: np.random.default_rng(slot).integers(0, 256, (480, 640, 3), dtype=np.uint8) for slot in range(3)
    }
    one_by_one, batched = torch.empty(3, 3, 224, 224), torch.empty(3, 3, 224, 224)

    def cameras_one_by_one() -> None:
        for slot, camera in cameras.items():
            image_to_model_padded(camera, out=one_by_one[slot])

    def cameras_batched() -> None:
        images_to_model_padded(cameras, batched)

    cameras_one_by_one()
    cameras_batched()
    if not torch.equal(one_by_one, batched):
        raise RuntimeError("the batched image path differs from one image at a time")
    policy = Policy(PolicyConfig(backend="fused"))
    obs = Observation({c: image for c in policy.cfg.cameras}, np.zeros(14, np.float32), "stack the cups")
    results = {
        "two_steps": {
            "median_ms": round(median_ms(lambda: image_to_model(resize_with_pad(image)), args.iters), 3)
        },
        "one_step": {"median_ms": round(median_ms(lambda: image_to_model_padded(image), args.iters), 3)},
        "cameras_one_by_one": {"median_ms": round(median_ms(cameras_one_by_one, args.iters), 3)},
        "cameras_batched": {"median_ms": round(median_ms(cameras_batched, args.iters), 3)},
        "cameras_one_by_one_with_busy_thread": {
            "median_ms": round(with_busy_thread(cameras_one_by_one, max(args.iters // 3, 5)), 3)
        },
        "cameras_batched_with_busy_thread": {
            "median_ms": round(with_busy_thread(cameras_batched, max(args.iters // 3, 5)), 3)
        },
        "policy_preprocess": {"median_ms": round(median_ms(lambda: policy.preprocess(obs), args.iters), 3)},
    }
    gpu_lines: list[str] = []
    if torch.cuda.is_available():
        results |= gpu_variants(cameras, batched, obs, args.iters)
        gpu_lines = [
            "",
            "On the GPU (each call synchronised, so the figures include the GPU's work): `cameras_host_then_copy`",
            "is the policy's path until 2026-12-01 (`cameras_batched` into pinned memory, then copied up as",
            "float32); `cameras_gpu` uploads the uint8 frames and resamples them there (the policy's path now:",
            "the resampling replayed as a CUDA graph, captured by the first call), and",
            "`cameras_gpu_launches_one_by_one` the same operations launched one by one from Python (the policy's",
            "path until 2026-12-05; checked equal to the graph's, bit for bit);",
            "`policy_preprocess_gpu` is `Policy.preprocess` with `tiny` on the GPU. The GPU's tensors against",
            f"the CPU's: {results['cameras_gpu']['fraction_differing']} of the values differ, by at most "
            f"{results['cameras_gpu']['max_abs_diff']:.3g}.",
        ]
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    record = {
        **record_header(f"{gpu} (CPU: {cpu}, {os.cpu_count()} cores)", args.commit),
        "setting": {
            "image": [480, 640, 3],
            "cameras": len(policy.cfg.cameras),
            "torch_threads": args.threads,
            "iters": args.iters,
        },
        "results": results,
    }
    lines = [
        f"# Preprocessing — CPU ({cpu}, {os.cpu_count()} cores, {args.threads} torch threads), GPU {gpu}",
        "",
        f"commit `{args.commit}`; one 480x640 camera image, then `Policy.preprocess` with "
        f"{len(policy.cfg.cameras)} of them; medians of {args.iters} calls (wall clock).",
        "",
        "| variant | median ms |",
        "|---|---|",
        *(f"| {k} | {v['median_ms']} |" for k, v in results.items()),
        "",
        "`two_steps` and `one_step` give the same tensor bit for bit, and so do `cameras_one_by_one` and",
        "`cameras_batched` (the policy's path on a CPU). `with_busy_thread`: another thread runs Python meanwhile.",
        *gpu_lines,
    ]
    where = "cpu" if gpu == "none" else gpu_tag(gpu)
    save_results(
        args.out, f"preprocess_{where}_{args.commit}_t{args.threads}", record, "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
