"""The graph engine's Triton kernels against their PyTorch definitions, in Triton's CPU interpreter.

This checks the kernels' indexing, masking, split-K and split-KV logic in CI (no GPU). Compilation and
speed are only exercised on a GPU (test_engine_gpu.py, marker `gpu`).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[kernels]')")
if torch.cuda.is_available():
    pytest.skip(
        "on a GPU machine the kernels are tested compiled (test_engine_gpu.py)", allow_module_level=True
    )

from rmuscle_ros.engine import ops, triton_ops  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


class _NoFallback:
    """Stands in for `ops` inside triton_ops: a test fails if a kernel silently fell back to PyTorch."""

    def __getattr__(self, name: str):
        raise AssertionError(f"triton_ops fell back to ops.{name}: the kernel itself was not tested")


@pytest.fixture
def no_fallback(monkeypatch: pytest.MonkeyPatch):
    return lambda: monkeypatch.setattr(triton_ops, "ops", _NoFallback())


@pytest.mark.parametrize("kind", ["rms", "layer_bias", "ada_gate", "split_partials"])
def test_add_norm(kind: str) -> None:
    n, d = 5, 48
    res = torch.randn(n, d)
    y = torch.randn(3, n, d) if kind == "split_partials" else torch.randn(n, d)
    kw: dict = {"eps": 1e-6, "rms": kind != "layer_bias"}
    if kind == "layer_bias":
        kw["y_bias"] = torch.randn(d)
    if kind == "ada_gate":
        kw |= {"gate": torch.randn(d), "mul": torch.randn(d), "add": torch.randn(d)}
    res_ref, out_ref, out = res.clone(), torch.empty(n, d), torch.empty(n, d)
    ops.add_norm(res_ref, y, out_ref, **kw)
    triton_ops.add_norm(res, y, out, **kw)
    assert rel(res, res_ref) < 1e-6 and rel(out, out_ref) < 1e-5


def test_geglu_and_rope(no_fallback) -> None:
    gu = torch.randn(6, 2 * 40)
    out, ref = torch.empty(6, 40), torch.empty(6, 40)
    assert rel(triton_ops.geglu(gu, out), ops.geglu(gu, ref)) < 1e-5
    n, h, kvh, dh = 7, 4, 2, 16
    qkv = torch.randn(n, (h + 2 * kvh) * dh)
    ang = torch.rand(n, dh // 2) * 6
    outs = []
    for impl in (ops, triton_ops):
        q, k, v = torch.empty(n, h * dh), torch.zeros(kvh, 20, dh), torch.zeros(kvh, 20, dh)
        impl.rope_qkv(qkv, ang.cos(), ang.sin(), q, k[:, 5 : 5 + n], v[:, 5 : 5 + n], h, kvh)
        outs.append((q, k, v))
    assert all(rel(a, b) < 1e-5 for a, b in zip(outs[1], outs[0], strict=True))


@pytest.mark.parametrize(("n", "h", "kvh", "lk"), [(20, 8, 1, 300), (9, 4, 2, 90), (40, 2, 2, 64)])
def test_attention_with_masked_keys(n: int, h: int, kvh: int, lk: int, no_fallback) -> None:
    dh = 16
    q = torch.randn(n, h * dh)
    k, v = torch.randn(kvh, lk + 8, dh)[:, :lk], torch.randn(kvh, lk + 8, dh)[:, :lk]
    bias = torch.where(torch.rand(lk) < 0.3, -1e30, 0.0)
    bias[:64] = -1e30  # a fully masked key block, as for a missing camera
    expected = ops.attention(q, k, v, bias, h)
    no_fallback()
    assert rel(triton_ops.attention(q, k, v, bias, h), expected) < 1e-5


@pytest.mark.parametrize("splits", [1, 4])
def test_few_row_matmuls(splits: int, no_fallback) -> None:
    a, w, gate_up = torch.randn(13, 256), torch.randn(48, 256), torch.randn(2 * 48, 256) * 0.1
    expected, expected_geglu = ops.linear(a, w, splits), ops.linear_geglu(a, gate_up, torch.empty(13, 48))
    no_fallback()
    cfg = {"bn": 16, "bk": 64}
    out = triton_ops.linear(a, w, splits, cfg)
    assert out.shape == ((splits, 13, 48) if splits > 1 else (13, 48))
    assert rel(out, expected) < 1e-5
    assert rel(triton_ops.linear_geglu(a, gate_up, torch.empty(13, 48), config=cfg), expected_geglu) < 1e-5


def test_qkv_with_rope_epilogue(no_fallback) -> None:
    n, h, kvh, dh, width = 11, 4, 1, 32, 128
    a, w = torch.randn(n, width), torch.randn((h + 2 * kvh) * dh, width) * 0.1
    ang = torch.rand(n, dh // 2) * 6
    outs = []
    for impl, kw in ((ops, {}), (triton_ops, {"config": {"bn": 16, "bk": 64}})):
        if impl is triton_ops:
            no_fallback()
        q, k, v = torch.empty(n, h * dh), torch.zeros(kvh, 30, dh), torch.zeros(kvh, 30, dh)
        impl.qkv_rope(a, w, ang.cos(), ang.sin(), q, k[:, 9 : 9 + n], v[:, 9 : 9 + n], h, kvh, **kw)
        outs.append((q, k, v))
    assert all(rel(x, y) < 1e-5 for x, y in zip(outs[1], outs[0], strict=True))
    assert (outs[1][1][:, :9] == 0).all()


def test_action_cache_kernels_read_only_selected_neurons(no_fallback) -> None:
    """Gathered GeGLU minus the anchor, the down-projection over the same neurons from a K-major weight
    (split-K), and add_norm adding the anchor output back (and storing it at the anchor step): each
    equals its definition."""
    m, width, f = 6, 128, 256
    x, gate_up = torch.randn(m, width), torch.randn(2 * f, width) * 0.1
    down_t = torch.randn(f, width) * 0.1  # (F, We): neuron j's output weights are row j
    neurons = torch.sort(torch.randperm(f)[:128]).values.to(torch.int32)
    anchor, y_anchor, res = torch.randn(m, f), torch.randn(m, width), torch.randn(m, width)
    outs = []
    for impl in (ops, triton_ops):
        if impl is triton_ops:
            no_fallback()
        cfg = {"config": {"bn": 16, "bk": 64}} if impl is triton_ops else {}
        delta = impl.linear_geglu(x, gate_up, torch.empty(m, 128), neurons=neurons, anchor=anchor, **cfg)
        y = impl.linear(delta, down_t, 2, neurons=neurons, **cfg)
        r, h, stored = res.clone(), torch.empty(m, width), torch.empty(m, width)
        impl.add_norm(r, y, h, eps=1e-6, rms=True, gate=torch.randn(width, generator=torch.Generator().manual_seed(1)),
                      y_base=y_anchor, y_store=stored)  # fmt: skip
        outs.append((delta, y, r, h, stored))
    assert all(rel(got, ref) < 1e-5 for got, ref in zip(outs[1], outs[0], strict=True))


def test_whole_fused_forward_with_the_kernels() -> None:
    """The fused π0.5 forward wired to the Triton kernels (interpreted) equals the same forward on the
    PyTorch definitions: checks every call site's arguments, strides and buffers, not just each kernel.
    Widths at which the expert takes the few-row kernels, split-K and the deferred norms."""
    from conftest import random_inputs, tiny_model

    from rmuscle_ros.engine.fused import FusedPi05
    from rmuscle_ros.models.config import GemmaConfig, get_preset

    gemma = GemmaConfig(width=256, depth=2, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32)
    cfg = get_preset("tiny").replace(vlm=gemma, expert=gemma, num_cameras=1, horizon=10, num_steps=2)
    model = tiny_model(cfg, seed=7)
    inputs, noise = random_inputs(cfg, valid_tokens=9, pad_to=12)
    expected = FusedPi05(model, device="cpu", dtype=torch.float32, ops=ops).run(inputs, noise, bucket=16)
    got = FusedPi05(model, device="cpu", dtype=torch.float32, ops=triton_ops).run(inputs, noise, bucket=16)
    assert rel(got, expected) < 1e-5
