"""Could the Action Cache's FFN be one kernel? The gathered gate/up and down-projection (two Triton kernels
today) against `bench/cluster_ffn.cu`, which does both in one kernel of 8-CTA clusters that sum their K
slices through distributed shared memory (the sums through L2 did not pay: README, 2457f0e).

Full `pi05` expert shapes at ρn (50 rows, width 1024, 4096 neurons), under programmatic dependent launch
as the engine launches. Each variant is captured as one CUDA graph of --launches back-to-back launches,
replayed --iters times; µs per launch = replay time / launches, median, with the weights hot (one copy,
in L2) and cold (--copies copies cycled). With `+ add_norm`, each launch is followed by the cached
layer-step's residual + norm, which sums the partial products (8 slices today, 16 chunks for the cluster
kernel) and writes the next launch's input: the chain as in the denoise graph. The kernel is compiled
here with nvcc (torch.utils.cpp_extension); it is a probe, not engine code.

    python bench/probe_cluster_ffn.py --commit $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import record_header, rel_l2, save_results
from bench.probe_ffn_kernels import per_kernel_us  # µs per launch of a graph of launches
from rmuscle_ros.engine import ops, triton_ops
from rmuscle_ros.engine.fused import gather_splits, keep_neuron_count
from rmuscle_ros.models.config import get_preset

ROWS_PADDED = 64  # the cluster kernel's partial products have 64 rows (the activations padded)
CHUNK = 128  # selected neurons per cluster (cluster_ffn.cu): one partial product per chunk


def build_extension():
    from torch.utils.cpp_extension import load

    return load(
        name="cluster_ffn_probe",
        sources=[str(Path(__file__).with_name("cluster_ffn.cu"))],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90", "-std=c++17", "-Xptxas=-v"],
        verbose=True,  # the build log carries ptxas's registers and spills per kernel
    )


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rho-n", type=float, default=0.5)
    p.add_argument("--copies", type=int, default=16, help="weight copies cycled through when cold")
    p.add_argument("--launches", type=int, default=96)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_cluster_ffn runs CUDA kernels: no CUDA device here")
    device = torch.device("cuda")
    ext = build_extension()
    e = get_preset("pi05").expert
    m, width, f = get_preset("pi05").horizon, e.width, e.mlp_dim
    sel = keep_neuron_count(args.rho_n, f)
    gen = torch.Generator(device).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    gate_up = [rand(2 * f, width, scale=width**-0.5) for _ in range(args.copies)]
    down_t = [rand(f, width, scale=f**-0.5) for _ in range(args.copies)]  # K-major, as the engine keeps it
    neurons = torch.randperm(f, generator=gen, device=device)[:sel].sort().values.to(torch.int32)
    x, anchor = rand(m, width), rand(m, f, scale=0.1)
    delta = torch.empty(m, sel, device=device, dtype=torch.bfloat16)
    partials = torch.zeros(sel // CHUNK, ROWS_PADDED, width, device=device)
    splits = gather_splits(sel)
    norm = {"eps": 1e-6, "rms": True, "gate": rand(width, dtype=torch.float32),
            "mul": rand(width, dtype=torch.float32), "add": rand(width, dtype=torch.float32),
            "y_base": rand(m, width, dtype=torch.float32), "res_ready": True}  # fmt: skip
    res = rand(m, width, dtype=torch.float32)
    h = x.clone()

    # Same result: the chunks' partials summed against the two kernels' slices summed, and the definition.
    with triton_ops.programmatic_launch(False):
        triton_ops.linear_geglu(x, gate_up[0], delta, neurons=neurons, anchor=anchor)
        y_triton = triton_ops.linear(delta, down_t[0], splits, neurons=neurons).sum(0)
    ext.cluster_ffn(x, gate_up[0], down_t[0], neurons, anchor, partials, False)
    y_cluster = partials[:, :m].sum(0)
    ref_delta = ops.linear_geglu(x, gate_up[0], torch.empty_like(delta), neurons=neurons, anchor=anchor)
    y_ref = ref_delta.float() @ down_t[0][neurons.long()].float()
    check = {
        "rel_l2_cluster_vs_triton": float(f"{rel_l2(y_cluster, y_triton):.3e}"),
        "rel_l2_cluster_vs_definition": float(f"{rel_l2(y_cluster, y_ref):.3e}"),
        "rel_l2_triton_vs_definition": float(f"{rel_l2(y_triton, y_ref):.3e}"),
        "padding_rows_zero": bool((partials[:, m:] == 0).all()),
    }
    check["max_active_clusters"] = ext.max_active_clusters(sel // CHUNK)  # one wave needs sel / CHUNK
    print(f"[probe] check: {check}", flush=True)

    # Where a launch's time goes: per CTA, the SM's clock at each phase boundary and the global timer at
    # its start and end; with all chunks, and with as many as the GPU holds clusters at once (one wave).
    phases = ("before the wait (indices, weights, anchor issued)", "activations in, weights landed",
              "gate/up + cluster sync", "GeGLU + 2 cluster syncs", "down + store")  # fmt: skip
    one_wave = min(sel // CHUNK, check["max_active_clusters"]) * CHUNK
    diagnostics = {}
    for n_sel in sorted({sel, one_wave}, reverse=True):
        stamps = torch.zeros(n_sel // CHUNK * 8, 8, dtype=torch.int64, device=device)
        part = torch.zeros(n_sel // CHUNK, ROWS_PADDED, width, device=device)
        for _ in range(3):
            ext.cluster_ffn(x, gate_up[0], down_t[0], neurons[:n_sel], anchor, part, False, stamps)
        torch.cuda.synchronize()
        st = stamps.cpu().double()
        cycles = st[:, 1:6] - st[:, 0:5]
        start, end = st[:, 6], st[:, 7]
        diagnostics[f"{n_sel // CHUNK} chunks"] = {
            "median_cycles": {ph: round(cycles[:, k].median().item()) for k, ph in enumerate(phases)},
            "cta_median_us": round((end - start).median().item() / 1e3, 3),
            "span_us": round((end.max() - start.min()).item() / 1e3, 3),
            "start_spread_us": round((start.max() - start.min()).item() / 1e3, 3),
        }
        print(f"[probe] {n_sel // CHUNK} chunks: {diagnostics[f'{n_sel // CHUNK} chunks']}", flush=True)

    def triton_ffn(i: int, chain: bool) -> None:
        a = h if chain else x
        triton_ops.linear_geglu(a, gate_up[i], delta, neurons=neurons, anchor=anchor)
        y = triton_ops.linear(delta, down_t[i], splits, neurons=neurons)
        if chain:
            triton_ops.add_norm(res, y, h, **norm)

    def cluster_ffn(i: int, chain: bool) -> None:
        a = h if chain else x
        ext.cluster_ffn(a, gate_up[i], down_t[i], neurons, anchor, partials, True)
        if chain:
            triton_ops.add_norm(res, partials[:, :m], h, **norm)

    runs = {
        "triton gate/up + down": lambda i: triton_ffn(i, False),
        "cluster kernel": lambda i: cluster_ffn(i, False),
        "same launch, 3 cluster barriers only": lambda i: ext.cluster_sync_only(sel // CHUNK, 3, True),
        "same launch, no barrier": lambda i: ext.cluster_sync_only(sel // CHUNK, 0, True),
        "triton gate/up + down + add_norm": lambda i: triton_ffn(i, True),
        "cluster kernel + add_norm": lambda i: cluster_ffn(i, True),
    }
    results: dict[str, dict[str, float | str]] = {}
    with triton_ops.programmatic_launch(True):
        for name, run in runs.items():
            try:
                results[name] = {
                    key: per_kernel_us(run, cold, args.copies, args.launches, args.iters)
                    for key, cold in (("hot_us", False), ("cold_us", True))
                }
            except Exception as exc:
                results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            print(f"[probe] {name}: {results[name]}", flush=True)
    gpu = torch.cuda.get_device_name(device)
    record = record_header(gpu, args.commit) | {
        "setting": {
            "preset": "pi05",
            "rho_n": args.rho_n,
            "rows": m,
            "selected": sel,
            "copies": args.copies,
            "launches": args.launches,
            "iters": args.iters,
            "pdl": True,
        },
        "check": check,
        "diagnostics": diagnostics,
        "results": results,
    }
    lines = [
        f"# The Action Cache's FFN as one cluster kernel — {gpu}, `pi05`",
        "",
        f"commit `{args.commit}`, command `{record['command']}`; ρn = {args.rho_n} ({sel} of {f} neurons), "
        f"{m} rows, PDL on; µs per launch, median of {args.iters} replays of {args.launches} launches. Hot: one "
        f"weight copy (in L2); cold: {args.copies} copies cycled (from HBM).",
        "",
        f"Result check (rel L2 of the summed output): {check}",
        "",
        f"Inside one launch (no PDL; SM cycles per phase, medians over CTAs): {diagnostics}",
        "",
        "| variant | hot µs | cold µs |",
        "|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r.get('hot_us', r.get('error'))} | {r.get('cold_us', '–')} |")
    stem = f"probe_cluster_ffn_{gpu_tag(gpu)}_{args.commit}"
    save_results(args.out, stem, record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
