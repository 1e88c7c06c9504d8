"""The ONNX export behind the `tensorrt` backend, at full size: what can be checked without TensorRT.

    python bench/check_export.py --preset pi05 --dtype float32 --commit $(git rev-parse --short HEAD)

float32: exports vision, prefill and the denoise step (`engine.onnx_export`), then runs them with ONNX
Runtime on the CPU through the stage composition the TensorRT engine uses, against the eager model in
float32 (on the GPU when there is one) on the benchmark's inputs: relative L2 of each stage's outputs and
of the chunk. bfloat16 (what the TensorRT engine builds): exports, then ONNX's full checker on each
graph, the types of K/V and of every softmax input. Both: export time per stage and file sizes.

Not a benchmark of speed: ONNX Runtime on the CPU is the export's checker here, not an engine anyone
deploys. The TensorRT build and its speed need a Thor (`python -m rmuscle_ros.engine.tensorrt`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import gpu_tag
from bench.bench_pi05 import make_inputs, random_model, record_header, rel_l2, save_results
from rmuscle_ros.engine import onnx_export
from rmuscle_ros.engine.onnx_runtime import open_sessions, session_runner
from rmuscle_ros.models.checkpoint import weights_fingerprint
from rmuscle_ros.models.config import get_preset
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model


def check_float32(
    export_dir: Path, model: Pi05Model, inputs: ModelInputs, noise: torch.Tensor, threads: int
) -> dict[str, object]:
    start = time.perf_counter()
    ort_run = session_runner(open_sessions(export_dir, threads))
    open_s = time.perf_counter() - start
    reference = onnx_export.torch_runner(onnx_export.stage_modules(model))
    errors: dict[str, float] = {}
    stage_s: dict[str, list[float]] = {s: [] for s in onnx_export.STAGES}

    def both(stage: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        ours = ort_run(stage, feeds)
        stage_s[stage].append(time.perf_counter() - t0)
        ref = reference(stage, {n: feeds[n].to(model.projector.weight.device) for n in feeds})
        for name in onnx_export.OUTPUTS[stage]:
            key = f"{stage}.{name}"
            if ref[name].dtype == torch.bool:
                errors[key] = float(not torch.equal(ours[name], ref[name].cpu()))
            else:
                errors[key] = max(errors.get(key, 0.0), rel_l2(ours[name], ref[name].cpu()))
        # Carry the reference forward so each stage is compared on the same inputs.
        return ref

    onnx_export.sample_actions_by_stage(both, inputs, noise, model.cfg.num_steps)

    # And the whole chunk through ONNX Runtime alone, against the eager model's sample_actions.
    t0 = time.perf_counter()  # one call: at full size it takes seconds on the CPU
    actions = onnx_export.sample_actions_by_stage(ort_run, inputs, noise, model.cfg.num_steps)
    call_s = time.perf_counter() - t0
    with torch.no_grad():
        device = model.projector.weight.device
        expected = model.sample_actions(inputs.to(device), noise.to(device)).cpu()
    return {
        "actions_rel_l2_vs_eager_f32": rel_l2(actions, expected),
        "stage_output_max_rel_l2": errors,
        "ort_sessions_s": round(open_s, 2),
        "ort_call_s": round(call_s, 2),
        "ort_stage_s_median": {s: round(statistics.median(v), 3) for s, v in stage_s.items()},
    }


def check_bfloat16(export_dir: Path) -> dict[str, object]:
    import onnx

    result: dict[str, object] = {}
    for stage in onnx_export.STAGES:
        path = export_dir / f"{stage}.onnx"
        start = time.perf_counter()
        onnx.checker.check_model(str(path), full_check=True)
        graph = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False)).graph
        types = {
            v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output, *graph.value_info]
        }
        softmax = sorted(
            {onnx.TensorProto.DataType.Name(types[n.input[0]]) for n in graph.node if n.op_type == "Softmax"}
        )
        result[stage] = {
            "checker": "passed",
            "check_s": round(time.perf_counter() - start, 1),
            "nodes": len(graph.node),
            "softmax_input_types": softmax,
            "io_types": {
                v.name: onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type)
                for v in [*graph.input, *graph.output]
            },
        }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="pi05")
    p.add_argument("--dtype", choices=sorted(onnx_export.DTYPES), default="float32")
    p.add_argument("--prompt-tokens", type=int, default=50)
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    p.add_argument("--workdir", help="where the export is written (default: a temporary directory)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--name")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The reference is float32 proper: no TF32 in cuDNN's convolution (SigLIP's patch embedding) or matmuls.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    cfg = get_preset(args.preset)
    start = time.perf_counter()
    model = random_model(cfg, device, seed=0)
    weights = weights_fingerprint(model)
    model = model.to(onnx_export.DTYPES[args.dtype])
    build_s = time.perf_counter() - start
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rmuscle_export_"))
    start = time.perf_counter()
    export_dir = onnx_export.export_model(model, workdir / "export", weights=weights)
    export_s = time.perf_counter() - start
    manifest = onnx_export.read_manifest(export_dir, verify=False)
    record = record_header(gpu, args.commit) | {
        "preset": args.preset,
        "dtype": args.dtype,
        "opset": onnx_export.OPSET,
        "model_build_s": round(build_s, 1),
        "export_s": round(export_s, 1),
        "export_stage_s": manifest["export_seconds"],
        "files_mb": {n: round(m["bytes"] / 1e6, 1) for n, m in manifest["files"].items()},
    }
    if args.dtype == "float32":
        inputs, noise = make_inputs(cfg, args.prompt_tokens, torch.device("cpu"), seed=0)
        record["results"] = {"onnxruntime_cpu": check_float32(export_dir, model, inputs, noise, args.threads)}
    else:
        record["results"] = {"onnx_checker": check_bfloat16(export_dir)}
    lines = [
        f"# ONNX export check: `{args.preset}`, {args.dtype}, opset {onnx_export.OPSET}",
        "",
        f"{record['date']}, commit `{args.commit}`, {gpu}; model built in {build_s:.0f} s, exported in "
        f"{export_s:.0f} s ({', '.join(f'{s} {v:.0f} s' for s, v in manifest['export_seconds'].items())}).",
        "",
        "| file | MB |",
        "|---|---|",
        *(f"| {n} | {mb} |" for n, mb in record["files_mb"].items()),
        "",
    ]
    res = record["results"]
    if "onnxruntime_cpu" in res:
        r = res["onnxruntime_cpu"]
        lines += [
            f"ONNX Runtime (CPU) against eager float32 ({device}), {args.prompt_tokens}-token prompt: chunk "
            f"relative L2 {r['actions_rel_l2_vs_eager_f32']:.2e}; a call took {r['ort_call_s']} s on the CPU.",
            "",
            "| stage output | max relative L2 (each stage on the reference's inputs) |",
            "|---|---|",
            *(f"| {k} | {v:.2e} |" for k, v in r["stage_output_max_rel_l2"].items()),
            "",
        ]
    else:
        lines += [
            "| stage | ONNX checker (full) | nodes | softmax input types | inputs / outputs |",
            "|---|---|---|---|---|",
            *(
                f"| {s} | {v['checker']} | {v['nodes']} | {', '.join(v['softmax_input_types'])} | "
                + ", ".join(f"{k} {t}" for k, t in v["io_types"].items())
                + " |"
                for s, v in res["onnx_checker"].items()
            ),
            "",
        ]
    name = args.name or f"export_{args.preset}_{args.dtype}_{gpu_tag(gpu)}_{args.commit}"
    save_results(Path(args.out), name, record, "\n".join(lines))


if __name__ == "__main__":
    main()
