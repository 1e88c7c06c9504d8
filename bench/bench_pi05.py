"""π0.5 latency benchmark on a GPU: eager vs the graph engine in one process, on the same inputs.

Setting (issue #2): full `pi05` size, 3 cameras, a prompt of ~50 valid tokens (task text + 14-D ALOHA
state; the graph engines compute it padded to its prompt bucket, 64 tokens; the roofline floor counts the
valid tokens only), 10 denoising steps, horizon 50; the graph engines take host inputs as the
node's policy handed them over until 2026-12-01 (images pinned; it now resamples them on the GPU and hands
them over there, as in the graph-device-inputs row). Weights are seeded random (no trained
π0.5 weights on the benchmark machine): timings do not depend on values, accuracy ratios are
graph-vs-eager on the same weights.

Writes bench/results/<name>.md and .json: date, gpu, commit, command, setting, measured ceilings,
FLOPs/bytes per call and roofline floor, and `results: {variant: {median_ms, hz, stages_ms, ...}}`.

    python bench/bench_pi05.py --preset pi05 --out bench/results --commit $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from rmuscle_ros.engine import create_engine
from rmuscle_ros.engine.cost import call_cost, total
from rmuscle_ros.engine.graph import STAGES, GraphEngine
from rmuscle_ros.models.checkpoint import init_random_
from rmuscle_ros.models.config import Pi05Config, get_preset
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model, euler_times


def cuda_time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> list[float]:
    """Per-iteration device time (CUDA events) in ms."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def time_interleaved(runs: dict[str, Callable[[], object]], iters: int, cuda: bool) -> dict[str, float]:
    """Median ms per run over `iters` rounds (after 3 warm-up rounds), one call of each run per round, so
    that clock drift between timing loops (up to ~0.3 ms on the H200) hits them alike: CUDA events from
    an idle GPU on a GPU, wall clock on a CPU."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(iters + 3):
        for name, run in runs.items():
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                run()
                ms = (time.perf_counter() - t0) * 1e3
            if i >= 3:
                samples[name].append(ms)
    return {name: round(statistics.median(v), 3) for name, v in samples.items()}


def time_call_steps(
    engine: GraphEngine, inputs: ModelInputs, noise: torch.Tensor, iters: int
) -> dict[str, float]:
    """Median host ms of one call's steps as sample_actions takes them, started with the GPU idle:
    begin_load; finish_load while the vision graph runs (a copy that waited for the stream would take
    about as long as vision); the tail graph's launch."""
    cuda = engine.device.type == "cuda"
    names = ("begin_load_host_ms", "finish_load_host_ms", "tail_launch_host_ms")
    rows: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        bucket = engine.begin_load(inputs, noise)
        t1 = time.perf_counter()
        engine.run_stage("vision", bucket)
        t2 = time.perf_counter()
        engine.finish_load()
        t3 = time.perf_counter()
        engine.run_stage("tail", bucket)
        t4 = time.perf_counter()
        for name, ms in zip(names, ((t1 - t0) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3), strict=True):
            rows[name].append(ms)
    if cuda:
        torch.cuda.synchronize()
    return {k: round(statistics.median(v), 3) for k, v in rows.items()}


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """bf16 matmul rate and device-to-device copy bandwidth, measured now (random data, not zeros)."""
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm = statistics.median(cuda_time_ms(lambda: a @ b, 20)) / 1e3
    src = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    cp = statistics.median(cuda_time_ms(lambda: dst.copy_(src), 20)) / 1e3
    return {"bf16_tflops": 2 * n**3 / mm / 1e12, "copy_tb_s": 2 * src.numel() * 2 / cp / 1e12}


def make_inputs(cfg, prompt_tokens: int, device: torch.device, seed: int) -> tuple[ModelInputs, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    c, s = cfg.num_cameras, cfg.vision.image_size
    images = torch.rand(1, c, 3, s, s, generator=gen) * 2 - 1
    tokens = torch.randint(0, cfg.vocab_size, (1, prompt_tokens), generator=gen)
    tokens[0, 0] = 2  # BOS
    inputs = ModelInputs(
        images, torch.ones(1, c, dtype=torch.bool), tokens, torch.ones(1, prompt_tokens, dtype=torch.bool)
    )
    noise = torch.randn(1, cfg.horizon, cfg.action_dim, generator=gen)
    return inputs.to(device), noise.to(device)


def policy_inputs(inputs: ModelInputs, noise: torch.Tensor) -> tuple[ModelInputs, torch.Tensor]:
    """The inputs as the node's policy handed them to the engine until 2026-12-01 (Policy.preprocess): host
    tensors, the images in pinned memory where there is CUDA. (It now makes the images on the GPU.)"""
    images = inputs.images.cpu()
    images = images.pin_memory() if torch.cuda.is_available() else images
    cpu = ModelInputs(images, inputs.image_masks.cpu(), inputs.tokens.cpu(), inputs.token_mask.cpu())
    return cpu, noise.cpu()


def random_model(cfg: Pi05Config, device: torch.device, seed: int) -> Pi05Model:
    """The model with seeded random weights, built on the device (a CPU-side default init of the larger
    presets takes minutes)."""
    with device:
        model = Pi05Model(cfg).to(device).eval()
    init_random_(model, seed)
    return model


def random_graph_engine(
    preset: str, device: torch.device, *, prompt_tokens: int = 50, seed: int = 0, **options: object
) -> tuple[GraphEngine, int]:
    """A graph engine for `preset` with seeded random weights, the benchmark's inputs loaded and its graphs
    captured (the eager model is dropped). Returns (engine, prompt bucket)."""
    cfg = get_preset(preset)
    model = random_model(cfg, device, seed)
    engine = create_engine("graph", model, device, **options)
    del model
    inputs, noise = make_inputs(cfg, prompt_tokens, device, seed)
    bucket = engine.load_inputs(inputs, noise)
    engine.warmup()
    return engine, bucket


def record_header(gpu: str, commit: str) -> dict[str, str]:
    """What every results file starts with, so later runs can be compared by a script."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "commit": commit,
        "command": " ".join(["python", *sys.argv]),
        "torch": torch.__version__,
    }


def finite_or_none(value: object) -> object:
    """`value` with every non-finite float (a figure not measured, e.g. the ceilings of a CPU run) replaced
    by None, so that the record is strict JSON (null, not NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def save_results(out: Path, stem: str, record: dict, markdown: str) -> None:
    """bench/results/<stem>.json (strict JSON: null where a figure is not finite) and .md (the same
    figures), and the Markdown on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(finite_or_none(record), indent=1, allow_nan=False) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    print(markdown, flush=True)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def eager_stages(
    model: Pi05Model, inputs: ModelInputs, noise: torch.Tensor
) -> dict[str, Callable[[], object]]:
    state: dict[str, object] = {}

    def vision() -> None:
        state["prefix"] = model.embed_prefix(inputs)

    def prefill() -> None:
        state["cache"] = model.prefill(*state["prefix"])

    def denoise() -> None:
        x, dt_ = noise.float(), -1.0 / model.cfg.num_steps
        for t in euler_times(model.cfg.num_steps):
            x = x + dt_ * model.velocity(x, torch.full((1,), t, device=x.device), state["cache"])

    return {"vision": vision, "prefill": prefill, "denoise": denoise}


# Fewest samples for which p10/p90 are given: with fewer, a 10th percentile is one of the two most extreme
# samples or an interpolation next to it, not a measured spread.
MIN_PERCENTILE_SAMPLES = 20


def summarize(samples: list[float]) -> dict[str, float | int | None]:
    """Median, Hz, sample count, min and max of `samples` (ms); p10/p90 (inclusive method: within the
    samples) only from at least MIN_PERCENTILE_SAMPLES samples, else None."""
    med = statistics.median(samples)
    enough = len(samples) >= MIN_PERCENTILE_SAMPLES
    q = statistics.quantiles(samples, n=100, method="inclusive") if enough else None
    return {
        "median_ms": round(med, 3),
        "p10_ms": round(q[9], 3) if q else None,
        "p90_ms": round(q[89], 3) if q else None,
        "hz": round(1e3 / med, 1),
        "samples": len(samples),
        "min_ms": round(min(samples), 3),
        "max_ms": round(max(samples), 3),
    }


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--prompt-tokens", type=int, default=50)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--eager-iters", type=int, default=10)
    p.add_argument(
        "--rounds", type=int, default=3, help="timing loops of the graph variants (each's median kept)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-serial",
        action="store_true",
        help="skip graph-nopdl, a second engine (pi05-7b: float32 model + two engines exceed an H200)",
    )
    p.add_argument("--commit", default="unknown")
    p.add_argument("--name", default=None, help="result file stem (default: <preset>_<gpu>_<date>)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = torch.cuda.get_device_name(device)
    cfg = get_preset(args.preset)
    print(
        f"[bench] {gpu}, preset {args.preset}, {cfg.num_cameras} cameras, {args.prompt_tokens} prompt tokens",
        flush=True,
    )

    ceilings = measure_ceilings(device)
    print(f"[bench] ceilings: {ceilings}", flush=True)

    model = random_model(cfg, device, args.seed)
    inputs, noise = make_inputs(cfg, args.prompt_tokens, device, args.seed)

    t0 = time.perf_counter()
    graph = create_engine("graph", model, device)
    build_s = time.perf_counter() - t0
    capture = graph.warmup()
    print(
        f"[bench] graph engine built in {build_s:.1f} s, {len(capture)} graphs captured in {sum(capture.values()):.1f} s",
        flush=True,
    )

    # The same engine with serial launches (no programmatic dependent launch), to measure what PDL buys.
    serial = create_engine("graph", model, device, pdl=False) if graph.pdl and not args.no_serial else None
    if serial is not None:
        serial.warmup()

    # Accuracy: graph (bf16) vs eager float32 (the reference) and eager bf16, same weights/inputs/noise.
    ref_f32 = model.sample_actions(inputs, noise)
    out_graph = graph.sample_actions(inputs, noise)
    results: dict[str, dict] = {}
    samples = cuda_time_ms(lambda: model.sample_actions(inputs, noise), max(3, args.eager_iters // 2))
    results["eager-fp32"] = summarize(samples)
    model.to(torch.bfloat16)
    out_eager_bf16 = model.sample_actions(inputs, noise)
    accuracy = {
        "graph_vs_eager_bf16_rel_l2": rel_l2(out_graph, out_eager_bf16),
        **(
            {"graph_vs_graph_nopdl_rel_l2": rel_l2(out_graph, serial.sample_actions(inputs, noise))}
            if serial
            else {}
        ),
        "graph_vs_eager_fp32_rel_l2": rel_l2(out_graph, ref_f32),
        "eager_bf16_vs_eager_fp32_rel_l2": rel_l2(out_eager_bf16, ref_f32),
    }
    print(f"[bench] accuracy: {accuracy}", flush=True)

    # Speed: eager bf16, fused kernels without graphs, graph; each with a per-stage split.
    stages_e = eager_stages(model, inputs, noise)
    results["eager"] = summarize(cuda_time_ms(lambda: model.sample_actions(inputs, noise), args.eager_iters))
    results["eager"]["stages_ms"] = {
        k: round(statistics.median(cuda_time_ms(f, args.eager_iters)), 3) for k, f in stages_e.items()
    }
    results["eager"]["stage_samples"] = args.eager_iters
    # The graph engines take the inputs as the node's policy handed them over until 2026-12-01: images in
    # pinned host memory, prompt and noise as host tensors. "graph-device-inputs": the same call with the
    # inputs already on the GPU (the prompt is then read back to pick its bucket); the policy now hands
    # the images over on the GPU, the prompt and noise on the host.
    host = policy_inputs(inputs, noise)
    bucket = graph.load_inputs(*host)
    variants = [("fused-nograph", graph, False, host), ("graph", graph, True, host),
                ("graph-device-inputs", graph, True, (inputs, noise))]  # fmt: skip
    if serial is not None:
        variants.insert(1, ("graph-nopdl", serial, True, host))
    # Stage columns: each stage's own graph replayed alone (CUDA events), and the tail graph (prefill +
    # denoise, the denoise's first step running alongside the prefill) that a call replays after vision.
    for variant, engine, use_graphs, (x, z) in variants:
        results[variant] = summarize(
            cuda_time_ms(
                lambda e=engine, u=use_graphs, x=x, z=z: e.sample_actions(x, z, use_graphs=u), args.iters
            )
        )
        engine.load_inputs(x, z)
        results[variant]["stages_ms"] = {
            s: round(
                statistics.median(
                    cuda_time_ms(lambda e=engine, s=s, u=use_graphs: e.run_stage(s, bucket, u), args.iters)
                ),
                3,
            )
            for s in (*STAGES, "tail")
        }
    results["graph"]["speedup_vs_eager"] = round(
        results["eager"]["median_ms"] / results["graph"]["median_ms"], 2
    )
    results["graph"]["prompt_bucket"] = bucket
    # The call's two graphs alone (vision, then the tail), inputs already loaded: sample_actions minus this
    # is what loading the inputs adds to a call.
    graph.load_inputs(*host)

    def replays() -> None:
        graph.run_stage("vision", bucket)
        graph.run_stage("tail", bucket)

    results["graph"]["replay_ms"] = round(statistics.median(cuda_time_ms(replays, args.iters)), 3)
    # Host time of each step of a call: the GPU waits for begin_load at the start of every call;
    # finish_load runs while the vision graph does.
    results["graph"] |= time_call_steps(graph, *host, args.iters)
    results["graph"]["pdl"] = graph.pdl
    # Spread between back-to-back timing loops (on the H200 up to ~0.3 ms): more rounds of the graph call,
    # alternated with the serial-launch variant where there is one, each round's median kept.
    timed = [v for v in variants if v[0] != "fused-nograph"]
    rounds: dict[str, list[float]] = {name: [results[name]["median_ms"]] for name, *_ in timed}
    for _ in range(args.rounds - 1):
        for name, engine, _, (x, z) in timed:
            samples = cuda_time_ms(lambda e=engine, x=x, z=z: e.sample_actions(x, z), args.iters)
            rounds[name].append(round(statistics.median(samples), 3))
    for name, medians in rounds.items():
        results[name]["round_medians_ms"] = medians

    costs = call_cost(cfg, args.prompt_tokens)
    peak, bw = ceilings["bf16_tflops"] * 1e12, ceilings["copy_tb_s"] * 1e12
    floor = {k: round(c.floor_s(peak, bw) * 1e3, 3) for k, c in costs.items()}
    floor_total = round(sum(floor.values()), 3)
    cost_json = {
        k: {"gflop": round(c.flops / 1e9, 1), "gbytes": round(c.bytes / 1e9, 3)} for k, c in costs.items()
    }
    tot = total(costs)
    results["graph"]["x_roofline_floor"] = round(results["graph"]["median_ms"] / floor_total, 2)

    record = {
        **record_header(gpu, args.commit),
        "setting": {
            "preset": args.preset,
            "cameras": cfg.num_cameras,
            "prompt_tokens": args.prompt_tokens,
            "steps": cfg.num_steps,
            "horizon": cfg.horizon,
            "weights": f"random (seed {args.seed})",
            "iters": args.iters,
            "eager_iters": args.eager_iters,
        },
        "ceilings": {k: round(v, 1 if "tflops" in k else 2) for k, v in ceilings.items()},
        "cost_per_call": {
            **cost_json,
            "total": {"gflop": round(tot.flops / 1e9, 1), "gbytes": round(tot.bytes / 1e9, 3)},
        },
        "roofline_floor_ms": {**floor, "total": floor_total},
        "accuracy": {k: float(f"{v:.3e}") for k, v in accuracy.items()},
        "capture_s": round(sum(capture.values()), 2),
        "results": results,
    }
    stem = args.name or f"{args.preset}_{gpu_tag(gpu)}_{record['date'][:10]}"
    save_results(args.out, stem, record, to_markdown(record))


def _ms(value: object) -> str:
    """A figure for the table, "–" where it was not measured (None) or does not apply (absent)."""
    return "–" if value is None else str(value)


def to_markdown(r: dict) -> str:
    s = r["setting"]
    bucket = r["results"]["graph"].get("prompt_bucket", "?")
    lines = [
        f"# π0.5 `{s['preset']}` latency — {r['gpu']}, {r['date']}",
        "",
        f"commit `{r['commit']}`, torch {r['torch']}, command `{r['command']}`",
        "",
        f"Setting: {s['cameras']} cameras, {s['prompt_tokens']} valid prompt tokens (the graph engines compute "
        f"the {bucket}-token bucket), {s['steps']} steps, horizon {s['horizon']}, weights {s['weights']}.",
        "",
        "Whole call (median, p10, p90, Hz): `sample_actions` (loading the inputs, vision, then the tail graph: "
        f"prefill + denoise) timed with CUDA events, n calls per row ({s['iters']} for the graph engines). "
        f"p10/p90: inclusive percentiles, given only from {MIN_PERCENTILE_SAMPLES} or more samples (– otherwise; "
        "min and max are in the JSON). Stage columns: each stage run alone, inputs loaded (CUDA events, median "
        "of as many calls): for the graph engines each stage's own graph (fused-nograph: its fused ops without "
        "graphs), and the tail a call runs after vision. A call is loading + vision + tail; inside the tail the "
        "denoise's first step runs alongside the prefill, so the stage columns, each timed alone, do not add "
        "up to the call.",
        "",
        "| variant | n | median ms | p10 | p90 | Hz | vision ms | prefill ms (alone) | denoise ms (alone) | tail ms (prefill + denoise graph) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in r["results"].items():
        st = v.get("stages_ms", {})
        lines.append(
            f"| {name} | {_ms(v.get('samples'))} | {v['median_ms']} | {_ms(v['p10_ms'])} | {_ms(v['p90_ms'])} | "
            f"{v['hz']} | {_ms(st.get('vision'))} | {_ms(st.get('prefill'))} | {_ms(st.get('denoise'))} | "
            f"{_ms(st.get('tail'))} |"
        )
    g = r["results"]["graph"]
    e = r["results"]["eager"]
    f = r["roofline_floor_ms"]
    c = r["cost_per_call"]
    lines += [
        "",
        "Eager rows (PyTorch, no graphs; eager: bf16, eager-fp32: float32) are host-bound (the GPU waits on "
        "kernel launches) and timed once, before the graph rows and not interleaved with them (eager "
        f"{_ms(e.get('samples'))} calls, its stages {_ms(e.get('stage_samples'))} calls each; eager-fp32 "
        f"{_ms(r['results'].get('eager-fp32', {}).get('samples'))} calls): for scale only; they move between runs.",
        "",
        f"graph vs eager (bf16): **{g['speedup_vs_eager']}×** (eager for scale only, above); graph = "
        f"{g['x_roofline_floor']}× the roofline floor.",
        "",
        f"The call's two graphs alone (vision, tail), inputs already loaded: {g['replay_ms']} ms. Loading "
        f"the inputs takes {g['begin_load_host_ms']} ms of host time before vision starts (validation, the "
        f"images' copy) and {g['finish_load_host_ms']} ms while it runs (prompt, layout, noise). The graph "
        "engines' rows take host inputs as the node's policy handed them over until 2026-12-01 (images pinned, "
        "prompt and noise on the host); graph-device-inputs takes them on the GPU (the policy's images now are).",
        "",
        "Medians of the graph call in successive timing loops (the table has the first): "
        + "; ".join(
            f"{k} {', '.join(map(str, v['round_medians_ms']))} ms"
            for k, v in r["results"].items()
            if "round_medians_ms" in v
        )
        + ".",
        "",
        f"Ceilings measured in this run: {r['ceilings']['bf16_tflops']} TFLOP/s bf16 matmul, "
        f"{r['ceilings']['copy_tb_s']} TB/s device copy. Roofline floor (projection from FLOPs and bytes, not "
        f"measured): the {s['prompt_tokens']} valid prompt tokens only, not the {bucket}-token bucket the graph "
        "engines compute.",
        "",
        "| stage | GFLOP | GB moved (min) | roofline floor ms |",
        "|---|---|---|---|",
    ]
    for k in ("vision", "prefill", "denoise"):
        lines.append(f"| {k} | {c[k]['gflop']} | {c[k]['gbytes']} | {f[k]} |")
    lines.append(f"| total | {c['total']['gflop']} | {c['total']['gbytes']} | {f['total']} |")
    lines += ["", "Accuracy (relative L2 of the action chunk, same weights, inputs and noise):", ""]
    lines += [f"- {k}: {v}" for k, v in r["accuracy"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
