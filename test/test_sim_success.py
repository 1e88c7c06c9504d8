"""bench/sim_success.py, the closed-loop success benchmark: its data and the pairing it relies on."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip(
    "gym_aloha", reason="gym-aloha (the ALOHA scenes) is not installed: make venv installs it"
)

from bench import sim_success
from rmuscle_ros.cache.runtime import LEARNING_REASON
from rmuscle_ros.sim.scripted import EPISODE_STEPS


def test_a_frames_action_chunk_stays_within_its_episode() -> None:
    """Each frame's target is its own episode's next `horizon` commands; past the episode's end the last
    command repeats (the arm holds it), never the next episode's first."""
    actions = np.repeat(np.arange(2 * EPISODE_STEPS, dtype=np.float32)[:, None], 14, axis=1)
    demos = {"actions": actions, "frame_step": np.array([0, EPISODE_STEPS - 5, EPISODE_STEPS])}
    chunks = sim_success.chunk_targets(demos, horizon=10)
    np.testing.assert_array_equal(chunks[0, :, 0], np.arange(10))
    last = EPISODE_STEPS - 1
    np.testing.assert_array_equal(chunks[1, :, 0], [*range(EPISODE_STEPS - 5, EPISODE_STEPS), *[last] * 5])
    np.testing.assert_array_equal(chunks[2, :, 0], np.arange(EPISODE_STEPS, EPISODE_STEPS + 10))


def test_seeds_parse_as_ranges_and_lists() -> None:
    assert sim_success.parse_seeds("0-3,7,10-11") == [0, 1, 2, 3, 7, 10, 11]


def test_evaluate_refuses_an_unfinished_policy_and_a_node_run_from_seed_0(tmp_path) -> None:
    """Found in review: a retrain cut short left its new norm stats beside the old model, and evaluate ran
    the pair (training.json, written last, now marks a finished policy); `--node --seeds 0-…` gave
    aloha_sim seed -1, refused once the run had started."""
    policy = tmp_path / "policy"
    policy.mkdir()
    evaluate = ["evaluate", "--policy", str(policy), "--results", str(tmp_path / "results")]
    with pytest.raises(
        SystemExit, match=r"training\.json is missing: not a policy `sim_success train` finished"
    ):
        sim_success.main(evaluate)
    (policy / "training.json").write_text(json.dumps({"preset": "tiny"}))
    with pytest.raises(SystemExit, match=r"--seeds: from 1 with --node .*, got 0"):
        sim_success.main([*evaluate, "--node", "--seeds", "0-3", "--warmup-seeds", "10-11"])
    # Scenes the library was warmed up on, or the policy was taught, measure recall (found in review: not
    # checked); refused before anything runs.
    with pytest.raises(SystemExit, match=r"--seeds: 2 scene\(s\) also in --warmup-seeds"):
        sim_success.main([*evaluate, "--seeds", "1000-1009", "--warmup-seeds", "1008-1011"])
    (policy / "training.json").write_text(json.dumps({"preset": "tiny", "demonstration_seeds": [3, 1004]}))
    with pytest.raises(
        SystemExit, match=r"--seeds: 1 scene\(s\) also in the policy's demonstrations \(\[1004\]"
    ):
        sim_success.main([*evaluate, "--seeds", "1000-1009", "--warmup-seeds", "2000-2001"])


@pytest.mark.slow
def test_collect_train_evaluate_on_one_scene(tmp_path) -> None:
    """The three stages end to end at toy sizes: the demonstrations round-trip through their file, the
    trained files load into a Policy, a repeated scene is served from the cache (its window refilled
    between calls, as the node does), each call's action error is measured against a dense policy on the
    same inputs and noise (0 for a dense call) and by the audits, and the report is written."""
    data = tmp_path / "demos.safetensors"
    sim_success.collect([0], data, placement_spread=0.25)
    demos = sim_success.load_demos(data)
    frames = EPISODE_STEPS // sim_success.FRAME_EVERY
    assert len(demos["frames"]) == frames and demos["frames"][0].shape == (168, 224, 3)
    assert demos["state"].shape == (frames, 14) and demos["actions"].shape == (EPISODE_STEPS, 14)
    policy = tmp_path / "policy"
    sim_success.train(data, policy, 2, 2, 1, 1e-4, 0, 1.0, state_noise=0.3, state_dropout=0.0)
    training = json.loads((policy / "training.json").read_text())
    assert training["steps"] == 2 and training["placement_spread"] == 0.25
    from rmuscle_ros.runtime.policy import Policy, PolicyConfig

    config = PolicyConfig(
        checkpoint=str(policy / "model.safetensors"),
        norm_stats=str(policy / "norm_stats.json"),
        backend="fused",
        cameras=(sim_success.CAMERA,),
    )
    from rmuscle_ros.cache.runtime import RMuscleConfig

    sim = sim_success.make_sim(0.25)
    dense = Policy(config)
    cached = Policy(config, cache=RMuscleConfig(rebuilds_per_tick=20, audit_every=1))
    first = sim_success.episode(sim, cached, 5, 50, shadow=dense)
    recorded = cached.reset_episode()  # records it: the repeat of the scene is served from it
    repeat = sim_success.episode(sim, cached, 5, 50, shadow=dense)
    sim.close()
    assert recorded is not None
    # each cached call names the recorded episode's call it was served from; other calls name none
    for ref, m in zip(repeat["references"], repeat["modes"], strict=True):
        assert (ref is not None and ref[0] == recorded and ref[1] >= 0) if m == "cached" else ref is None
    assert first["references"] == [None] * len(first["modes"])
    repeat |= {"seed": 5, "library_id": None}
    sim_success.served_from([repeat], [{"seed": 5, "library_id": recorded}])
    assert [s is not None and s[0] == 5 for s in repeat["served_from"]] == [
        m == "cached" for m in repeat["modes"]
    ]
    assert first["modes"] and set(first["modes"]) == {"dense"}
    assert first["rel_l2"] == [0.0] * len(first["modes"])  # paired with the same inputs and noise
    assert "cached" in repeat["modes"], repeat["modes"]  # the window was refilled between the calls
    assert all(0.0 < e < 1.0 for e, m in zip(repeat["rel_l2"], repeat["modes"], strict=True) if m == "cached")
    # every cached call audited in its motion window: the audit measures what the dense shadow does
    for e, a, m in zip(repeat["rel_l2"], repeat["audits"], repeat["modes"], strict=True):
        assert a is None if m != "cached" else a == pytest.approx(e, rel=1e-5)
    results = tmp_path / "results"
    evaluate = ["evaluate", "--policy", str(policy), "--seeds", "5", "--warmup-seeds", "6", "--replan", "50"]
    sim_success.main([*evaluate, "--results", str(results), "--name", "one", "--dense-control"])
    report = json.loads((results / "one.json").read_text())
    # the node's default schedule, ramp (a variant key without a suffix is uniform, as in earlier results)
    assert set(report["results"]) == {"scripted", "dense", "dense_control", "rmuscle_0.4_0.5_ramp"}
    assert report["results"]["scripted"]["successes"] == 1  # the demonstrator on that scene
    control = report["results"]["dense_control"]
    assert control["episodes"] == 1 and control["noise_offset"] == sim_success.CONTROL_NOISE_OFFSET
    assert (
        "| dense | " in (results / "one.md").read_text()
        and "dense_control: " in (results / "one.md").read_text()
    )


class _CountingPolicy:
    """A stand-in for the policy, to see which chunk row the loop executes when: call c's row r is
    c * 1000 + r in every action dimension."""

    model_cfg = SimpleNamespace(horizon=50, action_dim=14)

    def __init__(self) -> None:
        self.calls = 0

    def infer(self, obs: object, noise: object) -> object:
        rows = self.calls * 1000 + np.arange(50, dtype=np.float32)
        self.calls += 1
        return type("Chunk", (), {"actions": np.repeat(rows[:, None], 14, axis=1), "cache_mode": "dense"})

    def rebuild_cache(self, wait: bool = False) -> None:
        pass

    def cache_call_status(self) -> None:
        return None  # as a Policy without a cache

    def audit_cache(self) -> None:
        return None


def test_latency_steps_let_the_previous_chunk_run_on(monkeypatch) -> None:
    """`--latency-steps`: a chunk takes over `latency` steps after its observation, at its row `latency`;
    until then the previous chunk goes on past its `replan` rows, and before the episode's first chunk
    nothing is commanded (the arms hold). Without latency, call c's rows 0 .. replan-1 in turn."""
    executed: dict[int, float] = {}  # the sim's step (AlohaSim.steps) -> the row commanded at it

    def record(sim: object, action: np.ndarray) -> None:
        executed[sim.steps] = float(action[0])  # type: ignore[attr-defined]

    sim = sim_success.make_sim(0.25)
    monkeypatch.setattr(sim_success, "command", record)
    try:
        sim_success.episode(sim, _CountingPolicy(), 0, 25, latency=4)
        assert 0 not in executed and 3 not in executed  # before the first chunk: held
        assert executed[4] == 4 and executed[24] == 24  # call 0 from its row 4
        assert executed[25] == 25 and executed[28] == 28  # call 0 goes on while call 1 is under way
        assert executed[29] == 1004 and executed[50] == 1025  # call 1 from its row 4
        executed.clear()
        sim_success.episode(sim, _CountingPolicy(), 0, 25)
        assert executed[0] == 0 and executed[24] == 24 and executed[25] == 1000 and executed[49] == 1024
        # A delay as long as the replanning period or longer: each chunk still takes its turn (found in
        # review: one pending slot, each chunk replaced by the next before its turn, nothing commanded).
        executed.clear()
        sim_success.episode(sim, _CountingPolicy(), 0, 10, latency=25)
        assert 24 not in executed and executed[25] == 25 and executed[34] == 34
        assert executed[35] == 1025 and executed[45] == 2025
    finally:
        sim.close()


class _RowsAfterPolicy(_CountingPolicy):
    """The counting policy's chunks with every row from `after` on changed: a shadow that agrees with it
    on the rows before `after` alone."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def infer(self, obs: object, noise: object) -> object:
        chunk = super().infer(obs, noise)
        chunk.actions[self.after :] += 1.0  # type: ignore[attr-defined]
        return chunk


def test_executed_rows_error_covers_the_rows_the_arms_execute() -> None:
    """`rel_l2_executed` compares only the rows a chunk has executed (`latency` .. `latency + replan - 1`):
    a shadow that differs from row latency + replan on gives 0 there and an error over the whole chunk;
    one that differs from row latency + replan - 1 on gives an error there too."""
    sim = sim_success.make_sim(0.25)
    try:
        run = sim_success.episode(sim, _CountingPolicy(), 0, 25, shadow=_RowsAfterPolicy(29), latency=4)
        assert run["rel_l2_executed"] == [0.0] * len(run["modes"])
        assert all(e > 0 for e in run["rel_l2"])
        run = sim_success.episode(sim, _CountingPolicy(), 0, 25, shadow=_RowsAfterPolicy(28), latency=4)
        assert all(e > 0 for e in run["rel_l2_executed"])
    finally:
        sim.close()


class _FallbackPolicy(_CountingPolicy):
    """The counting policy, its calls in mode fallback for `reason`: RMuscle's learning episode (run dense
    to be recorded, LEARNING_REASON) or a scene that left the reference (similarity under the threshold)."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def infer(self, obs: object, noise: object) -> object:
        chunk = super().infer(obs, noise)
        chunk.cache_mode = "fallback"  # type: ignore[attr-defined]
        return chunk

    def cache_call_status(self) -> dict:
        return {"reason": self.reason, "reference_episode": -1, "reference_position": -1}


def test_an_episode_run_dense_to_be_recorded_is_counted_apart() -> None:
    """An episode after one served from the cache that fell back runs dense to be recorded: its calls are
    fallback in the modes, counted as learning calls, and the episode is not counted as fallen back (found in
    review: it was, beside the episode that really fell back); the table says how many were learning."""
    sim = sim_success.make_sim(0.25)
    try:
        policies = (
            _FallbackPolicy(LEARNING_REASON),
            _CountingPolicy(),
            _FallbackPolicy("similarity 0.5 below 0.8"),
        )
        runs = [sim_success.episode(sim, p, 0, 25) for p in policies]
    finally:
        sim.close()
    assert [r["learning"] for r in runs] == [True, False, False]
    calls = len(runs[0]["modes"])
    assert [r["learning_calls"] for r in runs] == [calls, 0, 0]
    assert sim_success.fallen_back(runs) == 1  # the third alone
    summary = sim_success.summarise(runs, 1.0)
    assert summary["episodes_learning"] == 1 and summary["per_episode"][0]["learning"]
    assert summary["learning_calls"] == calls and summary["modes"]["fallback"] == 2 * calls
    report = {"date": "d", "commit": "c", "command": "x", "setting": "s", "results": {"v": summary}}
    assert f"| 0 / {calls} / {2 * calls} ({calls} learning) |" in sim_success.to_markdown(report)


def test_discordant_scenes_and_their_sign_test() -> None:
    """The dense control's comparison (a review found "within the runs' spread" with no spread measured):
    scenes only one side won, by the highest and the final reward, and an exact two-sided sign test."""
    base = [{"success": s, "final_reward": f} for s, f in [(1, 4), (1, 0), (0, 0), (1, 4), (0, 0)]]
    other = [{"success": s, "final_reward": f} for s, f in [(1, 4), (0, 0), (1, 4), (0, 0), (1, 0)]]
    out = sim_success.discordant(base, other)
    assert (out["only_other_highest"], out["only_base_highest"]) == (2, 2)
    assert (out["only_other_final"], out["only_base_final"]) == (1, 1)
    assert out["sign_test_p_highest"] == 1.0
    lopsided = sim_success.discordant(
        [{"success": 0, "final_reward": 0}] * 8, [{"success": 1, "final_reward": 4}] * 8
    )
    assert lopsided["sign_test_p_highest"] == round(2 / 2**8, 3)  # 8 of 8 one way: p = 2 · 0.5^8
