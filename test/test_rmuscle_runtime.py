"""rMuscle at run time on the CPU (tiny model, fused backend): what a cell operator relies on.

Dense warm-up episodes are recorded; a repeat of the task is served from the cache once the window
holds its entries; below the threshold the episode falls back to dense for good; ρ = 1 and fallback
chunks are the dense chunks bit for bit; the library persists, is refused for other weights, and a
corrupt episode is reported and left out.

Random weights: the tiny model's retrieval descriptors barely tell scenes apart (similarities ≈ 0.998
for any two), so the fallback tests raise the threshold to 1 instead of changing the scene, and the
window is rebuilt whole after each call (alignment on such descriptors jumps within the lookahead).
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch

from rmuscle_ros.cache.library import LibraryMismatch
from rmuscle_ros.cache.retrieval import unit_rows
from rmuscle_ros.cache.runtime import LEARNING_REASON, REBUILD_TRIES, RMuscleConfig
from rmuscle_ros.runtime.policy import NonFiniteActions, Observation, Policy, PolicyConfig

CFG = PolicyConfig(backend="fused")
FULL_REBUILD = 20  # rebuilds per tick that refill the whole default window


def scene(t: float, seed: int = 0, light: float = 1.0, noise: float = 0.0) -> np.ndarray:
    """A textured bench with an object that moves along a fixed path as the task progresses (t in [0, 1])."""
    h, w = 120, 160
    yy, xx = np.mgrid[0:h, 0:w]
    bench = np.random.default_rng(1234).integers(60, 200, (h // 8, w // 8, 3)).repeat(8, 0).repeat(8, 1)
    cx, cy = w * (0.25 + 0.5 * t), h * (0.6 - 0.3 * np.sin(np.pi * t))
    blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * 10.0**2))[..., None] * np.array([200, 60, -80])
    img = (bench + blob) * light + noise * np.random.default_rng(seed).standard_normal((h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def episode(n: int, *, offset: float = 0.0, light: float = 1.0, noise: float = 0.0) -> list[Observation]:
    out = []
    for i, t in enumerate(np.linspace(offset, 1.0, n)):
        img = scene(t, seed=i, light=light, noise=noise)
        out.append(Observation({c: img for c in CFG.cameras}, np.full(14, t, np.float32), "stack the cups"))
    return out


def run(policy: Policy, observations: list[Observation], rebuild: bool = True) -> list:
    """Infer each observation with noise fixed by its index (policies can then be compared call by call)."""
    chunks = []
    for i, obs in enumerate(observations):
        noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(i))
        chunks.append(policy.infer(obs, noise))
        if rebuild:
            policy.rebuild_cache()  # the node does this right after publishing, in the motion window
    return chunks


def test_dense_warmup_is_recorded_then_the_repeat_is_served_from_the_cache(tmp_path) -> None:
    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    warm = run(policy, episode(6))
    assert [c.cache_mode for c in warm] == ["dense"] * 6
    assert policy.reset_episode() == 0, "the dense episode is recorded as library episode 0"
    status = policy.cache_status()
    assert status["library_episodes"] == 1 and status["library_bytes"] > 0

    repeat = run(policy, episode(6, offset=0.05, light=0.97, noise=2.0))
    modes = [c.cache_mode for c in repeat]
    assert modes[0] == "dense", "the first call of an episode finds the window empty"
    assert modes[1:] == ["cached"] * 5
    assert all(c.cache_similarity > 0.8 for c in repeat)
    assert all(np.isfinite(c.actions).all() and c.actions.shape == (50, 14) for c in repeat)
    status = policy.cache_status()
    assert status["hit_rate"] == pytest.approx(5 / 6) and status["window_entries"] > 0
    # what the latest (cached) call was served from: library episode 0, one of its 6 calls
    assert status["reference_episode"] == 0 and 0 <= status["reference_position"] < 6
    assert policy.reset_episode() is None, "an episode served from the cache is not recorded"
    assert policy.cache_status()["library_episodes"] == 1
    rm = policy.rmuscle
    assert rm is not None
    recorded = rm.library.entries[0]
    assert recorded.last_used > recorded.created, "served from: the episode counts as used for eviction"
    policy.close()


def test_a_policy_that_records_nothing_deletes_nothing_past_lowered_bounds(tmp_path) -> None:
    """Found in review: a bring-up with `record` off and a lowered (or typo'd) `max_episodes` evicted and
    deleted recorded episodes at open. Recording off, they are kept; recording on, the lowered bound evicts
    at open, as documented."""
    lib = str(tmp_path / "lib")
    policy = Policy(CFG, RMuscleConfig(library_path=lib, rebuilds_per_tick=FULL_REBUILD))
    for _ in range(2):  # no window refills: each episode runs dense and is recorded
        run(policy, episode(2), rebuild=False)
        assert policy.reset_episode() is not None
    policy.close()
    reader = Policy(CFG, RMuscleConfig(library_path=lib, record=False, max_episodes=1))
    assert reader.cache_status()["library_episodes"] == 2
    reader.close()
    writer = Policy(CFG, RMuscleConfig(library_path=lib, max_episodes=1))
    assert writer.cache_status()["library_episodes"] == 1
    writer.close()


def test_non_finite_actions_are_refused_naming_where_and_keep_the_episode_out_of_the_library(
    tmp_path,
) -> None:
    """A call whose actions hold NaN or Inf raises NonFiniteActions (the node drops it: never published),
    and its episode is not recorded, since its recorded calls may hold the same fault. The next episode
    records as usual."""
    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    run(policy, episode(3))
    infer = policy.rmuscle.infer

    def faulty(inputs, noise):  # the real call (recorded as usual), then a fault in its result
        actions, info = infer(inputs, noise)
        actions[0, 7, 3] = float("nan")
        return actions, info

    policy.rmuscle.infer = faulty
    with pytest.raises(NonFiniteActions, match=r"1 of 700 values, the first at step 7, action 3; dense call"):
        policy.infer(episode(4)[3])
    del policy.rmuscle.infer
    assert np.isfinite(run(policy, episode(2))[0].actions).all(), "the next call is served as usual"
    assert policy.reset_episode() is None, "the faulty episode is not recorded"
    assert policy.cache_status()["library_episodes"] == 0
    run(policy, episode(3))
    assert policy.reset_episode() == 0, "the next episode is"
    policy.close()


def test_a_call_whose_recording_fails_is_left_out_and_the_episode_keeps_its_other_calls(
    tmp_path, monkeypatch
) -> None:
    """A call's recording that fails part way (a copy off the GPU, out of memory) raises (the node drops
    the call), and only that call is left out: before, its fields were half appended, the episode's fields
    no longer paired call for call, and the reset refused the whole episode (found in review)."""
    from rmuscle_ros.cache import runtime

    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    real, calls = runtime.images_to_u8, [0]

    def fails_once(images: torch.Tensor) -> np.ndarray:
        calls[0] += 1
        if calls[0] == 3:  # after the call's descriptor was kept
            raise RuntimeError("CUDA error: out of memory (simulated)")
        return real(images)

    monkeypatch.setattr(runtime, "images_to_u8", fails_once)
    observations = episode(5)
    for i, obs in enumerate(observations):
        if i == 2:
            with pytest.raises(RuntimeError, match="out of memory"):
                policy.infer(obs)
        else:
            policy.infer(obs)
    assert policy.reset_episode() == 0
    assert policy.rmuscle.library.entries[0].calls == 4
    policy.close()


def test_an_interrupted_library_write_is_written_before_the_next_episode(tmp_path, monkeypatch) -> None:
    """Ctrl-C while the reset writes the finished episode: the episode stays in memory and is written at
    the next reset or at close (the node's shutdown), which Ctrl-C runs. Before, it had left memory
    before the write and was lost (found in review)."""
    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    library = policy.rmuscle.library
    real = type(library).add

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    run(policy, episode(3))
    monkeypatch.setattr(type(library), "add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        policy.reset_episode()
    monkeypatch.setattr(type(library), "add", real)
    assert library.entries == {} and policy.rmuscle.unsaved is not None
    run(policy, episode(2))
    assert policy.close() == 1, "the episode in progress is written after the interrupted one"
    index = json.loads((tmp_path / "lib" / "index.json").read_text())
    assert [(e["calls"], e["meta"]["session_episode"]) for e in index["episodes"]] == [(3, "0"), (2, "1")]


def test_an_interrupt_while_the_episode_is_stacked_keeps_it_and_writes_it_later(
    tmp_path, monkeypatch
) -> None:
    """Ctrl-C in the milliseconds while the reset stacks the finished episode's calls into its arrays (before
    its write): the calls are kept as they are, stacked and written at the next reset or at close. Before,
    the episode was lost (found in review, left then as a known gap)."""
    from rmuscle_ros.cache import runtime

    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    real = runtime._episode_of

    def interrupted(rec: object) -> object:
        raise KeyboardInterrupt

    run(policy, episode(3))
    monkeypatch.setattr(runtime, "_episode_of", interrupted)
    with pytest.raises(KeyboardInterrupt):
        policy.reset_episode()
    monkeypatch.setattr(runtime, "_episode_of", real)
    assert policy.rmuscle.library.entries == {} and policy.rmuscle.unsaved is not None
    assert policy.cache_status()["episode_unsaved"] == 0
    run(policy, episode(2))
    assert policy.close() == 1, "the episode in progress is written after the interrupted one"
    index = json.loads((tmp_path / "lib" / "index.json").read_text())
    assert [(e["calls"], e["meta"]["session_episode"]) for e in index["episodes"]] == [(3, "0"), (2, "1")]


def test_an_unwritten_episode_is_not_taken_for_one_an_earlier_process_wrote(tmp_path, monkeypatch) -> None:
    """Found by mutation testing: session episode numbers start at 0 in every process, so an episode kept
    after a failed write must not be taken as written because a library episode of an earlier process
    bears its number (it would be dropped without a word)."""
    from safetensors import SafetensorError

    from rmuscle_ros.cache import library as library_module
    from rmuscle_ros.cache.library import RecordingFailed

    lib = str(tmp_path / "lib")
    earlier = Policy(CFG, RMuscleConfig(library_path=lib))
    run(earlier, episode(2), rebuild=False)
    assert earlier.reset_episode() == 0  # session episode 0 of the earlier process
    earlier.close()
    policy = Policy(CFG, RMuscleConfig(library_path=lib))
    real = library_module.save_file

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(library_module, "save_file", full_disk)
    run(policy, episode(3), rebuild=False)  # this process's session episode 0
    with pytest.raises(RecordingFailed, match="No space left"):
        policy.reset_episode()
    assert policy.cache_status()["episode_unsaved"] == 0
    monkeypatch.setattr(library_module, "save_file", real)
    policy.reset_episode()  # episode 1: no calls; the kept episode 0 is written first
    index = json.loads((tmp_path / "lib" / "index.json").read_text())
    assert [(e["calls"], e["meta"]["session_episode"]) for e in index["episodes"]] == [(2, "0"), (3, "0")]
    assert policy.cache_status()["episode_unsaved"] == -1
    policy.close()


def test_an_episode_whose_write_failed_is_kept_and_written_at_the_next_reset(
    tmp_path, monkeypatch, caplog
) -> None:
    """A disk that fills for a while: an episode whose write fails stays in memory and is written before
    the next one once the disk has room (found in review: it was dropped). Only the latest is kept: a
    second failure drops the first, with an error naming it; one still unwritten at close is named too."""
    from safetensors import SafetensorError

    from rmuscle_ros.cache import library as library_module
    from rmuscle_ros.cache.library import RecordingFailed

    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    library = policy.rmuscle.library
    real = library_module.save_file

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(library_module, "save_file", full_disk)
    for calls in (3, 4):  # session episodes 0 and 1
        run(policy, episode(calls))
        with pytest.raises(RecordingFailed, match="No space left"):
            policy.reset_episode()
    assert library.entries == {} and policy.cache_status()["episode_unsaved"] == 1
    assert "episode 0, not yet written to the library, is dropped: episode 1 is not written" in caplog.text
    monkeypatch.setattr(library_module, "save_file", real)  # room again
    run(policy, episode(2))
    assert policy.reset_episode() is not None and len(library.entries) == 2
    index = json.loads((tmp_path / "lib" / "index.json").read_text())
    assert [(e["calls"], e["meta"]["session_episode"]) for e in index["episodes"]] == [(4, "1"), (2, "2")]
    assert policy.cache_status()["episode_unsaved"] == -1

    policy.close()

    other = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "other"), rebuilds_per_tick=FULL_REBUILD))
    run(other, episode(2))
    monkeypatch.setattr(library_module, "save_file", full_disk)
    with pytest.raises(RecordingFailed):
        other.close()
    assert "episode 0 is not recorded: its write failed or was interrupted, and the library closes now" in (
        caplog.text
    )


def _a_long_episode_kept_a_short_one_running(tmp_path, monkeypatch) -> Policy:
    """A disk with room for short episodes only: episode 0 (4 calls) failed and is kept, episode 1 (2 calls)
    has run and is not yet reset."""
    from rmuscle_ros.cache import library as library_module
    from rmuscle_ros.cache.library import RecordingFailed

    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    real = library_module.save_file

    def room_for_short_ones(tensors, filename, metadata=None):
        if tensors["descriptors"].shape[0] >= 4:
            raise OSError(28, "No space left on device")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(library_module, "save_file", room_for_short_ones)
    run(policy, episode(4))
    with pytest.raises(RecordingFailed):
        policy.reset_episode()
    run(policy, episode(2, offset=0.5))
    return policy


def test_a_kept_episode_stays_kept_when_a_later_one_is_written(tmp_path, monkeypatch, caplog) -> None:
    """The disk has room for a short episode, not for the long one kept from before: the short one is
    written and the long one stays kept, with no word of it being dropped (found in review: it was
    dropped, and the log said the later write had failed)."""
    from rmuscle_ros.cache import library as library_module

    real = library_module.save_file
    policy = _a_long_episode_kept_a_short_one_running(tmp_path, monkeypatch)
    assert policy.reset_episode() is not None and policy.cache_status()["episode_unsaved"] == 0
    assert "dropped" not in caplog.text
    monkeypatch.setattr(library_module, "save_file", real)
    assert policy.close() is None, "the kept episode is written at close; none was in progress"
    index = json.loads((tmp_path / "lib" / "index.json").read_text())
    assert sorted(e["meta"]["session_episode"] for e in index["episodes"]) == ["0", "1"]


def test_an_interrupt_while_a_kept_episode_is_retried_keeps_the_finished_one(
    tmp_path, monkeypatch, caplog
) -> None:
    """Ctrl-C while the reset writes the episode kept from a failed write: the episode that just ended,
    not yet tried, is kept in its place (found in review: it was lost without a word)."""
    from rmuscle_ros.cache import library as library_module
    from rmuscle_ros.cache.library import RecordingFailed

    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    real = library_module.save_file

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(library_module, "save_file", full_disk)
    run(policy, episode(3))
    with pytest.raises(RecordingFailed):
        policy.reset_episode()
    run(policy, episode(5))
    monkeypatch.setattr(library_module, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        policy.reset_episode()
    assert policy.cache_status()["episode_unsaved"] == 1
    assert "episode 0, not yet written to the library, is dropped: episode 1 is not written" in caplog.text
    monkeypatch.setattr(library_module, "save_file", real)
    assert policy.close() is None
    index = json.loads((tmp_path / "lib" / "index.json").read_text())
    assert [(e["calls"], e["meta"]["session_episode"]) for e in index["episodes"]] == [(5, "1")]


def test_a_kept_episode_whose_write_landed_is_not_written_again(tmp_path) -> None:
    """An interrupt right after the write returned, before the episode left `unsaved`: the library holds
    it already, so the next try does not write it a second time (found in review)."""
    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    run(policy, episode(3))
    written = policy.reset_episode()
    policy.rmuscle.unsaved = (
        policy.rmuscle.library.load(written),
        0,
        "stack the cups",
    )  # as the interrupt left it
    assert policy.close() is None
    index = json.loads((tmp_path / "lib" / "index.json").read_text())
    assert [e["meta"]["session_episode"] for e in index["episodes"]] == ["0"]


def test_close_says_a_kept_episode_is_lost_even_when_the_one_in_progress_is_written(
    tmp_path, monkeypatch
) -> None:
    """The last chance for a kept episode is the close: one that still cannot be written raises, naming it
    and the episode in progress that was written (the node counts errors.cache_close; found in review: a
    loss that only the log said)."""
    from rmuscle_ros.cache.library import RecordingFailed

    policy = _a_long_episode_kept_a_short_one_running(tmp_path, monkeypatch)
    with pytest.raises(RecordingFailed, match=r"episode 0, kept since .* is not recorded") as e:
        policy.close()
    assert "the episode in progress was recorded as library episode" in str(e.value)
    index = json.loads((tmp_path / "lib" / "index.json").read_text())
    assert [e["meta"]["session_episode"] for e in index["episodes"]] == ["1"]


def test_an_interrupt_after_the_index_was_written_does_not_write_the_episode_twice(
    tmp_path, monkeypatch
) -> None:
    """Ctrl-C once the new index is in place (while the evicted episodes' files are deleted): the episode
    is in the library, and is not written again at close (found in review: it was, under a second id)."""
    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    library = policy.rmuscle.library

    def interrupted(self, entries):
        raise KeyboardInterrupt

    run(policy, episode(3))
    monkeypatch.setattr(type(library), "_delete_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        policy.reset_episode()
    monkeypatch.undo()
    assert sorted(library.entries) == [0] and policy.rmuscle.unsaved is None
    assert policy.close() is None
    assert len(json.loads((tmp_path / "lib" / "index.json").read_text())["episodes"]) == 1


def test_a_second_interrupt_during_a_reset_does_not_merge_the_next_episode_into_this_one(
    tmp_path, monkeypatch, caplog
) -> None:
    """Ctrl-C twice: the first interrupts episode 0's write, the second the retry of it at the next reset.
    Episode 1, which ended there, is kept in episode 0's place (one kept at most, the latest; episode 0
    is dropped with an error), and not carried into episode 2 (found in review: episodes 1 and 2 were
    recorded as one reference of 5 calls)."""
    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    library = policy.rmuscle.library
    real, interrupts = type(library).add, {"left": 2}

    def add(self, *args, **kwargs):
        if interrupts["left"]:
            interrupts["left"] -= 1
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(library), "add", add)
    for calls in (4, 3):
        run(policy, episode(calls))
        with pytest.raises(KeyboardInterrupt):
            policy.reset_episode()
    run(policy, episode(2))
    policy.reset_episode()
    index = json.loads((tmp_path / "lib" / "index.json").read_text())
    assert [(e["calls"], e["meta"]["session_episode"]) for e in index["episodes"]] == [(3, "1"), (2, "2")]
    assert "episode 0, not yet written to the library, is dropped: episode 1 is not written" in caplog.text


def test_an_interrupt_after_the_index_was_written_leaves_retrieval_on_the_library_as_it_is(
    tmp_path, monkeypatch
) -> None:
    """With max_episodes 1 the add evicts episode 0; Ctrl-C while its file is deleted. Retrieval then
    searches episode 1, which the library holds (found in review: it kept searching the evicted episode
    0, and every call and refill raised KeyError)."""
    policy = Policy(
        CFG,
        RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD, max_episodes=1),
    )
    library = policy.rmuscle.library
    run(policy, episode(3))
    assert policy.reset_episode() == 0
    run(policy, episode(3, offset=0.9), rebuild=False)  # another scene: dense, recorded

    def interrupted(self, entries):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(library), "_delete_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        policy.reset_episode()
    monkeypatch.undo()
    assert sorted(library.entries) == [1] and sorted(policy.rmuscle._descriptors) == [1]
    modes = [c.cache_mode for c in run(policy, episode(3, offset=0.9))]
    assert "cached" in modes, modes  # served from episode 1, no KeyError


def test_a_cached_call_with_non_finite_actions_sends_the_episode_dense() -> None:
    """Its references may hold the fault: the rest of the episode runs dense (found in review: later calls
    were served from the same references); the next runs dense to be recorded, and the one after is served
    again."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD))
    run(policy, episode(4))
    policy.reset_episode()
    live = episode(4, offset=0.05, light=0.97, noise=2.0)
    assert run(policy, live[:2])[-1].cache_mode == "cached"
    infer = policy.rmuscle.infer

    def faulty(inputs, noise):
        actions, info = infer(inputs, noise)
        actions[0, 0, 0] = float("inf")
        return actions, info

    policy.rmuscle.infer = faulty
    with pytest.raises(NonFiniteActions, match=r"cached call.*runs dense from now on"):
        policy.infer(live[2])
    del policy.rmuscle.infer
    assert [c.cache_mode for c in run(policy, live[3:])] == ["fallback"]
    assert policy.rmuscle.last.reason == "a cached call produced non-finite actions"
    assert policy.reset_episode() is None
    # a fresh reference first (the episode after one served, then fallen back, runs dense to be recorded),
    # then the episodes are served again
    assert {c.cache_mode for c in run(policy, episode(2, offset=0.05))} == {"fallback"}
    assert policy.reset_episode() == 1
    assert run(policy, episode(2, offset=0.05))[-1].cache_mode == "cached"
    policy.close()


def test_an_episode_served_then_fallen_back_is_followed_by_one_recorded_dense() -> None:
    """Found in review: an episode served from the cache that then fell back (its scene left the reference's)
    was not recorded, nothing said why, and the next episode started cached from the same reference, fell
    back, and so on: the library never learnt the scene. The reset says why, and the next episode of the
    task runs dense from its start (mode fallback) and is recorded; an episode of another task is not held
    dense, and the learning waits for the task's next episode (one without calls, too, found in a review
    of the change)."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD))
    run(policy, episode(4))
    assert policy.reset_episode() == 0
    live = episode(4, offset=0.05, light=0.97, noise=2.0)

    def diverging() -> None:
        modes = [c.cache_mode for c in run(policy, live[:2])]
        assert modes[-1] == "cached"
        policy.reconfigure_cache(threshold=1.0)  # the scene leaves the reference's
        assert [c.cache_mode for c in run(policy, live[2:])] == ["fallback"] * 2
        policy.reconfigure_cache(threshold=0.8)
        assert policy.reset_episode() is None
        assert policy.cache_status()["last_episode_excluded"] == (
            f"{modes.count('cached')} of its calls were served from the cache before it fell back (similarity "
            "below 1.0); the next episode runs dense, to be recorded in its place"
        )

    diverging()
    reruns = policy.rmuscle.match_reruns
    learning = run(policy, live)
    assert {c.cache_mode for c in learning} == {"fallback"} and policy.rmuscle.last.reason == LEARNING_REASON
    assert policy.rmuscle.match_reruns == reruns, "no cached run for nothing (the window is not usable)"
    assert policy.reset_episode() == 1
    assert run(policy, live)[-1].cache_mode == "cached"
    policy.reset_episode()
    diverging()
    other = run(policy, with_task(live[:2], "sort the screws"))  # the learning was for the cups
    assert {c.cache_mode for c in other} == {"dense"} and policy.rmuscle.last.reason != LEARNING_REASON
    assert policy.reset_episode() is not None  # the screws' first reference
    assert policy.reset_episode() is None  # an episode without calls
    learning = run(policy, live)  # the cups again: still to be learnt
    assert {c.cache_mode for c in learning} == {"fallback"} and policy.rmuscle.last.reason == LEARNING_REASON
    assert policy.reset_episode() is not None
    assert run(policy, live)[-1].cache_mode == "cached"
    policy.close()


def test_a_task_changed_for_one_call_and_back_keeps_the_episodes_alignment() -> None:
    """Found in review: a prompt changed for one call and back (an operator's correction) sent retrieval
    back to the references' starts, and with scenes told apart, the rest of the episode into fallback.
    Mid-episode the alignment is kept: back on its task the episode goes on from where it was."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD))
    run(policy, episode(12))
    policy.reset_episode()
    rm = policy.rmuscle
    live = episode(12, offset=0.02, noise=1.0)
    run(policy, live[:8])
    before = rm.retriever.positions[0]
    assert before >= 5
    run(policy, with_task(live[8:9], "sort the screws"))  # no episode of it: dense
    chunks = run(policy, live[9:])
    assert rm.retriever.positions[0] >= before, "back at the references' starts"
    assert "fallback" not in {c.cache_mode for c in chunks}
    policy.close()


def test_would_record_says_whether_the_reset_records_the_episode() -> None:
    """What the node's min_episode_s asks before it keeps a short episode out (found in a review of the
    change: a cached episode's reset reply lost its own reason to that rule's)."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD))
    assert not policy.cache_would_record(), "no calls yet"
    run(policy, episode(3))
    assert policy.cache_would_record()
    assert policy.reset_episode() == 0
    run(policy, episode(3, offset=0.05, light=0.97, noise=2.0))  # served from episode 0
    assert not policy.cache_would_record()
    policy.reset_episode()
    policy.reconfigure_cache(threshold=1.0)  # runs dense, but:
    run(policy, episode(2, light=0.5), rebuild=False)
    assert policy.cache_would_record()
    policy.discard_episode("a failed attempt")
    assert not policy.cache_would_record()
    policy.close()
    assert not Policy(CFG).cache_would_record(), "no cache"


def test_an_episodes_first_call_matched_on_the_host_says_why_it_runs_dense() -> None:
    """With match_on_gpu off an episode's first call runs dense (it is matched on the host after its dense
    stages); found in review, it said "entry not rebuilt yet" with its entry in the window."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, match_on_gpu=False))
    run(policy, episode(4))
    policy.reset_episode()
    policy.rebuild_cache()
    assert policy.infer(episode(4)[0]).cache_mode == "dense"
    assert policy.rmuscle.last.reason == "an episode's first call, matched on the host: dense"
    policy.close()


def test_an_episodes_likely_start_is_the_most_recently_used_reference() -> None:
    """Found by mutation testing: the entries a reset rebuilds for the next episode's first call taken from
    the least recently used references passed. With one candidate (top_k 1), the one last served."""
    policy = Policy(CFG, RMuscleConfig(top_k=1, rebuilds_per_tick=FULL_REBUILD))
    for _ in range(2):
        run(policy, episode(3), rebuild=False)
        policy.reset_episode()
    rm = policy.rmuscle
    for used in (0, 1, 0):
        time.sleep(0.002)  # touch() stamps with the wall clock
        rm.library.touch(used)
        rm._wanted = []
        rm.want_episode_starts()
        assert {episode for episode, _ in rm._wanted} == {used}
    policy.close()


def test_library_images_round_trip_to_the_models_input_exactly() -> None:
    """Found by mutation testing: a library image truncated instead of rounded back to uint8 passed (only
    a GPU test compared the function with itself). Every uint8 level makes the model input the
    preprocessing makes, and back, exactly: a rebuilt reference sees what the recorded call saw."""
    from rmuscle_ros.cache.runtime import images_from_u8, images_to_u8

    u8 = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1).repeat(3, axis=3)
    x = torch.from_numpy(u8).permute(0, 3, 1, 2).float() / 255.0 * 2.0 - 1.0  # the preprocessing's arithmetic
    assert np.array_equal(images_to_u8(x).numpy(), u8)
    assert torch.equal(images_from_u8(images_to_u8(x).numpy()), x)


def test_the_host_path_serves_the_best_match_and_a_long_episode_reuses_the_windows_slots() -> None:
    """Found by mutation testing: with matching on the host, serving the worst of the candidates passed,
    and so did slots never given back (the tests' episodes never filled the 20-entry window). Here a
    window of 4 entries (top_k 2, lookahead 1) serves a 10-call repeat from the best match each call."""
    policy = Policy(
        CFG, RMuscleConfig(top_k=2, lookahead=1, rebuilds_per_tick=FULL_REBUILD, match_on_gpu=False)
    )
    run(policy, episode(10))
    policy.reset_episode()
    run(policy, episode(10, light=0.9), rebuild=False)  # a second reference of the task, recorded dense
    assert policy.reset_episode() == 1
    rm = policy.rmuscle
    query, best, loaded = rm.retriever.query, [], []
    rm.retriever.query = lambda *a: (best.append(query(*a)), best[-1])[1]
    load = rm.engine.load_window_entry
    rm.engine.load_window_entry = lambda index: (loaded.append(rm.window[index].key), load(index))[1]
    modes = []
    for i, obs in enumerate(episode(10, offset=0.05, noise=2.0)):
        chunk = policy.infer(obs, torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(i)))
        modes.append(chunk.cache_mode)
        if chunk.cache_mode == "cached":  # the entry loaded, and the one reported, are the best match's
            want = (best[-1][0].episode, best[-1][0].position)
            assert loaded[-1] == want and (rm.last.episode, rm.last.position) == want
        policy.rebuild_cache()
        assert rm.missing_entries() == 0, "every wanted entry rebuilt: slots are given back"
    assert len(rm.window) == 4 and modes[2:] == ["cached"] * 8, modes
    policy.close()


def test_a_slot_being_rewritten_serves_neither_its_old_entry_nor_the_new_one() -> None:
    """Found by mutation testing: a slot that kept its old key while a rebuild overwrote it part by part
    passed; wanted again meanwhile, its half-written reference could be served. Once its first part is
    queued the slot holds no key until the new entry's last part is done."""
    policy = Policy(
        CFG, RMuscleConfig(top_k=1, lookahead=1, rebuilds_per_tick=FULL_REBUILD, rebuild_slices=4)
    )
    run(policy, episode(6))
    policy.reset_episode()
    policy.rebuild_cache()
    rm = policy.rmuscle
    held = {slot.index: slot.key for slot in rm.window}
    assert all(key is not None for key in held.values()), "the window is full"
    rm._wanted = [(0, 4), (0, 5)]  # retrieval moved on: both slots are free to take
    assert rm.rebuild_slice() == (True, False)  # the first part of one entry
    slot = rm._building.slot
    old = held[slot.index]
    assert slot.key is None and all(s.key != old for s in rm.window)
    rm._wanted.append(old)  # wanted again midway
    assert rm._ready_slot(old) is None and rm._ready_slot((0, 4)) is None
    while rm._building is not None:
        rm.rebuild_slice()
    assert slot.key == (0, 4) and rm._ready_slot((0, 4)) is slot
    policy.close()


def test_the_window_is_refilled_part_by_part_and_a_stale_part_is_dropped(tmp_path) -> None:
    """The node's motion window queues one part at a time (it can stop between any two): an entry is
    usable once its last part ran, and one that is no longer wanted midway is dropped (here the call
    that wanted it is discarded, as warm-up calls are; retrieval moving on does the same)."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, rebuild_slices=4))
    run(policy, episode(4))
    policy.reset_episode()
    live = episode(4, offset=0.05, noise=2.0)
    parts = len(policy.rmuscle.engine.rebuild_parts)  # tiny: vision, then each of its 2 layers
    assert parts == 3
    assert policy.infer(live[0]).cache_mode == "dense"  # the window is empty
    assert policy.rebuild_cache_slice() == (True, False)
    policy.rmuscle.discard_recording()  # nothing is wanted any more: the entry one part in is dropped
    assert policy.rebuild_cache_slice() == (False, False)
    assert policy.cache_status()["window_entries"] == 0

    assert policy.infer(live[0]).cache_mode == "dense"
    steps = [policy.rebuild_cache_slice() for _ in range(parts)]
    assert steps == [(True, False)] * (parts - 1) + [(True, True)]
    assert policy.cache_status()["window_entries"] == 1
    while policy.rebuild_cache_slice() != (False, False):  # the rest of what the call wanted
        pass
    assert [c.cache_mode for c in run(policy, live[1:])] == ["cached"] * 3


def test_a_rebuild_part_that_raises_midway_starts_its_entry_over(tmp_path) -> None:
    """A part updates the rebuild lane's state in place, layer by layer: one that raises partway (a
    transient fault, a GPU out of memory) must not be run again on what it left. Before (found in
    review), the next motion window re-ran it, the layer's attention update went in twice, and the entry
    came out wrong yet usable. Now the entry starts over and comes out as a rebuild without the fault."""
    from types import SimpleNamespace

    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, rebuild_slices=4))
    run(policy, episode(4))
    policy.reset_episode()
    assert policy.infer(episode(4, offset=0.05, noise=2.0)[0]).cache_mode == "dense"  # the window is empty
    rm, engine = policy.rmuscle, policy.rmuscle.engine
    ops, fault = engine.fused.ops, {"armed": False}

    def linear_geglu(*args: object, **kwargs: object) -> torch.Tensor:
        if fault["armed"]:  # the layer's FFN, after its attention updated the residual
            fault["armed"] = False
            raise RuntimeError("a transient fault in a rebuild part")
        return ops.linear_geglu(*args, **kwargs)

    engine.fused.ops = SimpleNamespace(**{**vars(ops), "linear_geglu": linear_geglu})
    assert policy.rebuild_cache_slice() == (True, False)  # vision
    fault["armed"] = True
    with pytest.raises(RuntimeError, match="transient fault"):
        policy.rebuild_cache_slice()  # the first layer's part
    assert policy.cache_status()["window_entries"] == 0 and rm._building is None
    while (step := policy.rebuild_cache_slice()) != (True, True):
        assert step == (True, False)
    (slot,) = [slot for slot in rm.window if slot.key is not None]
    after_fault = [t[slot.index].clone() for t in (engine.window.ffn_in, engine.window.ffn_out)]
    engine.fused.ops = ops
    slot.key = None  # the same entry again, without a fault
    while policy.rebuild_cache_slice() != (True, True):
        pass
    assert all(
        torch.equal(a, t[slot.index])
        for a, t in zip(after_fault, (engine.window.ffn_in, engine.window.ffn_out), strict=True)
    )
    policy.close()


def test_an_episodes_last_use_is_on_disk_at_each_reset_not_only_at_close(tmp_path) -> None:
    """A cell served from one task records nothing for hours: the index was written only at a clean close,
    so a process killed without one (SIGKILL, the OOM killer, a power cut) lost the day's use, and eviction
    after the restart took the episode the cell had been served from (found in review). The index on disk
    holds the use from the reset after the call, with the library still open."""
    lib = tmp_path / "lib"
    policy = Policy(CFG, RMuscleConfig(library_path=str(lib), rebuilds_per_tick=FULL_REBUILD))
    run(policy, episode(4))
    assert policy.reset_episode() == 0

    def on_disk() -> float:
        (entry,) = json.loads((lib / "index.json").read_text())["episodes"]
        return entry["last_used"]

    recorded = on_disk()
    assert run(policy, episode(4, offset=0.05, noise=2.0))[-1].cache_mode == "cached"
    used = policy.rmuscle.library.entries[0].last_used
    assert used > recorded and on_disk() == recorded, "served: in memory until the reset"
    assert policy.reset_episode() is None  # a cached episode is not recorded: nothing else writes the index
    assert on_disk() == used
    policy.close()


def test_temporary_libraries_left_by_processes_that_ended_are_removed(tmp_path, monkeypatch, caplog) -> None:
    """With no library_path the cache records into a temporary folder, removed at a clean close only: each
    SIGKILL (ten seconds after a launch's Ctrl-C), OOM kill or power cut left one behind, of up to
    max_library_mb, and nothing removed them (found in review). The next such cache removes the folders it
    marked as temporary whose lock no process holds; never one a live process holds, one just left (its
    lock file fresh), nor a library_path that shares the prefix (found in review: it was removed)."""
    import logging
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from rmuscle_ros.cache.library import LibraryKey, ReferenceLibrary
    from rmuscle_ros.cache.runtime import (
        ABANDONED_AFTER_S,
        TEMPORARY_LIBRARY_PREFIX,
        TEMPORARY_MARKER,
        _remove_abandoned_temporary_libraries,
    )

    def age(root: Path) -> None:
        old = os.stat(root / ".lock").st_mtime - ABANDONED_AFTER_S - 1
        os.utime(root / ".lock", (old, old))

    # A node's cache on a temporary library, killed: what it leaves
    killed = "; ".join((
        "import os, signal",
        "from rmuscle_ros.cache.runtime import RMuscleConfig",
        "from rmuscle_ros.runtime.policy import Policy, PolicyConfig",
        "policy = Policy(PolicyConfig(backend='fused'), RMuscleConfig())",  # held: not collected
        "os.kill(os.getpid(), signal.SIGKILL)",
    ))  # fmt: skip
    environment = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", killed], env=environment, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    found = list(tmp_path.glob(f"{TEMPORARY_LIBRARY_PREFIX}*"))
    assert len(found) == 1, (list(tmp_path.iterdir()), done.stderr[-2000:])
    left = found[0]
    assert (left / TEMPORARY_MARKER).is_file() and (left / ".lock").is_file()
    # A cell's library_path that shares the prefix, its node stopped; a temporary library a live process holds
    cell = tmp_path / f"{TEMPORARY_LIBRARY_PREFIX}cell1"
    ReferenceLibrary.open(cell, LibraryKey("w", {"cameras": 1})).close()
    live = tmp_path / f"{TEMPORARY_LIBRARY_PREFIX}live"
    live.mkdir()
    (live / TEMPORARY_MARKER).touch()
    library = ReferenceLibrary.open(live, LibraryKey("w", {"cameras": 1}))
    for root in (cell, live):
        age(root)

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    caplog.set_level(logging.INFO, logger="rmuscle_ros.cache.runtime")
    policy = Policy(CFG, RMuscleConfig())
    made = policy.rmuscle.library.root
    assert made.parent == tmp_path and (made / TEMPORARY_MARKER).is_file()
    assert left.exists(), "left a moment ago: its lock file is fresh (a process may be opening it)"
    age(left)
    _remove_abandoned_temporary_libraries()  # as the next node's cache does
    assert not left.exists() and f"removed {left}, a temporary library left by a process" in caplog.text
    assert (cell / ".lock").exists() and live.exists() and made.exists()
    library.save_index()  # the live process's library works on
    policy.close()
    assert not made.exists()
    library.close()


def test_the_window_is_refilled_from_single_calls_not_whole_episodes(tmp_path) -> None:
    """A window entry's rebuild reads its own call's rows (ReferenceLibrary.load_call). Before, it read the
    whole episode file (~114 MiB for 100 calls at `pi05`; docs/rmuscle.md has the times) into the first
    part of the entry, and kept the top_k latest whole episodes in memory. A node restarted on its library
    reads every entry from the files."""
    cfg = RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD)
    recording = Policy(CFG, cfg)
    run(recording, episode(4))
    recording.close()
    policy = Policy(CFG, cfg)

    def whole(episode_id: int) -> None:
        raise AssertionError(f"episode {episode_id} was read whole")

    policy.rmuscle.library.load = whole
    assert [c.cache_mode for c in run(policy, episode(4, offset=0.05, noise=2.0))][1:] == ["cached"] * 3
    policy.close()


def test_an_entry_whose_rebuild_keeps_failing_is_set_aside_and_the_others_are_rebuilt(caplog) -> None:
    """A fault that persists for one entry (inputs the engine refuses, memory too short for it): before
    (found in review), every motion window tried that entry first, since it is the best wanted, failed and
    ended there, so no other entry was ever rebuilt and the episode ran dense. After REBUILD_TRIES failures
    in an episode it is set aside (logged, counted in the status); the next episode tries it again. A fault
    at an entry's start (the engine refusing its inputs) counts the same."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, rebuild_slices=4))
    run(policy, episode(4))
    policy.reset_episode()
    assert policy.infer(episode(4, offset=0.05, noise=2.0)[0]).cache_mode == "dense"  # the window is empty
    rm, engine = policy.rmuscle, policy.rmuscle.engine
    target, missing = rm._wanted[0], policy.cache_entries_missing()
    assert missing > 1
    step = engine.rebuild_step

    def faulty_step(*args: object, **kwargs: object) -> bool:
        if rm._building is not None and rm._building.key == target:
            raise RuntimeError("a persistent fault in one entry")
        return step(*args, **kwargs)

    engine.rebuild_step = faulty_step
    for _ in range(REBUILD_TRIES):
        with pytest.raises(RuntimeError, match="persistent fault"):
            policy.rebuild_cache_slice()  # each window's first part: the best wanted entry's
        assert policy.cache_status()["window_entries"] == 0
    while policy.rebuild_cache_slice() != (False, False):  # the other entries
        pass
    assert policy.cache_status()["window_entries"] == missing - 1
    assert target not in {slot.key for slot in rm.window}
    assert policy.cache_status()["entries_set_aside"] == 1
    assert f"library episode {target[0]}, call {target[1]} failed {REBUILD_TRIES} times" in caplog.text
    assert policy.cache_entries_missing() == 0, "not counted as deferred"
    del engine.rebuild_step

    policy.reset_episode()  # the next episode tries it again
    assert policy.cache_status()["entries_set_aside"] == 0
    raised = 0

    def refusing(*args: object, **kwargs: object) -> int:
        raise RuntimeError("the engine refuses this entry's inputs")

    engine.begin_rebuild = refusing
    wanted = len([key for key in rm._wanted if key not in {slot.key for slot in rm.window}])
    assert wanted > 0
    while True:
        try:
            if policy.rebuild_cache_slice() == (False, False):
                break
        except RuntimeError:
            raised += 1
            assert raised <= REBUILD_TRIES * wanted, "an entry tried more often than REBUILD_TRIES"
    assert raised == REBUILD_TRIES * wanted and policy.cache_status()["entries_set_aside"] == wanted
    del engine.begin_rebuild
    policy.close()


def test_the_gpu_pick_at_the_threshold_serves(tmp_path) -> None:
    """The match stage's pick comes back as float32 (`match_host`): one exactly at the threshold serves,
    compared in float32 as host retrieval does (found in review: 0.7 is 0.699999988 in float32, below the
    float 0.7, so such a pick ran the call again dense)."""
    policy = Policy(CFG, RMuscleConfig(threshold=0.7))
    rm = policy.rmuscle
    usable = [True] * len(rm.window)
    rm.engine.match_host.copy_(torch.tensor([0.0, 0.7]))  # float32, as the device writes it
    assert rm._pick(usable) == (0, pytest.approx(0.7), True)
    rm.engine.match_host[1] = float(np.nextafter(np.float32(0.7), np.float32(0)))
    assert rm._pick(usable)[2] is False
    policy.close()


def test_the_window_refills_the_next_positions_first(tmp_path) -> None:
    """After a call aligned at position p, the refill builds p + 1, p + 2, ... first and p itself last: the
    next call is most likely one chunk on, and a node with time for one entry per motion window must not
    spend it on the entry just passed."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=1))
    run(policy, episode(8), rebuild=False)
    policy.reset_episode()
    policy.infer(episode(8, offset=0.05, noise=2.0)[0])
    rm = policy.rmuscle
    assert rm is not None
    p = rm.retriever.positions[0]
    built = []
    while policy.rebuild_cache(max_entries=1):
        built += [s.key for s in rm.window if s.key is not None and s.key not in built]
    assert built == [(0, q) for q in range(p + 1, min(p + 5, 8))] + [(0, p)]


def test_a_policy_started_on_a_recorded_library_serves_its_first_call_cached(tmp_path) -> None:
    """`expect_task` before the first episode (the node calls it at configure, after the warm-up, whose call
    is discarded) wants that task's likely first calls; a motion window then (the node runs one at
    activation) rebuilds them, and the first call of the process is served cached, not only those after
    its first reset. It keeps what a reset wanted (the finished episode's candidates first), and is a
    no-op without a cache."""
    cache = RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD)
    first = Policy(CFG, cache)
    run(first, episode(6))
    assert first.close() == 0

    policy = Policy(CFG, cache)
    rm = policy.rmuscle
    assert rm is not None and policy.cache_status()["library_episodes"] == 1
    policy.warmup("stack the cups")
    assert rm._wanted == [], "the warm-up's call is discarded, and what it wanted with it"
    policy.expect_task("stack the cups")
    assert rm.task == "stack the cups" and rm._wanted == [(0, p) for p in range(rm.cfg.lookahead + 1)]
    policy.rebuild_cache()
    repeat = run(policy, episode(6, offset=0.05, light=0.97, noise=2.0))
    assert [c.cache_mode for c in repeat] == ["cached"] * 6

    policy.reset_episode()
    wanted = list(rm._wanted)
    policy.expect_task("stack the cups")
    assert rm._wanted == wanted, "a reset's choice stands"
    policy.expect_task("sort the screws")
    assert rm.task == "sort the screws" and rm._wanted == [], "no episode of that task"
    with pytest.raises(ValueError, match="prompt"):
        policy.expect_task("")
    policy.close()
    Policy(CFG).expect_task("stack the cups")  # no cache: nothing to want


def test_rho_one_and_fallback_chunks_are_the_dense_chunks(tmp_path) -> None:
    dense = Policy(CFG)
    exact = Policy(CFG, RMuscleConfig(rho_p=1.0, rho_n=1.0, rebuilds_per_tick=FULL_REBUILD))
    fallback = Policy(CFG, RMuscleConfig(threshold=1.0))
    for p in (exact, fallback):
        run(p, episode(4))
        p.reset_episode()
    live = episode(4, offset=0.1, noise=2.0)
    want = [c.actions for c in run(dense, live)]
    got_exact = run(exact, live)
    assert [c.cache_mode for c in got_exact][1:] == ["cached"] * 3
    got_fallback = run(fallback, live)
    assert [c.cache_mode for c in got_fallback] == ["fallback"] * 4
    for chunks in (got_exact, got_fallback):
        assert all(np.array_equal(c.actions, w) for c, w in zip(chunks, want, strict=True))


def test_the_action_cache_alone_refills_its_window_without_running_the_model() -> None:
    """With ρp = 1 (the Action Cache alone) a window entry is its recorded masks and retrieval key: the
    refill copies them and runs no stage of the model, and the repeat is served cached from its first
    call (its chunks the Action Cache's, not dense ones; test_rmuscle_engine checks them bit for bit)."""
    alone = Policy(CFG, RMuscleConfig(rho_p=1.0, rho_n=0.5, rebuilds_per_tick=FULL_REBUILD))
    rm, engine = alone.rmuscle, alone.engine
    assert rm is not None and not engine.context_cache
    run(alone, episode(6))
    assert alone.reset_episode() == 0
    ran: list[str] = []
    prefill, encode = engine.fused.prefill, engine.fused.encode_images
    engine.fused.prefill = lambda *a, **k: ran.append("prefill") or prefill(*a, **k)
    engine.fused.encode_images = lambda *a, **k: ran.append("vision") or encode(*a, **k)
    try:
        assert alone.rebuild_cache() == rm.cfg.lookahead + 1  # the likely first calls, as after any reset
        assert ran == [], "the refill ran the model"
        assert all(slot.is_ready() for slot in rm.window if slot.key is not None)
    finally:
        del engine.fused.prefill, engine.fused.encode_images
    repeat = run(alone, episode(6, offset=0.05, light=0.97, noise=2.0))
    assert [c.cache_mode for c in repeat] == ["cached"] * 6
    assert rm.status()["window_entries"] > 0
    dense = [c.actions for c in run(Policy(CFG), episode(6, offset=0.05, light=0.97, noise=2.0))]
    assert not any(np.array_equal(c.actions, d) for c, d in zip(repeat, dense, strict=True))


def test_a_one_camera_cell_counts_rho_p_over_its_camera_and_rho_one_stays_dense() -> None:
    """A cell with fewer cameras than the model's slots (the sim's one): ρp counts the rows of the cameras
    it has (before, the empty slots' rows took most of the budget), and ρ = 1 is still dense bit for bit."""
    from rmuscle_ros.engine.fused import rho_count

    one = dataclasses.replace(CFG, cameras=CFG.cameras[:1])
    policy = Policy(one, RMuscleConfig(rho_p=0.4))
    tpi = policy.model_cfg.vision.tokens_per_image
    assert policy.engine.keep_tokens == rho_count(0.4, tpi)
    policy.close()
    dense = Policy(one)
    exact = Policy(one, RMuscleConfig(rho_p=1.0, rho_n=1.0, rebuilds_per_tick=FULL_REBUILD))
    warm = [dataclasses.replace(o, images={one.cameras[0]: o.images[one.cameras[0]]}) for o in episode(4)]
    run(exact, warm)
    exact.reset_episode()
    live = [
        dataclasses.replace(o, images={one.cameras[0]: o.images[one.cameras[0]]})
        for o in episode(4, offset=0.1, noise=2.0)
    ]
    got = run(exact, live)
    assert [c.cache_mode for c in got][1:] == ["cached"] * 3
    want = [c.actions for c in run(dense, live)]
    assert all(np.array_equal(c.actions, w) for c, w in zip(got, want, strict=True))


def test_a_repeats_first_call_is_served_cached_once_the_reset_refilled_the_window() -> None:
    """At a reset the runtime wants the first calls of the episodes the next one will likely repeat (those
    the finished one was served from, best first, then the most recently used), and a motion window then
    (the node runs one at each reset) rebuilds them: the repeat's first call is served cached. A first call
    whose scene is not in the repertoire waits for the pick, runs dense, and wastes no cached run."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD))
    rm = policy.rmuscle
    assert rm is not None
    run(policy, episode(6))
    assert policy.reset_episode() == 0
    starts = [(0, p) for p in range(rm.cfg.lookahead + 1)]
    assert rm._wanted == starts
    loads = []
    load = rm.library.load
    rm.library.load = lambda i: loads.append(i) or load(i)  # type: ignore[method-assign]
    policy.rebuild_cache()  # the motion window at the reset
    assert loads == [], "the episode just recorded is rebuilt from memory, not read back from its file"
    repeat = run(policy, episode(6, offset=0.05, light=0.97, noise=2.0))
    assert [c.cache_mode for c in repeat] == ["cached"] * 6
    assert all(np.isfinite(c.actions).all() for c in repeat) and rm.match_reruns == 0
    assert policy.reset_episode() is None, "an episode served from the cache is not recorded"
    assert rm._wanted == starts, "the episode it was served from"

    policy.rebuild_cache()
    policy.reconfigure_cache(threshold=1.0)  # a scene no library call matches that well
    assert policy.infer(episode(3, offset=0.5, noise=2.0)[0]).cache_mode == "fallback"
    assert rm.match_reruns == 0, "the pick was checked before any cached stage was queued"


def test_fallback_is_sticky_until_the_episode_resets(tmp_path) -> None:
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD))
    run(policy, episode(4))
    policy.reset_episode()
    retriever = policy.rmuscle.retriever
    threshold = retriever.cfg.threshold
    retriever.cfg = type(retriever.cfg)(4, 4, 1.0)  # the scene leaves the repertoire...
    live = episode(4, offset=0.1, noise=2.0)
    assert policy.infer(live[0]).cache_mode == "fallback"
    retriever.cfg = type(retriever.cfg)(4, 4, threshold)  # ...and comes back within the same episode
    assert [c.cache_mode for c in run(policy, live[1:])] == ["fallback"] * 3, "sticky for the episode"
    assert policy.cache_status()["mode"] == "fallback"
    assert policy.reset_episode() == 1, "an all-dense (fallback) episode becomes a new reference"
    # Until its first call the new episode's status is no call's (found in review: the finished episode's
    # FALLBACK, which CacheStatus calls sticky until the reset, was shown through the scene reset).
    status = policy.cache_status()
    assert (status["mode"], status["similarity"], status["hit_rate"]) == ("dense", 0.0, 0.0), status
    assert [c.cache_mode for c in run(policy, episode(3, offset=0.1))][1:] == ["cached"] * 2


def test_retrieval_waits_for_no_call_it_cannot_serve_cached() -> None:
    """When nothing can serve a call cached (an empty window), or finding out would scan the whole library
    (an episode's first call; an episode that fell back), its dense stages are queued before retrieval
    runs, so a library scan never delays it; otherwise, matched on the host, retrieval picks the entry
    before the cached stages (matched on the GPU they run first: the test after this one). Seen from inside
    retrieval: whether the call's actions already exist."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, match_on_gpu=False))
    rm = policy.rmuscle
    run(policy, episode(4))
    policy.reset_episode()
    retriever, seen = rm.retriever, []
    query = retriever.query

    def spy(descriptor: np.ndarray):
        seen.append(bool(rm.engine.actions.abs().sum() > 0))
        return query(descriptor)

    def infer(obs: Observation) -> str:
        rm.engine.actions.zero_()
        mode = policy.infer(obs).cache_mode
        policy.rebuild_cache()
        return mode

    retriever.query = spy
    live = episode(4, offset=0.1, noise=2.0)
    assert [infer(live[0]), infer(live[1])] == ["dense", "cached"]
    assert seen == [True, False], "the episode's first call ran dense first; the cached one waited"
    assert policy.reset_episode() is None and any(slot.key is not None for slot in rm.window)
    assert rm.retriever is retriever, "nothing was recorded: the same library, the same retriever"
    seen.clear()
    assert [infer(live[0]), infer(live[1])] == ["dense", "cached"]
    assert seen == [True, False], "with a full window too, the first call does not wait for the scan"
    threshold = retriever.cfg.threshold
    retriever.cfg = type(retriever.cfg)(4, 4, 1.0)  # the scene leaves the repertoire...
    assert infer(live[2]) == "fallback"
    retriever.cfg = type(retriever.cfg)(4, 4, threshold)
    assert infer(live[3]) == "fallback"
    assert seen[2:] == [False, True], "found out by retrieval; from then on the dense stages go first"


def with_task(observations: list[Observation], task: str) -> list[Observation]:
    return [dataclasses.replace(o, prompt=task) for o in observations]


def test_a_policy_that_cannot_be_built_leaves_its_library_unheld(tmp_path) -> None:
    """A bad norm_stats (or tokenizer) fails the policy before its library is opened: no marker is left
    for a process that lives on (a node whose configure failed), so `remove` and the next configure are
    not refused (before, found in review, the library stayed held until the process ended)."""
    from rmuscle_ros.cache.library import holder

    lib = tmp_path / "lib"
    with pytest.raises(ValueError, match="norm stats file"):
        Policy(
            PolicyConfig(backend="fused", norm_stats=str(tmp_path / "absent.json")),
            RMuscleConfig(library_path=str(lib)),
        )
    assert holder(lib) is None
    Policy(CFG, RMuscleConfig(library_path=str(lib))).close()


def test_an_episode_with_calls_run_while_recording_was_off_is_not_recorded() -> None:
    """`record` may change live: an episode that ran some calls with it off would be recorded without
    them, its positions no longer following its calls (found in review). It is not recorded, and the
    status says why; the next episode, recorded throughout, is."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD))
    for i, obs in enumerate(episode(6)):
        if i in (2, 4):
            policy.reconfigure_cache(record=i == 4)
        policy.infer(obs)
    assert policy.reset_episode() is None
    assert (
        policy.cache_status()["last_episode_excluded"]
        == "recording (cache.record) was off for 2 of its calls"
    )
    run(policy, episode(3))
    assert policy.reset_episode() == 0 and policy.rmuscle.library.entries[0].calls == 3


def test_an_episode_longer_than_the_library_can_hold_stops_recording_and_frees_its_calls(tmp_path) -> None:
    """A cell that never calls ~/reset_episode would keep every call of its one endless episode in the
    host's memory (~1.1 MB a call at pi05), and the library would refuse it at the end anyway (found in
    review). Once the recording outgrows the whole library's bound it is dropped, the episode runs on
    unrecorded, and the reset says why; the next episode records as usual."""
    policy = Policy(
        CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, library_path=str(tmp_path), max_library_mb=4)
    )
    rt = policy.rmuscle
    run(policy, episode(1))
    per_call = rt._recording.nbytes
    assert per_call > 0
    calls = (4 << 20) // per_call + 2  # one past the bound
    run(policy, episode(calls), rebuild=False)
    assert rt._recording.nbytes == 0 and not rt._recording.descriptors, "the calls were not freed"
    assert policy.reset_episode() is None and not rt.library.entries
    excluded = policy.cache_status()["last_episode_excluded"]
    assert "more than the whole library may hold (cache.max_library_mb 4)" in excluded, excluded
    run(policy, episode(3))
    assert policy.reset_episode() == 0 and rt.library.entries[0].calls == 3


def test_a_recording_just_under_the_bound_is_dropped_as_it_runs_not_refused_at_the_reset(tmp_path) -> None:
    """The file holds a header beside the tensors a recording counts (~0.5 KB): before (found in review) a
    recording counted just under the library's bound passed the running check and its reset then failed
    with EpisodeTooLarge. The running check leaves room for the header: the episode is dropped as it runs,
    and the reset says why."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, library_path=str(tmp_path)))
    rt = policy.rmuscle
    run(policy, episode(1))
    per_call = rt._recording.nbytes
    rt.discard_recording()
    rt.library.max_bytes = 5 * per_call + 100  # the five calls' tensors fit; with the file's header, not
    run(policy, episode(5), rebuild=False)
    assert policy.reset_episode() is None and not rt.library.entries
    excluded = policy.cache_status()["last_episode_excluded"]
    assert "more than the whole library may hold" in excluded, excluded
    policy.close()


def test_a_read_only_library_records_nothing_and_each_reset_says_why(tmp_path, monkeypatch, caplog) -> None:
    """A library whose lock file cannot be created (a read-only mount) is served but not written: before
    (found in review) each dense episode's calls were still kept in host memory and every reset failed
    with "cannot record an episode". No call is kept, the reset says why instead of failing (not blaming
    cache.record, which was on), and the open warns once."""
    import errno
    import os
    from pathlib import Path

    from rmuscle_ros.cache import library as library_module

    lib = tmp_path / "lib"
    first = Policy(CFG, RMuscleConfig(library_path=str(lib), rebuilds_per_tick=FULL_REBUILD))
    run(first, episode(3))
    assert first.close() == 0
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if Path(path).name == ".lock" and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(library_module.os, "open", read_only)
    caplog.set_level("WARNING")
    # threshold 1: every call runs dense (fallback), as an episode the library would record
    policy = Policy(CFG, RMuscleConfig(library_path=str(lib), rebuilds_per_tick=FULL_REBUILD, threshold=1.0))
    said = [r.getMessage() for r in caplog.records if "read-only" in r.getMessage()]
    assert len(said) == 1 and "none is recorded" in said[0], said
    rt = policy.rmuscle
    assert rt.library.read_only and policy.cache_status()["library_episodes"] == 1
    policy.reconfigure_cache(record=False)
    run(policy, episode(2), rebuild=False)
    policy.reconfigure_cache(record=True)
    run(policy, episode(3), rebuild=False)
    assert rt._recording.nbytes == 0 and not rt._recording.descriptors, "calls kept in host memory"
    assert policy.reset_episode() is None
    excluded = policy.cache_status()["last_episode_excluded"]
    assert (
        "the library was opened read-only (its lock file" in excluded and "Read-only file system" in excluded
    )
    assert "cache.record" not in excluded, excluded
    run(policy, episode(2), rebuild=False)
    assert policy.close() is None
    monkeypatch.undo()
    assert sorted(p.name for p in lib.glob("episode_*")) == ["episode_000000.safetensors"]


def test_muscle_memory_is_per_task(tmp_path, caplog) -> None:
    """The descriptor sees the scene, not the instruction, and a bench set up the same way may be doing
    another job. A call is served only from episodes recorded under its task (the prompt's instruction,
    as the prompt carries it), each episode is recorded under its own, and an episode whose task changed
    after its first call is kept out of the library (its calls ran under two tasks)."""
    lib = tmp_path / "lib"
    policy = Policy(CFG, RMuscleConfig(library_path=str(lib), rebuilds_per_tick=FULL_REBUILD))
    rm = policy.rmuscle
    assert rm is not None
    run(policy, episode(4))  # "stack the cups"
    assert policy.reset_episode() == 0

    screws = run(policy, with_task(episode(4, offset=0.05, noise=2.0), "sort the screws"))
    assert [c.cache_mode for c in screws] == ["dense"] * 4, "the same bench, another task: not served"
    assert rm.last.reason == "no library episode of this task"
    status = policy.cache_status()
    assert (status["task"], status["task_episodes"], status["library_episodes"]) == ("sort the screws", 0, 1)
    assert policy.reset_episode() == 1, "recorded, under its own task"

    # The first task again, spelled as an operator might: the same prompt once cleaned.
    cups = run(policy, with_task(episode(4, offset=0.05, noise=2.0), "  stack_the cups\n"))
    assert [c.cache_mode for c in cups][1:] == ["cached"] * 3
    assert rm.last.episode == 0, "served from the cups' episode, not the screws'"
    assert policy.reset_episode() is None

    caplog.set_level("WARNING", logger="rmuscle_ros.cache.runtime")
    policy.rebuild_cache()  # the window holds the cups' first entries again
    assert any(slot.key is not None and slot.key[0] == 0 for slot in rm.window)
    towel = run(policy, with_task(episode(4)[:2], "fold the towel"))
    towel += run(policy, with_task(episode(4)[2:], "wipe the bench"))
    assert [c.cache_mode for c in towel] == ["dense"] * 4, "the cups' entries serve neither task"
    assert policy.reset_episode() is None, "an episode that ran under two tasks is not recorded"
    assert "its task changed from 'fold the towel' to 'wipe the bench' after 2 call(s)" in caplog.text
    run(policy, with_task(episode(3), "wipe the bench"))
    assert policy.reset_episode() == 2, "the next episode is"
    policy.close()
    index = json.loads((lib / "index.json").read_text())
    assert [e["meta"]["task"] for e in index["episodes"]] == [
        "stack the cups",
        "sort the screws",
        "wipe the bench",
    ]


def test_a_prompt_that_changes_every_call_is_served_dense_and_cheaply(tmp_path) -> None:
    """A prompt that changes within an episode (e.g. a planner's subtask instructions) is a new task at each
    change: those calls are served only from episodes of their own prompt, the episode is not recorded, and
    switching costs no rebuild of retrieval (a mask over the rows it holds)."""
    policy = Policy(CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD))
    rm = policy.rmuscle
    assert rm is not None
    run(policy, episode(4))
    assert policy.reset_episode() == 0
    retriever = rm.retriever
    steps = [dataclasses.replace(o, prompt=f"stack the cups: step {k}") for k, o in enumerate(episode(4))]
    assert [c.cache_mode for c in run(policy, steps)] == ["dense"] * 4
    assert rm.retriever is retriever, "retrieval was restricted, not rebuilt"
    assert policy.reset_episode() is None, "its calls ran under four prompts"
    assert [c.cache_mode for c in run(policy, episode(4, offset=0.05))][1:] == ["cached"] * 3
    policy.close()


def test_a_named_job_keeps_one_memory_across_the_prompts_it_runs(tmp_path) -> None:
    """A cell whose prompt changes within one job (a planner's subtask instructions) names the job
    (`task`): its episodes are recorded and served under that name whatever each call's prompt says.
    Changing the name live (RMuscle.reconfigure, the node's `cache.task`) is a change of task."""
    policy = Policy(
        CFG, RMuscleConfig(library_path=str(tmp_path / "lib"), rebuilds_per_tick=FULL_REBUILD, task="Cups")
    )
    rm = policy.rmuscle
    assert rm is not None

    def steps(observations: list[Observation]) -> list[Observation]:
        return [
            dataclasses.replace(o, prompt=f"stack the cups: step {k}") for k, o in enumerate(observations)
        ]

    run(policy, steps(episode(4)))
    assert policy.reset_episode() == 0, "recorded, though its calls had four prompts"
    assert rm.library.entries[0].meta["task"] == "Cups"
    repeat = run(policy, steps(episode(4, offset=0.05, noise=2.0)))
    assert [c.cache_mode for c in repeat][1:] == ["cached"] * 3
    assert policy.cache_status()["task"] == "Cups"
    assert policy.reset_episode() is None

    policy.reconfigure_cache(task="")  # back to the prompt's instruction: no episode of those
    assert [c.cache_mode for c in run(policy, steps(episode(3)))] == ["dense"] * 3
    with pytest.raises(ValueError, match="task must be a string"):
        policy.reconfigure_cache(task=3)
    policy.close()


def test_episodes_recorded_without_their_task_are_named_and_never_served(tmp_path, caplog) -> None:
    """A library written before episodes carried their task: which task they ran is unknown, so they are
    served for none, and opening the library says which they are and how to take them out."""
    lib = tmp_path / "lib"
    first = Policy(CFG, RMuscleConfig(library_path=str(lib), rebuilds_per_tick=FULL_REBUILD))
    run(first, episode(3))
    assert first.close() == 0
    index = json.loads((lib / "index.json").read_text())
    del index["episodes"][0]["meta"]["task"]
    (lib / "index.json").write_text(json.dumps(index))
    caplog.set_level("WARNING", logger="rmuscle_ros.cache.runtime")
    again = Policy(CFG, RMuscleConfig(library_path=str(lib), rebuilds_per_tick=FULL_REBUILD))
    assert "library episode(s) [0]" in caplog.text and "without their task" in caplog.text
    assert "rmuscle_ros.cache.library remove" in caplog.text
    assert [c.cache_mode for c in run(again, episode(3, offset=0.1))] == ["dense"] * 3
    assert again.cache_status()["task_episodes"] == 0
    again.close()


def test_library_persists_and_is_refused_for_other_weights(tmp_path) -> None:
    lib = str(tmp_path / "lib")
    first = Policy(CFG, RMuscleConfig(library_path=lib, rebuilds_per_tick=FULL_REBUILD))
    run(first, episode(3))
    assert first.close() == 0, "closing records the episode in progress"
    again = Policy(CFG, RMuscleConfig(library_path=lib, rebuilds_per_tick=FULL_REBUILD))
    assert again.cache_status()["library_episodes"] == 1
    chunks = run(again, episode(3, offset=0.1))
    assert chunks[-1].cache_mode == "cached"
    again.close()  # one opener at a time, in one process too
    with pytest.raises(LibraryMismatch, match="other weights"):
        Policy(PolicyConfig(backend="fused", seed=1), RMuscleConfig(library_path=lib))
    # Recorded under other preprocessing, its images or state tokens are not what the live calls see
    # (found in review: a library from before image_antialias / aloha_adapt_to_pi was switched on served).
    for setting, names in (
        ("image_antialias", "image resizing"),
        ("aloha_adapt_to_pi", "the state's convention"),
    ):
        changed = dataclasses.replace(CFG, **{setting: True})
        with pytest.raises(LibraryMismatch, match=rf"{setting}: library absent, model True") as e:
            Policy(changed, RMuscleConfig(library_path=lib))
        assert names in str(e.value)
    # Masks are recorded for the steps after the anchors only: another anchors count would read zero masks
    # as neuron 0 (found in review; 1, the default, keeps the key libraries had before).
    with pytest.raises(LibraryMismatch, match=r"anchors: library absent, model 2") as e:
        Policy(CFG, RMuscleConfig(library_path=lib, anchors=2))
    assert "dense anchor steps (cache.anchors)" in str(e.value)
    # A cell with fewer cameras records descriptors without the empty slots: a library of all three is
    # refused when a camera is taken out (found in review: it was served), naming the setting.
    fewer = dataclasses.replace(CFG, cameras=CFG.cameras[:2])
    with pytest.raises(LibraryMismatch, match=r"cameras_filled: library absent, model 2") as e:
        Policy(fewer, RMuscleConfig(library_path=lib))
    assert "the node's camera_topics" in str(e.value)


def test_a_library_recorded_with_the_cameras_in_other_slots_is_refused(tmp_path) -> None:
    """Two cameras in the wrists' slots (a cell without a base camera) record other inputs than two in
    the first slots: a library of one is refused for the other, naming camera_slots; the same slots
    record and serve their repeats."""
    lib = str(tmp_path / "lib")
    wrists = dataclasses.replace(CFG, cameras=CFG.cameras[1:], camera_slots=(1, 2))
    calls = [Observation({c: o.images[c] for c in wrists.cameras}, o.state, o.prompt) for o in episode(4)]
    policy = Policy(wrists, RMuscleConfig(library_path=lib, rebuilds_per_tick=FULL_REBUILD))
    run(policy, calls)
    assert policy.reset_episode() == 0
    assert [c.cache_mode for c in run(policy, calls)][1:] == ["cached"] * 3
    policy.close()
    first_slots = dataclasses.replace(CFG, cameras=CFG.cameras[1:])
    with pytest.raises(LibraryMismatch, match=r"camera_slots: library \[1, 2\], model absent") as e:
        Policy(first_slots, RMuscleConfig(library_path=lib))
    assert "an empty entry leaving its slot empty" in str(e.value)


def test_a_ramp_schedule_serves_repeats_and_keeps_a_library_of_its_own(tmp_path) -> None:
    """neuron_schedule "ramp" (the default) records and serves like the uniform one; its masks rank other
    counts per step, so a library recorded under one schedule is refused under the other, naming the
    shapes."""
    assert RMuscleConfig().neuron_schedule == "ramp"
    lib = str(tmp_path / "lib")
    ramp = RMuscleConfig(library_path=lib, rebuilds_per_tick=FULL_REBUILD, neuron_schedule="ramp")
    policy = Policy(CFG, ramp)
    run(policy, episode(4))
    assert policy.reset_episode() == 0
    chunks = run(policy, episode(4, offset=0.05, light=0.97, noise=2.0))
    assert [c.cache_mode for c in chunks[1:]] == ["cached"] * 3
    assert all(np.isfinite(c.actions).all() for c in chunks)
    policy.close()
    # The message names what differs and the setting that recorded it, so a cell knows what to set back.
    with pytest.raises(
        LibraryMismatch, match=r"other shapes .*mask_steps: library \[.*\], model absent"
    ) as e:
        Policy(CFG, RMuscleConfig(library_path=lib, neuron_schedule="uniform"))
    assert "recorded under other neuron schedule or rho_n (cache.neuron_schedule" in str(e.value)
    assert e.value.fields == ("mask_neurons", "mask_steps")
    with pytest.raises(ValueError, match="neuron_schedule"):
        RMuscleConfig(neuron_schedule="linear")


def test_a_corrupt_episode_is_reported_left_out_and_kept(tmp_path) -> None:
    lib = tmp_path / "lib"
    first = Policy(CFG, RMuscleConfig(library_path=str(lib)))
    run(first, episode(3))
    first.close()
    episode_file = next(lib.glob("episode_*.safetensors"))
    data = bytearray(episode_file.read_bytes())
    data[-100] ^= 0xFF
    episode_file.write_bytes(bytes(data))
    policy = Policy(CFG, RMuscleConfig(library_path=str(lib)))
    status = policy.cache_status()
    assert status["library_episodes"] == 0
    assert any("corrupt" in p for p in status["library_problems"])
    assert [c.cache_mode for c in run(policy, episode(2))] == ["dense", "dense"]
    assert episode_file.exists(), "the corrupt file is kept for inspection"


def test_an_episode_damaged_while_the_node_runs_is_left_out_and_the_cell_records_anew(tmp_path) -> None:
    """An episode file that can no longer be read after open checked it (a failing disk, a file replaced by
    hand): the window's refill reports it and leaves it out instead of failing every motion window on it,
    the calls run dense, and the cell records the task again and serves its repeats from that."""
    lib = tmp_path / "lib"
    policy = Policy(CFG, RMuscleConfig(library_path=str(lib), rebuilds_per_tick=FULL_REBUILD))
    rm = policy.rmuscle
    assert rm is not None
    run(policy, episode(4))
    assert policy.reset_episode() == 0
    (lib / "episode_000000.safetensors").write_bytes(b"overwritten")
    after = run(policy, episode(4, offset=0.05, noise=2.0))
    assert [c.cache_mode for c in after] == ["dense"] * 4
    status = policy.cache_status()
    assert status["library_episodes"] == 0 and status["task_episodes"] == 0
    assert any(
        "episode 0: episode_000000.safetensors could not be read" in p for p in status["library_problems"]
    )
    assert policy.reset_episode() == 1, "every call ran dense: recorded, the task's memory again"
    assert [c.cache_mode for c in run(policy, episode(4, offset=0.1))][1:] == ["cached"] * 3
    assert rm.last.episode == 1
    policy.close()
    assert (lib / "episode_000000.safetensors").read_bytes() == b"overwritten", "kept for inspection"


def test_an_episode_left_out_mid_episode_keeps_the_episodes_alignment(tmp_path) -> None:
    """An episode left out mid-episode (its file damaged, found by a refill: `_leave_out`) takes only its own
    entries out of service: the episode's alignment on the other episodes holds, and its next calls are
    served from the position it had reached on, not from the references' starts (a mutation review found
    the alignment's reset here untested: the match on the window served the next call from the entries in
    hand, and the refills after it went back to the starts). The tiny random model's descriptors barely move
    the alignment, so a refill never rereads the damaged file mid-episode here: the leave-out is called as
    the refill calls it."""
    lib = tmp_path / "lib"
    recorder = Policy(CFG, RMuscleConfig(library_path=str(lib), threshold=1.0))  # every call dense: recorded
    for k in range(2):
        run(recorder, episode(12, noise=float(k)))
        assert recorder.reset_episode() == k
    recorder.close()
    policy = Policy(CFG, RMuscleConfig(library_path=str(lib), rebuilds_per_tick=FULL_REBUILD))
    rm = policy.rmuscle
    assert rm is not None
    live = episode(12, offset=0.02, light=0.97, noise=2.0)
    assert [c.cache_mode for c in run(policy, live[:6])][1:] == ["cached"] * 5
    served, position = rm.last.episode, rm.last.position
    other = 1 - served
    rm._leave_out(other, f"episode_{other:06d}.safetensors could not be read")
    assert policy.cache_status()["task_episodes"] == 1
    for obs in live[6:9]:  # each call's window refilled after it: what retrieval asked for
        assert run(policy, [obs])[0].cache_mode == "cached"
        assert rm.last.episode == served and rm.last.position >= position, "the alignment started over"
        assert rm.retriever.positions[served] >= position
    policy.close()


def test_cache_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="rho_p"):
        RMuscleConfig(rho_p=0.0)
    with pytest.raises(ValueError, match="threshold"):
        RMuscleConfig(threshold=2.0)
    with pytest.raises(ValueError, match="rebuilds_per_tick"):
        RMuscleConfig(rebuilds_per_tick=0)
    with pytest.raises(ValueError, match="eager"):
        Policy(PolicyConfig(backend="eager"), RMuscleConfig())


def test_concurrent_rebuilds_serve_the_same_chunks(tmp_path) -> None:
    """Rebuilding kernel by kernel alongside live calls (`concurrent_rebuilds`) changes scheduling only:
    the repeat is served cached, with the same chunks as with graph rebuilds that live calls wait for."""
    chunks = []
    for concurrent in (False, True):
        cfg = RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, concurrent_rebuilds=concurrent)
        policy = Policy(CFG, cfg)
        run(policy, episode(4))
        policy.reset_episode()
        chunks.append(run(policy, episode(4, offset=0.05, light=0.97, noise=2.0)))
        policy.close()
    assert [c.cache_mode for c in chunks[1]] == ["dense"] + ["cached"] * 3
    assert all(np.array_equal(a.actions, b.actions) for a, b in zip(*chunks, strict=True))


def test_matching_on_the_gpu_serves_the_same_chunks_as_matching_on_the_host(tmp_path) -> None:
    """With `match_on_gpu` the engine picks the window entry itself and the cached graphs run before the
    host's retrieval answers: with one library episode the window holds exactly retrieval's candidates, so
    the entries, chunks and modes are those of host matching. No pick fell below the threshold."""
    chunks, statuses = [], []
    for on_gpu in (False, True):
        policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, match_on_gpu=on_gpu))
        run(policy, episode(6))
        policy.reset_episode()
        live = episode(6, offset=0.05, light=0.97, noise=2.0)
        chunks.append(run(policy, live + live[3:]))  # back to an earlier scene: the alignment moves back
        statuses.append(policy.cache_status())
        policy.close()
    modes = [c.cache_mode for c in chunks[1]]
    assert modes == [c.cache_mode for c in chunks[0]] and modes.count("cached") >= 6
    assert all(np.array_equal(a.actions, b.actions) for a, b in zip(*chunks, strict=True))
    assert statuses[0]["match_reruns"] == statuses[1]["match_reruns"] == 0


def test_matched_calls_find_the_usable_flags_in_place() -> None:
    """The flags the match stage picks from (wanted and rebuilt entries) are copied to the engine where
    they change, after a call's retrieval and as a rebuild completes, not at the start of the next call:
    there that copy was host time before the call's first graph. The engine's flags are the host's."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, match_on_gpu=True))
    run(policy, episode(6))
    policy.reset_episode()
    rm = policy.rmuscle
    assert rm is not None
    real, copies = rm.engine.set_usable, []
    rm.engine.set_usable = lambda usable: (copies.append(list(usable)), real(usable))[1]
    begin_load = rm.engine.begin_load
    at_call: list[tuple[list[bool], list[bool], int]] = []

    def spy(*a, **k):
        at_call.append((rm._usable(), rm.engine.window.usable.tolist(), len(copies)))
        return begin_load(*a, **k)

    rm.engine.begin_load = spy
    modes = []
    for obs in episode(5, offset=0.05, noise=2.0):
        before = len(copies)
        modes.append(policy.infer(obs).cache_mode)
        assert at_call[-1][2] == before, "the call copied the flags before its first graph"
        policy.rebuild_cache()
    assert modes[0] == "dense" and modes[1:] == ["cached"] * 4
    assert copies, "the flags were copied between calls"
    for slot in rm.window:  # the match stage compares with retrieval's own rows, bit for bit
        if slot.key is not None:
            library_episode, call = slot.key
            want = unit_rows(rm._descriptors[library_episode][call][None])[0]
            assert np.array_equal(rm.engine.window.keys[slot.index].numpy(), want)
            # and its Action Cache masks are that call's (found by mutation testing: a slot keeping the
            # masks it held before its rebuild passed)
            masks = rm.library.load_call(library_episode, call).action_masks[0]
            assert np.array_equal(slot.neurons.numpy(), masks.astype(np.int32))
    for host, device, _ in at_call[1:]:  # the matched calls: the engine's flags are the host's
        assert any(host) and device == host
    # Someone else writes the engine's flags (bench_rmuscle's stage timings do): the next call copies its own.
    real([True] * len(rm.window))
    assert policy.infer(episode(5, offset=0.05, noise=2.0)[4]).cache_mode == "cached"
    host, device, _ = at_call[-1]
    assert device == host != [True] * len(rm.window)


def test_a_gpu_pick_below_the_threshold_runs_the_call_again_dense(tmp_path) -> None:
    """The first call below the threshold is matched on the GPU before the host knows: its cached result is
    dropped and the call runs again dense, so the chunk is the dense chunk bit for bit (mode fallback)."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, match_on_gpu=True))
    run(policy, episode(6))
    policy.reset_episode()
    live = episode(4, offset=0.05, light=0.97, noise=2.0)
    cached = run(policy, live[:3])
    assert [c.cache_mode for c in cached] == ["dense", "cached", "cached"]
    # The scene "leaves" the repertoire now (see the module docstring: raise the threshold to 1). The
    # window still holds the entries the last call asked for, so the next call is matched on the GPU.
    rm = policy.rmuscle
    rm.cfg = dataclasses.replace(rm.cfg, threshold=1.0)
    rm._refresh_retriever()
    out = run(policy, live[3:])[0]
    assert out.cache_mode == "fallback" and policy.cache_status()["match_reruns"] == 1
    dense = Policy(CFG, RMuscleConfig(record=False))
    noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(0))
    assert np.array_equal(out.actions, dense.infer(live[3], noise).actions)


def test_settings_that_fix_no_shape_change_between_calls_and_the_rest_are_refused() -> None:
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD))
    rm = policy.rmuscle
    policy.reconfigure_cache(threshold=0.9, record=False, rebuilds_per_tick=3)
    assert (rm.cfg.threshold, rm.cfg.record, rm.cfg.rebuilds_per_tick) == (0.9, False, 3)
    assert rm.retriever.cfg.threshold == 0.9
    with pytest.raises(ValueError, match="rho_p is fixed when the engine is built"):
        policy.reconfigure_cache(rho_p=0.5)
    with pytest.raises(ValueError, match="threshold"):
        policy.reconfigure_cache(threshold=2.0)
    assert rm.cfg.threshold == 0.9 and rm.cfg.rho_p == 0.4, "a refused change changes nothing"
    run(policy, episode(2))
    assert policy.reset_episode() is None, "recording is off"


def test_the_retrieval_descriptor_leaves_out_a_missing_camera() -> None:
    """A missing camera's descriptor row is 0: its black filler is the same in every call, and counted it
    made any two scenes of a one-camera cell look alike (found in review: scene cosine c gave (c + 3.74) /
    4.74, so the 0.8 threshold passed any c >= 0.05). With it out, a one-camera cell's similarity is its
    camera's own cosine, and a call missing a camera its reference had scores lower."""
    one = dataclasses.replace(CFG, cameras=CFG.cameras[:1])
    policy = Policy(one, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD))
    cam = one.cameras[0]
    rows = []
    for t in (0.0, 1.0):
        obs = episode(2)[0]
        obs = dataclasses.replace(obs, images={cam: scene(t, light=0.3 + t)})
        policy.infer(obs)
        d = policy.engine.descriptor().cpu().numpy()
        assert d[0].any() and not d[1:].any(), "the empty slots' rows are 0"
        rows.append(d[0])
    policy.close()
    # the recorded descriptors' similarity is the camera's own cosine, not pulled toward 1
    from rmuscle_ros.cache.retrieval import unit_rows

    u = unit_rows(np.stack(rows))
    cos = float(rows[0] @ rows[1] / np.linalg.norm(rows[0]) / np.linalg.norm(rows[1]))
    assert float(u[0] @ u[1]) == pytest.approx(cos, abs=1e-6)
    # three cameras, the same scene: one camera missing from the call scores below the full call
    full = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD))
    obs = episode(2)[0]
    full.infer(obs)
    d_full = full.engine.descriptor().cpu().numpy().copy()
    full.infer(dataclasses.replace(obs, images={c: obs.images[c] for c in CFG.cameras[:2]}))
    d_two = full.engine.descriptor().cpu().numpy()
    assert not d_two[2].any() and np.array_equal(d_two[:2], d_full[:2])
    u = unit_rows(np.stack([d_full, d_two]))
    assert float(u[0] @ u[1]) < 0.9
    full.close()


def test_an_engine_of_other_cache_shapes_is_refused_naming_the_shapes_it_needs() -> None:
    """RMuscle checks the engine against its settings, for the cameras the engine was built for (a
    one-camera policy's), and names the shapes it needs with those cameras (found in review: it named
    them for every slot)."""
    from rmuscle_ros.cache.runtime import RMuscle
    from rmuscle_ros.engine import create_engine
    from rmuscle_ros.models.config import get_preset
    from rmuscle_ros.models.pi05 import Pi05Model

    cfg = RMuscleConfig(rebuilds_per_tick=FULL_REBUILD)
    model = Pi05Model(get_preset("tiny")).eval()
    engine = create_engine("fused", model, "cpu", cache=dataclasses.replace(cfg.shapes(1), rho_p=0.5))
    with pytest.raises(ValueError, match=r"built with cache=CacheShapes\(rho_p=0\.4, .*cameras=1\), got"):
        RMuscle(engine, cfg, "weights")
    RMuscle(create_engine("fused", model, "cpu", cache=cfg.shapes(1)), cfg, "weights").close()
