"""Checkpoint loading with the real LeRobot/openpi key layout, and clear errors for bad files."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import random_inputs, tiny_model
from safetensors.torch import load_file, save_file

from rmuscle_ros.models import checkpoint
from rmuscle_ros.models.checkpoint import CheckpointError, load_model, save_checkpoint, weights_fingerprint
from rmuscle_ros.models.config import get_preset

EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
TIED = "paligemma_with_expert.paligemma.lm_head.weight"
EXPERT_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A tiny checkpoint in LeRobot's layout and the reference actions of the model it came from."""
    model = tiny_model(seed=3)
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_checkpoint(model, path)
    inputs, noise = random_inputs(model.cfg)
    return path, model.sample_actions(inputs, noise)


def _actions(path: Path) -> torch.Tensor:
    model = load_model(get_preset("tiny"), path)
    inputs, noise = random_inputs(model.cfg)
    return model.sample_actions(inputs, noise)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    tensors = load_file(str(src))
    edit(tensors)
    save_file(tensors, str(dst))
    return dst


def test_lerobot_layout_round_trip(saved) -> None:
    path, expected = saved
    assert all(k.startswith("model.") for k in load_file(str(path)))
    assert torch.equal(_actions(path), expected)


def test_openpi_layout_without_prefix(saved, tmp_path: Path) -> None:
    path, expected = saved

    def strip(t: dict) -> None:
        for k in list(t):
            t[k.removeprefix("model.")] = t.pop(k)

    assert torch.equal(_actions(_rewrite(path, tmp_path / "openpi.safetensors", strip)), expected)


def test_embedding_only_as_tied_lm_head_and_unused_heads_ignored(saved, tmp_path: Path) -> None:
    path, expected = saved

    def tie(t: dict) -> None:
        embed = t.pop("model." + EMBED)
        t["model." + TIED] = embed
        t["model." + EXPERT_HEAD] = torch.zeros(embed.shape[0], 64)  # present in real files, never used

    assert torch.equal(_actions(_rewrite(path, tmp_path / "tied.safetensors", tie)), expected)


def test_legacy_time_mlp_names(saved, tmp_path: Path) -> None:
    path, expected = saved

    def rename(t: dict) -> None:
        for k in [k for k in t if k.startswith("model.time_mlp_")]:
            t[k.replace("model.time_mlp_", "model.action_time_mlp_")] = t.pop(k)

    assert torch.equal(_actions(_rewrite(path, tmp_path / "legacy.safetensors", rename)), expected)


def test_missing_tensor_is_named(saved, tmp_path: Path) -> None:
    path, _ = saved
    key = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.down_proj.weight"
    bad = _rewrite(path, tmp_path / "missing.safetensors", lambda t: t.pop(key))
    with pytest.raises(
        CheckpointError, match=r"missing tensor .*gemma_expert\.model\.layers\.1\.mlp\.down_proj"
    ):
        _actions(bad)


def test_misshaped_tensor_is_named(saved, tmp_path: Path) -> None:
    path, _ = saved
    key = "model.action_in_proj.weight"
    bad = _rewrite(path, tmp_path / "shape.safetensors", lambda t: t.__setitem__(key, torch.zeros(64, 14)))
    with pytest.raises(CheckpointError, match=r"action_in_proj\.weight.*\[64, 14\].*\[64, 32\]"):
        _actions(bad)


def test_other_architecture_is_refused(saved, tmp_path: Path) -> None:
    path, _ = saved
    bad = _rewrite(
        path, tmp_path / "pi0.safetensors", lambda t: t.__setitem__("model.state_proj.weight", torch.zeros(2))
    )
    with pytest.raises(CheckpointError, match=r"state_proj.*π0 checkpoint"):
        _actions(bad)


def test_nan_weights_are_refused(saved, tmp_path: Path) -> None:
    path, _ = saved
    key = "model.time_mlp_in.bias"
    bad = _rewrite(path, tmp_path / "nan.safetensors", lambda t: t[key].__setitem__(0, float("nan")))
    with pytest.raises(CheckpointError, match=r"time_mlp_in\.bias.*NaN"):
        _actions(bad)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_file_gives_a_clear_error(saved, tmp_path: Path, damage: str) -> None:
    path, _ = saved
    data = path.read_bytes()
    bad = tmp_path / f"{damage}.safetensors"
    bad.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": b"\x00not a safetensors file" * 10, "empty": b""}[
            damage
        ]
    )
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        _actions(bad)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        _actions(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_files_are_converted(saved, tmp_path: Path, dtype: torch.dtype) -> None:
    path, _ = saved
    half = _rewrite(
        path, tmp_path / "half.safetensors", lambda t: t.update({k: v.to(dtype) for k, v in t.items()})
    )
    model = load_model(get_preset("tiny"), half)
    stored = load_file(str(half))["model.action_out_proj.weight"]
    assert model.action_out_proj.weight.dtype == torch.float32
    assert torch.equal(model.action_out_proj.weight, stored.float())


@pytest.mark.parametrize(
    ("dtype", "name"), [(torch.int8, "I8"), (torch.bool, "BOOL"), (torch.float8_e4m3fn, "F8_E4M3")]
)
def test_other_dtypes_are_refused(saved, tmp_path: Path, dtype: torch.dtype, name: str) -> None:
    """An int8 copy used to come out all zeros (copy_ casts), FP8 to fail inside PyTorch."""
    path, _ = saved
    key = "model.action_out_proj.weight"
    bad = _rewrite(path, tmp_path / "dtype.safetensors", lambda t: t.__setitem__(key, t[key].to(dtype)))
    with pytest.raises(
        CheckpointError,
        match=rf"tensor of a dtype .*: 'action_out_proj\.weight' is {name}; accepted: F32, BF16, F16",
    ):
        _actions(bad)


def _pi0_layout(t: dict) -> None:
    """Turn π0.5 tensors into π0's: plain RMSNorm weights in the expert, state_proj, a 2W-input time MLP."""
    width = t["model.action_in_proj.weight"].shape[0]
    for k in [
        k for k in t if re.search(r"gemma_expert\.model\.(layers\.\d+\.\w+_layernorm|norm)\.dense\.", k)
    ]:
        if t.pop(k).ndim == 2:
            t[k.replace(".dense.weight", ".weight")] = torch.zeros(width)
    for k in [k for k in t if k.startswith("model.time_mlp_")]:
        t[k.replace("model.time_mlp_", "model.action_time_mlp_")] = t.pop(k)
    t["model.action_time_mlp_in.weight"] = torch.zeros(width, 2 * width)
    t["model.state_proj.weight"], t["model.state_proj.bias"] = torch.zeros(width, 32), torch.zeros(width)


def test_pi0_checkpoint_is_named_with_every_mismatch(saved, tmp_path: Path) -> None:
    """A π0 file used to stop at its first missing tensor, before the check that carries the π0 hint."""
    path, _ = saved
    bad = _rewrite(path, tmp_path / "pi0.safetensors", _pi0_layout)
    with pytest.raises(CheckpointError) as err:
        _actions(bad)
    message = str(err.value)
    assert "pi0.safetensors" in message and "a π0 checkpoint?" in message
    assert "'state_proj." in message and "input_layernorm.weight'" in message
    # 2 layers x 2 norms + final norm, weight and bias each; the time MLP; state_proj + 5 plain norms.
    assert re.search(r"missing tensor '[^;]*, … \(10 in all\)", message)
    assert re.search(r"mis-shaped tensor 'action_time_mlp_in\.weight' has shape \[64, 128\][^;]*;", message)
    assert re.search(r"unexpected tensor '[^;]*, … \(7 in all\)", message)


def test_all_kinds_of_mismatch_are_reported_together(saved, tmp_path: Path) -> None:
    path, _ = saved

    def damage(t: dict) -> None:
        t.pop("model.action_out_proj.bias")
        t["model.action_in_proj.weight"] = torch.zeros(64, 14)
        t["model.extra.weight"] = torch.zeros(2)

    bad = _rewrite(path, tmp_path / "mixed.safetensors", damage)
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor 'action_out_proj\.bias'; mis-shaped tensor 'action_in_proj\.weight' has "
        r"shape \[64, 14\].*; unexpected tensor 'extra\.weight'; refusing",
    ) as err:
        _actions(bad)
    assert "π0" not in str(err.value)


def test_checkpoint_directory_holding_model_safetensors(saved, tmp_path: Path) -> None:
    path, expected = saved
    directory = tmp_path / "pretrained_model"
    directory.mkdir()
    shutil.copy(path, directory / "model.safetensors")
    assert torch.equal(_actions(directory), expected)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty is a directory without a model\.safetensors"):
        _actions(tmp_path / "empty")


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_pickle_file_is_refused_unread(saved, tmp_path: Path, kind: str, monkeypatch) -> None:
    path = tmp_path / "pytorch_model.bin"
    if kind == "torch.save":  # a zip archive holding a pickle
        torch.save({"w": torch.zeros(2)}, path)
    else:
        path.write_bytes(pickle.dumps({"w": [0.0, 0.0]}, protocol=4))

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    with pytest.raises(CheckpointError, match="a pickle checkpoint is refused; convert it to safetensors"):
        _actions(path)


def test_a_truncated_safetensors_file_is_not_called_a_pickle(saved, tmp_path: Path) -> None:
    """A download cut off half way whose header length happens to begin with byte 0x80 (1 file in 256)
    is a truncated safetensors file, not a pickle (a second review found it named as one)."""
    path, _ = saved
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    padded = length + (0x80 - length % 256) % 256  # header length whose low byte is 0x80: pad its JSON
    header = data[8 : 8 + length] + b" " * (padded - length)
    cut = tmp_path / "model.safetensors"
    cut.write_bytes(
        (padded.to_bytes(8, "little") + header + data[8 + length :])[: (8 + padded + len(data)) // 2]
    )
    assert cut.read_bytes()[0] == 0x80
    with pytest.raises(CheckpointError, match="corrupt or truncated") as e:
        load_model(get_preset("tiny"), str(cut))
    assert "pickle" not in str(e.value)


def test_a_truncated_small_safetensors_file_that_begins_like_a_pickle_is_not_called_one(
    tmp_path: Path,
) -> None:
    """The case the test above cannot reach with the tiny checkpoint's long header: a header of 0x380 bytes
    makes the file begin b"\\x80\\x03", a pickle's PROTO 3, and the file cut off is still named truncated,
    not a pickle (found by a mutation review: skipping the header check passed the suite)."""
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(64)}, str(path))
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + length] + b" " * (0x380 - length)  # trailing spaces pad a safetensors header
    path.write_bytes(((0x380).to_bytes(8, "little") + header + data[8 + length :])[:-16])
    assert path.read_bytes()[:2] == b"\x80\x03"
    with pytest.raises(CheckpointError, match="corrupt or truncated") as e:
        load_model(get_preset("tiny"), str(path))
    assert "pickle" not in str(e.value)


def test_git_lfs_pointer_is_named(tmp_path: Path) -> None:
    pointer = tmp_path / "model.safetensors"
    pointer.write_bytes(
        b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 14467030080\n"
    )
    with pytest.raises(CheckpointError, match=r"git-lfs pointer.*`git lfs pull`"):
        _actions(pointer)


def test_tensor_stored_with_and_without_the_prefix_is_refused(saved, tmp_path: Path) -> None:
    """Stripping `model.` used to keep one of the two copies silently."""
    path, _ = saved
    key = "model.action_out_proj.weight"
    bad = _rewrite(
        path,
        tmp_path / "dup.safetensors",
        lambda t: t.__setitem__(key.removeprefix("model."), torch.zeros_like(t[key])),
    )
    with pytest.raises(
        CheckpointError,
        match=r"tensor stored twice: 'action_out_proj\.weight' and 'model\.action_out_proj",
    ):
        _actions(bad)


def _beside(saved_path: Path, directory: Path, config: dict) -> Path:
    directory.mkdir()
    shutil.copy(saved_path, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return directory / "model.safetensors"


@pytest.mark.parametrize(
    ("config", "field", "value", "ours"),
    [
        ({"type": "pi05", "chunk_size": 10, "num_inference_steps": 10}, "chunk_size", 10, "horizon = 50"),
        ({"type": "pi05", "tokenizer_max_length": 256}, "tokenizer_max_length", 256, "max_token_len = 200"),
        (
            {"action_dim": 32, "action_horizon": 10, "paligemma_variant": "gemma_2b"},
            "action_horizon",
            10,
            "horizon",
        ),
        # the time embedding's periods (found in review: not compared, the actions off by up to 0.8)
        (
            {"type": "pi05", "min_period": 1e-3, "max_period": 4.0},
            "min_period",
            0.001,
            "time_min_period = 0.004",
        ),
        (
            {"type": "pi05", "min_period": 4e-3, "max_period": 10.0},
            "max_period",
            10.0,
            "time_max_period = 4.0",
        ),
    ],
)
def test_recorded_horizon_steps_and_prompt_length_must_match_the_preset(
    saved, tmp_path: Path, config: dict, field: str, value: int, ours: str
) -> None:
    """These change no tensor's shape: a chunk_size-10 fine-tune used to run silently at horizon 50; a
    prompt trained longer than the preset's would be cut."""
    path, _ = saved
    ckpt = _beside(path, tmp_path / "pretrained_model", config)
    with pytest.raises(
        CheckpointError,
        match=rf"config\.json: .*{field} {value}, the model preset fixes {ours}.*; no preset here runs this checkpoint",
    ):
        _actions(ckpt)
    with pytest.raises(CheckpointError, match=field):  # the directory form reads the same config.json
        _actions(ckpt.parent)


@pytest.mark.parametrize(
    "config",
    [
        {"type": "pi05", "chunk_size": 50, "num_inference_steps": 10, "tokenizer_max_length": 200},
        {"type": "pi05", "min_period": 0.004, "max_period": 4},  # LeRobot's defaults, as JSON writes them
        {"type": "pi05"},  # fields it does not hold are not checked
        # another step count is an inference choice, and a shorter trained prompt changes no weight (a
        # second review found both refused); the Policy cuts prompts at it (the next test)
        {"type": "pi05", "num_inference_steps": 5, "tokenizer_max_length": 48},
        {"type": "pi0", "chunk_size": 10},  # another policy's config.json is not read
        {"dims": {"horizon": 10}},  # not a policy config at all
    ],
)
def test_matching_or_unrelated_config_json_loads(saved, tmp_path: Path, config: dict) -> None:
    path, expected = saved
    assert torch.equal(_actions(_beside(path, tmp_path / "ckpt", config)), expected)


def test_weights_fingerprint_covers_every_weight() -> None:
    """Libraries and engines key on the fingerprint: a change to any one value gives another key
    (earlier builds sampled ~4096 values per tensor, so a fine-tune of a few embedding rows kept the key)."""
    model = tiny_model()
    first = weights_fingerprint(model)
    assert re.fullmatch(r"sha256:[0-9a-f]{16}", first)
    assert weights_fingerprint(tiny_model()) == first  # the same weights, built again
    embed = model.llm.embed_tokens.weight
    with torch.no_grad():
        embed.view(-1)[1] += 1.0  # one value of one embedding row, which the old sampling skipped
    assert weights_fingerprint(model) != first


def test_weights_fingerprint_keeps_its_value_across_builds() -> None:
    """Every cell's library and exported engines are keyed on this value: a build that computes it another
    way (another piece size, FINGERPRINT_CHUNK, or order) throws them all away at upgrade. Found in
    review: the piece size once went from 64 to 16 MB with no change of scheme. A change must be
    deliberate: a new FINGERPRINT_SCHEME, and the library's refusal saying so (is_sampled_fingerprint's
    way), with this value updated."""
    module = torch.nn.Module()
    pattern = torch.arange((20 << 20) + 3, dtype=torch.int64) % 251  # over one piece, not a multiple
    module.register_buffer("bytes", pattern.to(torch.uint8))
    module.weight = torch.nn.Parameter(torch.linspace(-1, 1, 24).reshape(4, 6))
    assert weights_fingerprint(module) == "sha256:a60f834199947bcd"


def test_weights_fingerprint_hashes_large_tensors_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor is hashed in pieces (in parallel): together they are its bytes, each exactly once, in order."""
    t = torch.randn(1001, dtype=torch.bfloat16)
    whole = t.view(torch.uint8).numpy().tobytes()
    monkeypatch.setattr(checkpoint, "FINGERPRINT_CHUNK", 97)  # not a divisor of 2002 bytes
    pieces = checkpoint._pieces(t)
    assert len(pieces) == 21 and b"".join(p.numpy().tobytes() for p in pieces) == whole
    assert b"".join(p.numpy().tobytes() for p in checkpoint._pieces(t.reshape(7, 143).t())) != whole
    assert [p.numel() for p in checkpoint._pieces(torch.empty(0))] == [0]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu on the device machine)"
)
def test_weights_fingerprint_is_the_same_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same weights give the same key on either device (their bytes, copied off the GPU through each
    thread's pinned buffer); with pieces smaller than the tensors, as a full-size model's are."""
    monkeypatch.setattr(checkpoint, "FINGERPRINT_CHUNK", 4096)
    model = tiny_model()
    on_cpu = weights_fingerprint(model)
    assert weights_fingerprint(model.to("cuda")) == on_cpu


def test_prompts_are_cut_where_the_checkpoints_training_cut_them(saved, tmp_path: Path) -> None:
    """LeRobot's tokenizer step truncates at its config's tokenizer_max_length, in training and in its own
    inference. Found in review: a checkpoint trained at 48 tokens ran a 94-token prompt whole here, the
    model seeing tokens and positions it never saw; the node now refuses such a prompt (its tail, the state,
    would be cut), and a Policy's calls are cut at 48."""
    from rmuscle_ros.runtime.policy import Policy, PolicyConfig, synthetic_observation

    path, _ = saved
    ckpt = _beside(path, tmp_path / "trained_at_48", {"type": "pi05", "tokenizer_max_length": 48})
    policy = Policy(PolicyConfig(checkpoint=str(ckpt)))
    long_task = "pick up the red cube and place it in the bin"
    tokens, most = policy.prompt_tokens(long_task)
    assert most == 48 and tokens > 48
    chunk = policy.infer(synthetic_observation(policy.cfg, long_task))
    assert chunk.prompt_truncated and 48 < chunk.prompt_tokens <= tokens
    inputs, _, truncated = policy.preprocess(synthetic_observation(policy.cfg, long_task))
    assert truncated and int(inputs.token_mask.sum()) == 48 and inputs.tokens.shape[-1] == 200
    plain = Policy(PolicyConfig(checkpoint=str(path)))  # no config.json: the preset's 200
    assert plain.prompt_tokens(long_task) == (tokens, 200)


def test_a_zip_that_is_no_torch_save_is_not_called_a_pickle_and_policy_paths_are_typed(
    tmp_path: Path,
) -> None:
    """Found in review: any zip (an .npz) was called "a pickle file (torch.save's)"; PolicyConfig took
    cameras="top" (three cameras t, o, p, refused only at the first call) and a checkpoint of 123 (a bare
    TypeError from pathlib)."""
    import numpy as np

    from rmuscle_ros.runtime.policy import PolicyConfig

    npz = tmp_path / "model.safetensors"
    with npz.open("wb") as f:
        np.savez(f, w=np.zeros(2))
    with pytest.raises(CheckpointError, match=r"is a zip archive \(an \.npz\?\), not safetensors"):
        load_model(get_preset("tiny"), npz)
    for bad, says in (
        ({"cameras": "top"}, "cameras: a list of camera names"),
        ({"cameras": (1, 2)}, "cameras: a list of camera names"),
        ({"checkpoint": 123}, "checkpoint: a path or None, got 123"),
        ({"trt_opt_prompt_len": True}, "trt_opt_prompt_len: an int, got True"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            PolicyConfig(**bad)


def test_the_config_a_saved_checkpoint_records_is_compared_with_the_model(saved, tmp_path: Path) -> None:
    """`save_checkpoint` records its model's config in the file: a field that changes no tensor's shape
    (the horizon here) and differs from the model's was never compared, and the weights ran as they were
    not trained (found in review). Refused now, naming the field; another step count is an inference
    choice, and a record without the field (an earlier build's) is not compared."""
    from safetensors import safe_open

    path, expected = saved
    with safe_open(str(path), framework="pt") as f:
        recorded = json.loads(f.metadata()["rmuscle_ros_config"])
    tensors = load_file(str(path))

    def saved_with(config: dict, name: str) -> Path:
        out = tmp_path / name / "model.safetensors"
        out.parent.mkdir()
        save_file(tensors, str(out), metadata={"format": "pt", "rmuscle_ros_config": json.dumps(config)})
        return out

    with pytest.raises(
        CheckpointError, match=r"saved from a model of another config: horizon 10 \(this model: 50\)"
    ):
        _actions(saved_with(recorded | {"horizon": 10}, "horizon"))
    assert torch.equal(_actions(saved_with(recorded | {"num_steps": 3}, "steps")), expected)
    older = {k: v for k, v in recorded.items() if k != "horizon"}
    assert torch.equal(_actions(saved_with(older, "older")), expected)


def test_a_shorter_prompt_length_recorded_by_save_checkpoint_cuts_prompts(saved, tmp_path: Path) -> None:
    """A checkpoint `save_checkpoint` wrote from a model of a shorter `max_token_len` loads (a shorter
    prompt fits), and its prompts are cut there, as they are at a `config.json`'s `tokenizer_max_length`
    (noticed last session: accepted, not applied); the shortest of the two wins."""
    from safetensors import safe_open

    from rmuscle_ros.runtime.policy import Policy, PolicyConfig

    path, _ = saved
    with safe_open(str(path), framework="pt") as f:
        recorded = json.loads(f.metadata()["rmuscle_ros_config"])
    out = tmp_path / "saved_at_40" / "model.safetensors"
    out.parent.mkdir()
    config = recorded | {"max_token_len": 40}
    save_file(
        load_file(str(path)), str(out), metadata={"format": "pt", "rmuscle_ros_config": json.dumps(config)}
    )
    long_task = "pick up the red cube and place it in the bin"
    assert Policy(PolicyConfig(checkpoint=str(out))).prompt_tokens(long_task)[1] == 40
    (out.parent / "config.json").write_text(json.dumps({"type": "pi05", "tokenizer_max_length": 48}))
    assert Policy(PolicyConfig(checkpoint=str(out))).prompt_tokens(long_task)[1] == 40
    (out.parent / "config.json").write_text(json.dumps({"type": "pi05", "tokenizer_max_length": 32}))
    assert Policy(PolicyConfig(checkpoint=str(out))).prompt_tokens(long_task)[1] == 32


def test_a_checkpoint_trained_on_relative_actions_is_not_run_absolute(saved, tmp_path: Path) -> None:
    """LeRobot (≥ 0.5.1) records `use_relative_actions` in config.json. Found in review: a relative
    checkpoint loaded and ran absolute, its offsets commanded as joint positions. Either mismatch is refused
    before the weights load, naming the setting; the matching one loads; a config without it is unchecked."""
    from rmuscle_ros.runtime.policy import Policy, PolicyConfig

    path, _ = saved
    arms = (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12)  # delta_joint_actions' dims: the grippers stay absolute
    relative = _beside(path, tmp_path / "relative", {"type": "pi05", "use_relative_actions": True})
    with pytest.raises(CheckpointError, match=r"use_relative_actions true .* set delta_joint_actions: true"):
        Policy(PolicyConfig(checkpoint=str(relative)))
    assert Policy(PolicyConfig(checkpoint=str(relative), delta_actions=arms)).cfg.delta_actions == arms
    absolute = _beside(path, tmp_path / "absolute", {"type": "pi05", "use_relative_actions": False})
    with pytest.raises(
        CheckpointError, match=r"use_relative_actions false .* set delta_joint_actions: false"
    ):
        Policy(PolicyConfig(checkpoint=str(absolute), delta_actions=arms))
    unrecorded = _beside(path, tmp_path / "unrecorded", {"type": "pi05"})
    Policy(PolicyConfig(checkpoint=str(unrecorded), delta_actions=arms))


def test_a_checkpoint_that_records_no_config_loads_saying_what_it_cannot_check(
    saved, tmp_path: Path, caplog
) -> None:
    """openpi's PyTorch training writes no config.json: a fine-tune of another horizon (pi05_libero's 10)
    ran at the preset's 50 without a word (found in review). It still loads (nothing to refuse it by), with
    a warning naming what could not be checked and how to record it."""
    import logging

    path, expected = saved
    bare = _rewrite(path, tmp_path / "model.safetensors", lambda tensors: None)  # no metadata, no config.json
    with caplog.at_level(logging.WARNING, logger="rmuscle_ros.models.checkpoint"):
        assert torch.equal(_actions(bare), expected)
    assert "records no config" in caplog.text and '{"action_horizon": N' in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rmuscle_ros.models.checkpoint"):
        _actions(path)  # save_checkpoint's metadata records it
    assert "records no config" not in caplog.text


def test_a_sharded_checkpoint_is_named_as_one_not_as_corrupt_or_another_model(saved, tmp_path: Path) -> None:
    """Its directory read as "without a model.safetensors", its index as a corrupt file and a shard as
    another architecture (found in review): each form now says it is sharded and what to do."""
    path, _ = saved
    tensors = load_file(str(path))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {k: s for s, keys in shards.items() for k in keys}}))
    for given in (tmp_path, index, tmp_path / "model-00001-of-00002.safetensors"):
        with pytest.raises(CheckpointError, match=r"a sharded checkpoint .*merge the shards into one"):
            _actions(given)


def test_an_empty_checkpoint_path_is_refused_not_read_as_the_working_directory() -> None:
    """ "" reads as ".": a model.safetensors in the working directory was loaded, past the checks that ask
    `if cfg.checkpoint` (found in review)."""
    from rmuscle_ros.runtime.policy import PolicyConfig

    with pytest.raises(ValueError, match=r"^checkpoint: an empty path; None for none"):
        PolicyConfig(checkpoint="")
    with pytest.raises(CheckpointError, match=r"checkpoint: an empty path"):
        load_model(get_preset("tiny"), "")
