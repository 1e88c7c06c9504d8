"""The `tensorrt` backend's runtime (engine/tensorrt.py) on the CPU, through a stand-in for TensorRT.

TensorRT cannot be installed here, so `stand_in_tensorrt` builds a module object in its place. These tests
check what TensorRTEngine does around TensorRT (which addresses and shapes it binds, what it does when
TensorRT refuses one, warmup after a failed build, the prompt length it runs at, the errors when packages
are missing), not TensorRT's parser, builder or numerics, which have not run anywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import importlib.machinery
import json
import math
import sys
import types
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from conftest import random_inputs, rel_l2, tiny_model

from rmuscle_ros.engine import engine_cache, onnx_export
from rmuscle_ros.engine.tensorrt import ALIGN, OPT_PROMPT_LEN, TensorRTEngine, aligned_empty
from rmuscle_ros.models.pi05 import Pi05Model

FLOAT_TENSORS = {"images", "visual", "keys", "values", "x", "x_next"}
INT_TENSORS = {"tokens", "step"}


def stand_in_tensorrt(reference: Pi05Model) -> types.ModuleType:
    """A stand-in for TensorRT 10's Python module, as far as TensorRTEngine uses it.

    Builder: the "parser" only notes which stage a file is (its name), and a "plan" is JSON: the stage and
    the optimisation profile; `fail` names stages whose build returns None, as build_serialized_network
    does on failure. Runtime: an execution context keeps TensorRT's documented rules that the engine's
    code depends on: set_input_shape returns False for a shape outside the profile (static inputs are not
    checked), set_tensor_address returns False for an address not on a 256-byte boundary. Either refusal
    keeps the previous binding (our assumption: the header documents only the False), and
    execute_async_v3 returns False while a tensor has no address.
    Execution: it reads the inputs from the bound addresses and writes the outputs to them, computed by
    the stage's PyTorch module of `reference` (float32), so results are the export's stages, not
    TensorRT's. `log` records each execution: (stage, input shapes, step index for denoise).
    """
    cfg, run = reference.cfg, onnx_export.torch_runner(onnx_export.stage_modules(reference))
    trt = types.ModuleType("tensorrt")
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)
    trt.__version__ = "10.13.0-stand-in"
    trt.fail, trt.built, trt.log, trt.addresses, trt.loggers = set(), [], [], [], []
    # What the builder was asked for: each network's creation flags, each config's workspace limit; and
    # the stages whose file the parser rejects (as for an operator it does not know).
    trt.network_flags, trt.workspaces, trt.unparsable = [], [], set()

    class Logger:
        WARNING = 2

        def __init__(self, severity: int) -> None:
            pass

    trt.Logger = Logger
    trt.DataType = enum.Enum("DataType", "FLOAT HALF BF16 INT32 INT64 BOOL")
    trt.TensorIOMode = enum.Enum("TensorIOMode", "INPUT OUTPUT")
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", "STRONGLY_TYPED")
    trt.MemoryPoolType = enum.Enum("MemoryPoolType", "WORKSPACE")
    torch_of = {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.INT64: torch.int64,
        trt.DataType.BOOL: torch.bool,
    }

    def dtype(name: str) -> Any:
        if name in FLOAT_TENSORS:
            return trt.DataType.FLOAT
        return trt.DataType.INT64 if name in INT_TENSORS else trt.DataType.BOOL

    class OnnxParser:
        num_errors = 0

        def __init__(self, network: types.SimpleNamespace, logger: Logger) -> None:
            self.network = network
            trt.loggers.append(logger)

        def parse_from_file(self, path: str) -> bool:
            self.network.stage = Path(path).name.removesuffix(".onnx")
            if self.network.stage in trt.unparsable:
                self.num_errors = 1
                return False
            return True

        def get_error(self, i: int) -> str:
            return "In node 7 (importGelu): UNSUPPORTED_NODE"

    class Builder:
        def __init__(self, logger: Logger) -> None:
            trt.loggers.append(logger)

        def create_network(self, flags: int) -> types.SimpleNamespace:
            trt.network_flags.append(flags)
            return types.SimpleNamespace(stage=None)

        def create_builder_config(self) -> types.SimpleNamespace:
            config = types.SimpleNamespace(
                profile={}, set_memory_pool_limit=lambda pool, size: trt.workspaces.append((pool, size))
            )
            config.add_optimization_profile = lambda profile: config.profile.update(profile.shapes)
            return config

        def create_optimization_profile(self) -> types.SimpleNamespace:
            profile = types.SimpleNamespace(shapes={})
            profile.set_shape = lambda name, lo, opt, hi: profile.shapes.update({name: [lo, opt, hi]})
            return profile

        def build_serialized_network(self, network: types.SimpleNamespace, config: Any) -> bytes | None:
            trt.built.append(network.stage)
            if network.stage in trt.fail:
                return None
            return json.dumps({"stage": network.stage, "profile": config.profile}).encode()

    class Runtime:
        def __init__(self, logger: Logger) -> None:
            trt.loggers.append(logger)

        def deserialize_cuda_engine(self, plan: bytes) -> Engine | None:
            if trt.refuse_plans:  # TensorRT's answer to a plan it cannot load, or to no memory for it
                return None
            return Engine(**json.loads(plan))

    class Engine:
        def __init__(self, stage: str, profile: dict[str, list[list[int]]]) -> None:
            self.stage, self.profile = stage, profile
            self.inputs, self.outputs = onnx_export.INPUTS[stage], onnx_export.OUTPUTS[stage]
            self.num_io_tensors = len(self.inputs) + len(self.outputs)

        def get_tensor_name(self, i: int) -> str:
            return (*self.inputs, *self.outputs)[i]

        def get_tensor_mode(self, name: str) -> Any:
            return trt.TensorIOMode.INPUT if name in self.inputs else trt.TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name: str) -> Any:
            return dtype(name)

        def create_execution_context(self) -> Context:
            return Context(self)

    class Context:
        def __init__(self, engine: Engine) -> None:
            self.engine, self.shapes, self.bound = engine, {}, {}

        def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
            if name in self.engine.profile:
                lo, _, hi = self.engine.profile[name]
                if len(shape) != len(lo) or not all(
                    a <= s <= b for a, s, b in zip(lo, shape, hi, strict=True)
                ):
                    return False
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name: str, address: int) -> bool:
            if address % 256:
                return False
            self.bound[name] = address
            trt.addresses.append(address)
            return True

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            if name == "visual":
                return (1, cfg.image_tokens, cfg.vlm.width)
            if name == "x_next":
                return self.shapes["x"]
            lp = cfg.image_tokens + self.shapes["tokens"][1]
            return (
                (1, lp)
                if name == "pad_mask"
                else (cfg.vlm.depth, 1, cfg.vlm.num_kv_heads, lp, cfg.vlm.head_dim)
            )

        def execute_async_v3(self, stream: int) -> bool:
            stage = self.engine.stage
            if set(self.bound) != {*self.engine.inputs, *self.engine.outputs}:
                return False
            feeds = {n: memory(self.bound[n], self.shapes[n], dtype(n)) for n in self.engine.inputs}
            outputs = run(stage, {n: t.clone() for n, t in feeds.items()})
            for name, value in outputs.items():
                memory(self.bound[name], self.get_tensor_shape(name), dtype(name)).copy_(value)
            trt.log.append((stage, self.shapes.copy(), int(feeds["step"]) if stage == "denoise" else None))
            return True

    def memory(address: int, shape: tuple[int, ...], trt_dtype: Any) -> torch.Tensor:
        """The tensor at `address`, as TensorRT would read it (dense, row-major)."""
        dt = torch_of[trt_dtype]
        buffer = (ctypes.c_char * (math.prod(shape) * dt.itemsize)).from_address(address)
        return torch.frombuffer(buffer, dtype=dt).view(shape)

    trt.OnnxParser, trt.Builder, trt.Runtime = OnnxParser, Builder, Runtime
    return trt


class _Stream:
    """torch.cuda's stream API on the CPU: every operation here is already done when it returns. Which
    stream is current follows `torch.cuda.stream(...)` as in torch (the caller's default stream outside
    it), and each wait is recorded as (waiting, waited on) in `waits`."""

    cuda_stream = 0
    waits: ClassVar[list[tuple[_Stream, _Stream]]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: _Stream) -> None:
        _Stream.waits.append((self, other))

    def synchronize(self) -> None:
        pass


_CALLERS_STREAM = _Stream()
_current: list[_Stream] = [_CALLERS_STREAM]


@contextlib.contextmanager
def _on_stream(stream: _Stream) -> Any:
    _current.append(stream)
    try:
        yield
    finally:
        _current.pop()


@pytest.fixture
def trt(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The stand-in installed as `tensorrt`, torch.cuda's device queries and streams answered on the CPU,
    and `ensure_export` giving the export's directory without exporting (the stand-in reads file names)."""
    fake = stand_in_tensorrt(tiny_model())
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (11, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Thor (stand-in)")
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _current[-1])
    monkeypatch.setattr(torch.cuda, "stream", _on_stream)
    _Stream.waits.clear()
    fake.exports = 0
    fake.refuse_plans = False
    fake.forced = []

    def ensure_export(model: Pi05Model, cache_dir: Path, *, weights: str, force: bool = False) -> Path:
        assert model is not None, "the export needs the model's weights"
        fake.exports += 1
        fake.forced.append(force)
        key = onnx_export.export_key(model.cfg, weights, onnx_export.dtype_name(model))
        (Path(cache_dir) / key.digest()).mkdir(parents=True, exist_ok=True)
        return Path(cache_dir) / key.digest()

    monkeypatch.setattr(onnx_export, "ensure_export", ensure_export)
    return fake


def engine_on_cpu(cache_dir: Path) -> TensorRTEngine:
    return TensorRTEngine(tiny_model(), device=torch.device("cpu"), cache_dir=cache_dir)


def test_each_denoising_step_and_batch_item_is_bound_on_a_256_byte_boundary(trt, tmp_path: Path) -> None:
    """TensorRT refuses a tensor address off a 256-byte boundary and keeps the previous one. Each step
    index has a row of its own in the step table, and a batch's second observation (1600 bytes into the
    tokens) is copied into the engine's buffers, so the ten steps see 0..9 and both items their own
    prompt: the chunks are the eager model's."""
    engine = engine_on_cpu(tmp_path)
    engine.warmup()
    model = tiny_model()
    inputs, noise = random_inputs(model.cfg, batch=2, valid_tokens=150, pad_to=200, seed=5)
    inputs.image_masks[1, 2] = False
    trt.log.clear()
    got = engine.sample_actions(inputs, noise)
    assert rel_l2(got, model.sample_actions(inputs, noise)) < 1e-5
    steps = [step for stage, _, step in trt.log if stage == "denoise"]
    assert steps == list(range(model.cfg.num_steps)) * 2
    assert trt.addresses and all(a % ALIGN == 0 for a in trt.addresses)


def test_a_call_starts_after_the_callers_stream_and_the_caller_waits_for_it(trt, tmp_path: Path) -> None:
    """The engine's stream waits for the caller's (the policy's preprocessing queued the images there)
    before its input copies, and the caller's waits for the engine's before it reads the actions (found
    in review: the first wait was made inside the engine's stream context, where it waited on itself)."""
    engine = engine_on_cpu(tmp_path)
    engine.warmup()
    model = tiny_model()
    inputs, noise = random_inputs(model.cfg, valid_tokens=20, pad_to=200, seed=1)
    _Stream.waits.clear()
    engine.sample_actions(inputs, noise)
    assert _Stream.waits == [(engine._stream, _CALLERS_STREAM), (_CALLERS_STREAM, engine._stream)]


def test_every_builder_parser_and_runtime_gets_the_one_logger(trt, tmp_path: Path) -> None:
    """TensorRT keeps the first logger it was given per process and warns at each other one."""
    engine_on_cpu(tmp_path).warmup()
    assert len(trt.loggers) == 7  # a builder and a parser per stage, and the runtime
    assert all(logger is trt.loggers[0] for logger in trt.loggers)


def test_a_shape_or_address_tensorrt_refuses_is_an_error_naming_the_tensor(trt, tmp_path: Path) -> None:
    engine = engine_on_cpu(tmp_path)
    engine.warmup()
    prefill = engine._stages["prefill"]
    too_long = aligned_empty((1, 201), torch.int64, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"prefill\.tokens: TensorRT refused the input shape \(1, 201\)"):
        prefill.enqueue({"tokens": too_long}, {}, 0)
    off_boundary = aligned_empty((1, 64), torch.int64, torch.device("cpu"))[:, 1:33]
    with pytest.raises(
        RuntimeError,
        match=r"prefill\.tokens: TensorRT refused the address 0x[0-9a-f]+ \(8 bytes past a 256-byte",
    ):
        prefill.enqueue({"tokens": off_boundary}, {}, 0)


def test_a_failed_build_leaves_the_engine_as_it_was_and_the_next_warmup_retries(trt, tmp_path: Path) -> None:
    engine = engine_on_cpu(tmp_path)
    trt.fail = {"prefill"}
    with pytest.raises(RuntimeError, match=r"failed to build an engine from .*prefill\.onnx"):
        engine.warmup()
    assert engine._stages == {} and engine.model is not None
    trt.fail = set()
    timings = engine.warmup()
    assert {"engine_vision", "engine_prefill", "engine_denoise", "first_call"} <= set(timings)
    assert trt.built == [
        "vision",
        "prefill",
        "prefill",
        "denoise",
    ]  # vision's plan was kept from the first try
    assert engine.model is None  # released once everything ran
    inputs, noise = random_inputs(engine.cfg, valid_tokens=12, pad_to=16, seed=2)
    assert rel_l2(engine.sample_actions(inputs, noise), tiny_model().sample_actions(inputs, noise)) < 1e-5


def test_a_cached_plan_that_does_not_load_is_an_error_naming_the_file_and_the_way_out(
    trt, tmp_path: Path
) -> None:
    """It matched its key and checksum, so every configure loaded it again: the error names the file to
    delete (the node cannot ask for a rebuild) and says it may be memory (found in review)."""
    engine_on_cpu(tmp_path).warmup()
    trt.refuse_plans = True
    engine = engine_on_cpu(tmp_path)
    plan = next((tmp_path / "tensorrt").glob("vision-*.plan"))
    with pytest.raises(RuntimeError) as err:
        engine.warmup()
    assert f"could not deserialize the vision engine from {plan}" in str(err.value)
    assert "Out of GPU memory" in str(err.value) and f"delete {plan} so that the next configure" in str(
        err.value
    )
    assert engine._stages == {} and engine.model is not None  # as it was: the next warmup tries again
    plan.unlink()
    trt.refuse_plans = False
    trt.built.clear()
    engine.warmup()
    assert trt.built == ["vision"]


def test_a_change_to_the_builders_code_builds_the_plans_again(trt, tmp_path: Path, monkeypatch) -> None:
    """The plans' key holds this module's code digest: builder flags or profiles changed in an update are
    not served from plans built the old way (found in review: the key covered the export's code only)."""
    from rmuscle_ros.engine import tensorrt as trt_engine

    engine_on_cpu(tmp_path).warmup()
    trt.built.clear()
    engine_on_cpu(tmp_path).warmup()
    assert trt.built == []
    monkeypatch.setattr(trt_engine, "builder_code_digest", lambda: "0" * 16)
    engine_on_cpu(tmp_path).warmup()
    assert trt.built == ["vision", "prefill", "denoise"]


def test_a_padded_prompt_runs_at_its_bucket_and_gives_the_padded_calls_actions(trt, tmp_path: Path) -> None:
    """The policy pads every prompt to 200 slots; the engine runs it at the bucket holding its last valid
    token (40 -> 64), and the actions are the eager model's on the padded prompt."""
    engine = engine_on_cpu(tmp_path)
    engine.warmup()
    plan = json.loads(next((tmp_path / "tensorrt").glob("prefill-*.plan")).read_bytes())
    assert plan["profile"]["tokens"] == [[1, 1], [1, OPT_PROMPT_LEN], [1, 200]]
    model = tiny_model()
    inputs, noise = random_inputs(model.cfg, valid_tokens=40, pad_to=200, seed=3)
    trt.log.clear()
    got = engine.sample_actions(inputs, noise)
    assert [shapes["tokens"] for stage, shapes, _ in trt.log if stage == "prefill"] == [(1, 64)]
    assert rel_l2(got, model.sample_actions(inputs, noise)) < 1e-5


def test_without_tensorrt_or_the_exporter_the_backend_says_what_is_missing_at_construction(
    trt, tmp_path: Path, block_imports
) -> None:
    """TensorRT or the exporter's packages missing: each named with where it comes from, at construction."""
    block_imports("onnxscript")
    with pytest.raises(
        RuntimeError,
        match=r"backend 'tensorrt' .*needs onnxscript, not installed here: pip install 'onnx>=1.17' 'onnxscript>=0.3'",
    ):
        engine_on_cpu(tmp_path)
    block_imports("tensorrt")
    with pytest.raises(
        RuntimeError,
        match=r"backend 'tensorrt' needs tensorrt, onnxscript, not installed here: .*JetPack.*pip install 'onnx>=1.17' 'onnxscript>=0.3'",
    ):
        engine_on_cpu(tmp_path)


def test_with_every_plan_cached_the_engine_runs_them_without_exporting(
    trt, tmp_path: Path, block_imports
) -> None:
    """Cached plans are found by the export's key, computed without exporting; the exporter's packages
    are still required, since that key holds onnx's version (a second review found every cached plan
    missed once onnx was uninstalled, where the engine had promised to run without it)."""
    engine_on_cpu(tmp_path).warmup()
    assert trt.exports == 1
    engine = engine_on_cpu(tmp_path)
    engine.warmup()
    assert trt.exports == 1
    # The engine leases its version and plan set from `engine_cache prune` for its life.
    key = asdict(engine._plan_keys()["vision"])
    assert engine_cache.leases(tmp_path) == {(key["export"], engine_cache.plan_set(key))}
    inputs, noise = random_inputs(engine.cfg, seed=4)
    assert rel_l2(engine.sample_actions(inputs, noise), tiny_model().sample_actions(inputs, noise)) < 1e-5
    block_imports("onnx")
    with pytest.raises(RuntimeError, match=r"backend 'tensorrt' needs onnx, not installed here"):
        engine_on_cpu(tmp_path)


def test_the_policy_builds_its_engines_for_the_prompt_length_it_is_given(
    trt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`model.trt_opt_prompt_len` (PolicyConfig) reaches the engines' profiles; its default is the engine's
    own, and a length the preset cannot take is refused naming the setting. (The backend needs CUDA: here
    the policy's engine is made on the CPU with the options the policy passes.)"""
    from rmuscle_ros.runtime import policy as policy_module
    from rmuscle_ros.runtime.policy import Policy, PolicyConfig

    monkeypatch.setattr(
        policy_module,
        "create_engine",
        lambda name, model, device, **options: TensorRTEngine(model, device=torch.device("cpu"), **options),
    )

    assert PolicyConfig().trt_opt_prompt_len == OPT_PROMPT_LEN
    with pytest.raises(ValueError, match=r"^trt_opt_prompt_len: must be in 1\.\.200"):
        PolicyConfig(trt_opt_prompt_len=201)
    policy = Policy(PolicyConfig(backend="tensorrt", engine_cache_dir=str(tmp_path), trt_opt_prompt_len=96))
    policy.engine.warmup()
    plan = json.loads(next((tmp_path / "tensorrt").glob("prefill-*.plan")).read_bytes())
    assert plan["profile"]["tokens"] == [[1, 1], [1, 96], [1, 200]]


def test_the_node_says_which_bucket_its_prompt_runs_at_and_what_to_set() -> None:
    from rmuscle_ros.node.rmuscle_node import prompt_bucket_note

    buckets = onnx_export.prompt_buckets(tiny_model().cfg)
    assert prompt_bucket_note(40, buckets, 64) == (
        True,
        "the prompt takes 40 tokens with the state and runs at the 64-token bucket, the length the TensorRT "
        "engines are tuned for",
    )
    tuned, note = prompt_bucket_note(70, buckets, 64)
    assert not tuned and "runs at the 96-token bucket" in note and "set it to 96" in note


def test_a_plan_is_loaded_only_by_the_tensorrt_gpu_and_profile_it_was_built_for(
    trt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JetPack upgrade (another TensorRT), another GPU or compute capability sharing the cache, another
    `trt_opt_prompt_len` or workspace, another checkpoint: each gets plans of its own, never one built for the others (a
    TensorRT plan is specific to all of them). Found by a mutation review: dropping any of these from the
    plans' key left the suite passing, and a stale plan would have been loaded."""
    from rmuscle_ros.engine.tensorrt import PlanCache

    cache = PlanCache(tmp_path / "tensorrt")

    def paths(**options: Any) -> list[Path]:
        engine = TensorRTEngine(tiny_model(), device=torch.device("cpu"), cache_dir=tmp_path, **options)
        return [cache.path(key) for key in engine._plan_keys().values()]

    seen = [paths()]
    seen.append(paths(opt_prompt_len=96))
    seen.append(paths(workspace_gib=8.0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (11, 1))
    seen.append(paths())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Jetson AGX Orin")
    seen.append(paths())
    monkeypatch.setattr(trt, "__version__", "10.14.0-stand-in")
    seen.append(paths())
    # Another checkpoint of the same preset (a fine-tune): its own export, so its own plans.
    engine = TensorRTEngine(tiny_model(seed=1), device=torch.device("cpu"), cache_dir=tmp_path)
    seen.append([cache.path(key) for key in engine._plan_keys().values()])
    every = [p for ps in seen for p in ps]
    assert len(set(every)) == len(every) == 3 * len(seen)


def test_the_builders_code_digest_follows_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plans' key holds the digest of tensorrt.py's source, so an update that changes how plans are
    built (flags, profiles) builds them again on the Jetson. Found by a mutation review: the test above
    replaces the digest function, so a digest that ignored the source passed."""
    from rmuscle_ros.engine import tensorrt as trt_engine

    source = tmp_path / "tensorrt.py"
    source.write_text("FLAGS = 1\n")
    monkeypatch.setattr(trt_engine, "__file__", str(source))
    before = trt_engine.builder_code_digest()
    source.write_text("FLAGS = 2\n")
    assert trt_engine.builder_code_digest() != before and len(before) == 16


def test_the_networks_are_strongly_typed_with_the_workspace_asked_for(trt, tmp_path: Path) -> None:
    """The bfloat16 export is built as a strongly typed network, so TensorRT keeps its types (float32
    softmax and norms as eager bfloat16 computes them) instead of picking precisions per layer; the
    workspace limit is the engine's. Found by a mutation review: the stand-in ignored both."""
    TensorRTEngine(tiny_model(), device=torch.device("cpu"), cache_dir=tmp_path, workspace_gib=2.0).warmup()
    strongly_typed = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    assert trt.network_flags == [strongly_typed] * 3
    assert trt.workspaces == [(trt.MemoryPoolType.WORKSPACE, 2 << 30)] * 3


def test_an_export_tensorrt_cannot_parse_is_an_error_naming_the_file_and_the_parsers_words(
    trt, tmp_path: Path
) -> None:
    """Found by a mutation review: with the parser's answer ignored, an empty network would be built
    (or fail later with nothing said about the ONNX file)."""
    trt.unparsable = {"denoise"}
    with pytest.raises(
        RuntimeError, match=r"TensorRT could not parse .*denoise\.onnx: In node 7 \(importGelu\): UNSUPPORTED"
    ):
        engine_on_cpu(tmp_path).warmup()
    assert "denoise" not in trt.built


def test_a_plan_holding_another_stages_engine_is_refused_by_name(trt, tmp_path: Path) -> None:
    """A plan file whose engine has other tensors than its stage's (another stage's engine stored under
    its name) is an error naming the stage and both tensor sets, not bound blindly. Found by a mutation
    review."""
    from rmuscle_ros.engine.tensorrt import PlanCache

    engine_on_cpu(tmp_path).warmup()
    engine = engine_on_cpu(tmp_path)
    keys, cache = engine._plan_keys(), PlanCache(tmp_path / "tensorrt")
    vision = cache.load(keys["vision"])
    assert vision is not None
    cache.store(keys["prefill"], vision, 1.0)
    with pytest.raises(RuntimeError, match=r"prefill engine has tensors \['images', 'visual'\], expected"):
        engine.warmup()


def test_a_tensor_of_another_dtype_is_refused_before_tensorrt_reads_its_bytes(trt, tmp_path: Path) -> None:
    """TensorRT reads a bound address as its engine's type: int32 tokens bound as int64 would be read as
    other tokens. Found by a mutation review."""
    engine = engine_on_cpu(tmp_path)
    engine.warmup()
    tokens = aligned_empty((1, 32), torch.int32, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"prefill\.tokens: torch\.int32, the engine takes torch\.int64"):
        engine._stages["prefill"].enqueue({"tokens": tokens}, {}, 0)


def test_force_rebuild_exports_and_builds_again_with_every_plan_cached(trt, tmp_path: Path) -> None:
    """`--force-rebuild` (the way out the deserialize error names) builds every plan again and asks for a
    fresh export, though all are cached. Found by a mutation review."""
    engine_on_cpu(tmp_path).warmup()
    trt.built.clear()
    trt.forced.clear()
    TensorRTEngine(tiny_model(), device=torch.device("cpu"), cache_dir=tmp_path, force_rebuild=True).warmup()
    assert trt.built == ["vision", "prefill", "denoise"] and trt.forced == [True]


def test_a_noise_batch_other_than_the_inputs_is_refused(trt, tmp_path: Path) -> None:
    """As eager and onnxruntime refuse it (found by a mutation review: untested on this backend)."""
    engine = engine_on_cpu(tmp_path)
    engine.warmup()
    inputs, noise = random_inputs(engine.cfg, batch=2)
    with pytest.raises(ValueError, match=r"noise must be \(2, 50, 32\)"):
        engine.sample_actions(inputs, noise[:1])


def test_a_plan_under_another_keys_name_is_not_loaded_and_the_longest_prompt_can_be_the_opt(
    tmp_path: Path,
) -> None:
    """PlanCache.load checks the sidecar's whole key, not only the file name: a plan and sidecar copied
    under another key's name (by hand, from another Jetson) are built again, not loaded. And
    `trt_opt_prompt_len` may be the longest prompt (max_token_len), as PolicyConfig accepts. Found by a
    mutation review."""
    from rmuscle_ros.engine.tensorrt import PlanCache, PlanKey, profile_shapes

    cache = PlanCache(tmp_path)
    orin = PlanKey(2, "a" * 16, "vision", "10.3.0", "NVIDIA Jetson AGX Orin", "8.7", 64, 1 << 32, "b" * 16)
    thor = PlanKey(2, "a" * 16, "vision", "10.13.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b" * 16)
    plan = cache.store(orin, b"orin plan", 1.0)
    plan.rename(cache.path(thor))
    plan.with_suffix(".json").rename(cache.path(thor).with_suffix(".json"))
    assert cache.load(thor) is None
    cfg = tiny_model().cfg
    assert profile_shapes(cfg, "prefill", cfg.max_token_len)["tokens"][1] == (1, cfg.max_token_len)


def test_what_tensorrt_refuses_or_a_first_call_that_fails_is_an_error_not_stale_actions(
    trt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An enqueue TensorRT refuses, an output buffer of another shape than the engine's, an observation of
    another camera count (copy_ would broadcast one camera into all), each raise rather than return the
    previous call's actions; a warmup whose first call fails leaves the engine unwarmed, to try again.
    Found by a mutation review."""
    from rmuscle_ros.models.pi05 import ModelInputs

    engine = engine_on_cpu(tmp_path)
    engine.warmup()
    vision = engine._stages["vision"]
    monkeypatch.setattr(vision.context, "execute_async_v3", lambda stream: False)
    with pytest.raises(RuntimeError, match=r"TensorRT failed to enqueue the vision engine"):
        vision.enqueue({"images": engine._images}, {"visual": engine._visual}, 0)
    cfg = engine.cfg
    short = aligned_empty((1, cfg.image_tokens - 1, cfg.vlm.width), torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"vision\.visual: engine output \(1, \d+, \d+\), buffer"):
        vision.enqueue({"images": engine._images}, {"visual": short}, 0)
    inputs, _ = random_inputs(cfg, seed=6)
    one_camera = ModelInputs(inputs.images[:, :1], inputs.image_masks, inputs.tokens, inputs.token_mask)
    with pytest.raises(ValueError, match=r"images must be \(1, 3, 3, \d+, \d+\), got \(1, 1, 3"):
        engine._load(one_camera)

    fresh = engine_on_cpu(tmp_path)

    def failing_call(inputs: Any, noise: Any) -> Any:
        raise RuntimeError("an asynchronous CUDA error")

    monkeypatch.setattr(fresh, "sample_actions", failing_call)
    with pytest.raises(RuntimeError, match="an asynchronous CUDA error"):
        fresh.warmup()
    assert fresh._stages == {} and fresh.model is not None
