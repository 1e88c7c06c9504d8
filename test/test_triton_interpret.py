"""The graph engine's Triton kernels against their PyTorch definitions, in Triton's CPU interpreter.

This checks the kernels' indexing, masking, split-K and split-KV logic in CI (no GPU). That they compile
for the H200 is checked by test_kernels_compile.py; their speed only on a GPU (test_engine_gpu.py, marker
`gpu`).
"""

from __future__ import annotations

import pytest
import torch

# conftest.py switches Triton to its interpreter on a machine without a GPU, before anything imports it.
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


# (tokens, tokens per program): one partial block, several blocks with a partial last one, exact blocks
@pytest.mark.parametrize(("n", "block_t"), [(7, 16), (21, 8), (32, 16)])
def test_geglu_and_rope(n: int, block_t: int, no_fallback) -> None:
    gu = torch.randn(6, 2 * 40)
    out, ref = torch.empty(6, 40), torch.empty(6, 40)
    assert rel(triton_ops.geglu(gu, out), ops.geglu(gu, ref)) < 1e-5
    h, kvh, dh = 4, 2, 16
    qkv = torch.randn(n, (h + 2 * kvh) * dh)
    ang = torch.rand(n, dh // 2) * 6
    outs = []
    for impl in (ops, triton_ops):
        # Buffers larger than the outputs: the masked last block must not write past token n.
        q, k, v = torch.zeros(n + 8, h * dh), torch.zeros(kvh, n + 13, dh), torch.zeros(kvh, n + 13, dh)
        kw = {}
        if impl is triton_ops:
            no_fallback()
            kw["config"] = {"block_t": block_t}
        impl.rope_qkv(qkv, ang.cos(), ang.sin(), q[:n], k[:, 5 : 5 + n], v[:, 5 : 5 + n], h, kvh, **kw)
        outs.append((q, k, v))
    assert all(rel(a, b) < 1e-5 for a, b in zip(outs[1], outs[0], strict=True))
    q, k, v = outs[1]
    assert (q[n:] == 0).all() and (k[:, 5 + n :] == 0).all() and (v[:, 5 + n :] == 0).all()


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


@pytest.mark.parametrize(("batch", "heads", "t", "dh"), [(3, 2, 40, 24), (1, 4, 70, 32)])
def test_packed_attention_kernel(batch: int, heads: int, t: int, dh: int, no_fallback) -> None:
    """SigLIP's attention read in place from the packed QKV output, Dh not a power of two (72 at full size)."""
    qkv = torch.randn(batch * t, 3 * heads * dh)
    expected = ops.packed_attention(qkv, batch, heads)
    no_fallback()
    got = triton_ops.packed_attention(qkv, batch, heads, {"kernel": 1, "bm": 16, "bn": 16})
    assert got.shape == expected.shape and rel(got, expected) < 1e-5


@pytest.mark.parametrize("preload", [0, 32768])  # the weight slice streamed in a K loop, or preloaded whole
@pytest.mark.parametrize("splits", [1, 4])
def test_few_row_matmuls(splits: int, preload: int, no_fallback) -> None:
    a, w, gate_up = torch.randn(13, 256), torch.randn(48, 256), torch.randn(2 * 48, 256) * 0.1
    expected, expected_geglu = ops.linear(a, w, splits), ops.linear_geglu(a, gate_up, torch.empty(13, 48))
    no_fallback()
    cfg = {"bn": 16, "bk": 64, "preload": preload}
    out = triton_ops.linear(a, w, splits, cfg)
    assert out.shape == ((splits, 13, 48) if splits > 1 else (13, 48))
    assert rel(out, expected) < 1e-5
    assert rel(triton_ops.linear_geglu(a, gate_up, torch.empty(13, 48), config=cfg), expected_geglu) < 1e-5


@pytest.mark.parametrize(
    "m, programs",
    [(70, 0), (40, 4)],  # one tile per program; fewer programs than tiles, two left idle
)
def test_many_row_matmul_with_geglu(m: int, programs: int, no_fallback) -> None:
    """The prefill's gate/up GEMM with the GeGLU in its epilogue (TMA tiles): rows past M read as zeros
    and are not written; programs that take several tiles cover each one once."""
    a, gate_up = torch.randn(m, 128), torch.randn(2 * 160, 128) * 0.1
    expected = ops.linear_geglu(a, gate_up, torch.empty(m, 160))
    no_fallback()
    out = torch.full((m + 3, 160), 7.0)  # rows past M must keep their contents
    cfg = {"bm": 32, "bn": 32, "bk": 32, "group_m": 2, "programs": programs}
    assert triton_ops.linear_geglu(a, gate_up, out[:m], config=cfg) is not None
    assert rel(out[:m], expected) < 1e-5 and (out[m:] == 7.0).all()


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


@pytest.mark.parametrize("preload", [0, 32768])
@pytest.mark.parametrize(("sel", "splits"), [(128, 2), (320, 3), (192, 4)])
def test_action_cache_kernels_read_only_selected_neurons(
    sel: int, splits: int, preload: int, no_fallback
) -> None:
    """Gathered GeGLU minus the anchor, the down-projection over the same neurons from a K-major weight
    (split-K: even; 5 blocks of 64 in 3 slices, the last shorter; 3 blocks in 4 slices, the last empty;
    its weight slice streamed in a K loop or preloaded whole), and add_norm adding the anchor output back
    (and storing it at the anchor step): each equals its definition."""
    m, width, f = 6, 128, 512
    x, gate_up = torch.randn(m, width), torch.randn(2 * f, width) * 0.1
    down_t = torch.randn(f, width) * 0.1  # (F, We): neuron j's output weights are row j
    neurons = torch.sort(torch.randperm(f)[:sel]).values.to(torch.int32)
    anchor, y_anchor, res = torch.randn(m, f), torch.randn(m, width), torch.randn(m, width)
    outs = []
    for impl in (ops, triton_ops):
        if impl is triton_ops:
            no_fallback()
        cfg = {"config": {"bn": 16, "bk": 64, "preload": preload}} if impl is triton_ops else {}
        delta = impl.linear_geglu(x, gate_up, torch.empty(m, sel), neurons=neurons, anchor=anchor, **cfg)
        y = impl.linear(delta, down_t, splits, neurons=neurons, **cfg)
        y = y.sum(0, keepdim=True)  # the slices differ (ops: ceil(K / splits); the kernel: whole blocks)
        r, h, stored = res.clone(), torch.empty(m, width), torch.empty(m, width)
        impl.add_norm(r, y, h, eps=1e-6, rms=True, gate=torch.randn(width, generator=torch.Generator().manual_seed(1)),
                      y_base=y_anchor, y_store=stored)  # fmt: skip
        outs.append((delta, y, r, h, stored))
    assert all(rel(got, ref) < 1e-5 for got, ref in zip(outs[1], outs[0], strict=True))


@pytest.mark.parametrize("m", [6, 70])  # one block of rows, or two (the second partly masked)
def test_neuron_scores_sum_each_neurons_change_over_the_rows(m: int, no_fallback) -> None:
    """The recording denoise's per-neuron Σ_rows |act − anchor| (its columns in blocks of 128, 300 ending
    in a partial one), the ops definition."""
    act, anchor = torch.randn(m, 300), torch.randn(m, 300)
    expected = ops.neuron_scores(act, anchor, torch.empty(300))
    no_fallback()
    out = torch.full((302,), -1.0)  # past F: untouched
    triton_ops.neuron_scores(act, anchor, out[:300])
    assert rel(out[:300], expected) < 1e-6 and (out[300:] == -1).all()


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_norm_measures_the_context_cache_drift(out_dtype: torch.dtype, scaled: bool, no_fallback) -> None:
    """drift_out[r] = ‖(out[r] − drift_ref[r]) · drift_scale‖² over the first Nv rows, from out as stored
    (rounded to its dtype); the other rows write nothing. (The interpreter rounds to bf16 by truncation, the
    GPU to nearest: so bf16 outputs are compared loosely, the drift exactly against the kernel's own
    output.) drift_scale: the pre-FFN norm's (1 + w), so that the drift is the FFN input's own."""
    n, nv, d = 9, 5, 48
    res, y = torch.randn(n, d), torch.randn(n, d)
    drift_ref = torch.randn(nv, d).to(out_dtype)
    scale = 1.0 + 2.0 * torch.randn(d) if scaled else None
    outs = []
    for impl in (ops, triton_ops):
        if impl is triton_ops:
            no_fallback()
        r, out, drift = res.clone(), torch.empty(n, d, dtype=out_dtype), torch.full((nv + 2,), -1.0)
        impl.add_norm(
            r, y, out, eps=1e-6, rms=True, drift_ref=drift_ref, drift_out=drift[:nv], drift_scale=scale
        )
        outs.append((r, out, drift))
    (r_ref, out_ref, drift_want), (r, out, drift) = outs
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    assert rel(r, r_ref) < 1e-6 and rel(out.float(), out_ref.float()) < tol
    diff = out[:nv].float() - drift_ref.float()
    assert rel(drift[:nv], (diff if scale is None else diff * scale).pow(2).sum(-1)) < 1e-6
    assert rel(drift[:nv], drift_want[:nv]) < tol
    assert (drift[nv:] == -1).all()


def _ranks_by_spec(drift: torch.Tensor) -> list[int]:
    """rank(r) = #{j : d_j > d_r or (d_j == d_r and j < r)}, NaN counting as +inf (brute force)."""
    d = [float("inf") if x != x else x for x in drift.tolist()]
    return [sum(d[j] > d[r] or (d[j] == d[r] and j < r) for j in range(len(d))) for r in range(len(d))]


def _selection_by_spec(key: torch.Tensor, keep: int, lp: int) -> tuple[list[int], list[int]]:
    """context_select's rows_out and inv_out by the spec, from each visual row's rank by `key`."""
    nv, rank = key.shape[0], _ranks_by_spec(key)
    want_rows = [0] * keep + list(range(nv, lp))
    want_inv = [-1] * nv + list(range(keep, keep + lp - nv))
    for r in range(nv):
        if rank[r] < keep:
            want_rows[rank[r]], want_inv[r] = r, rank[r]
    return want_rows, want_inv


# (Nv, keep, Lp): one row block; keep = 1; keep = Nv; no prompt rows; several row blocks and drift chunks
@pytest.mark.parametrize(
    ("nv", "keep", "lp"), [(5, 2, 9), (5, 1, 9), (7, 7, 10), (1, 1, 1), (130, 130, 130), (300, 120, 333)]
)
def test_context_select_ranks_by_drift_ties_to_the_lower_row(nv: int, keep: int, lp: int, no_fallback):
    drift = torch.randint(0, 6, (nv,)).float()  # few distinct values: many ties
    if nv > 3:
        drift[3] = float("nan")
    want_rows, want_inv = _selection_by_spec(drift, keep, lp)
    for impl in (ops, triton_ops):
        if impl is triton_ops:
            no_fallback()
        rows = torch.full((keep + lp - nv,), -7, dtype=torch.int64)
        inv = torch.full((lp,), -7, dtype=torch.int32)
        impl.context_select(drift, keep, lp, rows, inv)
        assert rows.tolist() == want_rows and inv.tolist() == want_inv, impl.__name__
    # The spec itself: the chosen rows are the top `keep` by drift.
    key = torch.nan_to_num(drift, nan=float("inf"))
    chosen = torch.zeros(nv, dtype=torch.bool)
    chosen[rows[:keep]] = True
    assert int(chosen.sum()) == keep
    if keep < nv:
        assert key[chosen].min() >= key[~chosen].max()


# (Nv, keep, Lp, missing rows): fewer kept than present; more kept than present; several chunks
@pytest.mark.parametrize(
    ("nv", "keep", "lp", "missing"),
    [(12, 3, 15, range(4, 8)), (12, 10, 15, range(4, 8)), (300, 100, 333, range(0, 256))],
)
def test_context_select_ranks_a_missing_cameras_rows_last(nv, keep, lp, missing, no_fallback):
    """Rows whose keys nothing attends (key bias < 0: a camera missing from the call) rank after every
    attended row, whatever their drift (here the largest, and a NaN), ties to the lower row."""
    drift = torch.randint(0, 6, (nv,)).float()
    drift[list(missing)] = 100.0
    drift[missing[0]] = float("nan")
    key_bias = torch.zeros(lp + 5)  # the layout's: longer than the prefix (actions, padding)
    key_bias[list(missing)] = -1e30
    key = torch.nan_to_num(drift, nan=float("inf"))
    key[list(missing)] = -float("inf")
    want_rows, want_inv = _selection_by_spec(key, keep, lp)
    present = nv - len(missing)
    assert set(want_rows[: min(keep, present)]).isdisjoint(missing)
    for impl in (ops, triton_ops):
        if impl is triton_ops:
            no_fallback()
        rows = torch.full((keep + lp - nv,), -7, dtype=torch.int64)
        inv = torch.full((lp,), -7, dtype=torch.int32)
        impl.context_select(drift, keep, lp, rows, inv, key_bias)
        assert rows.tolist() == want_rows and inv.tolist() == want_inv, impl.__name__
    with pytest.raises(ValueError, match="key_bias must be 1-D over at least the"):
        ops.context_select(drift, keep, lp, rows, inv, key_bias[: nv - 1])
    with pytest.raises(ValueError, match=r"key_bias must be the layout's float key bias, got torch\.bool"):
        ops.context_select(drift, keep, lp, rows, inv, key_bias == 0)  # a mask, True = attended


def test_context_select_ranks_nan_and_inf_alike_ties_to_the_lower_row(no_fallback):
    """NaN counts as +inf, and an overflowed drift (+inf) stays +inf: found in review, nan_to_num's default
    made +inf float32's max in the PyTorch definition, below a NaN, while the kernel tied them."""
    drift = torch.tensor([float("inf"), float("nan"), 1.0, float("inf")])
    for impl in (ops, triton_ops):
        if impl is triton_ops:
            no_fallback()
        rows, inv = torch.empty(2, dtype=torch.int64), torch.empty(5, dtype=torch.int32)
        impl.context_select(drift, 1, 5, rows, inv)
        assert rows.tolist() == [0, 4] and inv.tolist() == [0, -1, -1, -1, 1], impl.__name__


# entries 0 and 2 are the descriptor itself (tied), entry 1 its opposite, the rest random
@pytest.mark.parametrize(
    ("entries", "usable", "nan", "want"),
    [
        (20, [1] * 20, False, (0, 1.0)),  # the first of equal maxima
        (20, [0, 1] * 10, False, None),  # 0 and 2 not usable: the best random one (by the definition)
        (3, [1, 1, 1], True, (2, 1.0)),  # entry 0 NaN: never picked
        (5, [0] * 5, False, (0, -2.0)),  # nothing usable
        (1, [1], False, (0, 1.0)),
    ],
)
def test_window_match_picks_the_best_usable_entry(
    entries: int, usable: list[int], nan: bool, want: tuple[int, float] | None, no_fallback
) -> None:
    gen = torch.Generator().manual_seed(entries)
    descriptor = torch.randn(3, 200, generator=gen)  # cameras × width, not a multiple of the block
    keys = torch.randn(entries, 600, generator=gen)
    keys[: min(entries, 3)] = descriptor.reshape(-1)
    if entries > 1:
        keys[1] *= -1
    if nan:
        keys[0] = float("nan")
    keys /= keys.norm(dim=1, keepdim=True)
    flags = torch.tensor(usable, dtype=torch.bool)
    if want is None:
        sims = torch.where(flags, keys @ (descriptor.reshape(-1) / descriptor.norm()), -2.0)
        want = (int(sims.argmax()), float(sims.max()))
    for impl in (ops, triton_ops):
        if impl is triton_ops:
            no_fallback()
        slot, out = torch.full((1,), -7, dtype=torch.int64), torch.full((2,), float("nan"))
        impl.window_match(descriptor, keys, flags, slot, out)
        assert int(slot) == want[0] and out[0] == want[0], impl.__name__
        assert out[1] == pytest.approx(want[1], abs=1e-5), impl.__name__


@pytest.mark.parametrize("splits", [1, 2])
def test_add_norm_reads_y_through_row_indices(splits: int, no_fallback) -> None:
    """y_rows/y_alt (the Context Cache's compact FFN output): residual row r adds y[y_rows[r]], or y_alt[r]
    where y_rows[r] < 0; the same as add_norm on the gathered y."""
    n, nv, d = 10, 6, 48
    y_rows = torch.tensor([2, -1, 0, -1, -1, 1, 3, 4, 5, 6], dtype=torch.int32)  # rows ≥ Nv all recomputed
    y = torch.randn(splits, 7, d) if splits > 1 else torch.randn(7, d)
    y_alt, res, gate = torch.randn(nv, d), torch.randn(n, d), torch.randn(d)
    compact = y.sum(0) if splits > 1 else y
    full = torch.cat([y_alt, torch.zeros(n - nv, d)])
    full[y_rows >= 0] = compact[y_rows[y_rows >= 0].long()]
    r_want, out_want = res.clone(), torch.empty(n, d)
    ops.add_norm(r_want, full, out_want, eps=1e-6, rms=True, gate=gate)
    for impl in (ops, triton_ops):
        if impl is triton_ops:
            no_fallback()
        r, out = res.clone(), torch.empty(n, d)
        impl.add_norm(r, y, out, eps=1e-6, rms=True, gate=gate, y_rows=y_rows, y_alt=y_alt)
        assert rel(r, r_want) < 1e-6 and rel(out, out_want) < 1e-5


def test_context_cached_prefill_with_the_kernels() -> None:
    """The prefill with the Context Cache on the Triton kernels (drift in add_norm, context_select, y read
    through row indices) writes the same K/V as on the PyTorch definitions."""
    from conftest import random_inputs, tiny_model

    from rmuscle_ros.engine.fused import (
        ContextCache,
        ContextRef,
        FusedPi05,
        KVBuffers,
        call_layout,
        pack_prompt,
    )
    from rmuscle_ros.models.config import GemmaConfig, get_preset

    gemma = GemmaConfig(width=256, depth=2, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32)
    cfg = get_preset("tiny").replace(vlm=gemma, expert=gemma, num_cameras=1, horizon=10, num_steps=2)
    model = tiny_model(cfg, seed=7)
    engines = [FusedPi05(model, device="cpu", dtype=torch.float32, ops=impl) for impl in (ops, triton_ops)]

    def prefill(engine: FusedPi05, seed: int, **kw) -> KVBuffers:
        inputs, _ = random_inputs(cfg, valid_tokens=9, pad_to=12, seed=seed)
        tokens, token_mask = pack_prompt(inputs.tokens[0], inputs.token_mask[0], 16)
        pad_mask = torch.cat([inputs.image_masks[0].repeat_interleave(256), token_mask])
        kv = KVBuffers.allocate(cfg, 288, torch.device("cpu"), torch.float32)
        visual = torch.empty(cfg.image_tokens, gemma.width)
        engines[0].encode_images(inputs.images[0], visual)
        engine.prefill(visual, tokens, call_layout(pad_mask.numpy(), cfg.horizon), kv, **kw)
        return kv

    entry = ContextRef.allocate(cfg, torch.device("cpu"), torch.float32)
    prefill(engines[0], seed=3, record=entry)
    expected, got = (prefill(e, seed=4, context=ContextCache(entry, keep=100)) for e in engines)
    lp = 256 + 16
    assert rel(got.keys[-1][:, :lp], expected.keys[-1][:, :lp]) < 1e-5
    assert rel(got.values[-1][:, :lp], expected.values[-1][:, :lp]) < 1e-5
    # The same entry read in place from a stack of three (as from the engine's window), picked by a slot
    # index on the device: the K/V the copied entry gives.
    stack = ContextRef(
        *(torch.stack([torch.randn_like(t), t, torch.randn_like(t)]) for t in (entry.ffn_in, entry.ffn_out))
    )
    slot = torch.tensor([1])
    for engine in engines:
        in_place = prefill(engine, seed=4, context=ContextCache(stack, keep=100, slot=slot))
        assert rel(in_place.keys[-1][:, :lp], expected.keys[-1][:, :lp]) < 1e-5
        assert rel(in_place.values[-1][:, :lp], expected.values[-1][:, :lp]) < 1e-5


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


@pytest.mark.parametrize("kernel", ["whole_row", "chunked"])
@pytest.mark.parametrize("mode", ["first", "between", "last"])
def test_action_step_between_denoising_steps(mode: str, kernel: str, no_fallback) -> None:
    """The Euler update and the next step's input projection + adaRMS norm equal their definition: before
    the first step (projection only), between steps (h is read, then overwritten), after the last (update);
    with the row in one tile and, as for wider experts, 256 features at a time."""
    ha, a, we = 7, 32, 512
    x0, h0 = torch.randn(ha, a), torch.randn(ha, we)
    params = {"euler_w": torch.randn(a, we) * 0.05, "euler_b": torch.randn(a), "in_w": torch.randn(we, a) * 0.2,
              "in_b": torch.randn(we), "eps": 1e-6}  # fmt: skip
    mod = {"mul": torch.randn(we), "add": torch.randn(we)}
    outs = []
    for impl in (ops, triton_ops):
        if impl is triton_ops:
            no_fallback()
        x, h, res = x0.clone(), h0.clone(), torch.zeros(ha, we)
        kw = dict(params)
        if mode != "first":
            kw["h"] = h
        if mode != "last":
            kw |= {"res": res, "out": h, **mod}
        if impl is triton_ops:
            kw["config"] = {"row_max": 1024 if kernel == "whole_row" else 0}
        impl.action_step(x, **kw)
        outs.append((x, h, res))
    assert all(rel(got, ref) < 1e-5 for got, ref in zip(outs[1], outs[0], strict=True) if ref.norm() > 0)


def test_prefetch_hint_stays_within_half_the_l2() -> None:
    """The denoising FFN's early prefetch (ops.Prefetch) never asks for more than half the L2 cache (taken
    as 50 MiB off a GPU): a whole tensor is cut short, row tables go only if they fit in what is left."""
    mib = 2**20
    q = torch.empty(4)
    half = triton_ops._l2_bytes(torch.device("cpu")) // 2
    gate_up = torch.empty(8 * mib, dtype=torch.bfloat16)  # 16 MiB
    args = triton_ops._prefetch_args(ops.Prefetch(whole=gate_up), q, q.device)
    assert args["WHOLE"] and args["whole_bytes"] == 16 * mib and args["N_TABLES"] == 0
    big = torch.empty(151 * mib, dtype=torch.bfloat16)  # pi05-7b's expert gate/up: 302 MiB
    assert triton_ops._prefetch_args(ops.Prefetch(whole=big), q, q.device)["whole_bytes"] == half
    w = torch.empty(8192, 1024, dtype=torch.bfloat16)  # rows of 2 KiB
    rows = torch.arange(2048, dtype=torch.int32)
    args = triton_ops._prefetch_args(ops.Prefetch(rows=rows, tables=((w, 0), (w, 4096))), q, q.device)
    assert (args["N_TABLES"], args["row_bytes"], args["t1_off"], args["ROW_LINES"]) == (2, 2048, 4096, 16)
    crowded = ops.Prefetch(whole=big, rows=rows, tables=((w, 0),))  # the whole tensor took the budget
    assert triton_ops._prefetch_args(crowded, q, q.device)["N_TABLES"] == 0
    mixed = ops.Prefetch(rows=rows, tables=((w, 0), (torch.empty(8192, 512, dtype=torch.bfloat16), 0)))
    assert triton_ops._prefetch_args(mixed, q, q.device)["N_TABLES"] == 0  # rows of different lengths
    assert triton_ops._prefetch_args(None, q, q.device)["WHOLE"] is False
    with pytest.raises(ValueError, match="at most 2 row tables"):
        ops.Prefetch(rows=rows, tables=((w, 0),) * 3)
