"""Policy: camera images + joint state + prompt in, an action chunk in robot units out."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from rmuscle_ros.demo import load_demo_config, main
from rmuscle_ros.runtime.policy import Observation, Policy, PolicyConfig, host_threads, synthetic_observation

CAMERAS = ("cam_high", "cam_left_wrist", "cam_right_wrist")


@pytest.fixture(scope="module")
def policy() -> Policy:
    return Policy(PolicyConfig(cameras=CAMERAS))


def test_chunk_from_aloha_sized_images(policy: Policy) -> None:
    obs = synthetic_observation(policy.cfg, "pick up the cube", seed=1)
    obs = Observation(obs.images, obs.state, obs.prompt, stamp_ns=123)
    chunk = policy.infer(obs)
    assert chunk.actions.shape == (50, 14) and chunk.actions.dtype == np.float32
    assert np.isfinite(chunk.actions).all()
    assert chunk.stamp_ns == 123 and chunk.latency_s > 0 and not chunk.prompt_truncated


def test_same_noise_same_chunk(policy: Policy) -> None:
    obs = synthetic_observation(policy.cfg, "stack the blocks", seed=2)
    noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(0))
    assert np.array_equal(policy.infer(obs, noise).actions, policy.infer(obs, noise).actions)


def test_missing_camera_is_masked_not_an_error(policy: Policy) -> None:
    obs = synthetic_observation(policy.cfg, "x", cameras=("cam_high", "cam_left_wrist"))
    assert policy.infer(obs).actions.shape == (50, 14)


def test_reused_image_buffer_carries_nothing_over(policy: Policy) -> None:
    """preprocess writes into the policy's (reused) image buffer: a camera missing from this observation is
    black, whatever the previous observation showed in its slot, and a rejected observation leaves the
    next one unaffected."""
    full = synthetic_observation(policy.cfg, "x", seed=3)
    policy.preprocess(full)
    bad = {**full.images, "cam_right_wrist": full.images["cam_right_wrist"].astype(np.float32)}
    with pytest.raises(ValueError, match=r"cam_right_wrist.*uint8"):  # after the first two slots were written
        policy.preprocess(Observation(bad, full.state, "x"))
    partial = synthetic_observation(policy.cfg, "x", seed=4, cameras=("cam_high",))
    inputs, _, _ = policy.preprocess(partial)
    fresh = Policy(PolicyConfig(cameras=CAMERAS)).preprocess(partial)[0]
    assert torch.equal(inputs.images, fresh.images) and (inputs.images[0, 1:] == -1.0).all()
    assert inputs.image_masks.tolist() == [[True, False, False]]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda o: Observation(
                {**o.images, "cam_high": o.images["cam_high"].astype(np.float32)}, o.state, o.prompt
            ),
            "cam_high.*uint8",
        ),
        (
            lambda o: Observation({**o.images, "cam_low": o.images["cam_high"]}, o.state, o.prompt),
            "unknown camera.*cam_low",
        ),
        (lambda o: Observation({}, o.state, o.prompt), "no camera image"),
        (lambda o: Observation(o.images, o.state[:7], o.prompt), r"state must have shape \(14,\)"),
        (  # found by a mutation review: 14 values in the wrong shape reached the prompt's builder
            lambda o: Observation(o.images, o.state.reshape(2, 7), o.prompt),
            r"state must have shape \(14,\), got \(2, 7\)",
        ),
        (lambda o: Observation(o.images, np.full(14, np.nan, np.float32), o.prompt), "NaN"),
        # found in review: a raw AttributeError / UnicodeEncodeError, or a silent cast
        (lambda o: Observation(o.images, o.state, None), "prompt must be text \\(str\\), got NoneType"),
        (lambda o: Observation(o.images, o.state, b"pick"), "prompt must be text \\(str\\), got bytes"),
        (lambda o: Observation(o.images, o.state, "pick \ud800"), "prompt is not valid text: surrogates"),
        (lambda o: Observation(o.images, o.state, " _ "), "prompt ' _ ' is blank once cleaned"),
        (
            lambda o: Observation(o.images, o.state.astype(np.complex64), o.prompt),
            "state must be real numbers",
        ),
        (lambda o: Observation(o.images, o.state > 0, o.prompt), "state must be real numbers .* dtype bool"),
        (lambda o: Observation(o.images, o.state.astype(str), o.prompt), "state must be real numbers"),
        (  # found in review: called "NaN or Inf", with numpy's overflow warning
            lambda o: Observation(o.images, np.r_[o.state[:13].astype(np.float64), 1e300], o.prompt),
            r"state has values beyond float32's range \(±3\.4e38\): \[.*1e\+300\]",
        ),
        (
            lambda o: Observation(o.images, np.r_[o.state[:13], 3e38].astype(np.float32), o.prompt),
            r"state dimension\(s\) \[13\] \(in the model's convention\) \[3\.0.*e\+38\] normalise past float32's",
        ),
    ],
)
def test_bad_observations_are_rejected_clearly(policy: Policy, edit, message: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clear error, not a numpy warning beside it
        with pytest.raises(ValueError, match=message):
            policy.infer(edit(synthetic_observation(policy.cfg, "x")))


def test_a_callers_noise_is_checked_and_warm_up_leaves_the_seeded_stream_alone(policy: Policy) -> None:
    """Found in review: integer noise ran truncated (the chunk up to 2.45 off), noise without its batch axis
    was refused as a batch mismatch, and the warm-up drew from the policy's noise stream, so with warm-up
    on a seed no longer gave the same chunks."""
    obs = synthetic_observation(policy.cfg, "x")
    horizon, dim = policy.model_cfg.horizon, policy.model_cfg.action_dim
    for noise, says in (
        (torch.ones(1, horizon, dim, dtype=torch.int64), "noise must be a floating-point torch.Tensor"),
        (np.ones((1, horizon, dim)), "noise must be a floating-point torch.Tensor .* got ndarray"),
        (torch.ones(horizon, dim), r"noise must be \(1, .*\) \(batch, horizon, action_dim\), got \("),
    ):
        with pytest.raises(ValueError, match=says):
            policy.infer(obs, noise=noise)  # type: ignore[arg-type]
    cold, warm = Policy(PolicyConfig(cameras=CAMERAS)), Policy(PolicyConfig(cameras=CAMERAS))
    warm.warmup()
    assert np.array_equal(cold.infer(obs).actions, warm.infer(obs).actions)


def test_a_closed_policy_refuses_calls() -> None:
    """After close (its episode recorded, its library given up) a call raises: before (found in review) it
    ran dense and unrecorded without a word."""
    from rmuscle_ros.cache.runtime import RMuscleConfig

    policy = Policy(PolicyConfig(backend="fused", cameras=CAMERAS), RMuscleConfig())
    obs = synthetic_observation(policy.cfg, "x")
    policy.infer(obs)
    policy.close()
    for call in (lambda: policy.infer(obs), policy.reset_episode):
        with pytest.raises(RuntimeError, match=r"the policy is closed \(Policy.close\)"):
            call()


class _Probe:
    """Stands for the GPU tensor `Policy.device_fault` runs its kernels on: each check raises the next
    error of `errors` (None: the kernels run and read back 2.0)."""

    def __init__(self, *errors: Exception | None) -> None:
        self.errors = list(errors)

    def fill_(self, value: float) -> _Probe:
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        return self

    def add_(self, value: float) -> _Probe:
        return self

    def item(self) -> float:
        return 2.0


def test_only_an_error_the_gpu_check_meets_twice_is_a_lost_context(policy: Policy, monkeypatch) -> None:
    """A lost CUDA context fails every later CUDA call; an error left over from other work is raised once,
    then cleared. So `device_fault` checks twice, and only an error in both is a lost GPU (the node ends
    its process on it): a transient one must not end a working cell. It names the first error, in one
    line; an out-of-memory error is no lost context."""
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be")
    monkeypatch.setattr(policy, "_device_probe", _Probe(RuntimeError("CUDA error: launch failure"), None))
    assert policy.device_fault(wait_all=False) is None
    monkeypatch.setattr(policy, "_device_probe", _Probe(sticky, RuntimeError("CUDA error: again")))
    assert (
        policy.device_fault(wait_all=False)
        == "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    monkeypatch.setattr(policy, "_device_probe", _Probe(torch.OutOfMemoryError("CUDA out of memory")))
    assert policy.device_fault(wait_all=False) is None
    monkeypatch.setattr(policy, "_device_probe", None)  # a CPU policy has none: nothing to lose
    assert policy.device_fault() is None


def test_read_only_model_sized_frames_take_no_copy_warning(policy: Policy) -> None:
    obs = synthetic_observation(policy.cfg, "x", size=(224, 224))
    for image in obs.images.values():
        image.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy.infer(obs)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("preset", "pi0"),
        ("backend", "openvino"),
        ("dtype", "float16"),
        ("state_dim", 40),
        ("cameras", ("a", "a")),
        # found by a mutation review: a bad device raised a bare RuntimeError from Policy, no cameras ran
        # until the first call refused every observation
        ("device", "gpu"),
        ("cameras", ()),
    ],
)
def test_invalid_config_names_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**{field: value})


def test_norm_stats_are_applied_to_the_output(tmp_path: Path) -> None:
    """Actions come back in robot units: with q01 = 0, q99 = 2 every action moves up by exactly 1."""
    stats = tmp_path / "policy_preprocessor_step_3_normalizer_processor.safetensors"
    ones = np.ones(14, np.float32)
    save_file(
        {
            "observation.state.q01": -ones,
            "observation.state.q99": ones,
            "action.q01": 0 * ones,
            "action.q99": 2 * ones,
        },
        str(stats),
    )
    plain = Policy(PolicyConfig(cameras=CAMERAS))
    scaled = Policy(PolicyConfig(cameras=CAMERAS, norm_stats=str(stats)))
    obs = synthetic_observation(plain.cfg, "x")
    noise = torch.randn(1, 50, 32)
    np.testing.assert_allclose(
        scaled.infer(obs, noise).actions, plain.infer(obs, noise).actions + 1, atol=1e-5
    )


def test_synthetic_demo_runs_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--synthetic", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    assert "action chunk 50 x 14" in out and "median" in out


def test_demo_config_rejects_unknown_keys(tmp_path: Path) -> None:
    bad = tmp_path / "demo.yaml"
    bad.write_text("preset: tiny\nbakend: eager\n")
    with pytest.raises(ValueError, match="bakend"):
        load_demo_config(bad)
    zero = tmp_path / "zero.yaml"
    zero.write_text("preset: tiny\ncalls: 0\n")  # crashed the run after its first call (found in review)
    with pytest.raises(SystemExit) as exit_:
        main(["--synthetic", "--config", str(zero)])
    assert exit_.value.code == 2


def test_the_demos_files_are_found_in_a_source_checkout_and_after_a_colcon_install(monkeypatch) -> None:
    """config/ and msg/ beside the package in the repository, or under its share directory once colcon
    installed it (found in review: only the first was looked in). The share directory here is the one the
    venv's interface build installed (AMENT_PREFIX_PATH names it, as a sourced workspace would)."""
    import os

    from rmuscle_ros import paths
    from rmuscle_ros.node.bags import typestore

    assert paths.package_file("config", "demo.yaml") == paths.SOURCE_ROOT / "config" / "demo.yaml"
    prefix = os.environ.get("AMENT_PREFIX_PATH") or str(Path(sys.prefix))
    monkeypatch.setenv("AMENT_PREFIX_PATH", prefix)
    monkeypatch.setattr(paths, "source_checkout", lambda: False)
    if not (Path(prefix) / "share" / "rmuscle_ros" / "msg").is_dir():
        pytest.skip(f"no rmuscle_ros share directory under {prefix} (make venv installs one)")
    installed = paths.package_file("config", "rmuscle_aloha.yaml")
    assert (
        installed == Path(prefix) / "share" / "rmuscle_ros" / "config" / "rmuscle_aloha.yaml"
        and installed.is_file()
    )
    assert "rmuscle_ros/msg/ActionChunk" in typestore(with_interfaces=True).types
    monkeypatch.setenv("AMENT_PREFIX_PATH", str(Path(prefix) / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"source the workspace's install/setup\.bash"):
        paths.package_file("msg")


def test_host_threads_default_is_bounded_on_a_gpu_only() -> None:
    """cpu_threads 0: on a GPU the host only preprocesses, and PyTorch's one thread per core stalled that
    on the H200 (runtime.policy.GPU_HOST_THREADS); on the CPU the model needs them all."""
    assert host_threads("cuda", 16) == 4 and host_threads("cuda:1", 2) == 2
    assert host_threads("cpu", 16) == 16


@pytest.mark.parametrize(
    "backend",
    [
        "fused",
        pytest.param(
            "graph",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (run with -m gpu on the device machine)",
                ),
            ],
        ),
    ],
)
def test_a_cell_without_a_base_camera_fills_the_wrist_slots(backend: str) -> None:
    """Cameras (left wrist, right wrist) in camera_slots (1, 2): the chunks of all three slots configured
    with the base camera missing (slot 0 masked), bit for bit; not those of the wrists in the first two
    slots, which is what a cell without a base camera got before (camera i filled slot i)."""
    wrists, device = ("left_wrist_0_rgb", "right_wrist_0_rgb"), "cuda" if backend == "graph" else "cpu"
    base = PolicyConfig(backend=backend, device=device)
    full = Policy(base)
    in_their_slots = Policy(dataclasses.replace(base, cameras=wrists, camera_slots=(1, 2)))
    obs = synthetic_observation(in_their_slots.cfg, "pick", seed=3)
    served = [p.infer(obs).actions for p in (full, in_their_slots)]
    assert np.array_equal(served[0], served[1])
    if backend == "fused":  # the images in other token positions: another computation (on tiny's random
        # weights a small change, which the GPU's bfloat16 may round away)
        in_the_first_slots = Policy(dataclasses.replace(base, cameras=wrists))
        assert not np.array_equal(served[0], in_the_first_slots.infer(obs).actions)


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ((1,), r"camera_slots: one distinct image slot in 0\.\.2 per camera \(2\)"),
        ((1, 1), r"camera_slots: one distinct"),
        ((1, 3), r"camera_slots: one distinct"),
        ((1, True), r"camera_slots: one distinct"),
        ([1, 2], r"camera_slots: a tuple of image slots"),  # a list would key a library apart (review)
    ],
)
def test_camera_slots_are_checked(slots: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyConfig(cameras=("left_wrist_0_rgb", "right_wrist_0_rgb"), camera_slots=slots)


def test_a_missing_base_camera_masks_its_slot_not_the_last_one(policy: Policy) -> None:
    """With the base camera missing, slot 0 is masked (and black) and both wrists' slots are seen: the mask
    follows the slots the cameras fill, not their count (found by a mutation review: masking the first
    len(present) slots passed the suite, so the model would read the black base image and drop the right
    wrist)."""
    obs = synthetic_observation(policy.cfg, "x", seed=5, cameras=("cam_left_wrist", "cam_right_wrist"))
    inputs, _, _ = policy.preprocess(obs)
    assert inputs.image_masks.tolist() == [[False, True, True]]
    assert (inputs.images[0, 0] == -1.0).all() and not (inputs.images[0, 2] == -1.0).all()


def test_image_antialias_reaches_the_images_the_model_sees() -> None:
    """model.image_antialias (openpi checkpoints, trained on PIL's smoothing resize) changes the images the
    policy feeds the model, exactly as image_to_model_padded(antialias=True) makes them (found by a
    mutation review: the setting could be dropped on the way without a test noticing)."""
    from rmuscle_ros.runtime.transforms import image_to_model_padded

    smooth = Policy(PolicyConfig(cameras=CAMERAS, image_antialias=True))
    obs = synthetic_observation(smooth.cfg, "x", seed=6)
    images = smooth.preprocess(obs)[0].images[0]
    for slot, name in enumerate(CAMERAS):
        expected = image_to_model_padded(obs.images[name], antialias=True)
        assert torch.equal(images[slot], expected)
        assert not torch.equal(images[slot], image_to_model_padded(obs.images[name]))


def test_a_robot_with_fewer_action_dims_than_state_dims_gets_chunks_of_its_action_dim() -> None:
    """state_dim 10, action_dim 7 (a robot whose state holds more than it commands): chunks are (horizon, 7),
    and the warm-up's synthetic observation carries a 10-value state (found by a mutation review: both dims
    were 14 in every test, so slicing the actions by state_dim, or sizing the synthetic state by action_dim,
    passed)."""
    policy = Policy(PolicyConfig(cameras=CAMERAS, state_dim=10, action_dim=7))
    obs = synthetic_observation(policy.cfg, "x")
    assert obs.state.shape == (10,)
    assert policy.infer(obs).actions.shape == (50, 7)


def test_reseeding_the_noise_replays_the_chunks_of_that_seed() -> None:
    """PolicyConfig.seed seeds the noise of calls without `noise`, and reseed_noise(seed) starts that stream
    again: a benchmark that reseeds per episode gets the same chunks call for call (found by a mutation
    review: a reseed that did nothing, or a seed the noise ignored, passed the suite)."""
    policy = Policy(PolicyConfig(cameras=CAMERAS, seed=3))
    obs = synthetic_observation(policy.cfg, "x", seed=7)
    first = [policy.infer(obs).actions for _ in range(2)]
    assert not np.array_equal(first[0], first[1])  # each call draws new noise
    policy.reseed_noise(3)
    assert all(np.array_equal(policy.infer(obs).actions, chunk) for chunk in first)


def test_a_tokenizer_with_more_ids_than_the_model_embeds_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer whose ids run past the preset's embedding table (PaliGemma's tokenizer.model with the
    tiny preset, say) is refused when the policy is made, naming both sizes, not met by an index error in
    the first call's embedding lookup (found by a mutation review: dropping the check passed the suite)."""
    from rmuscle_ros.models.tokenizer import ByteTokenizer
    from rmuscle_ros.runtime import policy as policy_module

    class WideTokenizer(ByteTokenizer):
        @property
        def vocab_size(self) -> int:
            return 1000

    monkeypatch.setattr(policy_module, "load_tokenizer", lambda path: WideTokenizer())
    with pytest.raises(ValueError, match=r"tokenizer: vocabulary 1000 exceeds the model's 320"):
        Policy(PolicyConfig(cameras=CAMERAS))
