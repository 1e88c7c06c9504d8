"""Backend selection: one dispatch table, lazy imports, loud failures on the wrong hardware."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import random_inputs, tiny_model

from rmuscle_ros.engine import BACKENDS, create_engine


def test_unknown_backend_lists_the_choices(tiny) -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown backend 'openvino'.*\['eager', 'fused', 'graph', 'onnxruntime', 'tensorrt'\]",
    ):
        create_engine("openvino", tiny, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_graph_backend_refuses_a_cpu_device(tiny) -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        create_engine("graph", tiny, "cpu")


def test_the_overlapped_first_step_is_a_cuda_graph_feature(tiny) -> None:
    """Without CUDA graphs the tail runs serially, and asking for the overlap there says why it cannot."""
    assert create_engine("fused", tiny, "cpu").overlap_first_step is False
    with pytest.raises(ValueError, match="overlap_first_step needs the CUDA graph engine"):
        create_engine("fused", tiny, "cpu", overlap_first_step=True)


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
    assert set(BACKENDS) == {"eager", "fused", "graph", "onnxruntime", "tensorrt"}


def test_fused_engine_rejects_mis_shaped_inputs_by_name(tiny) -> None:
    """The static-buffer engines name the input that does not fit, and the next good call still runs."""
    engine = create_engine("fused", tiny, "cpu")
    inputs, noise = random_inputs(tiny.cfg, valid_tokens=9, pad_to=12)
    expected = engine.sample_actions(inputs, noise)
    with pytest.raises(ValueError, match=r"noise must be \(1, 50, 32\)"):
        engine.sample_actions(inputs, noise[:, :10])
    bad_masks = type(inputs)(inputs.images, inputs.image_masks[:, :2], inputs.tokens, inputs.token_mask)
    with pytest.raises(ValueError, match=r"image_masks must be \(1, 3\)"):
        engine.sample_actions(bad_masks, noise)
    with pytest.raises(ValueError, match="images must be"):
        small = inputs.images[:, :, :, :100]
        engine.sample_actions(
            type(inputs)(small, inputs.image_masks, inputs.tokens, inputs.token_mask), noise
        )
    assert torch.equal(engine.sample_actions(inputs, noise), expected)
    # Found in review: each of these ran, or failed after vision had already run on the new images.
    images_before = engine.live.images.clone()
    two = type(inputs)(
        inputs.images.expand(2, -1, -1, -1, -1), inputs.image_masks, inputs.tokens, inputs.token_mask
    )
    for bad, says in (
        (two, r"one observation per call, got batches \{'images': 2"),  # extra rows were dropped
        (
            type(inputs)(inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask[:, :8]),
            "token_mask",
        ),
        (
            type(inputs)(inputs.images, inputs.image_masks, inputs.tokens.float(), inputs.token_mask),
            "integer ids",
        ),
        (
            type(inputs)(inputs.images, inputs.image_masks, inputs.tokens - 10_000, inputs.token_mask),
            "ids must be",
        ),
    ):
        with pytest.raises(ValueError, match=says):
            engine.sample_actions(bad, noise)
    with pytest.raises(ValueError, match="a live call needs its noise"):  # it reused the last call's noise
        engine.sample_actions(inputs, None)
    assert torch.equal(engine.live.images, images_before), "a refused call changes nothing"
    assert torch.equal(engine.sample_actions(inputs, noise), expected)


def test_a_prompt_longer_than_the_model_takes_is_refused_though_a_bucket_holds_it(tiny) -> None:
    """The top bucket is max_token_len rounded up to 16: 201-208 tokens of 200 fitted it and ran past the
    RoPE tables (an IndexError on the CPU; on a GPU a device-side assert, fatal to the process)."""
    engine = create_engine("fused", tiny, "cpu")
    top = tiny.cfg.max_token_len
    assert engine.buckets[-1] > top
    inputs, noise = random_inputs(tiny.cfg, valid_tokens=top + 1, pad_to=engine.buckets[-1])
    with pytest.raises(ValueError, match=f"prompt has {top + 1} tokens, more than the model's {top}"):
        engine.sample_actions(inputs, noise)


def test_eager_engine_refuses_noise_of_another_horizon(tiny) -> None:
    """It returned as many rows as the noise had (10 of 50) where the other engines refuse it."""
    inputs, noise = random_inputs(tiny.cfg)
    with pytest.raises(ValueError, match=r"noise must be \(1, 50, 32\)"):
        create_engine("eager", tiny, "cpu").sample_actions(inputs, noise[:, :10])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_a_cuda_device_without_a_gpu_is_named(tiny, backend: str) -> None:
    with pytest.raises(RuntimeError, match="no CUDA GPU here"):
        create_engine(backend, tiny, "cuda")


def test_fused_engine_prompt_layout_follows_each_call(tiny) -> None:
    """Inputs pass through reused staging buffers: a call after others (other prompt lengths, another
    bucket, a missing camera) gives what a fresh engine gives."""
    engine, fresh = create_engine("fused", tiny, "cpu"), create_engine("fused", tiny, "cpu")
    calls = [random_inputs(tiny.cfg, valid_tokens=n, pad_to=n + 3, seed=n) for n in (40, 9, 25)]
    calls[1][0].image_masks[0, 0] = False
    for inputs, noise in calls:
        engine.sample_actions(inputs, noise)
    inputs, noise = calls[1]
    assert torch.equal(engine.sample_actions(inputs, noise), fresh.sample_actions(inputs, noise))


def test_fused_engine_loads_in_two_halves_like_in_one(tiny) -> None:
    """begin_load + finish_load (the prompt packed while vision runs) loads what load_inputs does; the
    second half without the first is refused, and a refused begin_load leaves nothing half-loaded."""
    engine = create_engine("fused", tiny, "cpu")
    inputs, noise = random_inputs(tiny.cfg, valid_tokens=9, pad_to=12)
    engine.load_inputs(inputs, noise)
    whole = engine.live.staging.device.clone()
    engine.live.staging.device.zero_()
    engine.begin_load(inputs, noise)
    engine.finish_load()
    assert torch.equal(engine.live.staging.device, whole)
    with pytest.raises(RuntimeError, match="finish_load without begin_load"):
        engine.finish_load()
    with pytest.raises(ValueError, match="usable must flag each of the window's entries"):
        engine.begin_load(inputs, noise, usable=[True])  # no window on this engine
    with pytest.raises(RuntimeError, match="finish_load without begin_load"):
        engine.finish_load()


def test_a_prompt_longer_than_every_bucket_is_refused_before_anything_is_queued(tiny) -> None:
    """Too many valid prompt tokens for every bucket is a ValueError naming the count, raised before the
    images' copy (the live images untouched); a prompt row padded beyond the buckets loads."""
    engine = create_engine("fused", tiny, "cpu", buckets=[16])
    images_before = engine.live.images.clone()
    inputs, noise = random_inputs(tiny.cfg, valid_tokens=20, pad_to=24)
    with pytest.raises(ValueError, match="prompt has 20 tokens, more than the largest bucket 16"):
        engine.begin_load(inputs, noise)
    assert torch.equal(engine.live.images, images_before) and engine.live.pending is None
    inputs, noise = random_inputs(tiny.cfg, valid_tokens=15, pad_to=24)
    assert engine.begin_load(inputs, noise) == 16
    engine.finish_load()
    assert torch.equal(engine.live.images, inputs.images[0])


def test_engine_without_a_cache_has_no_retrieval_descriptor(tiny) -> None:
    engine = create_engine("fused", tiny, "cpu")
    with pytest.raises(RuntimeError, match="cache shapes"):
        engine.descriptor()
