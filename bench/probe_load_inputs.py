"""Where a graph-engine call spends the time its graphs do not: `load_inputs` on the host (issue #2).

On the H200 the call graph alone took 13.86 ms, the whole call 14.41 (`bench/results/pi05_h200_5b80a0c`):
the host spent 0.64 ms per call loading the inputs, against ~0.13 ms a few builds earlier, cause not found.
This probe times, per variant, in one process on the same inputs (medians of --iters calls):

- `host_load_ms`: host time of `load_inputs` (the GPU waits for it at the start of every call);
- `gpu_load_ms`: GPU time from a call's start to the end of its input copies;
- `call_ms`: the whole call on the GPU's clock (load + the call graph); `graph_ms`: the call graph alone;

for inputs as the node's policy hands them over (images pinned, prompt and noise on the host) and for
inputs already on the GPU, with the engine's defaults and with the prefill's gate/up GEMM on cuBLAS
(`triton_ops.GEMM_GEGLU["kernel"] = 0`, graphs captured so), and with the pinned staging buffer of
`5b80a0c` swapped in (`PinnedStaging`). Then a cProfile of `load_inputs` (default engine, host inputs):
its most expensive functions by own time.

    python bench/probe_load_inputs.py --commit $(git rev-parse --short HEAD)
    python bench/probe_load_inputs.py --device cpu --preset tiny   # a smoke run: the fused engine, no graphs
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pi05 import make_inputs, record_header, save_results
from rmuscle_ros.engine import create_engine
from rmuscle_ros.models.checkpoint import init_random_
from rmuscle_ros.models.config import get_preset
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model


class PinnedStaging:
    """The live lane's staging buffer as it was at 5b80a0c/d9f2611, where load_inputs took 0.64 ms: a pinned
    host buffer, one CUDA event per upload, and the next call's writes waiting on it. Swapped into an
    engine by this probe only, to A/B it against the pageable buffer the engine uses now."""

    def __init__(self, staging, pin: bool = True) -> None:  # pin=False: the view mapping alone, on a CPU
        self.device = staging.device
        self.host = staging.host.pin_memory() if pin else staging.host.clone()
        base = staging.host.data_ptr()

        def view(t: torch.Tensor) -> torch.Tensor:
            offset, n = t.data_ptr() - base, t.numel() * t.element_size()
            return self.host[offset : offset + n].view(t.dtype).view(t.shape)

        self.on_host = {name: view(t) for name, t in staging.on_host.items()}
        self.on_device = staging.on_device
        self._arrays = {name: t.numpy() for name, t in self.on_host.items()}
        self.copied: torch.cuda.Event | None = None

    @property
    def arrays(self) -> dict:
        if self.copied is not None:
            self.copied.synchronize()
        return self._arrays

    def upload(self) -> None:
        self.device.copy_(self.host, non_blocking=True)
        if self.host.is_pinned():
            self.copied = torch.cuda.Event()
            self.copied.record()


def _event(cuda: bool) -> torch.cuda.Event | None:
    if not cuda:
        return None
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def time_calls(engine, inputs: ModelInputs, noise: torch.Tensor, iters: int) -> dict[str, float]:
    """Medians over `iters` calls (after 5 warm-up calls) of the figures in the module docstring."""
    cuda = engine.device.type == "cuda"
    rows: dict[str, list[float]] = {"host_load_ms": [], "gpu_load_ms": [], "call_ms": [], "graph_ms": []}
    bucket = engine.load_inputs(inputs, noise)
    for i in range(iters + 5):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        start = _event(cuda)
        engine.load_inputs(inputs, noise)
        t1 = time.perf_counter()
        loaded = _event(cuda)
        if cuda:
            engine.run_stage("call", bucket)
        else:
            engine.sample_actions(inputs, noise)
        end = _event(cuda)
        if cuda:
            end.synchronize()
        if i < 5:
            continue
        rows["host_load_ms"].append((t1 - t0) * 1e3)
        if cuda:
            rows["gpu_load_ms"].append(start.elapsed_time(loaded))
            rows["call_ms"].append(start.elapsed_time(end))
    if cuda:
        for _ in range(iters):
            start = _event(cuda)
            engine.run_stage("call", bucket)
            end = _event(cuda)
            end.synchronize()
            rows["graph_ms"].append(start.elapsed_time(end))
    return {k: round(statistics.median(v), 3) for k, v in rows.items() if v}


def profile_load(load: Callable[[], object], calls: int, cuda: bool, rows: int = 12) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        load()
        if cuda:
            torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--prompt-tokens", type=int, default=50)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = get_preset(args.preset)
    with device:
        model = Pi05Model(cfg).to(device).eval()
    init_random_(model, 0)
    on_device, noise = make_inputs(cfg, args.prompt_tokens, device, 0)
    images = on_device.images.cpu()
    host = (
        ModelInputs(images.pin_memory() if cuda else images, on_device.image_masks.cpu(),
                    on_device.tokens.cpu(), on_device.token_mask.cpu()),
        noise.cpu(),
    )  # fmt: skip
    inputs = {"host": host, "device": (on_device, noise)} if cuda else {"host": host}
    engines = {"default": None, "gate_up_on_cublas": 0} if cuda else {"default": None}
    results: dict[str, dict[str, float]] = {}
    profile = ""
    for name, kernel in engines.items():
        from_triton = None
        if kernel is not None:
            from rmuscle_ros.engine import triton_ops  # CUDA only

            from_triton = dict(triton_ops.GEMM_GEGLU)
            triton_ops.GEMM_GEGLU["kernel"] = kernel
        engine = create_engine("graph" if cuda else "fused", model, device)
        engine.load_inputs(*host)
        engine.warmup()
        if from_triton is not None:
            triton_ops.GEMM_GEGLU.update(from_triton)
        for where, (x, z) in inputs.items():
            results[f"{name}_{where}_inputs"] = time_calls(engine, x, z, args.iters)
            print(f"[probe] {name}, inputs on the {where}: {results[f'{name}_{where}_inputs']}", flush=True)
        if name == "default":
            profile = profile_load(lambda e=engine: e.load_inputs(*host), 200, cuda)
            if cuda:  # the pinned staging of 5b80a0c, same engine and graphs
                pageable, engine.live.staging = engine.live.staging, PinnedStaging(engine.live.staging)
                results["pinned_staging_host_inputs"] = time_calls(engine, *host, args.iters)
                print(
                    f"[probe] pinned staging, host inputs: {results['pinned_staging_host_inputs']}",
                    flush=True,
                )
                engine.live.staging = pageable
        del engine
        if cuda:
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    record = {**record_header(gpu, args.commit), "preset": args.preset, "results": results}
    keys = ["host_load_ms", "gpu_load_ms", "call_ms", "graph_ms"]
    lines = [
        f"# load_inputs probe — {gpu}, `{args.preset}`",
        "",
        f"commit `{args.commit}`, command `{record['command']}`; medians of {args.iters} calls.",
        "",
        "| variant | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
        *(f"| {k} | " + " | ".join(str(v.get(c, "–")) for c in keys) + " |" for k, v in results.items()),
        "",
        "cProfile of load_inputs (default engine, host inputs, 200 calls), by own time:",
        "",
        "```",
        profile.strip(),
        "```",
    ]
    save_results(
        args.out,
        f"probe_load_inputs_{gpu.split()[-1].lower()}_{args.commit}",
        record,
        "\n".join(lines) + "\n",
    )


if __name__ == "__main__":
    main()
