"""What loading the inputs adds to a graph-engine call, and whether overlapping it with vision hides it
(issue #2).

A call is two graph replays, vision then the tail (prefill + denoise). Loading an observation has two
halves: `begin_load` (validation, the images' copy) must come before vision; `finish_load` (prompt,
layout, noise packed on the host, one upload) only before the tail. This probe times, on the GPU's clock,
three ways to run the same call, interleaved call by call so that clock drift between timing loops (up to
~0.3 ms on the H200) hits them alike:

- `overlapped`: `sample_actions` — begin_load, vision, finish_load, tail (the host packs while vision runs);
- `serial`: `load_inputs`, then vision, then the tail (the GPU waits for all of the host's work);
- `graphs_alone`: vision and the tail with the inputs already loaded (nothing to wait for);

for inputs as the node's policy handed them over until 2026-12-01 (images pinned, prompt and noise on the
host) and for inputs already on the GPU; each with the live lane's staging buffer pageable (the engine's default) and
pinned (`_Staging.pin`). Also the host time of each step of a call, and a cProfile of `load_inputs`.
(The previous version of this probe, `bench/results/probe_load_inputs_h200_acf81b9`, compared staging
buffers and the prefill's gate/up kernel: the pinned and pageable buffers load alike.)

    python bench/probe_load_inputs.py --commit $(git rev-parse --short HEAD)
    python bench/probe_load_inputs.py --device cpu --preset tiny   # a smoke run: the fused engine, no graphs
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import (
    make_inputs,
    policy_inputs,
    random_model,
    record_header,
    save_results,
    time_call_steps,
    time_interleaved,
)
from rmuscle_ros.engine import create_engine
from rmuscle_ros.engine.graph import GraphEngine
from rmuscle_ros.models.config import get_preset
from rmuscle_ros.models.pi05 import ModelInputs


def call_ways(engine: GraphEngine, inputs: ModelInputs, noise: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The three ways of the module docstring to run one call."""
    bucket = engine.load_inputs(inputs, noise)

    def serial() -> None:
        engine.load_inputs(inputs, noise)
        engine.run_stage("vision", bucket)
        engine.run_stage("tail", bucket)

    def graphs_alone() -> None:
        engine.run_stage("vision", bucket)
        engine.run_stage("tail", bucket)

    return {
        "overlapped": lambda: engine.sample_actions(inputs, noise),
        "serial": serial,
        "graphs_alone": graphs_alone,
    }


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
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--device", default="cuda")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = get_preset(args.preset)
    model = random_model(cfg, device, 0)
    on_device, noise = make_inputs(cfg, args.prompt_tokens, device, 0)
    host = policy_inputs(on_device, noise)
    inputs = {"host": host, "device": (on_device, noise)} if cuda else {"host": host}
    # The live lane's staging buffer as the engine makes it (pageable), and pinned (one more engine).
    engines = {}
    for staging in ("pageable", "pinned") if cuda else ("pageable",):
        engine = create_engine("graph" if cuda else "fused", model, device)
        if staging == "pinned":
            engine.live.staging.pin()
        engine.load_inputs(*host)
        engine.warmup()
        engines[staging] = engine
    results: dict[str, dict[str, float]] = {}
    for where, (x, z) in inputs.items():
        ways = {
            f"{staging}_{name}": run
            for staging, e in engines.items()
            for name, run in call_ways(e, x, z).items()
        }
        row = {f"{k}_ms": v for k, v in time_interleaved(ways, args.iters, cuda).items()}
        for staging, e in engines.items():
            row |= {f"{staging}_{k}": v for k, v in time_call_steps(e, x, z, args.iters).items()}
        results[f"{where}_inputs"] = row
        print(f"[probe] inputs on the {where}: {row}", flush=True)
    engine = engines["pageable"]
    profile = profile_load(lambda: engine.load_inputs(*host), 200, cuda)
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    record = {**record_header(gpu, args.commit), "preset": args.preset, "results": results}
    figures = list(next(iter(results.values())))
    lines = [
        f"# Loading a call's inputs — {gpu}, `{args.preset}`",
        "",
        f"commit `{args.commit}`, command `{record['command']}`; medians of {args.iters} calls per way, the "
        "ways interleaved call by call (bench/probe_load_inputs.py says what each is), with the live lane's "
        "staging buffer pageable and pinned.",
        "",
        "| figure | " + " | ".join(results) + " |",
        "|---|" + "---|" * len(results),
        *(f"| {f} | " + " | ".join(str(v.get(f, "–")) for v in results.values()) + " |" for f in figures),
        "",
        "cProfile of load_inputs (host inputs, 200 calls), by own time:",
        "",
        "```",
        profile.strip(),
        "```",
    ]
    save_results(
        args.out,
        f"probe_load_inputs_{gpu_tag(gpu)}_{args.commit}",
        record,
        "\n".join(lines) + "\n",
    )


if __name__ == "__main__":
    main()
