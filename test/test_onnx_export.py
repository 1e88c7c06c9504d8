"""The ONNX export behind the `tensorrt` backend, checked with ONNX Runtime on the CPU.

TensorRT itself cannot be installed here: these tests cover everything up to the engine build (the
export, its numerics through the same stage composition the TensorRT engine uses, the export and plan
caches) and the clear errors a machine without TensorRT gives.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import random_inputs, rel_l2, tiny_model

from rmuscle_ros.engine import create_engine, engine_cache, onnx_export
from rmuscle_ros.engine.onnx_export import ExportError, ensure_export, read_manifest
from rmuscle_ros.engine.onnx_runtime import OnnxRuntimeEngine
from rmuscle_ros.engine.tensorrt import PlanCache, PlanKey, import_tensorrt, profile_shapes
from rmuscle_ros.models.checkpoint import weights_fingerprint
from rmuscle_ros.models.config import get_preset
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model
from rmuscle_ros.runtime.policy import Policy, PolicyConfig, synthetic_observation

onnx = pytest.importorskip(
    "onnx", reason="the export needs the onnx package (pip install 'onnx>=1.17' 'onnxscript>=0.3')"
)
pytest.importorskip("onnxruntime", reason="the export is checked with onnxruntime (in the dev extra)")


@pytest.fixture(scope="module")
def export_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache directory for the module: the engines below share the tiny model's float32 export."""
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def ort_engine(export_cache: Path) -> OnnxRuntimeEngine:
    engine = create_engine("onnxruntime", tiny_model(), "cpu", cache_dir=export_cache)
    timings = engine.warmup()
    assert set(timings) == {"export", "sessions", "first_call"}
    return engine


def test_the_exported_stages_give_eager_float32s_actions(ort_engine) -> None:
    """Vision, prefill and one denoising step as ONNX graphs, replayed num_steps times, give the eager
    model's chunk, for any prompt length (the graphs take it as a dynamic axis), a masked camera and a
    batch of two (one observation at a time)."""
    model = tiny_model()
    for valid, padded, seed in ((3, 5, 1), (12, 16, 2), (150, 200, 3)):
        inputs, noise = random_inputs(model.cfg, batch=2, valid_tokens=valid, pad_to=padded, seed=seed)
        inputs.image_masks[1, 2] = False
        expected = model.sample_actions(inputs, noise)
        got = ort_engine.sample_actions(inputs, noise)
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert rel_l2(got, expected) < 1e-5, (valid, rel_l2(got, expected))


def test_each_stage_graph_matches_its_module(ort_engine) -> None:
    """Stage by stage, ONNX Runtime against the PyTorch module it was exported from (same inputs)."""
    model = tiny_model()
    reference = onnx_export.torch_runner(onnx_export.stage_modules(model))
    inputs, noise = random_inputs(model.cfg, valid_tokens=7, pad_to=9, seed=4)
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def both(stage: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ours = ort_engine._run(stage, feeds)
        ref = reference(stage, feeds)
        for name in onnx_export.OUTPUTS[stage]:
            if ref[name].dtype == torch.bool:
                assert torch.equal(ours[name], ref[name]), f"{stage}.{name}"
            else:
                assert rel_l2(ours[name], ref[name]) < 1e-6, f"{stage}.{name}"
        seen[stage] = ref
        return ref

    onnx_export.sample_actions_by_stage(both, inputs, noise, 2)
    assert set(seen) == set(onnx_export.STAGES)
    assert seen["prefill"]["keys"].shape == (2, 1, 1, model.cfg.image_tokens + 9, 16)


def test_a_padded_prompt_runs_at_its_bucket_with_the_padded_prompts_actions(ort_engine, monkeypatch) -> None:
    """The policy pads every prompt to max_token_len (200); the engine runs it cut after its last valid
    token, rounded up to the graph engine's 32-token bucket (90 -> 96), and gives the actions of the
    untrimmed graphs and of eager float32 on the padded prompt."""
    model = tiny_model()
    inputs, noise = random_inputs(model.cfg, valid_tokens=90, pad_to=200, seed=6)
    untrimmed = onnx_export.sample_actions_by_stage(ort_engine._run, inputs, noise, model.cfg.num_steps)
    seen = []
    run = ort_engine._run

    def spy(stage: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if stage == "prefill":
            seen.append(tuple(feeds["tokens"].shape))
        return run(stage, feeds)

    monkeypatch.setattr(ort_engine, "_run", spy)
    got = ort_engine.sample_actions(inputs, noise)
    assert seen == [(1, 96)]
    assert rel_l2(got, untrimmed) < 1e-5
    assert rel_l2(got, model.sample_actions(inputs, noise)) < 1e-5


def test_trim_prompt_cuts_after_the_last_valid_token_at_a_bucket() -> None:
    cfg = get_preset("pi05")
    buckets = onnx_export.prompt_buckets(cfg)
    assert buckets == [32, 64, 96, 128, 160, 192, 200]

    def width(mask: list[bool], length: int) -> int:
        token_mask = torch.zeros(1, length, dtype=torch.bool)
        token_mask[0, : len(mask)] = torch.tensor(mask)
        inputs = ModelInputs(torch.zeros(1), torch.ones(1, 1), torch.arange(length)[None], token_mask)
        trimmed = onnx_export.trim_prompt(inputs, buckets)
        assert torch.equal(trimmed.tokens, inputs.tokens[:, : trimmed.tokens.shape[1]])
        return trimmed.token_mask.shape[1]

    assert width([True] * 40, 200) == 64
    assert width([True] * 3 + [False] * 30 + [True], 200) == 64  # interior padding is kept
    assert width([True] * 32, 200) == 32 and width([True] * 193, 200) == 200
    assert width([True] * 3, 5) == 5  # never longer than given
    assert width([], 200) == 32
    with pytest.raises(ValueError, match=r"last valid token is number 201, past the longest \(200\)"):
        width([True] * 201, 210)


def test_without_its_packages_the_onnxruntime_backend_says_what_is_missing_at_construction(
    ort_engine, export_cache: Path, tmp_path: Path, block_imports
) -> None:
    """onnxruntime, onnx and onnxscript are needed (the key that finds a cached export holds onnx's
    version), each named with how to install it (pyproject.toml: `onnx` extra, onnxruntime in dev)."""
    block_imports("onnx", "onnxscript")
    with pytest.raises(
        RuntimeError,
        match=r"backend 'onnxruntime' needs onnx, onnxscript, not installed here: pip install 'onnx>=1\.17' 'onnxscript>=0\.3'$",
    ):
        OnnxRuntimeEngine(tiny_model(), device=torch.device("cpu"), cache_dir=tmp_path)
    block_imports("onnxruntime")
    with pytest.raises(
        RuntimeError,
        match=r"needs onnxruntime, onnx, onnxscript, not installed here: pip install onnxruntime .*dev",
    ):
        OnnxRuntimeEngine(tiny_model(), device=torch.device("cpu"), cache_dir=tmp_path)


def test_the_export_key_is_computed_without_importing_onnx(block_imports, monkeypatch) -> None:
    """The tensorrt backend computes it first, even when every plan is cached and nothing is exported."""
    cfg = get_preset("tiny")
    key = onnx_export.export_key(cfg, "w", "bfloat16")
    block_imports("onnx")
    assert onnx_export.export_key(cfg, "w", "bfloat16") == key
    assert "onnx" not in sys.modules and key.onnx == importlib.metadata.version("onnx")

    def version(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    absent = onnx_export.export_key(cfg, "w", "bfloat16")
    assert absent.onnx == "not installed" and absent.digest() != key.digest()
    with pytest.raises(RuntimeError, match=r"the ONNX export needs onnx, not installed here"):
        onnx_export.export_model(tiny_model(), Path("/nonexistent"), weights="w")


def test_the_export_key_follows_the_code_that_defines_the_graphs(tmp_path: Path, monkeypatch) -> None:
    """After a code update that changes the stages or the model, a Thor exports and builds again instead of
    reusing engines of the old graphs (before, found in review, only a hand-bumped format version did)."""
    assert {p.name for p in onnx_export.GRAPH_SOURCES} == {"onnx_export.py", "pi05.py"}
    assert onnx_export.export_key(
        get_preset("tiny"), "w", "bfloat16"
    ).onnxscript == importlib.metadata.version("onnxscript")
    source = tmp_path / "pi05.py"
    source.write_text("def layer(x): return x\n")
    monkeypatch.setattr(onnx_export, "GRAPH_SOURCES", (source,))
    before = onnx_export.export_key(get_preset("tiny"), "w", "bfloat16")
    source.write_text("def layer(x): return 2 * x\n")
    after = onnx_export.export_key(get_preset("tiny"), "w", "bfloat16")
    assert before.code != after.code and before.digest() != after.digest()


def test_an_export_is_found_by_content_and_a_damaged_one_is_replaced(
    ort_engine, export_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same weights reuse the export (a Policy on this cache directory exports nothing); another
    model gets its own directory; a truncated weights file is named, then exported again."""
    export_dir = ort_engine.export_dir
    assert export_dir is not None and export_dir.parent == export_cache / "onnx"
    manifest = read_manifest(export_dir)
    assert manifest["key"]["weights"] == weights_fingerprint(tiny_model())
    # The directory is named by the key's digest, computable without exporting: the tensorrt backend
    # finds its cached plans from it and skips the export when all are there.
    key = onnx_export.export_key(tiny_model().cfg, manifest["key"]["weights"], "float32")
    assert export_dir.name == key.digest() == manifest["digest"]
    assert manifest["key"]["dtype"] == "float32" and manifest["key"]["opset"] == onnx_export.OPSET
    assert {f"{s}.onnx" for s in onnx_export.STAGES} <= set(manifest["files"])

    mtime = (export_dir / "prefill.onnx").stat().st_mtime_ns
    os.utime(export_dir / "manifest.json", (1e9, 1e9))  # last used in 2001
    policy = Policy(PolicyConfig(backend="onnxruntime", engine_cache_dir=str(export_cache)))
    policy.engine.warmup()
    assert policy.engine.export_dir == export_dir  # found by content, not exported again:
    assert (export_dir / "prefill.onnx").stat().st_mtime_ns == mtime
    # and marked used, for `engine_cache prune` (test_engine_cache.py), and leased while the engine lives
    assert (export_dir / "manifest.json").stat().st_mtime > time.time() - 600
    assert (export_dir.name, engine_cache.EXPORT_ONLY) in engine_cache.leases(export_cache)
    chunk = policy.infer(synthetic_observation(policy.cfg, "pick up the cube"))
    eager = Policy(PolicyConfig(backend="eager"))
    expected = eager.infer(synthetic_observation(eager.cfg, "pick up the cube"))
    assert rel_l2(torch.from_numpy(chunk.actions), torch.from_numpy(expected.actions)) < 1e-5

    other = tiny_model(seed=1)
    assert (
        onnx_export.export_key(other.cfg, weights_fingerprint(other), "float32").digest() != export_dir.name
    )

    damaged = export_cache / "damaged"
    shutil.copytree(export_dir, damaged)
    data = damaged / "denoise.onnx.data"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(ExportError, match=r"denoise\.onnx\.data does not match its manifest"):
        read_manifest(damaged, verify=False)
    (damaged / "manifest.json").unlink()
    with pytest.raises(ExportError, match=r"not an ONNX export: no manifest\.json"):
        read_manifest(damaged)

    # ensure_export on a damaged directory at the model's key: reported, exported again, usable.
    shutil.rmtree(damaged)
    vision = export_dir / "vision.onnx.data"
    vision.write_bytes(vision.read_bytes()[:-8])
    with caplog.at_level(logging.WARNING):
        again = ensure_export(tiny_model(), export_cache / "onnx", weights=manifest["key"]["weights"])
    assert again == export_dir
    assert "vision.onnx.data does not match its manifest" in caplog.text
    assert read_manifest(again)["files"]["vision.onnx.data"] == manifest["files"]["vision.onnx.data"]


# TensorRT's ONNX parser, per operator: the data types it takes and, where the operator reads axes from an
# input, that input's index (it must be a constant). Facts from onnx-tensorrt's docs/operators.md, release
# 10.1 (opsets 9 to 20), for the operators the export emits; an operator missing here fails the test.
# LayerNormalization is left out on purpose: its importer sets the layer's compute precision, which a
# strongly typed network rejects (NvInfer.h, release 10.13), so the export spells SigLIP's norms out.
FLOATS = {"FLOAT", "FLOAT16", "BFLOAT16"}
INTS = {"INT32", "INT64"}
TENSORRT_OPS: dict[str, tuple[set[str], int | None]] = {
    "Add": (FLOATS | INTS, None),
    "And": ({"BOOL"}, None),
    "Cast": (FLOATS | INTS | {"BOOL", "UINT8"}, None),
    "Concat": (FLOATS | INTS | {"BOOL"}, None),
    "Cos": (FLOATS, None),
    "CumSum": (FLOATS, 1),
    "Div": (FLOATS | INTS, None),
    "Expand": (FLOATS | INTS | {"BOOL"}, None),
    "Gather": (FLOATS | INTS | {"BOOL"}, None),
    "Gelu": (FLOATS | INTS, None),
    "Gemm": (FLOATS, None),
    "MatMul": (FLOATS, None),
    "Mul": (FLOATS | INTS, None),
    "Neg": (FLOATS | INTS, None),
    "Pow": (FLOATS, None),
    "Reciprocal": (FLOATS, None),
    "ReduceMean": (FLOATS | INTS, 1),
    "ReduceSum": (FLOATS | INTS, 1),
    "Reshape": (FLOATS | INTS | {"BOOL"}, None),
    "Sin": (FLOATS, None),
    "Slice": (FLOATS | INTS | {"BOOL"}, 3),
    "Softmax": (FLOATS, None),
    "Split": (FLOATS | INTS | {"BOOL"}, None),
    "Sqrt": (FLOATS, None),
    "Squeeze": (FLOATS | INTS | {"BOOL"}, 1),
    "Sub": (FLOATS | INTS, None),
    "Tanh": (FLOATS, None),
    "Transpose": (FLOATS | INTS | {"BOOL"}, None),
    "Unsqueeze": (FLOATS | INTS | {"BOOL"}, 1),
    "Where": (FLOATS | INTS | {"BOOL"}, None),
}


@pytest.mark.slow
def test_the_bfloat16_export_is_what_tensorrts_parser_takes(tmp_path: Path) -> None:
    """The TensorRT path builds the bfloat16 export as a strongly typed network, which keeps the graph's
    types. ONNX Runtime has no bfloat16 CPU kernels, so this checks the graph itself: ONNX's full checker
    (with shape inference) at an opset TensorRT 10 reads; bfloat16 K/V and float32 at every softmax (as
    eager computes attention); and every node an operator, input type and constant axes that TensorRT's
    parser documents."""
    model = tiny_model()
    weights = weights_fingerprint(model)
    out = onnx_export.export_model(model.to(torch.bfloat16), tmp_path / "bf16", weights=weights)
    manifest = read_manifest(out)
    assert manifest["key"]["dtype"] == "bfloat16" and manifest["key"]["weights"] == weights
    assert onnx_export.OPSET <= 20
    name = onnx.TensorProto.DataType.Name
    for stage in onnx_export.STAGES:
        path = out / f"{stage}.onnx"
        onnx.checker.check_model(str(path), full_check=True)
        proto = onnx.load(str(path), load_external_data=False)
        assert {o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")} == {onnx_export.OPSET}
        graph = onnx.shape_inference.infer_shapes(proto).graph
        types = {
            v.name: name(v.type.tensor_type.elem_type)
            for v in [*graph.input, *graph.output, *graph.value_info]
        }
        types |= {t.name: name(t.data_type) for t in graph.initializer}
        constants = {t.name for t in graph.initializer} | {
            o for n in graph.node if n.op_type == "Constant" for o in n.output
        }
        for node in graph.node:
            if node.op_type == "Constant":
                continue
            assert node.op_type in TENSORRT_OPS, (
                f"{stage}: {node.op_type} is not in TensorRT's documented operators"
            )
            allowed, axes = TENSORRT_OPS[node.op_type]
            data = node.input[1] if node.op_type == "Where" else node.input[0]
            assert types[data] in allowed, f"{stage}: {node.op_type} on {types[data]}"
            if axes is not None and len(node.input) > axes and node.input[axes]:
                assert node.input[axes] in constants, f"{stage}: {node.op_type}'s axes are not a constant"
        if stage == "vision":
            assert "Conv" not in {n.op_type for n in graph.node}  # the patch embedding is a MatMul
        if stage == "prefill":
            assert types["keys"] == types["values"] == "BFLOAT16" and types["tokens"] == "INT64"
        if stage == "denoise":
            assert types["x"] == types["x_next"] == "FLOAT"
        softmax_inputs = {types[n.input[0]] for n in graph.node if n.op_type == "Softmax"}
        assert softmax_inputs == {"FLOAT"}, stage


def test_the_engine_cache_keeps_plans_by_key_and_rejects_altered_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = PlanCache(tmp_path)
    key = PlanKey(1, "abc", "prefill", "11.0.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b1")
    assert cache.load(key) is None
    path = cache.store(key, b"plan bytes", 12.0)
    assert cache.load(key) == b"plan bytes"
    assert json.loads(path.with_suffix(".json").read_text())["key"]["gpu"] == "NVIDIA Thor"
    for changed in (PlanKey(1, "abc", "prefill", "10.13.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b1"),
                    PlanKey(1, "abd", "prefill", "11.0.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b1"),
                    PlanKey(1, "abc", "prefill", "11.0.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b2")):  # fmt: skip
        assert cache.load(changed) is None  # another TensorRT, export or builder code: another file
    path.write_bytes(b"plan byt")
    with caplog.at_level(logging.WARNING):
        assert cache.load(key) is None
    assert "does not match its sidecar" in caplog.text
    assert not list(tmp_path.glob(".*.tmp"))


def test_what_a_killed_writer_left_is_removed_and_a_live_writers_files_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed while it wrote a plan or an export left its staging files for good (found in
    review: an export's is 6.5 GB at full size). The next store or export removes the entries written
    before this boot, and those an hour quiet whose pid is gone or is this process's (a container's runs
    are each pid 1); a fresh entry of a pid not seen here may be a live writer in another pid namespace
    and stays, as do live writers' (the closing review found the bare pid test wrong both ways).
    The host is taken to have booted two hours ago: on one up for less than an hour (a fresh CI machine)
    an hour-quiet entry is also one written before the boot (a fresh clone's run failed so, 20 minutes after
    its machine booted)."""
    import os
    import subprocess
    import time

    from rmuscle_ros.cache import lock
    from rmuscle_ros.engine.onnx_export import LEFTOVER_QUIET_S, remove_dead_writers_leftovers

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, me = gone.pid, os.getpid()
    booted = time.time() - 2 * LEFTOVER_QUIET_S
    monkeypatch.setattr(lock, "boot_time", lambda: booted)
    quiet = time.time() - LEFTOVER_QUIET_S - 60
    entries = {
        f".vision-abc.plan.{dead}.tmp": quiet,  # a killed writer's, an hour quiet: removed
        f".0123abcd.{dead}.k2j4x9q1": quiet,  # a killed export's staging folder: removed
        f".prefill-abc.plan.{me}.tmp": quiet,  # an earlier run that had this pid: removed
        ".denoise-abc.plan.1.tmp": booted - 60,  # written before this boot (pid 1 lives on): removed
        f".vision-abc.json.{dead}.tmp": None,  # fresh, pid not seen here: another namespace's, kept
        f".0123abcd.{me}.m3n4p5q6": None,  # this process's, being written: kept
        ".denoise-abc.json.1.tmp": quiet,  # pid 1 is alive here: kept
        ".notes": quiet,  # no pid in its name: not ours, kept
    }
    for name, written in entries.items():
        path = tmp_path / name
        path.mkdir() if "abcd" in name else path.write_bytes(b"half written")
        if written is not None:
            os.utime(path, (written, written))
    PlanCache(tmp_path).store(
        PlanKey(1, "abc", "vision", "11.0.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b1"), b"p", 1.0
    )
    assert sorted(p.name for p in tmp_path.glob(".*")) == sorted(
        [f".vision-abc.json.{dead}.tmp", f".0123abcd.{me}.m3n4p5q6", ".denoise-abc.json.1.tmp", ".notes"]
    )
    assert remove_dead_writers_leftovers(tmp_path) == []


def test_the_engines_optimisation_profiles_cover_every_prompt_length() -> None:
    cfg = get_preset("pi05")
    assert profile_shapes(cfg, "vision", 64) == {}
    prefill = profile_shapes(cfg, "prefill", 64)
    assert prefill["tokens"] == ((1, 1), (1, 64), (1, 200)) == prefill["token_mask"]
    denoise = profile_shapes(cfg, "denoise", 64)
    assert denoise["keys"] == ((18, 1, 1, 769, 256), (18, 1, 1, 832, 256), (18, 1, 1, 968, 256))
    assert denoise["pad_mask"] == ((1, 769), (1, 832), (1, 968))
    with pytest.raises(ValueError, match=r"opt_prompt_len must be in 1\.\.200, got 0"):
        profile_shapes(cfg, "prefill", 0)


def test_without_tensorrt_the_backend_says_what_it_needs(tiny: Pi05Model) -> None:
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="backend 'tensorrt' needs a CUDA GPU"):
            create_engine("tensorrt", tiny, "cpu")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(
            RuntimeError, match=r"TensorRT's Python bindings .* JetPack; .* docker/Dockerfile\.thor"
        ):
            import_tensorrt()
    else:
        pytest.skip("TensorRT is installed here: the missing-TensorRT error cannot be shown")


def test_rmuscle_is_refused_on_the_exported_backends() -> None:
    from rmuscle_ros.cache.runtime import RMuscleConfig

    with pytest.raises(ValueError, match=r"rMuscle needs backend 'graph' .* not 'onnxruntime'"):
        Policy(PolicyConfig(backend="onnxruntime"), cache=RMuscleConfig())


def test_two_exporters_of_one_model_export_it_once_and_prune_clears_killed_writers_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: two nodes starting on an empty cache each exported, and the second deleted the
    first's export while the first's TensorRT build read it (or failed renaming onto it). One exporter of
    a digest at a time now: the second waits and finds the first's. And `engine_cache prune` removes what
    writers killed mid-export left (6.5 GB at full size), which only a later export did before, and none
    comes once the export is made."""
    import threading
    from dataclasses import asdict

    from rmuscle_ros.cache import lock

    calls: list[str] = []

    def stub_export(model, out, *, weights):  # a valid-looking export, slowly
        out = Path(out)
        out.mkdir(parents=True)
        calls.append(threading.current_thread().name)
        time.sleep(0.5)
        key = onnx_export.export_key(model.cfg, weights, onnx_export.dtype_name(model))
        files = {}
        for stage in onnx_export.STAGES:
            path = out / f"{stage}.onnx"
            path.write_bytes(f"{stage} by {threading.current_thread().name}".encode())
            files[path.name] = {"bytes": path.stat().st_size, "sha256": onnx_export._sha256(path)}
        manifest = {"key": asdict(key), "digest": key.digest(), "files": files}
        (out / onnx_export.MANIFEST).write_text(json.dumps(manifest))
        return out

    monkeypatch.setattr(onnx_export, "export_model", stub_export)
    model, got = tiny_model(), {}

    def export(name: str) -> None:
        got[name] = ensure_export(model, tmp_path / "onnx", weights="sha256:w")

    threads = [threading.Thread(target=export, args=(n,), name=n) for n in ("first", "second")]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and got["first"] == got["second"], (calls, got)
    assert (got["first"] / "vision.onnx").read_text() == f"vision by {calls[0]}"

    quiet = time.time() - onnx_export.LEFTOVER_QUIET_S - 60
    monkeypatch.setattr(lock, "boot_time", lambda: quiet - 3600)
    killed = tmp_path / "onnx" / f".{got['first'].name}.{2**22 + 17}.k2j4x9q1"  # a pid not alive here
    killed.mkdir()
    (killed / "vision.onnx").write_bytes(b"half")
    os.utime(killed, (quiet, quiet))
    assert engine_cache.main(["--cache-dir", str(tmp_path), "prune", "--keep", "1"]) == 0
    assert not killed.exists() and got["first"].exists()
    assert f"removed 1 leftover(s) of writers that are gone: {killed.name}" in capsys.readouterr().out


def test_a_noise_batch_other_than_the_inputs_is_refused_as_eager_refuses_it(ort_engine) -> None:
    """Found in review: batch-2 inputs with batch-1 noise returned one chunk through ONNX Runtime (and, by
    reading, TensorRT), where eager raises: every engine now checks the noise's shape the same way."""
    inputs, noise = random_inputs(ort_engine.cfg, batch=2)
    with pytest.raises(ValueError, match=r"noise must be \(2, 50, 32\) \(batch, horizon, action_dim\)"):
        ort_engine.sample_actions(inputs, noise[:1])


def test_the_export_and_engine_commands_refuse_bad_arguments_before_loading_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: an existing --out and an unknown --preset ended in tracebacks, the first after the
    model's load (minutes at full size); the TensorRT command loaded the model before finding no TensorRT
    (or, without CUDA, died loading it). Each is a usage error now, before any load."""
    from rmuscle_ros.engine import tensorrt

    for argv, says in (
        (["--out", str(tmp_path)], "exists; name a new directory"),
        (["--out", str(tmp_path / "new"), "--preset", "pi6"], "argument --preset: invalid choice: 'pi6'"),
    ):
        with pytest.raises(SystemExit) as usage:
            onnx_export.main(argv)
        assert usage.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        tensorrt.main(["--preset", "tiny", "--opt-prompt-len", "0"])
    assert (
        usage.value.code == 2
        and "--opt-prompt-len: opt_prompt_len must be in 1..200, got 0" in capsys.readouterr().err
    )
    if not tensorrt.missing_packages(("tensorrt",)):
        return  # a machine with TensorRT (a Thor) goes on to build
    with pytest.raises(SystemExit) as usage:
        tensorrt.main(["--preset", "tiny"])
    assert usage.value.code == 2 and "the tensorrt backend needs tensorrt" in capsys.readouterr().err


def _stub_export(calls: list[str]):
    """export_model's stand-in: a valid-looking export (files and manifest as export_model writes them),
    without tracing the model; `calls` records each."""
    from dataclasses import asdict

    def export(model, out, *, weights):
        out = Path(out)
        out.mkdir(parents=True)
        calls.append(out.name)
        key = onnx_export.export_key(model.cfg, weights, onnx_export.dtype_name(model))
        files = {}
        for stage in onnx_export.STAGES:
            for name, data in (
                (f"{stage}.onnx", b"graph " + stage.encode()),
                (f"{stage}.onnx.data", b"w" * 64),
            ):
                (out / name).write_bytes(data)
                files[name] = {"bytes": len(data), "sha256": onnx_export._sha256(out / name)}
        manifest = {"key": asdict(key), "digest": key.digest(), "files": files}
        (out / onnx_export.MANIFEST).write_text(json.dumps(manifest))
        return out

    return export


def test_the_export_key_holds_the_toolchain_and_the_model_it_was_made_with() -> None:
    """A JetPack or pip upgrade of torch or onnx-ir (the exporter and its optimisation passes), another
    opset or another model config each get an export (and plans) of their own, never one made with the
    others. Found by a mutation review: torch's and onnx-ir's versions, the opset and the config could be
    left out of the key with the suite passing."""
    cfg = get_preset("tiny")
    key = onnx_export.export_key(cfg, "w", "bfloat16")
    assert key.torch == torch.__version__ and key.onnx_ir == importlib.metadata.version("onnx-ir")
    assert key.opset == onnx_export.OPSET and key.config == cfg.to_dict() and key.dtype == "bfloat16"
    assert onnx_export.export_key(get_preset("small"), "w", "bfloat16").digest() != key.digest()
    assert onnx_export.export_key(cfg, "w", "float32").digest() != key.digest()
    with pytest.raises(
        ValueError, match=r"export dtype must be one of \['bfloat16', 'float32'\], got 'float16'"
    ):
        onnx_export.export_key(cfg, "w", "float16")


def test_an_export_altered_in_place_missing_a_file_or_of_another_format_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """read_manifest checks every file's sha256 (a flipped bit on an SD card keeps the size), that every
    file is there and the format version; each is an ExportError, so that ensure_export exports again
    rather than serving or building from a damaged export. Found by a mutation review: only a truncated
    file was tested."""
    from dataclasses import asdict

    calls: list[str] = []
    monkeypatch.setattr(onnx_export, "export_model", _stub_export(calls))
    model = tiny_model()
    export = ensure_export(model, tmp_path, weights="sha256:w")
    data = export / "prefill.onnx.data"
    data.write_bytes(b"W" + data.read_bytes()[1:])  # same size, another byte
    read_manifest(export, verify=False)  # sizes only: as documented
    with pytest.raises(ExportError, match=r"prefill\.onnx\.data does not match its manifest"):
        read_manifest(export)
    (export / "denoise.onnx").unlink()
    with pytest.raises(ExportError, match=r"denoise\.onnx is missing"):
        read_manifest(export, verify=False)
    manifest = json.loads((export / onnx_export.MANIFEST).read_text())
    manifest["files"] = {}
    manifest["key"]["format_version"] = onnx_export.FORMAT_VERSION + 1
    (export / onnx_export.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=r"export format 2, this version reads 1"):
        read_manifest(export)
    (export / onnx_export.MANIFEST).write_text("{not json")
    with pytest.raises(ExportError, match=r"unreadable manifest"):
        read_manifest(export)

    # At the model's digest, a directory whose manifest names another key (copied there by hand): exported
    # again, not served.
    shutil.rmtree(export)
    assert ensure_export(model, tmp_path, weights="sha256:w") == export and len(calls) == 2
    manifest = json.loads((export / onnx_export.MANIFEST).read_text())
    manifest["key"]["weights"] = "sha256:another"
    (export / onnx_export.MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        assert ensure_export(model, tmp_path, weights="sha256:w") == export
    assert len(calls) == 3 and "exported for another model or toolchain" in caplog.text
    assert read_manifest(export)["key"] == asdict(onnx_export.export_key(model.cfg, "sha256:w", "float32"))


def test_a_forced_export_exports_again_though_one_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """force (the onnxruntime backend's force_export, the tensorrt backend's --force-rebuild) replaces a
    matching export. Found by a mutation review."""
    calls: list[str] = []
    monkeypatch.setattr(onnx_export, "export_model", _stub_export(calls))
    model = tiny_model()
    first = ensure_export(model, tmp_path, weights="sha256:w")
    assert ensure_export(model, tmp_path, weights="sha256:w") == first and len(calls) == 1
    assert ensure_export(model, tmp_path, weights="sha256:w", force=True) == first and len(calls) == 2
    assert read_manifest(first)["digest"] == first.name
