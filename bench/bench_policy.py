"""`Policy.infer` as the node calls it, by cache mode: a dense episode (recorded for the library), then a
repeat of it (served from the cache), ALOHA-sized cameras (3 × 480×640), one process.

Per call, wall clock: preprocess (the images resized into the model's input, the state, the prompt; on a
GPU only the host's part: the frames copied into pinned memory, the resampling queued) and the model
(rMuscle's runtime: vision, the match, the cached or recording prefill + denoise, the actions back on the
host; on a GPU after the resampling there). A second policy, alternated with the first call by call,
resamples the images on the host as the policy did until 2026-12-01. Between two calls, and at the reset between the episodes, the window is refilled and
waited for, as the node does in its motion windows (at the reset: the likely episodes' first calls, so
the repeat's first call can be served cached). Medians over each episode's calls after its first; the
first calls are reported apart, with their cache mode.

    python bench/bench_policy.py --commit $(git rev-parse --short HEAD)      # pi05, graph, on CUDA
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import record_header, save_results
from rmuscle_ros.cache.runtime import RMuscleConfig
from rmuscle_ros.runtime.policy import Policy, PolicyConfig, host_threads, synthetic_observation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="graph", help="graph (GPU) or fused (CPU)")
    p.add_argument("--calls", type=int, default=20, help="calls per episode")
    p.add_argument(
        "--threads", type=int, default=0, help="PyTorch CPU threads (0: as the node, host_threads)"
    )
    p.add_argument("--prompt", default="pick up the cube and place it in the bin")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--name", default=None)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    if args.calls < 2:
        p.error("--calls: at least 2 (each episode's first call is reported apart)")
    torch.set_num_threads(args.threads or host_threads(args.device, torch.get_num_threads()))
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    cfg = PolicyConfig(preset=args.preset, device=args.device, backend=args.backend, random_weights=True)
    # On a GPU the policy resamples the images there. A second policy, alternated call by call with the
    # first, times the path before that (the images resampled on the host into pinned memory, then copied
    # up): its buffers swapped by reaching into it, which only a benchmark should do.
    paths = ("", "_host_preprocessing") if cuda else ("",)
    start = time.perf_counter()
    policies = {path: Policy(cfg, cache=RMuscleConfig(rebuilds_per_tick=4 * 5)) for path in paths}
    load_s = time.perf_counter() - start
    if cuda:
        old = policies["_host_preprocessing"]
        old._uploads = None
        old._images = torch.empty(old._images.shape, pin_memory=True)
    start = time.perf_counter()
    for policy in policies.values():
        policy.warmup(args.prompt)
    warmup_s = time.perf_counter() - start
    gc.collect()  # as the node does after configure: later collections walk only what comes after
    gc.freeze()
    print(f"[bench_policy] loaded in {load_s:.1f} s, warm-up {warmup_s:.1f} s", flush=True)
    observations = [synthetic_observation(cfg, args.prompt, seed=i) for i in range(args.calls)]
    # On a GPU, each call's time on the GPU's clock: from an event recorded as the call starts (the GPU
    # idle) to the runtime's span (its first event passes once the preprocessing queued before it has
    # run), the span itself, and from the span's end to an event recorded once the call has returned.
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if cuda else (None, None)
    calls = []  # (path, episode, call, mode, preprocess ms, model ms, total ms, before span, span, after span)
    for episode in ("dense", "repeat"):
        for i, obs in enumerate(observations):
            for path, policy in policies.items():
                sync()
                if start is not None:
                    start.record()
                chunk = policy.infer(obs)
                t = chunk.timings_s
                split: list[float] = []  # off a GPU: none
                if start is not None and end is not None and policy.rmuscle is not None:
                    end.record()
                    span = policy.rmuscle.last_gpu_span  # valid until the next call
                    assert span is not None  # on a GPU
                    end.synchronize()
                    split = [
                        start.elapsed_time(span[0]),
                        span[0].elapsed_time(span[1]),
                        span[1].elapsed_time(end),
                    ]
                calls.append(
                    (path, episode, i, chunk.cache_mode, t["preprocess"] * 1e3,
                     t["model_and_postprocess"] * 1e3, chunk.latency_s * 1e3, *split)
                )  # fmt: skip
                policy.rebuild_cache(wait=True)
        for policy in policies.values():
            policy.reset_episode()
            policy.rebuild_cache(wait=True)  # the node's motion window at the reset: the likely starts
    for policy in policies.values():
        policy.close()

    def summary(rows: list[tuple]) -> dict:
        return {
            "calls": len(rows),
            "median_ms": round(statistics.median(r[6] for r in rows), 3),
            "preprocess_ms": round(statistics.median(r[4] for r in rows), 3),
            "model_ms": round(statistics.median(r[5] for r in rows), 3),
            "modes": sorted({r[3] for r in rows}),
        } | (
            {  # on a GPU: the GPU's clock from the call's start to the runtime's span, the span, and after it
                "before_gpu_span_ms": round(statistics.median(r[7] for r in rows), 3),
                "gpu_span_ms": round(statistics.median(r[8] for r in rows), 3),
                "after_gpu_span_ms": round(statistics.median(r[9] for r in rows), 3),
            }
            if cuda
            else {}
        )

    results = {}
    for path in paths:
        mine = [c for c in calls if c[0] == path]
        results |= {
            f"dense_recorded{path}": summary([c for c in mine if c[1] == "dense" and c[2] > 0]),
            f"cached{path}": summary([c for c in mine if c[1] == "repeat" and c[2] > 0]),
            f"first_call_dense_episode{path}": summary([c for c in mine if c[1] == "dense" and c[2] == 0]),
            f"first_call_repeat{path}": summary([c for c in mine if c[1] == "repeat" and c[2] == 0]),
        }
        if results[f"cached{path}"]["modes"] != ["cached"] or results[f"dense_recorded{path}"]["modes"] != [
            "dense"
        ]:
            raise RuntimeError(f"the episodes did not run as intended: {results}")
    device = torch.cuda.get_device_name() if cuda else "CPU"
    record = {
        **record_header(device, args.commit),
        "preset": args.preset,
        "backend": args.backend,
        "torch_threads": torch.get_num_threads(),
        "load_s": round(load_s, 2),
        # the first policy's parts of loading: weights, engine, and the weights fingerprint (every byte)
        "load_parts_s": {k: round(v, 3) for k, v in policies[""].load_timings.items()},
        "warmup_s": round(warmup_s, 2),
        "results": results,
        "calls_ms": [list(c[:4]) + [round(x, 3) for x in c[4:]] for c in calls],
    }
    lines = [
        f"# Policy.infer by cache mode, `{args.preset}` ({args.backend}) — {device}",
        "",
        f"commit `{args.commit}`, command `{record['command']}`; 3 cameras 480×640, random weights, "
        f"{args.calls} calls per episode, PyTorch CPU threads {record['torch_threads']}; loaded in "
        f"{record['load_s']} s ({len(policies)} policies; the first's parts "
        f"{', '.join(f'{k} {v} s' for k, v in record['load_parts_s'].items())}), warm-up "
        f"{record['warmup_s']} s. Wall clock per call; medians over each "
        "episode's calls after its first.",
        "",
        "| calls | n | mode | median ms | preprocess ms | model ms |"
        + (" before GPU span | GPU span | after |" if cuda else ""),
        "|---|---|---|---|---|---|" + ("---|" * 3 if cuda else ""),
    ]
    names = {
        "dense_recorded": "dense episode, recorded for the library",
        "cached": "its repeat, served from the cache",
        "first_call_dense_episode": "the dense episode's first call",
        "first_call_repeat": "the repeat's first call (after the reset's refill of the window)",
    }
    for path in paths:
        for key, name in names.items():
            r = results[key + path]
            modes = ", ".join(r["modes"])
            name += ", images resampled on the host (the previous path)" if path else ""
            lines.append(
                f"| {name} | {r['calls']} | {modes} | {r['median_ms']} | {r['preprocess_ms']} | {r['model_ms']} |"
                + (
                    f" {r['before_gpu_span_ms']} | {r['gpu_span_ms']} | {r['after_gpu_span_ms']} |"
                    if cuda
                    else ""
                )
            )
    if cuda:
        lines += ["", "The images are resampled on the GPU (the policy's path) except in the rows that say "
                  "otherwise: a second policy, alternated call by call with the first. On the GPU's clock "
                  "(CUDA events, ms): from the call's start (the GPU idle) to the start of the runtime's "
                  "span (`RMuscle.last_gpu_span`: it starts once the work queued before it, the images' "
                  "resampling, has run), the span (the call's stages and the gaps the host leaves between "
                  "them), and from its end to the call's return (the actions back on the host, "
                  "postprocessing)."]  # fmt: skip
    stem = args.name or f"policy_{args.preset}_{gpu_tag(device)}_{args.commit}"
    save_results(args.out, stem, record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
