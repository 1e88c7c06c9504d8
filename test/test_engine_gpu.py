"""GPU tests (marker `gpu`): Triton kernels against their PyTorch definitions, graph engine against eager.

Run on the device machine: `python -m pytest -m gpu test/test_engine_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from rmuscle_ros.engine import create_engine, ops
from rmuscle_ros.models.checkpoint import init_random_
from rmuscle_ros.models.config import GemmaConfig, get_preset
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu on the device machine)"
    ),
]
CUDA = torch.device("cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def triton_ops():
    from rmuscle_ros.engine import triton_ops

    return triton_ops


@pytest.mark.parametrize("d", [64, 1152, 2048])
@pytest.mark.parametrize("variant", ["rms", "layer", "rms_gate_mod", "layer_bias"])
def test_add_norm_matches_definition(triton_ops, d: int, variant: str) -> None:
    n = 77
    res = torch.randn(n, d, device=CUDA)
    y = torch.randn(n, d, device=CUDA, dtype=torch.bfloat16)
    vec = lambda: torch.randn(d, device=CUDA)  # noqa: E731
    kw = {"eps": 1e-6, "rms": variant.startswith("rms")}
    if variant == "rms_gate_mod":
        kw.update(gate=vec(), mul=vec(), add=vec())
    if variant == "layer_bias":
        kw.update(y_bias=vec())
    res_ref, out_ref = res.clone(), torch.full((n, d), float("nan"), device=CUDA, dtype=torch.bfloat16)
    out = torch.full_like(out_ref, float("nan"))
    ops.add_norm(res_ref, y, out_ref, **kw)
    triton_ops.add_norm(res, y, out, **kw)
    assert rel(res, res_ref) < 1e-6
    assert torch.isfinite(out).all() and rel(out, out_ref) < 1e-2


def test_geglu_matches_definition(triton_ops) -> None:
    gu = torch.randn(300, 2 * 4096, device=CUDA, dtype=torch.bfloat16)
    out = torch.full((300, 4096), float("nan"), device=CUDA, dtype=torch.bfloat16)
    ref = torch.empty_like(out)
    ops.geglu(gu, ref)
    triton_ops.geglu(gu, out)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-2


@pytest.mark.parametrize(("h", "kvh", "dh"), [(8, 1, 256), (16, 16, 256), (8, 2, 16)])
def test_rope_qkv_matches_definition(triton_ops, h: int, kvh: int, dh: int) -> None:
    n, cap, off = 70, 128, 30
    qkv = torch.randn(n, (h + 2 * kvh) * dh, device=CUDA, dtype=torch.bfloat16)
    ang = torch.rand(n, dh // 2, device=CUDA) * 10
    cos, sin = ang.cos(), ang.sin()
    outs = []
    for impl in (ops, triton_ops):
        q = torch.full((n, h * dh), float("nan"), device=CUDA, dtype=torch.bfloat16)
        k = torch.zeros(kvh, cap, dh, device=CUDA, dtype=torch.bfloat16)
        v = torch.zeros_like(k)
        impl.rope_qkv(qkv, cos, sin, q, k[:, off : off + n], v[:, off : off + n], h, kvh)
        outs.append((q, k, v))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert rel(got, want) < 1e-2
    assert (outs[1][1][:, :off] == 0).all(), "rope_qkv wrote outside its K slice"


def _streaming_model(seed: int) -> Pi05Model:
    """A small model at widths where the expert's matmuls take the weight-streaming kernels (the ones that
    prefetch under PDL and have the Action Cache's gathered variants), seeded random weights."""
    gemma = GemmaConfig(width=256, depth=2, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32)
    model = Pi05Model(get_preset("tiny").replace(vlm=gemma, expert=gemma)).to(CUDA).eval()
    init_random_(model, seed)
    return model


def _require_pdl() -> None:
    from rmuscle_ros.engine import triton_ops

    if not triton_ops.pdl_supported(CUDA):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")


def _inputs(cfg, valid_tokens: int, pad_to: int, missing_camera: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    c = cfg.num_cameras
    images = torch.rand(1, c, 3, 224, 224, generator=gen) * 2 - 1
    masks = torch.ones(1, c, dtype=torch.bool)
    if missing_camera:
        masks[0, -1] = False
    tokens = torch.randint(0, cfg.vocab_size, (1, pad_to), generator=gen)
    token_mask = torch.arange(pad_to)[None] < valid_tokens
    noise = torch.randn(1, cfg.horizon, cfg.action_dim, generator=gen)
    return ModelInputs(images, masks, tokens, token_mask).to(CUDA), noise.to(CUDA)


@pytest.mark.parametrize("missing_camera", [False, True])
def test_graph_engine_matches_eager_tiny(missing_camera: bool) -> None:
    cfg = get_preset("tiny")
    model = Pi05Model(cfg).to(CUDA).eval()
    init_random_(model, 1)
    inputs, noise = _inputs(cfg, valid_tokens=37, pad_to=60, missing_camera=missing_camera)
    ref = model.sample_actions(inputs, noise)
    engine = create_engine("graph", model, CUDA)
    engine.warmup()
    out = engine.sample_actions(inputs, noise)
    assert out.shape == ref.shape
    assert rel(out, ref) < 3e-2  # bf16 engine vs float32 reference
    # A replayed graph is deterministic, and a second call does not see the first one's state.
    again = engine.sample_actions(inputs, noise)
    assert torch.equal(out, again)
    # The call's tail graph (prefill + denoise) computes what the two stage graphs do.
    bucket = engine.load_inputs(inputs, noise)
    for stage in ("vision", "prefill", "denoise"):
        engine.run_stage(stage, bucket)
    assert torch.equal(engine.actions, out[0])


def test_pdl_gives_the_same_actions_as_serial_launches() -> None:
    """Programmatic dependent launch only overlaps weight prefetches with the previous kernel: the
    arithmetic, and so the result, is bit-identical to the same engine launching kernels one by one."""
    _require_pdl()
    model = _streaming_model(2)
    inputs, noise = _inputs(model.cfg, valid_tokens=37, pad_to=60, missing_camera=False)
    outs = []
    for pdl in (True, False):
        engine = create_engine("graph", model, CUDA, pdl=pdl)
        engine.warmup()
        outs.append(engine.sample_actions(inputs, noise))
        outs.append(engine.sample_actions(inputs, noise, use_graphs=False))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_recording_denoise_under_pdl_gives_the_masks_and_actions_of_serial_launches() -> None:
    """A dense episode's calls record Action Cache masks under PDL: the same masks as serial launches, and
    the same actions as the dense denoise."""
    from rmuscle_ros.engine.graph import CacheShapes

    _require_pdl()
    model = _streaming_model(5)
    inputs, noise = _inputs(model.cfg, valid_tokens=30, pad_to=40, missing_camera=False, seed=2)
    outs = []
    for pdl in (True, False):
        engine = create_engine("graph", model, CUDA, buckets=[64], cache=CacheShapes(0.4, 0.5), pdl=pdl)
        engine.warmup()
        bucket = engine.load_inputs(inputs, noise)
        engine.run_stage("vision", bucket)
        engine.run_stage("tail", bucket, variant="record")  # the dense prefill, then the recording denoise
        recorded = (engine.actions.clone(), engine.recorded_masks.clone())
        engine.run_stage("tail", bucket)
        outs.append((*recorded, engine.actions.clone()))
    (actions, masks, dense), (actions_serial, masks_serial, _) = outs
    assert torch.equal(actions, dense) and torch.equal(actions, actions_serial)
    assert torch.equal(masks, masks_serial) and masks[1:].any()


def test_the_first_denoising_step_alongside_the_prefill_gives_the_serial_tails_results() -> None:
    """With `overlap_first_step` (the default) the tail's denoise runs on its own stream and its first step
    follows the prefill layer by layer: the same actions and masks bit for bit as the serial tail, in every
    variant (dense, recording, cached), replayed as a graph or run directly."""
    from rmuscle_ros.engine.fused import ContextRef
    from rmuscle_ros.engine.graph import CacheShapes

    model = _streaming_model(6)
    inputs, noise = _inputs(model.cfg, valid_tokens=30, pad_to=40, missing_camera=False, seed=3)
    ref_inputs, _ = _inputs(model.cfg, valid_tokens=30, pad_to=40, missing_camera=False, seed=4)
    outs = []
    for overlap in (True, False):
        engine = create_engine(
            "graph", model, CUDA, buckets=[64], cache=CacheShapes(0.4, 0.5), overlap_first_step=overlap
        )
        assert engine.overlap_first_step is overlap
        engine.warmup()
        entry = ContextRef.allocate(model.cfg, CUDA, torch.bfloat16)
        engine.rebuild_entry(ref_inputs, entry)
        engine.rebuild_stream.synchronize()
        got = []
        for use_graph in (True, False):
            bucket = engine.load_inputs(inputs, noise)
            engine.run_stage("vision", bucket, use_graph)
            engine.run_stage("tail", bucket, use_graph, variant="record")
            got += [engine.actions.clone(), engine.recorded_masks.clone()]
            engine.load_reference(entry, engine.recorded_masks.clone())
            for variant in ("dense", "cached"):
                engine.run_stage("tail", bucket, use_graph, variant=variant)
                got.append(engine.actions.clone())
        outs.append(got)
    overlapped, serial = outs
    assert all(torch.equal(a, b) for a, b in zip(overlapped, serial, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(overlapped[:4], overlapped[4:], strict=True))
    assert not torch.equal(overlapped[3], overlapped[2]), "the cached tail differs from the dense one"


def test_graph_engine_takes_host_tensors() -> None:
    """The policy hands CPU tensors to the engine; the result equals that of device-resident inputs."""
    cfg = get_preset("tiny")
    model = Pi05Model(cfg).to(CUDA).eval()
    init_random_(model, 3)
    inputs, noise = _inputs(cfg, valid_tokens=20, pad_to=48, missing_camera=True)
    engine = create_engine("graph", model, CUDA)
    engine.warmup()
    on_device = engine.sample_actions(inputs, noise)
    on_host = engine.sample_actions(inputs.to(torch.device("cpu")), noise.cpu())
    assert torch.equal(on_device, on_host)
    # Two calls queued back to back from host tensors, with other prompts and images: each sees its own.
    other, other_noise = _inputs(cfg, valid_tokens=33, pad_to=48, missing_camera=False, seed=4)
    other_on_device = engine.sample_actions(other, other_noise)
    first = engine.sample_actions(inputs.to(torch.device("cpu")), noise.cpu())
    second = engine.sample_actions(other.to(torch.device("cpu")), other_noise.cpu())
    assert torch.equal(first, on_device) and torch.equal(second, other_on_device)
    # The same with the live lane's staging buffer pinned (uploads are then DMAs the host does not wait for).
    engine.live.staging.pin()
    first = engine.sample_actions(inputs.to(torch.device("cpu")), noise.cpu())
    second = engine.sample_actions(other.to(torch.device("cpu")), other_noise.cpu())
    assert torch.equal(first, on_device) and torch.equal(second, other_on_device)


def test_graph_engine_rejects_batches() -> None:
    cfg = get_preset("tiny")
    model = Pi05Model(cfg).to(CUDA).eval()
    engine = create_engine("graph", model, CUDA, buckets=[32])
    inputs, noise = _inputs(cfg, 10, 20, False)
    batch = ModelInputs(
        *(torch.cat([t, t]) for t in (inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask))
    )
    with pytest.raises(ValueError, match="one observation per call"):
        engine.sample_actions(batch, torch.cat([noise, noise]))
    long_inputs, _ = _inputs(cfg, 40, 40, False)
    with pytest.raises(ValueError, match="largest bucket"):
        engine.sample_actions(long_inputs, noise)


@pytest.mark.parametrize(
    ("n", "h", "kvh", "dh", "lk"),
    [(50, 8, 1, 256, 880), (832, 8, 1, 256, 832), (60, 16, 16, 256, 900), (37, 8, 2, 16, 100)],
)
def test_attention_matches_definition(triton_ops, n: int, h: int, kvh: int, dh: int, lk: int) -> None:
    q = torch.randn(n, h * dh, device=CUDA, dtype=torch.bfloat16)
    k = torch.randn(kvh, lk + 32, dh, device=CUDA, dtype=torch.bfloat16)[:, :lk]
    v = torch.randn(kvh, lk + 32, dh, device=CUDA, dtype=torch.bfloat16)[:, :lk]
    bias = torch.where(torch.rand(lk, device=CUDA) < 0.3, -1e30, 0.0)
    bias[:64] = -1e30  # a whole masked key block (a missing camera)
    ref = ops.attention(q, k, v, bias, h)
    out = triton_ops.attention(q, k, v, bias, h)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-2


def test_packed_attention_kernel_matches_definition(triton_ops) -> None:
    """SigLIP's attention at full size (3 images × 16 heads × 256 tokens, Dh 72) read in place."""
    qkv = torch.randn(3 * 256, 3 * 16 * 72, device=CUDA, dtype=torch.bfloat16)
    ref = ops.packed_attention(qkv, 3, 16)
    out = triton_ops.packed_attention(qkv, 3, 16)  # the Triton kernel is the default
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-2
    assert torch.equal(triton_ops.packed_attention(qkv, 3, 16, {"kernel": 0}), ref)


@pytest.mark.parametrize(
    ("m", "n", "k", "splits"),
    [(50, 2560, 1024, 1), (50, 1024, 4096, 4), (50, 8192, 1024, 1), (100, 64, 64, 1)],
)
def test_linear_matches_definition(triton_ops, m: int, n: int, k: int, splits: int) -> None:
    a = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=CUDA, dtype=torch.bfloat16) * k**-0.5
    ref, out = ops.linear(a, w, splits), triton_ops.linear(a, w, splits)
    assert out.shape == ref.shape and rel(out, ref) < 1e-2


@pytest.mark.parametrize(("m", "f", "k"), [(50, 4096, 1024), (20, 128, 64)])
def test_linear_geglu_matches_definition(triton_ops, m: int, f: int, k: int) -> None:
    a = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(2 * f, k, device=CUDA, dtype=torch.bfloat16) * k**-0.5
    ref = ops.linear_geglu(a, w, torch.empty(m, f, device=CUDA, dtype=torch.bfloat16))
    out = triton_ops.linear_geglu(a, w, torch.full((m, f), float("nan"), device=CUDA, dtype=torch.bfloat16))
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-2


def test_neuron_scores_match_definition(triton_ops) -> None:
    """The recording denoise's Σ_rows |act − anchor| per neuron, bf16 in, float32 out (pi05's expert)."""
    act, anchor = (torch.randn(50, 4096, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
    ref = ops.neuron_scores(act, anchor, torch.empty(4096, device=CUDA))
    out = triton_ops.neuron_scores(act, anchor, torch.full((4096,), float("nan"), device=CUDA))
    assert rel(out, ref) < 1e-6


@pytest.mark.parametrize(("h", "kvh", "dh"), [(8, 1, 256), (16, 16, 256), (8, 1, 16)])
def test_qkv_rope_matches_definition(triton_ops, h: int, kvh: int, dh: int) -> None:
    n, width, cap, off = 50, 1024, 960, 900
    a = torch.randn(n, width, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn((h + 2 * kvh) * dh, width, device=CUDA, dtype=torch.bfloat16) * width**-0.5
    ang = torch.rand(n, dh // 2, device=CUDA) * 10
    outs = []
    for impl in (ops, triton_ops):
        q = torch.full((n, h * dh), float("nan"), device=CUDA, dtype=torch.bfloat16)
        k = torch.zeros(kvh, cap, dh, device=CUDA, dtype=torch.bfloat16)
        v = torch.zeros_like(k)
        impl.qkv_rope(a, w, ang.cos(), ang.sin(), q, k[:, off : off + n], v[:, off : off + n], h, kvh)
        outs.append((q, k, v))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert torch.isfinite(got).all() and rel(got, want) < 1e-2
    assert (outs[1][1][:, :off] == 0).all(), "qkv_rope wrote outside its K slice"


@pytest.mark.parametrize("sel", [2048, 2944])
def test_action_cache_kernels_match_definition(triton_ops, sel: int) -> None:
    """Full-size expert shapes: 2048 (ρn 0.5) or 2944 (ρn 0.7: 23 blocks, split unevenly) of 4096
    neurons, gathered in place (no weight copies)."""
    from rmuscle_ros.engine.fused import gather_splits

    m, width, f = 50, 1024, 4096
    x = torch.randn(m, width, device=CUDA, dtype=torch.bfloat16)
    gate_up = torch.randn(2 * f, width, device=CUDA, dtype=torch.bfloat16) * width**-0.5
    down_t = torch.randn(f, width, device=CUDA, dtype=torch.bfloat16) * f**-0.5
    neurons = torch.sort(torch.randperm(f, device=CUDA)[:sel]).values.to(torch.int32)
    anchor = torch.randn(m, f, device=CUDA, dtype=torch.bfloat16)
    outs = []
    for impl in (ops, triton_ops):
        delta = impl.linear_geglu(
            x, gate_up, torch.empty(m, sel, device=CUDA, dtype=torch.bfloat16), neurons=neurons, anchor=anchor
        )
        y = impl.linear(delta, down_t, gather_splits(sel), neurons=neurons)
        outs.append((delta, y.sum(0)))  # summed: the two split K differently when it is uneven
    for got, want in zip(outs[1], outs[0], strict=True):
        assert torch.isfinite(got).all() and rel(got, want) < 1e-2


@pytest.mark.parametrize("ties", [False, True])
def test_context_cache_kernels_match_definition(triton_ops, ties: bool) -> None:
    """Full-size Context Cache (3 cameras: Nv = 768 visual rows, 64 prompt rows, W = 2048, ρp = 0.4):
    the drift measured by add_norm, the selection (exact: same rows in the same order) and add_norm reading
    the compact FFN output through the row indices."""
    nv, lp, d, keep = 768, 832, 2048, 308
    gen = torch.Generator(device=CUDA).manual_seed(0)
    res = torch.randn(lp, d, device=CUDA, generator=gen)
    attn_out = torch.randn(lp, d, device=CUDA, generator=gen).bfloat16()
    ffn_in = torch.randn(nv, d, device=CUDA, generator=gen).bfloat16()
    outs = []
    for impl in (ops, triton_ops):
        r, h = res.clone(), torch.full((lp, d), float("nan"), device=CUDA, dtype=torch.bfloat16)
        drift = torch.full((nv,), float("nan"), device=CUDA)
        impl.add_norm(r, attn_out, h, eps=1e-6, rms=True, drift_ref=ffn_in, drift_out=drift)
        outs.append((r, h, drift))
    (r_ref, h_ref, drift_ref), (r, h, drift) = outs
    assert rel(r, r_ref) < 1e-6 and torch.isfinite(h).all() and rel(h, h_ref) < 1e-2
    assert rel(drift, (h[:nv].float() - ffn_in.float()).pow(2).sum(-1)) < 1e-5  # from h as stored
    assert rel(drift, drift_ref) < 1e-3

    if ties:  # a few distinct values: the order among equal drifts decides
        drift = torch.randint(0, 40, (nv,), device=CUDA, generator=gen).float()
    key_bias = torch.zeros(lp, device=CUDA)
    key_bias[nv // 3 : 2 * nv // 3] = -1e30  # a camera missing from the call: its rows rank last
    for bias in (key_bias, None):
        selections = []
        for impl in (ops, triton_ops):
            rows = torch.full((keep + lp - nv,), -7, device=CUDA, dtype=torch.long)
            inv = torch.full((lp,), -7, device=CUDA, dtype=torch.int32)
            impl.context_select(drift, keep, lp, rows, inv, bias)
            selections.append((rows, inv))
        assert torch.equal(selections[1][0], selections[0][0])
        assert torch.equal(selections[1][1], selections[0][1])
    rows, inv = selections[1]
    assert drift[rows[:keep]].min() >= drift[inv[:nv] < 0].max()

    y = torch.randn(keep + lp - nv, d, device=CUDA, generator=gen).bfloat16()  # the recomputed rows' FFN
    ffn_out = torch.randn(nv, d, device=CUDA, generator=gen).bfloat16()
    outs = []
    for impl in (ops, triton_ops):
        r, h = res.clone(), torch.full((lp, d), float("nan"), device=CUDA, dtype=torch.bfloat16)
        impl.add_norm(r, y, h, eps=1e-6, rms=True, y_rows=inv, y_alt=ffn_out)
        outs.append((r, h))
    assert rel(outs[1][0], outs[0][0]) < 1e-6
    assert torch.isfinite(outs[1][1]).all() and rel(outs[1][1], outs[0][1]) < 1e-2


def _rmuscle_call(engine, inputs, noise, variant: str, use_graphs: bool = True) -> torch.Tensor:
    bucket = engine.load_inputs(inputs, noise)
    engine.run_stage("vision", bucket, use_graphs)
    engine.run_stage("prefill", bucket, use_graphs, variant="cached" if variant == "cached" else "dense")
    engine.run_stage("denoise", bucket, use_graphs, variant=variant)
    return engine.actions.clone()


@pytest.mark.parametrize("tie", [False, True])
def test_window_match_matches_definition(triton_ops, tie: bool) -> None:
    """The match stage's pick at full size (20 entries, 3 cameras × 2048): the same entry as the
    definition, a tie to the first of equal maxima, unusable entries never picked."""
    gen = torch.Generator(device=CUDA).manual_seed(1)
    descriptor = torch.randn(3, 2048, device=CUDA, generator=gen)
    keys = torch.randn(20, 3 * 2048, device=CUDA, generator=gen)
    keys[7] = keys[12] = descriptor.reshape(-1) + 0.1 * keys[7]  # the two best
    if not tie:
        keys[12] += 0.05 * keys[3]
    keys /= keys.norm(dim=1, keepdim=True)
    usable = torch.ones(20, dtype=torch.bool, device=CUDA)
    usable[[2, 5]] = False
    keys[2] = descriptor.reshape(-1) / descriptor.norm()  # the best of all, but not usable
    picks = []
    for impl in (ops, triton_ops):
        slot, out = torch.full((1,), -7, device=CUDA), torch.zeros(2, device=CUDA)
        impl.window_match(descriptor, keys, usable, slot, out)
        picks.append((int(slot), out.tolist()))
    assert picks[1][0] == picks[0][0] and picks[1][1][0] == picks[0][1][0]
    assert picks[1][1][1] == pytest.approx(picks[0][1][1], abs=1e-5)
    if tie:
        assert picks[1][0] == 7


def test_rmuscle_graphs_are_exact_at_rho_one_and_replay_the_cached_computation() -> None:
    from rmuscle_ros.engine.fused import ContextRef
    from rmuscle_ros.engine.graph import CacheShapes

    model = _streaming_model(4)
    cfg = model.cfg
    ref_inputs, noise = _inputs(cfg, valid_tokens=30, pad_to=40, missing_camera=False, seed=1)
    live_inputs, _ = _inputs(cfg, valid_tokens=30, pad_to=40, missing_camera=False, seed=1)
    live_inputs.images.add_(0.02 * torch.randn_like(live_inputs.images)).clamp_(-1, 1)
    whole_entry = None
    for shapes in (
        CacheShapes(1.0, 1.0),
        CacheShapes(0.4, 0.5, window=2),
        CacheShapes(0.4, 0.5, rebuild_slices=3),
    ):
        engine = create_engine("graph", model, CUDA, buckets=[64], cache=shapes)
        engine.warmup()
        bucket = engine.load_inputs(ref_inputs, noise)
        for stage, variant in (("vision", "dense"), ("prefill", "dense"), ("denoise", "record")):
            engine.run_stage(stage, bucket, variant=variant)
        masks = engine.recorded_masks.clone()
        if engine.action_cache:  # (ρn = 1 records none: every step runs dense)
            later = masks[1:]  # step 0 is the anchor: its row is never used
            assert (later[..., 1:] > later[..., :-1]).all(), "masks are sorted and without repeats"
            assert int(later.min()) >= 0 and int(later.max()) < cfg.expert.mlp_dim
        entry, entry_nograph = (ContextRef.allocate(cfg, CUDA, torch.bfloat16) for _ in range(2))
        engine.rebuild_entry(ref_inputs, entry)
        engine.rebuild_stream.synchronize()
        engine.rebuild_entry(ref_inputs, entry_nograph, use_graphs=False)
        engine.rebuild_stream.synchronize()
        assert torch.equal(entry.ffn_in, entry_nograph.ffn_in) and torch.equal(
            entry.ffn_out, entry_nograph.ffn_out
        )
        # A rebuild in slices (vision, then each layer), a live call between its parts: the same entry.
        if shapes.rebuild_slices == 1:
            whole_entry = entry
        else:
            sliced = ContextRef.allocate(cfg, CUDA, torch.bfloat16)
            for _ in range(engine.begin_rebuild(ref_inputs, sliced)):
                _rmuscle_call(engine, live_inputs, noise, "dense")
                torch.cuda.synchronize()  # between the parts, not alongside them (as the runtime orders)
                engine.rebuild_step()
                engine.rebuild_stream.synchronize()
            assert whole_entry is not None
            assert torch.equal(sliced.ffn_in, whole_entry.ffn_in) and torch.equal(
                sliced.ffn_out, whole_entry.ffn_out
            )
        dense = _rmuscle_call(engine, live_inputs, noise, "dense")
        engine.load_reference(entry, masks)
        cached = _rmuscle_call(engine, live_inputs, noise, "cached")
        if shapes.rho_p == 1.0:
            assert torch.equal(cached, dense), "ρ = 1 must replay the dense graphs"
        else:
            assert torch.isfinite(cached).all() and not torch.equal(cached, dense)
            assert torch.equal(cached, _rmuscle_call(engine, live_inputs, noise, "cached", use_graphs=False))
            if engine.window is not None:  # the same entry read in place from the window: the same result
                engine.window.ref(1).copy_(entry)
                engine.window.neurons[1].copy_(masks)
                engine.load_window_entry(1)
                assert torch.equal(_rmuscle_call(engine, live_inputs, noise, "cached"), cached)


def test_a_ramp_schedule_on_the_gpu_computes_what_the_cpu_definition_does() -> None:
    """neuron_schedule "ramp" in the graph engine (Triton's gathered kernels at 128, 256, ... 896 of 1,024
    neurons, a step that keeps none, a step that keeps all): each step records its own count of masks, the
    graph replays the direct launches, and given the same masks the cached actions are those of the CPU
    engine's float32 definition up to bf16 rounding, far closer than the cache's own error against dense."""
    from rmuscle_ros.engine.fused import ContextRef
    from rmuscle_ros.engine.graph import CacheShapes

    model = _streaming_model(7)
    cfg = model.cfg
    shapes = CacheShapes(1.0, 0.5, neuron_schedule="ramp")  # the Action Cache alone
    ref_inputs, noise = _inputs(cfg, valid_tokens=30, pad_to=40, missing_camera=False, seed=5)
    live_inputs, _ = _inputs(cfg, valid_tokens=30, pad_to=40, missing_camera=False, seed=6)
    engine = create_engine("graph", model, CUDA, buckets=[64], cache=shapes)
    assert engine.step_neurons == (1024, 0, 128, 256, 384, 512, 640, 768, 896, 1024)
    engine.warmup()
    recorded = []
    for use_graphs in (True, False):
        _rmuscle_call(engine, ref_inputs, noise, "record", use_graphs)
        recorded.append(engine.recorded_masks.clone())
    masks = recorded[0]
    assert torch.equal(masks, recorded[1])
    for s, c in enumerate(engine.step_neurons):
        if 0 < c < cfg.expert.mlp_dim:
            row = masks[s, :, :c]
            assert (row[..., 1:] > row[..., :-1]).all() and int(row.min()) >= 0
    dense = _rmuscle_call(engine, live_inputs, noise, "dense")
    engine.load_reference(ContextRef.allocate(cfg, CUDA, torch.bfloat16), masks)
    cached = _rmuscle_call(engine, live_inputs, noise, "cached")
    assert torch.equal(cached, _rmuscle_call(engine, live_inputs, noise, "cached", use_graphs=False))
    cpu = create_engine("fused", _streaming_model(7).cpu(), "cpu", buckets=[64], cache=shapes)  # float32
    cpu.load_reference(ContextRef.allocate(cfg, torch.device("cpu"), torch.float32), masks.cpu())
    cpu_live = (live_inputs.to(torch.device("cpu")), noise.cpu())
    cpu_cached = _rmuscle_call(cpu, *cpu_live, "cached")
    cpu_dense = _rmuscle_call(cpu, *cpu_live, "dense")
    cache_error = rel(cpu_cached, cpu_dense)
    assert cache_error > 1e-3, "the ramp leaves neurons out: not the dense result"
    assert rel(cached.cpu(), cpu_cached) < min(3e-2, cache_error / 3)
    assert rel(dense.cpu(), cpu_dense) < 3e-2


def test_rmuscle_runtime_on_the_gpu_records_then_serves_cached_and_is_exact_at_rho_one(tmp_path) -> None:
    """The policy-level runtime on the graph backend: live calls on the high-priority stream, rebuilds on
    the low-priority one; a recorded warm-up makes the repeat cached, its first call too once the reset's
    motion window rebuilt the episode's start; ρ = 1 chunks equal dense ones. The Action Cache alone
    (ρp = 1, ρn = 0.5) holds no FFN states and its refill queues no stage of the model."""
    import numpy as np

    from rmuscle_ros.cache.runtime import RMuscleConfig
    from rmuscle_ros.runtime.policy import Observation, Policy, PolicyConfig

    cfg = PolicyConfig(backend="graph", device="cuda")
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)

    def episode(n: int, noise: float) -> list[Observation]:
        out = []
        for i in range(n):
            img = np.clip(base + noise * rng.standard_normal(base.shape), 0, 255).astype(np.uint8)
            out.append(Observation({c: img for c in cfg.cameras}, np.full(14, i / n, np.float32), "stack"))
        return out

    def run(policy: Policy, observations: list[Observation]) -> list:
        chunks = []
        for i, obs in enumerate(observations):
            noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(i))
            chunks.append(policy.infer(obs, noise))
            # the arm's motion window, as the node runs it: entry by entry, each built before the next
            while policy.rebuild_cache(1, wait=True):
                assert policy.rmuscle.engine.rebuild_stream.query(), "wait=True returned before the rebuild"
        return chunks

    dense = Policy(cfg)
    dense.warmup()
    for shapes in (
        RMuscleConfig(rebuilds_per_tick=20),
        RMuscleConfig(rho_p=1.0, rho_n=1.0, rebuilds_per_tick=20),
        RMuscleConfig(rho_p=1.0, rho_n=1.0, rebuilds_per_tick=20, concurrent_rebuilds=True),
        RMuscleConfig(rho_p=1.0, rho_n=0.5, rebuilds_per_tick=20),
    ):
        policy = Policy(cfg, shapes)
        policy.warmup()
        engine = policy.rmuscle.engine
        if shapes.rho_p == 1.0:
            assert engine.rebuild_parts == [] and engine.window.ffn_in.numel() == 0
            assert not any(key[0] == "rebuild" for key in engine._graphs), "no rebuild graph captured"
        assert [c.cache_mode for c in run(policy, episode(4, 0.0))] == ["dense"] * 4
        assert policy.reset_episode() == 0
        while policy.rebuild_cache(1, wait=True):  # the motion window at the reset: the episode's start
            pass
        live = episode(4, 2.0)
        chunks = run(policy, live)
        assert [c.cache_mode for c in chunks] == ["cached"] * 4, "the first call too, from the refill"
        assert policy.rmuscle.match_reruns == 0
        assert all(np.isfinite(c.actions).all() for c in chunks)
        if shapes.rho_p == shapes.rho_n == 1.0:
            want = run(dense, live)
            assert all(np.array_equal(c.actions, w.actions) for c, w in zip(chunks, want, strict=True))
        policy.close()


def test_a_runtime_call_from_the_callers_own_stream_puts_it_back_ordered_after_the_call() -> None:
    """`RMuscle.infer` runs on the live stream and makes the caller's stream current again (set and put
    back with `torch.cuda.set_stream`, its ordering events allocated once and recorded again each call):
    a caller on a stream of its own finds it current after dense and cached calls, reads chunks equal to
    a dense policy's on the default stream (ρ = 1: ordered after the call's work, not read early), and
    each call's GPU span is timed."""
    import numpy as np

    from rmuscle_ros.cache.runtime import RMuscleConfig
    from rmuscle_ros.runtime.policy import Observation, Policy, PolicyConfig

    cfg = PolicyConfig(backend="graph", device="cuda")
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)
    observations = [
        Observation({c: base for c in cfg.cameras}, np.full(14, i / 4, np.float32), "stack") for i in range(4)
    ]

    def noise(i: int) -> torch.Tensor:
        return torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(i))

    dense = Policy(cfg)
    dense.warmup()
    want = [dense.infer(obs, noise(i)).actions for i, obs in enumerate(observations)]
    policy = Policy(cfg, RMuscleConfig(rho_p=1.0, rho_n=1.0, rebuilds_per_tick=20))
    policy.warmup()
    mine = torch.cuda.Stream()
    modes = []
    for _ in range(2):  # a recorded episode (dense), then its repeat (cached)
        for i, obs in enumerate(observations):
            with torch.cuda.stream(mine):
                chunk = policy.infer(obs, noise(i))
                assert torch.cuda.current_stream() == mine, (
                    f"a {chunk.cache_mode} call left another stream current"
                )
            assert np.array_equal(chunk.actions, want[i]), f"call {i} ({chunk.cache_mode})"
            assert chunk.timings_s["gpu"] > 0
            modes.append(chunk.cache_mode)
            while policy.rebuild_cache(1, wait=True):
                pass
        policy.reset_episode()
        while policy.rebuild_cache(1, wait=True):
            pass
    assert modes == ["dense"] * 4 + ["cached"] * 4
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    policy.close()


def test_an_audit_on_the_gpu_measures_what_a_dense_policy_gives_and_can_send_the_episode_dense() -> None:
    """Audits on the graph backend: the dense re-run of a cached call (on the live stream, after the
    rebuilds queued before it) gives the dense policy's chunk, so each audit's error is the cached chunk's
    error against it; an audit above the bound sends the rest of the episode dense, bit for bit."""
    import numpy as np

    from rmuscle_ros.cache.runtime import RMuscleConfig
    from rmuscle_ros.runtime.policy import Observation, Policy, PolicyConfig

    cfg = PolicyConfig(backend="graph", device="cuda")
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)
    observations = []
    for i in range(10):
        img = np.clip(base + 2.0 * rng.standard_normal(base.shape), 0, 255).astype(np.uint8)
        observations.append(
            Observation({c: img for c in cfg.cameras}, np.full(14, i / 5, np.float32), "stack")
        )
    warm, live = observations[:5], observations[5:]

    def noise(i: int) -> torch.Tensor:
        return torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(i))

    dense = Policy(cfg)
    dense.warmup()
    want = [dense.infer(obs, noise(i)).actions for i, obs in enumerate(live)]
    for bound in (0.0, 1e-6):
        policy = Policy(cfg, RMuscleConfig(rebuilds_per_tick=20, audit_every=1, audit_max_error=bound))
        policy.warmup()
        for i, obs in enumerate(warm):
            policy.infer(obs, noise(i))
        assert policy.reset_episode() == 0
        policy.rebuild_cache(wait=False)  # left queued: the first audit must wait for it
        chunks, audits = [], []
        for i, obs in enumerate(live):
            chunks.append(policy.infer(obs, noise(i)))
            audits.append(policy.audit_cache())
            policy.rebuild_cache(wait=False)
        modes = [c.cache_mode for c in chunks]
        if bound == 0.0:
            assert modes == ["cached"] * 5 and all(not a.tripped for a in audits)
            for chunk, audit, w in zip(chunks, audits, want, strict=True):
                expected = np.linalg.norm(chunk.actions - w) / np.linalg.norm(w)
                assert 0.0 < audit.error == pytest.approx(expected, rel=1e-5)
        else:
            assert modes == ["cached"] + ["fallback"] * 4 and audits[0].tripped and audits[1:] == [None] * 4
            assert all(np.array_equal(c.actions, w) for c, w in zip(chunks[1:], want[1:], strict=True))
        policy.close()


def test_a_gpu_policy_records_the_images_it_resampled_on_the_gpu(tmp_path) -> None:
    """With the engine on the GPU the policy resamples the images there, and a recorded episode keeps
    them: each call's library images are that call's model input as uint8, exactly (they reach the host
    through a pinned copy taken by the next call or at the episode's end)."""
    import numpy as np

    from rmuscle_ros.cache.runtime import RMuscleConfig, images_to_u8
    from rmuscle_ros.runtime.policy import Policy, PolicyConfig, synthetic_observation

    cfg = PolicyConfig(backend="graph", device="cuda")
    policy = Policy(cfg, RMuscleConfig(library_path=str(tmp_path / "library")))
    observations = [synthetic_observation(cfg, "stack", seed=i) for i in range(3)]
    want = []
    for obs in observations:
        want.append(images_to_u8(policy.preprocess(obs)[0].images[0]).cpu().numpy())
        assert policy.preprocess(obs)[0].images.is_cuda
        policy.infer(obs)
    assert policy.reset_episode() == 0
    recorded = policy.rmuscle.library.load(0).images
    assert recorded.shape == (3, *want[0].shape)
    assert all(np.array_equal(r, w) for r, w in zip(recorded, want, strict=True))
    policy.close()


def test_a_graph_policy_keeps_its_compiled_kernels_under_the_engine_cache_dir(tmp_path) -> None:
    """`engine_cache_dir` holds the graph backend's compiled Triton kernels (triton/): a fresh process
    (nothing compiled yet, as at a cell's first configure) writes them there, not in ~/.triton."""
    import os
    import subprocess
    import sys

    script = (
        "from rmuscle_ros.runtime.policy import Policy, PolicyConfig\n"
        f"Policy(PolicyConfig(backend='graph', device='cuda', engine_cache_dir={str(tmp_path)!r})).warmup()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    cubins = list((tmp_path / "triton").rglob("*.cubin"))
    assert len(cubins) >= 10, f"{len(cubins)} compiled kernels under {tmp_path / 'triton'}"


def test_retrieval_on_the_gpu_picks_what_the_host_picks() -> None:
    """The library's descriptors on the GPU: a first call, aligned calls and a fallback call give the same
    matches as host retrieval, similarities within float32 rounding."""
    import numpy as np

    from rmuscle_ros.cache.retrieval import RetrievalConfig, Retriever

    rng = np.random.default_rng(2)
    base = rng.standard_normal((3, 64)).astype(np.float32)
    library = {
        eid: np.stack([base + 0.3 * eid + 0.05 * t * rng.standard_normal((3, 64)) for t in range(n)])
        for eid, n in ((0, 30), (3, 1), (5, 12), (8, 30))
    }
    cfg = RetrievalConfig(top_k=3, lookahead=4, threshold=0.5)
    host, gpu = Retriever(cfg, library), Retriever(cfg, library, CUDA)
    assert gpu.on_device and not host.on_device
    for t in range(12):
        q = library[8][2 * t] + 0.01 * rng.standard_normal((3, 64)).astype(np.float32)
        if t == 11:
            q = -q  # the scene leaves the repertoire: fallback
        gpu.queue(torch.from_numpy(q).to(CUDA))
        want, got = host.query(q), gpu.query()
        assert [(m.episode, m.position) for m in got] == [(m.episode, m.position) for m in want]
        assert [m.similarity for m in got] == pytest.approx([m.similarity for m in want], abs=1e-5)
        assert gpu.fallback == host.fallback and gpu.last_similarity == pytest.approx(
            host.last_similarity, abs=1e-5
        )
    assert gpu.fallback
    # Restricted to some episodes (rMuscle: the current task's), and to none: the same picks, and a call's
    # queued similarities are collected either way (the next call's queue starts clean).
    for episodes in ([0, 5], []):
        host.restrict(episodes)
        gpu.restrict(episodes)
        for t in range(3):
            q = library[5][2 * t] + 0.01 * rng.standard_normal((3, 64)).astype(np.float32)
            gpu.queue(torch.from_numpy(q).to(CUDA))
            want, got = host.query(q), gpu.query()
            assert [(m.episode, m.position) for m in got] == [(m.episode, m.position) for m in want]
            assert {m.episode for m in got} <= set(episodes) and not gpu._queued
            assert gpu.last_similarity == pytest.approx(host.last_similarity, abs=1e-5)


def shifted_scene_episode(cfg, n: int, noise: float) -> list:
    """n observations of one random scene shifted 6 pixels a call (so that no two calls' entries tie in
    similarity), with `noise` (its seed too): the same scene at another noise is a repeat of the task."""
    import numpy as np

    from rmuscle_ros.runtime.policy import Observation

    base = np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    rng = np.random.default_rng(int(noise * 10))
    return [
        Observation(
            {c: np.clip(np.roll(base, 6 * i, axis=1) + noise * rng.standard_normal(base.shape), 0, 255)
             .astype(np.uint8) for c in cfg.cameras},
            np.full(14, i / n, np.float32),
            "stack",
        )
        for i in range(n)
    ]  # fmt: skip


def test_matching_on_the_gpu_serves_the_chunks_of_matching_on_the_host(tmp_path) -> None:
    """RMuscleConfig.match_on_gpu on the graph backend (pick and load in the match graph, the cached
    graphs queued before the host's retrieval answers): two host-matching runtimes agree bit for bit
    (checked first, so that a failure says which), and the GPU-matching one gives their chunks. Every
    runtime sees the same observations; each call's images differ (a shifted scene), so no two entries
    tie in similarity."""
    import numpy as np

    from rmuscle_ros.cache.runtime import RMuscleConfig
    from rmuscle_ros.runtime.policy import Policy, PolicyConfig

    cfg = PolicyConfig(backend="graph", device="cuda")

    def serve(on_gpu: bool) -> tuple[list, dict]:
        policy = Policy(cfg, RMuscleConfig(rebuilds_per_tick=20, match_on_gpu=on_gpu))
        policy.warmup()
        chunks = []
        for rep, noise in enumerate((0.0, 2.0)):  # a recorded warm-up, then the repeat
            for i, obs in enumerate(shifted_scene_episode(cfg, 4, noise)):
                action_noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(i))
                chunks.append(policy.infer(obs, action_noise))
                policy.rebuild_cache()
                torch.cuda.synchronize()  # the arm's motion window: rebuilds finish before the next call
            if rep == 0:
                policy.reset_episode()
        status = policy.cache_status()
        policy.close()
        return chunks[4:], status

    (a, _), (b, _), (gpu, status) = serve(False), serve(False), serve(True)
    assert [c.cache_mode for c in gpu][1:] == ["cached"] * 3 and status["match_reruns"] == 0
    assert [c.cache_mode for c in a] == [c.cache_mode for c in gpu]
    assert all(np.array_equal(x.actions, y.actions) for x, y in zip(a, b, strict=True)), "host vs host"
    assert all(np.array_equal(x.actions, y.actions) for x, y in zip(gpu, a, strict=True)), "gpu vs host"


@pytest.mark.parametrize("row_max", [1024, 0])
def test_action_step_matches_definition(triton_ops, row_max: int) -> None:
    """The kernel between two denoising steps (Euler update, input projection, adaRMS norm) at full size,
    whole rows in one tile and (as for wider experts) 256 features at a time."""
    ha, a, we = 50, 32, 1024
    gen = torch.Generator(device=CUDA).manual_seed(0)
    rnd = lambda *shape, s=1.0: torch.randn(*shape, device=CUDA, generator=gen) * s  # noqa: E731
    params = {"euler_w": rnd(a, we, s=0.05), "euler_b": rnd(a), "in_w": rnd(we, a, s=0.2), "in_b": rnd(we),
              "eps": 1e-6, "mul": rnd(we), "add": rnd(we)}  # fmt: skip
    x0, h0 = rnd(ha, a), rnd(ha, we).bfloat16()
    outs = []
    for impl in (ops, triton_ops):
        x, h, res = x0.clone(), h0.clone(), torch.zeros(ha, we, device=CUDA)
        kw = {"config": {"row_max": row_max}} if impl is triton_ops else {}
        impl.action_step(x, h=h, res=res, out=h, **params, **kw)
        outs.append((x, res, h.float()))
    assert rel(outs[1][0], outs[0][0]) < 1e-5 and rel(outs[1][1], outs[0][1]) < 1e-5
    assert rel(outs[1][2], outs[0][2]) < 1e-2  # bf16 output rounding


def test_device_fault_tells_a_lost_cuda_context_from_a_call_that_failed(tmp_path) -> None:
    """`Policy.device_fault` (what the node asks after a call raised): None on a working GPU, after an
    out-of-memory error and with the GPU's memory full, all of which leave the context working; after a
    real illegal address, what the check raised, every time after. (Letting the policy go then aborts the
    process: bench/probe_lost_gpu.py. The script ends as the node does, with os._exit.) Run in a process of
    its own: the test's process must keep its GPU."""
    import subprocess
    import sys

    from bench.probe_lost_gpu import WILD_STORE

    (tmp_path / "wild_store.py").write_text(WILD_STORE)
    script = tmp_path / "check.py"
    script.write_text(
        """
import os
import sys

import torch
from wild_store import fault_the_gpu
from rmuscle_ros.cache.runtime import RMuscleConfig
from rmuscle_ros.runtime.policy import Policy, PolicyConfig, synthetic_observation

policy = Policy(PolicyConfig(backend="graph", device="cuda"), RMuscleConfig(library_path=sys.argv[1]))
policy.infer(synthetic_observation(policy.cfg, "pick"))
assert policy.device_fault() is None, policy.device_fault()
try:
    torch.empty(1 << 50, device="cuda")  # 4 PiB
except torch.OutOfMemoryError:
    pass
else:
    raise AssertionError("no out-of-memory error")
assert policy.device_fault() is None, "an out-of-memory error is no lost context"
hog = []  # the GPU's memory full (found in review: the check allocated, and said "lost")
for size in (1 << 30, 1 << 20, 1 << 12):
    try:
        while True:
            hog.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        pass
assert policy.device_fault() is None, "a full GPU is no lost context"
del hog
torch.cuda.empty_cache()
try:
    fault_the_gpu(torch)
except Exception as e:
    print("the fault raised:", type(e).__name__)
print("FAULT", policy.device_fault())
print("AGAIN", policy.device_fault())
sys.stdout.flush()
os._exit(0)  # nothing freed: on a lost context that would abort the process
"""
    )
    # (the script's folder is first on its path: wild_store imports from there)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "library")], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    printed = run.stdout.splitlines()
    # each check one line (not PyTorch's advice lines after the error), the last two printed
    assert printed[-2].startswith("FAULT AcceleratorError: ") and "illegal memory access" in printed[-2], (
        printed
    )
    assert printed[-1].startswith("AGAIN AcceleratorError: "), printed


def test_after_an_episode_served_then_fallen_back_the_next_is_recorded_dense_on_the_gpu() -> None:
    """The learning episode (test_rmuscle_runtime's, on the CPU) on the graph backend, matched on the GPU:
    after an episode served from the cache that then fell back, the task's next episode runs dense from its
    start (mode fallback, the learning reason) with no cached run for nothing (no match rerun: the window
    is not used), is recorded at its reset, and the one after is served from the cache again."""
    from rmuscle_ros.cache.runtime import LEARNING_REASON, RMuscleConfig
    from rmuscle_ros.runtime.policy import Observation, Policy, PolicyConfig

    cfg = PolicyConfig(backend="graph", device="cuda")

    def run(policy: Policy, observations: list[Observation]) -> list:
        chunks = []
        for i, obs in enumerate(observations):
            chunks.append(
                policy.infer(obs, torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(i)))
            )
            policy.rebuild_cache()
            torch.cuda.synchronize()  # the arm's motion window: rebuilds finish before the next call
        return chunks

    policy = Policy(cfg, RMuscleConfig(rebuilds_per_tick=20))
    assert policy.rmuscle.cfg.match_on_gpu
    policy.warmup()
    run(policy, shifted_scene_episode(cfg, 4, 0.0))
    assert policy.reset_episode() == 0
    live = shifted_scene_episode(cfg, 4, 2.0)
    assert [c.cache_mode for c in run(policy, live[:2])][-1] == "cached"
    policy.reconfigure_cache(threshold=1.0)  # the scene leaves the reference's
    assert [c.cache_mode for c in run(policy, live[2:])] == ["fallback"] * 2
    policy.reconfigure_cache(threshold=0.8)
    assert policy.reset_episode() is None, "an episode served from the cache is no reference"
    reruns = policy.rmuscle.match_reruns
    learning = run(policy, live)
    assert {c.cache_mode for c in learning} == {"fallback"} and policy.rmuscle.last.reason == LEARNING_REASON
    assert policy.rmuscle.match_reruns == reruns, "a cached run for nothing"
    assert policy.reset_episode() == 1
    assert [c.cache_mode for c in run(policy, live)][1:] == ["cached"] * 3
    policy.close()
