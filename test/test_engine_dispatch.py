"""Backend selection: one dispatch table, lazy imports, loud failures on the wrong hardware."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import random_inputs, tiny_model

from rmuscle_ros.engine import BACKENDS, create_engine


def test_unknown_backend_lists_the_choices(tiny) -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'tensorrt'.*\['eager', 'fused', 'graph'\]"):
        create_engine("tensorrt", tiny, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_graph_backend_refuses_a_cpu_device(tiny) -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        create_engine("graph", tiny, "cpu")


def test_eager_engine_runs_the_model() -> None:
    model = tiny_model(seed=2)
    inputs, noise = random_inputs(model.cfg)
    expected = model.sample_actions(inputs, noise)
    engine = create_engine("eager", model, "cpu", dtype="float32")
    assert engine.warmup() == {}
    assert torch.equal(engine.sample_actions(inputs, noise), expected)
    with pytest.raises(ValueError, match="dtype"):
        create_engine("eager", model, "cpu", dtype="float16")


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_cpu_path_never_imports_gpu_modules(backend: str) -> None:
    code = (
        "import sys; from rmuscle_ros.runtime.policy import Policy, PolicyConfig, synthetic_observation;"
        f"p = Policy(PolicyConfig(backend={backend!r})); p.infer(synthetic_observation(p.cfg, 'x'));"
        "print(sorted(m for m in sys.modules if m == 'triton' or m.endswith('triton_ops')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[]"
    assert set(BACKENDS) == {"eager", "fused", "graph"}
