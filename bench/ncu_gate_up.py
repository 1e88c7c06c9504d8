"""The denoise's gate/up kernels for Nsight Compute: the Action Cache's gathered one (16 and 32 columns per
program) and the dense one, at the `pi05` expert's shapes (50 rows, 4096 neurons, ρn 0.5), 5 launches each
with the same weights (hot in L2), no PDL. Run it under ncu, one launch profiled at a time
(bench/device_run.sh ncu_gate_up does: launches 3, 8 and 13 of `_skinny_matmul_kernel`).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rmuscle_ros.engine import triton_ops

if not torch.cuda.is_available():
    raise SystemExit("ncu_gate_up launches CUDA kernels: no CUDA device here")
dev = torch.device("cuda")
gen = torch.Generator(dev).manual_seed(0)
x = torch.randn(50, 1024, device=dev, generator=gen).bfloat16()
gate_up = (torch.randn(8192, 1024, device=dev, generator=gen) * 0.03).bfloat16()
neurons = torch.randperm(4096, device=dev, generator=gen)[:2048].sort().values.int()
anchor = torch.randn(50, 4096, device=dev, generator=gen).bfloat16()
delta = torch.empty(50, 2048, device=dev, dtype=torch.bfloat16)
act = torch.empty(50, 4096, device=dev, dtype=torch.bfloat16)
for _ in range(5):  # launches 0-4: gathered, 32 columns per program (the default)
    triton_ops.linear_geglu(x, gate_up, delta, neurons=neurons, anchor=anchor)
for _ in range(5):  # launches 5-9: dense
    triton_ops.linear_geglu(x, gate_up, act)
for _ in range(5):  # launches 10-14: gathered, 16 columns per program
    triton_ops.linear_geglu(x, gate_up, delta, neurons=neurons, anchor=anchor, config={"bn": 16})
torch.cuda.synchronize()
