"""Smoke test of bench/probes_rmuscle.py on `tiny`: every probe runs and returns sane fractions, ρ = 1 is
exact, the training forward matches the model's, and one training step gives a finite loss (< 20 s)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import probes_rmuscle as probes
from rmuscle_ros.models.config import get_preset


@pytest.fixture
def one_thread():
    """The script runs with one intra-op thread (see its docstring); restore the test process's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fraction(x: float) -> bool:
    return 0.0 <= x <= 1.0 + 1e-6


def test_probes_run_on_tiny(one_thread) -> None:
    model = probes.build_model(get_preset("tiny"), seed=0)
    out = probes.probe_model(model, calls=3, rho_p=[0.4], rho_n=[0.5], pairs=[(1.0, 1.0), (0.4, 0.5)])
    assert out["recorded_masks_equal_sparse_ffn_top_neurons"]
    ctx = out["context_cache"]["0.4"]
    assert len(ctx["captured_per_layer"]) == model.cfg.vlm.depth - 1
    assert _fraction(ctx["captured_mean"]) and ctx["captured_mean"] <= ctx["best_possible_mean"] + 1e-6
    act = out["action_cache"]["0.5"]
    assert all(_fraction(act[k]) for k in ("kept_own", "kept_with_reference_mask", "overlap_same_task"))
    assert act["kept_with_reference_mask"] <= act["kept_own"] + 1e-6  # a call's own top ρn is the best set
    assert out["episode"]["p1_n1"]["rel_l2_max"] == 0.0
    assert 0.0 < out["episode"]["p0.4_n0.5"]["rel_l2_median"] < 1.0
    assert 0.0 < out["episode"]["p0.4_n0.5"]["rel_l2_median_subtask_prompt"] < 1.0
    assert out["episode"]["p1_n1"]["rel_l2_median_subtask_prompt"] == 0.0, "ρ = 1 is exact for any prompt"
    record = {
        **dict.fromkeys(("date", "commit", "torch", "command"), "-"),
        "setting": {"task": "-", "episodes": "-"},
        "results": {"tiny_random": {"description": "-"} | out},
    }
    report = probes.to_markdown(record)
    assert "## Summary" in report and "Probe 4" in report


def test_training_forward_and_one_step(one_thread) -> None:
    cfg = get_preset("tiny")
    model = probes.build_model(cfg, seed=0)
    inputs, actions = probes.training_batch(cfg, 2, torch.Generator().manual_seed(1))
    assert actions.shape == (2, cfg.horizon, cfg.action_dim)
    assert probes.check_training_prefill(model, inputs) < 1e-4
    report = probes.train(model, steps=1, batch=1, draws=2, lr=1e-3, seed=0)
    assert math.isfinite(report["final_loss"]) and not model.training


def test_load_inputs_probe_times_a_cpu_engine(tiny) -> None:
    """bench/probe_load_inputs.py's timing on the fused engine: host time only (no GPU clock), and its three
    ways of running a call give the same actions."""
    from bench.bench_pi05 import make_inputs, time_call_steps, time_interleaved
    from bench.probe_load_inputs import call_ways, profile_load
    from rmuscle_ros.engine import create_engine

    engine = create_engine("fused", tiny, "cpu")
    inputs, noise = make_inputs(tiny.cfg, 20, torch.device("cpu"), 0)
    ways = call_ways(engine, inputs, noise)
    outputs = []
    for run in ways.values():
        engine.actions.zero_()
        run()
        outputs.append(engine.actions.clone())
    assert all(torch.equal(outputs[0], o) for o in outputs[1:]) and outputs[0].abs().sum() > 0
    figures = time_interleaved(ways, iters=2, cuda=False) | time_call_steps(engine, inputs, noise, iters=2)
    assert set(figures) == {
        "overlapped", "serial", "graphs_alone",
        "begin_load_host_ms", "finish_load_host_ms", "tail_launch_host_ms",
    }  # fmt: skip
    assert all(v > 0 for v in figures.values())
    assert "graph.py" in profile_load(lambda: engine.load_inputs(inputs, noise), 3, cuda=False)


def test_vision_mlp_probe_runs_the_engine_mlps_on_a_cpu(tiny) -> None:
    """bench/probe_vision_mlp.py's variants run the engine's SigLIP MLP over all rows and over ρ of them;
    on a CPU they are timed by wall clock."""
    from bench.bench_pi05 import time_interleaved
    from bench.probe_vision_mlp import mlp_variants
    from rmuscle_ros.engine import create_engine

    engine = create_engine("fused", tiny, "cpu")
    runs = mlp_variants(engine.fused, [0.4])
    assert set(runs) == {"dense", "cached_0.4"}
    ms = time_interleaved(runs, iters=1, cuda=False)
    assert set(ms) == set(runs) and all(v > 0 for v in ms.values())


def test_retrieval_benchmark_times_the_four_situations() -> None:
    """bench/bench_retrieval.py times Retriever.query aligned, on an episode's first call and in fallback,
    and a task change (Retriever.restrict: microseconds, which may round to 0.0 ms)."""
    from bench.bench_retrieval import measure

    ms = measure(episodes=3, calls=6, iters=2)
    queries = ("aligned_ms", "first_call_ms", "fallback_ms")
    assert set(ms) == {*queries, "task_change_ms"} and all(ms[k] > 0 for k in queries)
    assert ms["task_change_ms"] >= 0


def test_rmuscle_benchmark_runs_every_phase_on_a_cpu(tmp_path) -> None:
    """bench/bench_rmuscle.py end to end on `tiny` (CPU smoke run): the ρ row, the rebuild's parts, the
    live call behind a queued part, and the calls by library size, in its JSON record; and a ρp = 1 row
    (the Action Cache alone), which has nothing to rebuild."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "bench" / "bench_rmuscle.py"), "--device", "cpu", "--preset", "tiny",
           "--rho", "0.4,0.5", "--rho", "1,0.5", "--iters", "2", "--calls", "4", "--library-episodes", "1", "3",
           "--out", str(tmp_path), "--name", "smoke"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    row = json.loads((tmp_path / "smoke.json").read_text())["results"]["rmuscle"]
    assert row["speedup"] > 0 and len(row["rebuild_part_ms"]) == 3  # tiny: vision, then its 2 layers
    assert row["live_call_one_part_queued_ms"] > 0 and row["live_call_one_rebuild_queued_ms"] > 0
    sizes = row["library_scaling"]
    assert [s["episodes"] for s in sizes] == [1, 3] and all(s["host"]["cached"] > 0 for s in sizes)
    assert "By library size" in (tmp_path / "smoke.md").read_text()
    assert row["recorded_call_ms"] > 0
    assert row["node_like"]["calls"] >= 1 and row["node_like"]["rmuscle_ms"] > 0  # a new observation each
    assert "Node-like calls" in (tmp_path / "smoke.md").read_text()
    alone = json.loads((tmp_path / "smoke.json").read_text())["results"][
        "rmuscle_p1_n0.5"
    ]  # the Action Cache alone
    assert alone["rebuild_part_ms"] == [] and alone["rebuild_entry_ms"] == 0 and alone["window_entry_mb"] == 0
    assert alone["engine_cache_mb"] < row["engine_cache_mb"]


def test_policy_benchmark_times_a_dense_episode_and_its_cached_repeat(tmp_path) -> None:
    """bench/bench_policy.py on `tiny` (CPU smoke run): the dense episode is recorded and its repeat served
    from the cache (the script checks the modes), each with its preprocess and model times."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "bench" / "bench_policy.py"), "--preset", "tiny", "--device", "cpu",
           "--backend", "fused", "--calls", "3", "--threads", "1", "--out", str(tmp_path), "--name", "smoke"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    results = json.loads((tmp_path / "smoke.json").read_text())["results"]
    for key in ("dense_recorded", "cached"):
        r = results[key]
        assert r["calls"] == 2 and r["median_ms"] >= r["model_ms"] > 0 and r["preprocess_ms"] > 0
    assert results["first_call_repeat"]["modes"] == ["cached"], "the reset's refill serves the first call"


def test_first_rebuild_probe_times_each_part_after_a_reset(tmp_path) -> None:
    """bench/probe_first_rebuild.py on `tiny` (CPU smoke run): a recorded episode, then the parts of the
    reset's refill, each with its pieces; the repeat is served cached."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "bench" / "probe_first_rebuild.py"), "--device", "cpu", "--backend",
           "fused", "--calls", "3", "--out", str(tmp_path), "--commit", "smoke"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    record = json.loads((tmp_path / "probe_first_rebuild_tiny_cpu_smoke.json").read_text())
    assert record["modes"] == {"recorded": ["dense"] * 3, "cached": ["cached"] * 3}
    parts = [r for r in record["results"]["parts"] if r["after"].startswith("the reset after the recorded")]
    assert len(parts) >= 3 and sum(r["completed_an_entry"] for r in parts) == 3, "the episode's 3 calls"
    assert parts[0]["call_load_ms"] > 0 and all(r["total_ms"] >= r["host_ms"] > 0 for r in parts)


def test_call_timeline_probe_splits_each_call_into_host_steps_and_stages(tmp_path) -> None:
    """bench/probe_call_timeline.py on `tiny` (CPU smoke run): the dense call, the engine's cached call and
    the runtime's (checked cached by the script) each get their stages, and the runtime's its host steps
    before the first launch, in order."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "bench" / "probe_call_timeline.py"), "--device", "cpu", "--preset", "tiny",
           "--iters", "2", "--calls", "3", "--out", str(tmp_path), "--commit", "smoke"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    results = json.loads((tmp_path / "probe_call_timeline_tiny_smoke.json").read_text())["results"]
    assert results["dense_engine"]["vision_dense_ms"] > 0 and results["dense_engine"]["tail_dense_ms"] > 0
    for name in ("cached_engine", "cached_runtime"):
        assert results[name]["match_cached_ms"] > 0 and results[name]["tail_cached_ms"] > 0, name
    rt = results["cached_runtime"]
    assert (
        rt["host_runtime_infer_entry_ms"] <= rt["host_begin_load_entry_ms"] <= rt["host_to_first_launch_ms"]
    )
    assert rt["wall_ms"] >= rt["host_to_first_launch_ms"] > 0
