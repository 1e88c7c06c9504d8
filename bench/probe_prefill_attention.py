"""The prefill's attention, kernel against kernel, as the prefill graph runs it (issue #2's margin).

The engine's Triton attention takes ~27 µs per prefill layer on an H200 (17 layers, ~0.47 ms per call:
8 query heads × Lp rows over Lp keys of one K/V head, Dh 256). An earlier comparison with PyTorch's SDPA
backends timed eager launches, whose overhead (~45 µs) hid the kernels' own times. Here every variant is
a CUDA graph of `--layers` back-to-back calls on the same buffers, the graphs replayed interleaved
and timed with CUDA events; the table gives µs per call. Variants:

- `triton`: the engine's kernel (`triton_ops.attention`), with its default and a few other configurations;
- `cudnn_bias`: SDPA's cuDNN backend with the key mask as a broadcast bias, q as the strided view the
  engine has, K/V broadcast over the heads without a copy (what `ops.attention` does);
- `cudnn_bias_contiguous`: the same with q, K and V laid out head-major beforehand (copies not timed: a
  bound for a QKV kernel that wrote that layout);
- `cudnn_nomask`, `flash_nomask`: no key mask at all (a bound: right only when no key is padding);
- `gemm_softmax`: cuBLAS for QKᵀ and PV (heads folded into rows) with a float32 softmax between.

Each output's relative L2 error against a float32 reference (with the mask; the no-mask variants against a
float32 reference without it) is reported next to its time.

    python bench/probe_prefill_attention.py --commit $(git rev-parse --short HEAD) --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import record_header, save_results, time_interleaved
from rmuscle_ros.engine import triton_ops
from rmuscle_ros.models.config import get_preset

# The engine's default, then a sweep around it, timed in the same graphs.
TRITON_CONFIGS = {"triton": {}} | {
    f"triton_bm{bm}_bn{bn}_w{w}_s{s}": {"bm": bm, "bn": bn, "warps": w, "stages": s}
    for bm, w in ((64, 4), (64, 8), (128, 8))
    for bn in (32, 64, 128)
    for s in (1, 2, 3)
    if not (bm == 128 and bn == 128)
}


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, heads: int
) -> torch.Tensor:
    """float32 attention, (N, H·Dh)."""
    n, dh = q.shape[0], k.shape[-1]
    qh = q.float().view(n, heads, dh).transpose(0, 1)  # (H, N, Dh)
    s = qh @ k[0].float().t() * dh**-0.5 + bias.float()
    return (s.softmax(-1) @ v[0].float()).transpose(0, 1).reshape(n, heads * dh)


def variants(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, heads: int
) -> dict[str, tuple[Callable[[], torch.Tensor], bool]]:
    """name -> (one attention call returning (N, H·Dh), whether it applies the key mask)."""
    n, lk, dh = q.shape[0], k.shape[1], k.shape[2]
    qh = q.view(1, n, heads, dh).transpose(1, 2)
    kh, vh = k[None].expand(1, heads, lk, dh), v[None].expand(1, heads, lk, dh)
    mask = bias.to(q.dtype).view(1, 1, 1, lk).expand(1, heads, n, lk)
    qc, kc, vc = qh.contiguous(), kh.contiguous(), vh.contiguous()

    def sdpa(backend: SDPBackend, qq, kk, vv, attn_mask) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=attn_mask)
            return out.transpose(1, 2).reshape(n, heads * dh)

        return run

    def gemm_softmax() -> torch.Tensor:
        s = q.view(n * heads, dh) @ k[0].t()  # rows (token, head), as q is laid out
        p = torch.softmax(s.float() * dh**-0.5 + bias, dim=-1).to(q.dtype)
        return (p @ v[0]).view(n, heads * dh)

    runs: dict[str, tuple[Callable[[], torch.Tensor], bool]] = {
        name: (lambda c=cfg: triton_ops.attention(q, k, v, bias, heads, config=c), True)
        for name, cfg in TRITON_CONFIGS.items()
    }
    runs["cudnn_bias"] = (sdpa(SDPBackend.CUDNN_ATTENTION, qh, kh, vh, mask), True)
    runs["cudnn_bias_contiguous"] = (sdpa(SDPBackend.CUDNN_ATTENTION, qc, kc, vc, mask), True)
    runs["cudnn_nomask"] = (sdpa(SDPBackend.CUDNN_ATTENTION, qc, kc, vc, None), False)
    runs["flash_nomask"] = (sdpa(SDPBackend.FLASH_ATTENTION, qc, kc, vc, None), False)
    runs["gemm_softmax"] = (gemm_softmax, True)
    return runs


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--prompt-bucket", type=int, default=64, help="prompt rows (the bucket of ~50 tokens)")
    p.add_argument("--valid-prompt", type=int, default=50, help="prompt rows that are not padding")
    p.add_argument("--layers", type=int, default=17, help="calls per graph (the prefill's full layers)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    device = torch.device("cuda")
    cfg = get_preset(args.preset)
    g = cfg.vlm
    n = cfg.num_cameras * cfg.vision.tokens_per_image + args.prompt_bucket
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(n, g.num_heads * g.head_dim, device=device, generator=gen).to(torch.bfloat16)
    k, v = (
        torch.randn(g.num_kv_heads, n, g.head_dim, device=device, generator=gen).to(torch.bfloat16)
        for _ in range(2)
    )
    bias = torch.zeros(n, device=device)
    bias[n - (args.prompt_bucket - args.valid_prompt) :] = -1e30  # the prompt's padding rows
    runs = variants(q, k, v, bias, g.num_heads)
    ref = {True: reference(q, k, v, bias, g.num_heads), False: reference(q, k, v, bias * 0, g.num_heads)}

    errors: dict[str, object] = {}
    graphs: dict[str, Callable[[], None]] = {}
    for name, (run, masked) in runs.items():
        try:
            out = run()  # eager first: a backend that cannot run says so here
            torch.cuda.synchronize()
            errors[name] = round(float((out.float() - ref[masked]).norm() / ref[masked].norm()), 6)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.layers):
                    run()
            graphs[name] = graph.replay
        except Exception as exc:  # no kernel for these shapes, layouts or resources: recorded, not fatal
            errors[name] = f"unavailable: {str(exc).splitlines()[0][:160]}"
            print(f"[probe] {name}: {errors[name]}", flush=True)
    ms = time_interleaved(graphs, args.iters, True)
    results = {
        name: {
            "median_ms": ms[name],
            "us_per_call": round(ms[name] * 1e3 / args.layers, 2),
            "rel_l2_vs_fp32": errors[name],
            "masked": runs[name][1],
        }
        for name in graphs
    }
    results |= {name: {"error": err} for name, err in errors.items() if name not in graphs}
    print(f"[probe] {ms}", flush=True)
    gpu = torch.cuda.get_device_name(device)
    record = {
        **record_header(gpu, args.commit),
        "preset": args.preset,
        "shape": {
            "queries": n,
            "keys": n,
            "heads": g.num_heads,
            "kv_heads": g.num_kv_heads,
            "dh": g.head_dim,
        },
        "layers_per_graph": args.layers,
        "triton_configs": TRITON_CONFIGS,
        "results": results,
    }
    lines = [
        f"# Prefill attention kernels in CUDA graphs — {gpu}, `{args.preset}`",
        "",
        f"commit `{args.commit}`, command `{record['command']}`. {g.num_heads} query heads × {n} rows over {n} "
        f"keys of {g.num_kv_heads} K/V head, Dh {g.head_dim}, {args.prompt_bucket - args.valid_prompt} padding "
        f"keys masked; {args.layers} calls per graph, medians of {args.iters} interleaved replays.",
        "",
        "| variant | µs per call | masked | rel L2 vs fp32 |",
        "|---|---|---|---|",
        *(
            f"| {k} | {r['us_per_call']} | {r['masked']} | {r['rel_l2_vs_fp32']} |"
            if "error" not in r
            else f"| {k} | – | – | {r['error']} |"
            for k, r in results.items()
        ),
    ]
    text = "\n".join(lines) + "\n"
    save_results(args.out, f"probe_prefill_attention_{gpu_tag(gpu)}_{args.commit}", record, text)


if __name__ == "__main__":
    main()
