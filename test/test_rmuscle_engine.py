"""rMuscle inside the engine (CPU, float32 PyTorch definitions of every kernel).

The guarantees a user relies on: ρ = 1 is the dense result bit for bit; recording masks does not change
the dense result; the cached arithmetic with nothing left out reproduces dense; a reference entry rebuilt
from the same observation is what the dense prefill computed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import random_inputs, rel_l2, tiny_model

from rmuscle_ros.engine import create_engine
from rmuscle_ros.engine.fused import ActionCache, ContextCache, ContextRef, rho_count
from rmuscle_ros.engine.graph import CacheShapes


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11)


def _run(engine, inputs, noise, prefill: str, denoise: str) -> torch.Tensor:
    bucket = engine.load_inputs(inputs, noise)
    engine.run_stage("vision", bucket)
    engine.run_stage("prefill", bucket, variant=prefill)
    engine.run_stage("denoise", bucket, variant=denoise)
    return engine.actions.clone()


def _reference(engine, inputs, noise) -> tuple[ContextRef, torch.Tensor]:
    """Record an observation densely: its Action Cache masks and its rebuilt Context Cache entry."""
    _run(engine, inputs, noise, "dense", "record")
    masks = engine.recorded_masks.clone()
    entry = ContextRef.allocate(engine.cfg, engine.device, engine.dtype)
    engine.rebuild_entry(inputs, entry)
    return entry, masks


def test_rho_one_is_the_dense_result_bit_for_bit(model) -> None:
    engine = create_engine("fused", model, "cpu", cache=CacheShapes(rho_p=1.0, rho_n=1.0))
    inputs, noise = random_inputs(model.cfg, valid_tokens=15, pad_to=20)
    dense = _run(engine, inputs, noise, "dense", "dense")
    entry, masks = _reference(engine, *random_inputs(model.cfg, valid_tokens=9, pad_to=20, seed=4))
    engine.load_reference(entry, masks)
    assert torch.equal(_run(engine, inputs, noise, "cached", "cached"), dense)


def test_recording_masks_does_not_change_the_result(model) -> None:
    engine = create_engine("fused", model, "cpu", cache=CacheShapes())
    inputs, noise = random_inputs(model.cfg, valid_tokens=15, pad_to=20)
    assert torch.equal(
        _run(engine, inputs, noise, "dense", "record"), _run(engine, inputs, noise, "dense", "dense")
    )
    masks = engine.recorded_masks
    keep = rho_count(0.5, model.cfg.expert.mlp_dim)
    assert masks.shape == (model.cfg.num_steps, model.cfg.expert.depth, keep)
    later = masks[1:]  # step 0 is the anchor: its row is never used
    assert (later[..., 1:] > later[..., :-1]).all(), "masks are sorted and without repeats"
    assert int(later.min()) >= 0 and int(later.max()) < model.cfg.expert.mlp_dim


def test_the_action_cache_alone_holds_and_rebuilds_no_ffn_states(model) -> None:
    """At ρp = 1 the cached prefill is the dense one and reads no reference entry: the engine holds no FFN
    states (102 MB an entry at pi05), a rebuild runs no stage and leaves its output as it was, and a cached
    call is the dense prefill followed by the cached denoise that an engine with a Context Cache runs on
    the same masks, bit for bit."""
    cfg = model.cfg
    alone = create_engine("fused", model, "cpu", cache=CacheShapes(rho_p=1.0, rho_n=0.5, window=4))
    both = create_engine("fused", model, "cpu", cache=CacheShapes(rho_p=0.4, rho_n=0.5, window=4))
    assert not alone.context_cache and both.context_cache
    assert alone.window.ffn_in.numel() == alone.window.ffn_out.numel() == 0 and alone.ctx_ref.nbytes == 0
    assert both.window.ffn_in.numel() > 0
    held = both.window.nbytes + 2 * both.ctx_ref.nbytes  # the window's and the two standalone entries' states
    assert both.cache_bytes - alone.cache_bytes == held - alone.window.nbytes
    assert alone.rebuild is None and alone.rebuild_parts == []

    ref_inputs, ref_noise = random_inputs(cfg, valid_tokens=9, pad_to=20, seed=4)
    entry, masks = _reference(both, ref_inputs, ref_noise)
    ran: list[str] = []
    prefill, encode = alone.fused.prefill, alone.fused.encode_images
    alone.fused.prefill = lambda *a, **k: ran.append("prefill") or prefill(*a, **k)
    alone.fused.encode_images = lambda *a, **k: ran.append("vision") or encode(*a, **k)
    try:
        out = ContextRef.allocate(cfg, alone.device, alone.dtype)
        out.ffn_in.fill_(7.0)
        assert alone.begin_rebuild(ref_inputs, out) == 0 and alone.rebuild_step() is True
        alone.rebuild_entry(ref_inputs, out)
        assert ran == [] and bool((out.ffn_in == 7.0).all()), "nothing ran, nothing was written"
        with pytest.raises(RuntimeError, match="no rebuild is in progress"):
            alone.rebuild_step()
    finally:
        del alone.fused.prefill, alone.fused.encode_images

    inputs, noise = random_inputs(cfg, valid_tokens=15, pad_to=20)
    alone.load_reference(alone.ctx_ref, masks)
    cached = _run(alone, inputs, noise, "cached", "cached")
    both.load_reference(entry, masks)
    assert torch.equal(cached, _run(both, inputs, noise, "dense", "cached"))
    assert not torch.equal(cached, _run(alone, inputs, noise, "dense", "dense")), "the Action Cache ran"


def test_rebuilt_entry_is_what_the_dense_prefill_computed(model) -> None:
    """The rebuild lane reproduces the live lane's FFN inputs/outputs for the same observation, so a
    call whose reference is itself drifts by zero everywhere and the Context Cache copies exact values."""
    engine = create_engine("fused", model, "cpu", cache=CacheShapes(rho_p=0.4, rho_n=1.0))
    inputs, noise = random_inputs(model.cfg, valid_tokens=15, pad_to=20)
    entry, masks = _reference(engine, inputs, noise)
    again = ContextRef.allocate(engine.cfg, engine.device, engine.dtype)
    engine.rebuild_entry(inputs, again)
    assert torch.equal(entry.ffn_in, again.ffn_in) and torch.equal(entry.ffn_out, again.ffn_out)
    assert entry.ffn_in.abs().sum() > 0
    engine.load_reference(entry, masks)
    dense = _run(engine, inputs, noise, "dense", "dense")
    assert rel_l2(_run(engine, inputs, noise, "cached", "cached"), dense) < 1e-5


def test_a_rebuild_in_slices_with_live_calls_between_is_the_whole_rebuild(model) -> None:
    """A rebuild run part by part, with live calls on the same engine between the parts, gives the entry
    a rebuild in one part gives, bit for bit; the live calls are unaffected."""
    inputs, _ = random_inputs(model.cfg, valid_tokens=15, pad_to=20)
    other, other_noise = random_inputs(model.cfg, valid_tokens=9, pad_to=20, seed=5)
    whole = create_engine("fused", model, "cpu", cache=CacheShapes(rho_p=0.4, rho_n=1.0))
    want = ContextRef.allocate(whole.cfg, whole.device, whole.dtype)
    whole.rebuild_entry(inputs, want)
    live_alone = _run(whole, other, other_noise, "dense", "dense")

    sliced = create_engine("fused", model, "cpu", cache=CacheShapes(rho_p=0.4, rho_n=1.0, rebuild_slices=4))
    assert [vision for vision, _ in sliced.rebuild_parts] == [True, False, False]  # tiny: 2 layers
    got = ContextRef.allocate(sliced.cfg, sliced.device, sliced.dtype)
    parts = sliced.begin_rebuild(inputs, got)
    done = []
    for _ in range(parts):
        assert torch.equal(_run(sliced, other, other_noise, "dense", "dense"), live_alone)
        done.append(sliced.rebuild_step())
    assert done == [False] * (parts - 1) + [True]
    assert torch.equal(got.ffn_in, want.ffn_in) and torch.equal(got.ffn_out, want.ffn_out)
    with pytest.raises(RuntimeError, match="no rebuild is in progress"):
        sliced.rebuild_step()


def test_rebuild_slices_cover_every_layer_once() -> None:
    from rmuscle_ros.engine.graph import rebuild_slices

    assert rebuild_slices(1, 18) == [(True, range(18))]
    assert rebuild_slices(4, 18) == [(True, range(0)), (False, range(0, 6)), (False, range(6, 12)),
                                     (False, range(12, 18))]  # fmt: skip
    for slices in range(2, 12):
        for depth in (1, 2, 5, 18, 28):
            parts = rebuild_slices(slices, depth)
            assert [i for _, layers in parts for i in layers] == list(range(depth))
            assert len(parts) == 1 + min(slices - 1, depth) and all(layers for _, layers in parts[1:])
    with pytest.raises(ValueError, match="rebuild_slices"):
        CacheShapes(rebuild_slices=0)


def test_cached_arithmetic_with_nothing_left_out_is_dense(model) -> None:
    """Forced through the cached code paths (not the ρ = 1 shortcut): every visual token recomputed and
    every neuron updated must give the dense actions (up to float32 rounding)."""
    cfg = model.cfg
    engine = create_engine("fused", model, "cpu", cache=CacheShapes())
    inputs, noise = random_inputs(cfg, valid_tokens=12, pad_to=20)
    dense = _run(engine, inputs, noise, "dense", "dense")
    entry, _ = _reference(engine, *random_inputs(cfg, valid_tokens=7, pad_to=20, seed=8))  # another scene
    fused = engine.fused
    bucket = engine.load_inputs(inputs, noise)
    engine.run_stage("vision", bucket)
    layout = engine.layout[bucket]
    fused.prefill(
        engine.visual, engine.tokens[bucket], layout, engine.kv, context=ContextCache(entry, cfg.image_tokens)
    )
    every = torch.arange(cfg.expert.mlp_dim, dtype=torch.int32).expand(cfg.num_steps, cfg.expert.depth, -1)
    out = torch.empty(cfg.horizon, cfg.action_dim)
    fused.denoise(engine.noise, layout, engine.kv, out, action=ActionCache(every.contiguous(), anchors=1))
    assert rel_l2(out, dense) < 1e-5


def test_context_cache_recomputes_the_most_drifted_rows_ties_to_the_earlier(model) -> None:
    """Which visual rows the cached prefill recomputes. The reference is the live observation's own entry,
    except that rows S drifted (their FFN inputs moved) and the stored FFN outputs of S and of rows 0, 1
    are garbage. With keep = |S| + 2 the prefill recomputes S and, of the undrifted rows (all tied at
    drift 0), the two earliest: no garbage is read and the K/V are the dense ones. With keep = |S| + 1,
    row 1 copies its garbage (so the check can fail)."""
    cfg = model.cfg
    engine = create_engine("fused", model, "cpu", cache=CacheShapes())
    inputs, noise = random_inputs(cfg, valid_tokens=12, pad_to=20)
    entry, _ = _reference(engine, inputs, noise)
    bucket = engine.load_inputs(inputs, noise)
    engine.run_stage("vision", bucket)
    lp = cfg.image_tokens + bucket

    def prefill_kv(context: ContextCache | None = None) -> torch.Tensor:
        layout = engine.layout[bucket]
        engine.fused.prefill(engine.visual, engine.tokens[bucket], layout, engine.kv, context=context)
        return torch.cat([engine.kv.keys[-1][:, :lp], engine.kv.values[-1][:, :lp]])

    dense = prefill_kv()
    drifted = torch.tensor([5, 300, 301, 767])
    entry.ffn_in[:, drifted] += 1.0
    entry.ffn_out[:, drifted] = 1e3
    entry.ffn_out[:, :2] = 1e3
    assert rel_l2(prefill_kv(ContextCache(entry, len(drifted) + 2)), dense) < 1e-5
    assert rel_l2(prefill_kv(ContextCache(entry, len(drifted) + 1)), dense) > 1e-2


def test_a_camera_missing_from_the_call_never_takes_the_context_caches_budget(model) -> None:
    """The rows of a masked camera are attended by nothing, so recomputing them buys nothing. Found in
    review: they were ranked with the rest, and in the one-camera sim they took a median 233 of a layer's
    308 recomputed rows. Here camera 1 is missing and its rows drifted most (and hold garbage); the
    present rows S drifted less. With keep = |S| + 2 the prefill recomputes S and rows 0, 1, and the
    attended rows' K/V are the dense ones."""
    cfg, tpi = model.cfg, model.cfg.vision.tokens_per_image
    engine = create_engine("fused", model, "cpu", cache=CacheShapes())
    inputs, noise = random_inputs(cfg, valid_tokens=12, pad_to=20)
    inputs.image_masks[0, 1] = False
    entry, _ = _reference(engine, inputs, noise)
    bucket = engine.load_inputs(inputs, noise)
    engine.run_stage("vision", bucket)
    lp = cfg.image_tokens + bucket
    attended = engine.layout[bucket].key_bias[:lp] == 0
    assert not attended[tpi : 2 * tpi].any() and attended[:tpi].all()

    def prefill_kv(context: ContextCache | None = None) -> torch.Tensor:
        layout = engine.layout[bucket]
        engine.fused.prefill(engine.visual, engine.tokens[bucket], layout, engine.kv, context=context)
        return torch.cat([engine.kv.keys[-1][:, :lp][:, attended], engine.kv.values[-1][:, :lp][:, attended]])

    dense = prefill_kv()
    drifted = torch.tensor([5, 2 * tpi + 3, 3 * tpi - 1])
    entry.ffn_in[:, drifted] += 1.0
    entry.ffn_in[:, tpi : 2 * tpi] += 50.0  # the missing camera's rows: far more drift
    entry.ffn_out[:, drifted] = 1e3
    entry.ffn_out[:, :2] = 1e3
    entry.ffn_out[:, tpi : 2 * tpi] = 1e3
    assert rel_l2(prefill_kv(ContextCache(entry, len(drifted) + 2)), dense) < 1e-5
    assert rel_l2(prefill_kv(ContextCache(entry, len(drifted) + 1)), dense) > 1e-2


def test_rho_p_counts_the_rows_of_the_cameras_a_cell_has() -> None:
    """CacheShapes.cameras (the policy's cameras): ρp is a fraction of those slots' rows; keeping all of
    them is the dense prefill (ρp = 1 stays exact with slots unfilled); a count beyond the model's slots,
    or not an int, is refused."""
    cfg = tiny_model().cfg
    tpi = cfg.vision.tokens_per_image
    assert CacheShapes(rho_p=0.4).keep_tokens(cfg) == rho_count(0.4, cfg.image_tokens)
    assert CacheShapes(rho_p=0.4, cameras=1).keep_tokens(cfg) == rho_count(0.4, tpi) < tpi
    assert CacheShapes(rho_p=0.4, cameras=2).keep_tokens(cfg) == rho_count(0.4, 2 * tpi)
    assert CacheShapes(rho_p=1.0, cameras=1).keep_tokens(cfg) == cfg.image_tokens
    with pytest.raises(ValueError, match="cameras: the model has 3 image slots, got 4"):
        CacheShapes(cameras=4).keep_tokens(cfg)
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="cameras must be an int"):
            CacheShapes(cameras=bad)


def test_cached_call_differs_from_dense_only_by_the_approximation(model) -> None:
    """A similar observation served from a reference: finite, the right shape, close to dense."""
    cfg = model.cfg
    engine = create_engine("fused", model, "cpu", cache=CacheShapes())
    ref_inputs, noise = random_inputs(cfg, valid_tokens=12, pad_to=20)
    entry, masks = _reference(engine, ref_inputs, noise)
    live = random_inputs(cfg, valid_tokens=12, pad_to=20)[0]
    live.images.add_(0.02 * torch.randn_like(live.images)).clamp_(-1, 1)
    dense = _run(engine, live, noise, "dense", "dense")
    engine.load_reference(entry, masks)
    cached = _run(engine, live, noise, "cached", "cached")
    assert torch.isfinite(cached).all() and cached.shape == dense.shape
    assert not torch.equal(cached, dense)
    assert rel_l2(cached, dense) < 0.5


def test_cache_shapes_are_validated() -> None:
    with pytest.raises(ValueError, match="rho_p"):
        CacheShapes(rho_p=0.0)
    with pytest.raises(ValueError, match="rho_n"):
        CacheShapes(rho_n=1.5)
    with pytest.raises(ValueError, match="anchors"):
        CacheShapes(anchors=0)
    engine = create_engine("fused", tiny_model(), "cpu")
    with pytest.raises(RuntimeError, match="cache shapes"):
        engine.run_stage("prefill", 32, variant="cached")
    with pytest.raises(ValueError, match="stage 'rebuild' has no variant 'record'"):  # rebuild_step's job
        engine.run_stage("rebuild", 32, variant="record")


def test_kept_neuron_counts_suit_the_gathered_kernels() -> None:
    """At full width the Action Cache keeps whole 128-neuron blocks (other counts would leave the Triton
    kernels for PyTorch gathers), never fewer than ceil(ρn·F), and splits its down-projection into
    slices of whole blocks, none empty, about as many as the dense one has (8) whenever there are blocks
    enough, odd block counts included; narrow test models keep exactly ceil(ρn·F)."""
    from rmuscle_ros.engine.fused import gather_splits, keep_neuron_count, rho_count

    for f in (4096, 24576):  # pi05, pi05-7b
        for rho in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9, 1.0):
            n = keep_neuron_count(rho, f)
            assert n % 128 == 0 and rho_count(rho, f) <= n <= f
            blocks, splits = n // 128, gather_splits(n)
            per_slice = -(-blocks // splits)
            assert blocks >= 2 * splits and (splits - 1) * per_slice < blocks  # ≥ 2 blocks each, none empty
            assert splits >= min(8, blocks // 2) - 1  # 20 blocks: 7 slices of 3 (the last 2)
    assert keep_neuron_count(0.5, 4096) == 2048 and gather_splits(2048) == 8
    assert keep_neuron_count(0.7, 4096) == 2944 and gather_splits(2944) == 8  # 23 blocks: 3 per slice, 2 last
    assert keep_neuron_count(0.3, 128) == rho_count(0.3, 128) == 39


def test_the_match_stage_loads_the_most_similar_usable_entry(model) -> None:
    """On-device matching: the match stage runs vision, picks the usable window entry whose key is most
    similar to the call's descriptor, makes it the cached graphs' reference (read in place) and loads its
    masks, and reports (index, similarity); the cached tail then gives what loading that entry by hand
    gives, by copy (`load_reference`) or in place (`load_window_entry`)."""
    engine = create_engine("fused", model, "cpu", cache=CacheShapes(window=3))
    window = engine.window
    inputs, noise = random_inputs(model.cfg, valid_tokens=15, pad_to=20)
    refs = [random_inputs(model.cfg, valid_tokens=9, pad_to=20, seed=s) for s in (4, 5, 6)]
    for i, (ref_inputs, ref_noise) in enumerate(refs):
        entry, masks = _reference(engine, ref_inputs, ref_noise)
        window.ref(i).copy_(entry)
        window.neurons[i].copy_(masks)
    bucket = engine.load_inputs(inputs, noise)
    engine.run_stage("vision", bucket)
    d = engine.descriptor().flatten()
    unit = d / d.norm()
    window.keys[0] = -unit  # least similar
    window.keys[1] = unit  # most similar, but not usable below
    window.keys[2] = (unit + 0.1 * torch.randn_like(unit)) / (unit + 0.1 * torch.randn_like(unit)).norm()
    # the last pick is not entry 0 (found by mutation testing: a cached prefill reading entry 0 whatever
    # was picked passed, the loop ending on a pick of 0)
    for usable, want in (([True, True, True], 1), ([True, False, False], 0), ([True, False, True], 2)):
        bucket = engine.load_inputs(inputs, noise, usable)
        engine.run_stage("match", bucket, variant="cached")
        index, similarity = int(engine.match_host[0]), float(engine.match_host[1])
        assert index == want
        assert similarity == pytest.approx(float(window.keys[want] @ unit), abs=1e-5)
        assert int(engine.ref_slot) == want, "the cached prefill reads the picked entry in place"
        assert torch.equal(engine.neurons, window.neurons[want])
        assert torch.equal(engine.descriptor_host, engine.descriptor())
    engine.run_stage("tail", bucket, variant="cached")
    by_match = engine.actions.clone()
    engine.load_reference(window.ref(2), window.neurons[2])
    assert torch.equal(_run(engine, inputs, noise, "cached", "cached"), by_match)
    engine.load_window_entry(0)  # another entry, then the picked one again: in place, no copy
    assert not torch.equal(_run(engine, inputs, noise, "cached", "cached"), by_match)
    engine.load_window_entry(2)
    assert torch.equal(_run(engine, inputs, noise, "cached", "cached"), by_match)
    # With every entry's masks alike, the entries differ by their references alone: each is read where it
    # lies (found by mutation testing: a prefill reading entry 0 whatever was loaded passed, the masks
    # making the results differ all the same)
    for i in range(3):
        window.neurons[i].copy_(window.neurons[2])
    results = []
    for i in range(3):
        engine.load_window_entry(i)
        results.append(_run(engine, inputs, noise, "cached", "cached"))
    assert torch.equal(results[2], by_match)
    assert not torch.equal(results[0], results[2]) and not torch.equal(results[1], results[2])
    with pytest.raises(IndexError, match="window entry 3 of 3"):
        engine.load_window_entry(3)
    with pytest.raises(ValueError, match="each of the window's entries"):
        engine.load_inputs(inputs, noise, [True])


def test_recorded_masks_rank_neurons_by_their_score_times_their_down_projections_norm(model) -> None:
    """Found by mutation testing: masks ranked on the scores alone (without ‖W_down[:, j]‖, the size of a
    neuron's contribution to the output) passed. Neurons whose down-projection norm dwarfs every other's
    are the ones recorded, in every step and layer the Action Cache serves."""
    engine = create_engine("fused", model, "cpu", cache=CacheShapes(rho_p=1.0, rho_n=0.5))
    norms = engine.fused.down_norms
    count = engine.recorded_masks.shape[-1]
    gen = torch.Generator().manual_seed(3)
    chosen = [
        torch.randperm(norms.shape[-1], generator=gen)[:count].sort().values for _ in range(norms.shape[0])
    ]
    norms.fill_(1.0)
    for layer, neurons in enumerate(chosen):
        norms[layer, neurons] = 1e6
    _run(engine, *random_inputs(model.cfg, valid_tokens=9, pad_to=20, seed=4), "dense", "record")
    masks = engine.recorded_masks[engine.cache.anchors :]  # (steps after the anchor, depth, count)
    for layer, neurons in enumerate(chosen):
        assert all(torch.equal(masks[s, layer].long(), neurons) for s in range(masks.shape[0])), layer


def test_step_schedules_keep_rho_n_of_the_neurons_on_average() -> None:
    """Per denoising step, how many expert neurons the Action Cache updates. Uniform: ρn in every step after
    the anchor (the published method). Ramp: a linear rise to every neuron in the last step, ρn on average
    (the same weights read per call), in whole 128-neuron blocks at full width; steps may keep none (the
    anchor's FFN output is reused) or all (the step runs dense)."""
    from rmuscle_ros.engine.fused import keep_neuron_count, step_neuron_counts

    assert step_neuron_counts(0.5, 4096, 10, 1, "uniform") == (4096,) + (2048,) * 9
    assert step_neuron_counts(0.4, 128, 10, 2, "uniform") == (128, 128) + (keep_neuron_count(0.4, 128),) * 8
    ramp = step_neuron_counts(0.5, 4096, 10, 1, "ramp")
    assert ramp == (4096, 0, 512, 1024, 1536, 2048, 2560, 3072, 3584, 4096)
    for f in (128, 1024, 4096, 24576):  # tiny, small, pi05, pi05-7b
        for rho in (0.3, 0.4, 0.5, 0.6, 0.8, 1.0):
            counts = step_neuron_counts(rho, f, 10, 1, "ramp")
            later = counts[1:]
            assert counts[0] == f and list(later) == sorted(later) and later[0] >= 0 and later[-1] <= f
            assert abs(sum(later) / (9 * f) - rho) <= (1 / 32 if f >= 1024 else 1 / f), (f, rho, counts)
            if f >= 1024:
                assert all(c % 128 == 0 for c in counts)
    assert step_neuron_counts(0.3, 4096, 10, 1, "ramp")[-1] == 2432  # 0.6 of F, nearest block: 19
    assert step_neuron_counts(0.75, 4096, 10, 1, "ramp")[1] == 2048  # 0.5 → 1
    assert step_neuron_counts(1.0, 4096, 10, 1, "ramp") == (4096,) * 10
    assert step_neuron_counts(0.5, 4096, 2, 1, "ramp") == (4096, 2048)  # one later step: ρn itself
    with pytest.raises(ValueError, match="neuron_schedule"):
        CacheShapes(neuron_schedule="cosine")
    assert not CacheShapes(rho_n=1.0, neuron_schedule="ramp").action_cache(tiny_model().cfg)


def test_a_ramp_records_each_steps_own_count_of_neurons(model) -> None:
    """A step that keeps c neurons records the c largest contribution scores of that step, sorted: the
    same c a uniform schedule keeping c records for it (the scores do not depend on the schedule)."""
    cfg = model.cfg
    f = cfg.expert.mlp_dim
    inputs, noise = random_inputs(cfg, valid_tokens=15, pad_to=20)
    ramp = create_engine("fused", model, "cpu", cache=CacheShapes(neuron_schedule="ramp"))
    counts = ramp.step_neurons
    assert counts == (f, 0, 16, 32, 48, 64, 80, 96, 112, 128)  # tiny: 128 neurons, to the nearest one
    assert ramp.keep_neurons == 112 and ramp.action_cache
    _run(ramp, inputs, noise, "dense", "record")
    for s, c in enumerate(counts):
        if 0 < c < f:
            row = ramp.recorded_masks[s, :, :c]
            assert (row[..., 1:] > row[..., :-1]).all() and int(row.min()) >= 0 and int(row.max()) < f
    for rho, step in ((0.5, 5), (0.25, 3)):  # uniform keeps 64 and 32: the ramp's steps 5 and 3
        uniform = create_engine("fused", model, "cpu", cache=CacheShapes(rho_n=rho))
        _run(uniform, inputs, noise, "dense", "record")
        c = counts[step]
        assert uniform.keep_neurons == c
        assert torch.equal(ramp.recorded_masks[step, :, :c], uniform.recorded_masks[step])


@torch.no_grad()
def _action_cache_reference(model, inputs, noise, neurons, counts, anchors: int) -> torch.Tensor:
    """DESIGN §4's Action Cache in plain torch on the model's own modules, the prefill dense: steps before
    `anchors` run dense, the last one's GeGLU activations and FFN output kept; a later step s with
    counts[s] < F recomputes only neurons[s, i, :counts[s]] of layer i and adds W_down[:, S] (a_s[S] −
    a_anchor[S]) onto the anchor's FFN output (0 neurons: the anchor's output as it is); F runs dense."""
    from rmuscle_ros.models.pi05 import euler_times, gated_residual, gelu_tanh, masked_attention

    cfg = model.cfg
    prefix = model.prefill(*model.embed_prefix(inputs))
    x_t, act, out = noise.float(), {}, {}
    for s, t in enumerate(euler_times(cfg.num_steps)):
        cond = model.time_conditioning(torch.full((1,), t))
        x = model.action_in_proj(x_t)
        horizon = x.shape[1]
        positions = prefix.valid_len[:, None] + torch.arange(horizon)
        mask = torch.cat([prefix.pad_mask, prefix.pad_mask.new_ones(1, horizon)], 1)[:, None, :]
        mask = mask.expand(1, horizon, -1)
        layers = zip(model.expert.layers, prefix.keys, prefix.values, strict=True)
        for i, (layer, k_prefix, v_prefix) in enumerate(layers):
            q, k, v, gate = layer.attention_inputs(x, positions, cond)
            k, v = torch.cat([k_prefix, k], 2), torch.cat([v_prefix, v], 2)
            x = gated_residual(x, layer.self_attn.o_proj(masked_attention(q, k, v, mask)), gate)
            h, gate = layer.post_attention_layernorm(x, cond)
            mlp = layer.mlp
            if s < anchors or counts[s] == cfg.expert.mlp_dim:
                a = gelu_tanh(mlp.gate_proj(h)) * mlp.up_proj(h)
                y = mlp.down_proj(a)
                if s < anchors:
                    act[i], out[i] = a, y
            else:
                chosen = neurons[s, i, : counts[s]].long()
                a = gelu_tanh(h @ mlp.gate_proj.weight[chosen].T) * (h @ mlp.up_proj.weight[chosen].T)
                y = out[i] + (a - act[i][..., chosen]) @ mlp.down_proj.weight[:, chosen].T
            x = gated_residual(x, y, gate)
        x, _ = model.expert.norm(x, cond)
        x_t = x_t - model.action_out_proj(x).float() / cfg.num_steps
    return x_t[0]


@pytest.mark.parametrize(("schedule", "anchors"), [("ramp", 1), ("ramp", 2), ("uniform", 1)])
def test_the_action_cache_is_its_design_computed_plainly(model, schedule: str, anchors: int) -> None:
    """The cached denoise against a plain-torch reference of DESIGN §4's Action Cache (the prefill dense, to
    see the Action Cache alone), with the reference's recorded masks. Found in review: the ramp's step of 0
    neurons (the first after the anchor, the default schedule) dropped each layer's FFN output instead of
    reusing the anchor's (0.022 from this reference then)."""
    cfg = model.cfg
    engine = create_engine(
        "fused", model, "cpu", cache=CacheShapes(rho_n=0.5, neuron_schedule=schedule, anchors=anchors)
    )
    assert schedule != "ramp" or 0 in engine.step_neurons  # the step this test is about
    entry, masks = _reference(engine, *random_inputs(cfg, valid_tokens=9, pad_to=20, seed=4))
    engine.load_reference(entry, masks)
    inputs, noise = random_inputs(cfg, valid_tokens=15, pad_to=20, seed=5)
    cached = _run(engine, inputs, noise, "dense", "cached")
    reference = _action_cache_reference(model, inputs, noise, masks, engine.step_neurons, anchors)
    assert rel_l2(cached, reference) < 1e-5, rel_l2(cached, reference)
    assert rel_l2(cached, _run(engine, inputs, noise, "dense", "dense")) > 1e-3  # an approximation, served


def test_a_ramp_that_keeps_every_neuron_is_dense_bit_for_bit(model) -> None:
    """Through the Action Cache's code path: steps that keep all neurons run the dense FFN, so a schedule of
    only those gives the dense actions exactly; a served ramp call is close to dense, not equal."""
    cfg = model.cfg
    f = cfg.expert.mlp_dim
    engine = create_engine("fused", model, "cpu", cache=CacheShapes(neuron_schedule="ramp"))
    inputs, noise = random_inputs(cfg, valid_tokens=12, pad_to=20)
    dense = _run(engine, inputs, noise, "dense", "dense")
    bucket = engine.load_inputs(inputs, noise)
    engine.run_stage("vision", bucket)
    engine.run_stage("prefill", bucket)
    every = ActionCache(engine.neurons, anchors=1, counts=(f,) * cfg.num_steps)
    out = torch.empty(cfg.horizon, cfg.action_dim)
    engine.fused.denoise(engine.noise, engine.layout[bucket], engine.kv, out, action=every)
    assert torch.equal(out, dense)

    entry, masks = _reference(engine, *random_inputs(cfg, valid_tokens=12, pad_to=20, seed=3))
    engine.load_reference(entry, masks)
    cached = _run(engine, inputs, noise, "cached", "cached")
    assert torch.isfinite(cached).all() and not torch.equal(cached, dense)
    assert rel_l2(cached, dense) < 0.5


@pytest.mark.parametrize("anchors", [1, 2])
def test_masks_are_ranked_against_the_anchor_a_cached_call_adds_onto(model, monkeypatch, anchors) -> None:
    """A cached step adds its selected neurons' change onto the last anchor step's activations, so a
    recording ranks each later step's neurons by their change since that anchor: with 2 anchors, step 1's
    activations, not step 0's (found in review: masks were ranked against step 0 whatever the anchors)."""
    engine = create_engine("fused", model, "cpu", cache=CacheShapes(rho_n=0.5, anchors=anchors))
    ops = engine.fused.ops
    activations: list[
        torch.Tensor
    ] = []  # every linear_geglu output, in call order (step by step, layer by layer)
    scored: list[torch.Tensor] = []  # the anchor each neuron_scores call ranks against
    real_geglu, real_scores = ops.linear_geglu, ops.neuron_scores

    def geglu(x, w, out, **kw):
        result = real_geglu(x, w, out, **kw)
        activations.append(out.clone())
        return result

    def scores(act, anchor, out):
        scored.append(anchor.clone())
        return real_scores(act, anchor, out)

    monkeypatch.setattr(ops, "linear_geglu", geglu)
    monkeypatch.setattr(ops, "neuron_scores", scores)
    bucket = engine.load_inputs(*random_inputs(model.cfg, valid_tokens=15, pad_to=20))
    engine.run_stage("vision", bucket)
    engine.run_stage("prefill", bucket)
    activations.clear()  # the prefill's FFNs: not the expert's
    engine.run_stage("denoise", bucket, variant="record")
    depth, steps = model.cfg.expert.depth, model.cfg.num_steps
    assert len(activations) == steps * depth and len(scored) == (steps - anchors) * depth
    last_anchor = activations[(anchors - 1) * depth : anchors * depth]
    for k, anchor in enumerate(scored):
        assert torch.equal(anchor, last_anchor[k % depth]), f"scoring call {k} ranked against another step"


@torch.no_grad()
def _first_ffn_inputs(model, inputs) -> torch.Tensor:
    """The first prefix layer's FFN input, norm(res) · (1 + w), from the model's own modules: (Lp, W)."""
    from rmuscle_ros.models.pi05 import gated_residual, masked_attention

    embs, pad = model.embed_prefix(inputs)
    positions, mask = pad.cumsum(-1) - 1, pad[:, None, :] & pad[:, :, None]
    layer = model.llm.layers[0]
    q, k, v, gate = layer.attention_inputs(embs.float(), positions, None)
    x = gated_residual(embs.float(), layer.self_attn.o_proj(masked_attention(q, k, v, mask)), gate)
    return layer.post_attention_layernorm(x)[0][0]


def test_the_context_cache_ranks_the_drift_of_the_ffn_input_itself() -> None:
    """DESIGN §4: the visual tokens whose FFN input drifted most are recomputed. The engine's normalised rows
    lack the pre-FFN norm's (1 + w) (folded into the FFN's weights); found in review, it ranked them
    unscaled, which with uneven norm weights (a trained Gemma's) picks other tokens. The first layer's choice
    (its residual is the dense one's) against the top ρp of the FFN inputs' drift computed plainly."""
    model = tiny_model(seed=11)
    with torch.no_grad():  # uneven, and each layer's its own (a wrong layer's scale would pick others)
        for n, layer in enumerate(model.llm.layers):
            gen = torch.Generator().manual_seed(1 + n)
            layer.post_attention_layernorm.weight.normal_(0.0, 2.0, generator=gen)
    cfg, nv = model.cfg, model.cfg.image_tokens
    engine = create_engine("fused", model, "cpu", cache=CacheShapes(rho_p=0.4, rho_n=1.0))
    reference = random_inputs(cfg, valid_tokens=9, pad_to=20, seed=4)
    entry, masks = _reference(engine, *reference)
    engine.load_reference(entry, masks)
    live, noise = random_inputs(cfg, valid_tokens=15, pad_to=20, seed=5)
    ops, chosen = engine.fused.ops, []

    def select(drift, keep, num_rows, rows_out, inv_out, key_bias):
        ops.context_select(drift, keep, num_rows, rows_out, inv_out, key_bias)
        chosen.append(set(rows_out[:keep].tolist()))

    engine.fused.ops = SimpleNamespace(**{n: getattr(ops, n) for n in dir(ops) if not n.startswith("__")})
    engine.fused.ops.context_select = select
    try:
        _run(engine, live, noise, "cached", "dense")
    finally:
        engine.fused.ops = ops
    h_live, h_ref = _first_ffn_inputs(model, live)[:nv], _first_ffn_inputs(model, reference[0])[:nv]
    drift = (h_live - h_ref).pow(2).sum(-1)
    want = set(torch.topk(drift, engine.keep_tokens).indices.tolist())
    assert len(chosen[0] & want) >= 0.99 * len(want), len(chosen[0] & want) / len(want)
    # the ranking without the scale, for contrast: it picks other tokens
    scale = 1.0 + model.llm.layers[0].post_attention_layernorm.weight
    unscaled = ((h_live - h_ref) / scale).pow(2).sum(-1)
    other = set(torch.topk(unscaled, engine.keep_tokens).indices.tolist())
    assert len(other & want) < 0.95 * len(want)
