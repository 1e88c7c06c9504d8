"""Audits of cached calls on the CPU (tiny model, fused backend): what a cell operator relies on.

An audit runs a cached call again dense, on the inputs and noise it had, and measures the cached chunk's
error against that dense chunk: the one measure of the caches' error a cell has on its own weights. The
error is the one a dense policy would give on the same observation and noise; an audit changes nothing
that is served; above `audit_max_error` the episode runs dense until it resets.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from test_rmuscle_runtime import CFG, FULL_REBUILD, episode, with_task

from rmuscle_ros.cache.runtime import LEARNING_REASON, RMuscleConfig
from rmuscle_ros.runtime.action_space import ALOHA_DELTA_ACTIONS
from rmuscle_ros.runtime.policy import Policy, PolicyConfig


def noise(i: int) -> torch.Tensor:
    return torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(i))


def served(policy: Policy, observations, audit: bool) -> tuple[list, list]:
    """Infer each observation (noise by index), the motion window after each: the audit first if one is
    due (as the node runs it), then the rebuilds. Returns the chunks and the audits."""
    chunks, audits = [], []
    for i, obs in enumerate(observations):
        chunks.append(policy.infer(obs, noise(i)))
        if audit:
            audits.append(policy.audit_cache())
        policy.rebuild_cache()
    return chunks, audits


def warmed(cache: RMuscleConfig, cfg: PolicyConfig = CFG) -> Policy:
    """A policy whose library holds one dense episode of the task."""
    policy = Policy(cfg, cache)
    served(policy, episode(5), audit=False)
    assert policy.reset_episode() == 0
    return policy


LIVE = episode(5, offset=0.05, light=0.97, noise=2.0)


@pytest.mark.parametrize(
    "cfg",
    [CFG, dataclasses.replace(CFG, aloha_adapt_to_pi=True, delta_actions=ALOHA_DELTA_ACTIONS)],
    ids=["absolute", "openpi_aloha"],
)
def test_an_audit_measures_the_cached_chunk_against_the_same_call_run_dense(cfg: PolicyConfig) -> None:
    """Each audit's error is the cached chunk's relative L2 error, in robot units, against what a dense
    policy gives on the same observation and noise; auditing changes no chunk that is served. With delta
    actions, between the chunks as published (the state added back)."""
    dense = Policy(cfg)
    want = [dense.infer(obs, noise(i)).actions for i, obs in enumerate(LIVE)]
    audited = warmed(RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, audit_every=1), cfg)
    plain = warmed(RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, audit_every=0), cfg)
    chunks, audits = served(audited, LIVE, audit=True)
    unaudited, _ = served(plain, LIVE, audit=False)
    assert [c.cache_mode for c in chunks] == ["dense"] + ["cached"] * 4
    assert audits[0] is None, "a dense call is not audited"
    for chunk, audit, w in zip(chunks[1:], audits[1:], want[1:], strict=True):
        assert audit is not None and not audit.tripped and audit.episode == 0
        expected = np.linalg.norm(chunk.actions - w) / np.linalg.norm(w)
        assert 0.0 < audit.error == pytest.approx(expected, rel=1e-5)
    assert all(np.array_equal(a.actions, b.actions) for a, b in zip(chunks, unaudited, strict=True))
    status = audited.cache_status()
    errors = [a.error for a in audits[1:]]
    assert status["audits"] == 4 and status["audit_trips"] == 0 and status["audits_missed"] == 0
    assert status["audit_error_last"] == errors[-1] and status["audit_error_max"] == max(errors)
    assert status["audit_error_median"] == pytest.approx(float(np.median(errors)))


def test_at_rho_one_an_audit_finds_no_error() -> None:
    policy = warmed(RMuscleConfig(rho_p=1.0, rho_n=1.0, rebuilds_per_tick=FULL_REBUILD, audit_every=1))
    chunks, audits = served(policy, LIVE, audit=True)
    assert [c.cache_mode for c in chunks][1:] == ["cached"] * 4
    assert [a.error for a in audits[1:]] == [0.0] * 4


def test_an_audit_above_the_bound_sends_the_episode_dense_until_it_resets(caplog) -> None:
    dense = Policy(CFG)
    want = [dense.infer(obs, noise(i)).actions for i, obs in enumerate(LIVE)]
    policy = warmed(RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, audit_every=1, audit_max_error=1e-6))
    chunks, audits = served(policy, LIVE, audit=True)
    assert [c.cache_mode for c in chunks] == ["dense", "cached"] + ["fallback"] * 3
    assert audits[1] is not None and audits[1].tripped and audits[1].error > 1e-6
    assert audits[2:] == [None] * 3, "dense calls are not audited"
    assert all(np.array_equal(c.actions, w) for c, w in zip(chunks[2:], want[2:], strict=True))
    assert "an audit found a cached chunk" in policy.rmuscle.last.reason
    assert "runs dense from now on" in caplog.text and "library episode 0" in caplog.text
    assert policy.cache_status()["audit_trips"] == 1
    assert policy.reset_episode() is None, "an episode served from the cache is not recorded"
    # It is no reference and was not recorded: found in review, a cell whose scene left its reference
    # midway started each episode cached, fell back and recorded nothing, forever, without a reason. The
    # reset says why, and the next episode runs dense from its start, to be recorded.
    excluded = policy.cache_status()["last_episode_excluded"]
    assert excluded.startswith(
        "1 of its calls were served from the cache before it fell back (an audit found a cached chunk"
    ) and excluded.endswith("; the next episode runs dense, to be recorded in its place"), excluded
    learning, _ = served(policy, LIVE[:3], audit=True)
    assert [c.cache_mode for c in learning] == ["fallback"] * 3
    assert policy.rmuscle.last.reason == LEARNING_REASON
    assert all(np.array_equal(c.actions, w) for c, w in zip(learning, want[:3], strict=True))
    assert policy.reset_episode() == 1, "recorded as a reference"
    again, _ = served(policy, LIVE[:3], audit=False)
    assert [c.cache_mode for c in again][1:] == ["cached"] * 2, "the next episode is served again"


def test_audits_come_every_nth_cached_call_and_a_missed_one_passes_the_turn() -> None:
    policy = warmed(RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, audit_every=2))
    due = []
    for i, obs in enumerate([*LIVE, *LIVE[1:]]):
        policy.infer(obs, noise(i))
        due.append(policy.cache_audit_due())
        if due[-1] and i != 3:  # the motion window after call 3 has no time for its audit
            assert policy.audit_cache() is not None
        policy.rebuild_cache()
    # calls 1..8 are cached: 1 audited, 2 passed, 3 due but missed, so 4 is due, 5 passed, 6, 8 audited
    assert due == [False, True, False, True, True, False, True, False, True]
    status = policy.cache_status()
    assert (status["audits"], status["audits_missed"]) == (4, 1)
    assert policy.audit_cache() is None, "nothing is due once audited"


def test_an_audit_still_due_when_the_episode_resets_counts_as_missed() -> None:
    """A reset can come between a cached call and its audit (the motion window had no time for it): the
    audit is not run (a trip would send the next episode dense), and the status counts it missed, as
    the node's /diagnostics say how many cached calls went unaudited."""
    policy = warmed(RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, audit_every=1))
    served(policy, LIVE[:2], audit=False)  # dense, then cached: its audit is due
    assert policy.cache_audit_due()
    policy.reset_episode()
    assert not policy.cache_audit_due() and policy.audit_cache() is None
    status = policy.cache_status()
    assert (status["audits"], status["audits_missed"], status["audit_trips"]) == (0, 1, 0)
    chunks, _ = served(policy, LIVE[:2], audit=True)  # the next episode's cached calls are audited
    cached = sum(c.cache_mode == "cached" for c in chunks)
    assert cached and (policy.cache_status()["audits"], policy.cache_status()["audits_missed"]) == (cached, 1)


def test_an_audit_trip_holds_for_the_rest_of_the_episode_across_a_task_change() -> None:
    """A trip sends the rest of the episode dense, and a prompt that changes within the episode (a planner's
    next subtask, whose task the library also holds) does not serve it cached again (it did before; found
    in review). The next episode is served again (an episode of two tasks starts no learning episode:
    which task's scene the library lacks is not known)."""
    policy = Policy(CFG, RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, audit_every=1, audit_max_error=1e-6))
    served(policy, episode(4), audit=False)
    assert policy.reset_episode() == 0
    served(policy, with_task(episode(4), "sort the screws"), audit=False)
    assert policy.reset_episode() == 1
    live = episode(6, offset=0.05, noise=2.0)
    chunks, audits = served(policy, live[:3], audit=True)
    assert [c.cache_mode for c in chunks] == ["dense", "cached", "fallback"] and audits[1].tripped
    later, _ = served(policy, with_task(live[3:], "sort the screws"), audit=False)
    assert [c.cache_mode for c in later] == ["fallback"] * 3
    assert "an audit found a cached chunk" in policy.rmuscle.last.reason
    policy.reset_episode()
    again, _ = served(policy, with_task(live[:3], "sort the screws"), audit=False)
    assert "cached" in [c.cache_mode for c in again], "the next episode is served again"


def test_an_audit_whose_error_is_not_finite_trips_even_without_a_bound() -> None:
    policy = warmed(RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, audit_every=1))
    served(policy, LIVE[:1], audit=False)  # an episode's first call: dense, the window empty
    assert policy.infer(LIVE[1], noise(1)).cache_mode == "cached" and policy.cache_audit_due()
    audit = policy.rmuscle.audit(lambda cached, dense: float("nan"))
    assert audit is not None and audit.tripped and audit.error == math.inf
    assert policy.infer(LIVE[2], noise(2)).cache_mode == "fallback"


def test_audit_settings_are_validated_and_change_between_calls() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="audit_every must be an int >= 0"):
            RMuscleConfig(audit_every=bad)
    for bad in (-0.1, float("nan"), float("inf"), "0.1"):
        with pytest.raises(ValueError, match="audit_max_error must be a finite number >= 0"):
            RMuscleConfig(audit_max_error=bad)
    policy = warmed(RMuscleConfig(rebuilds_per_tick=FULL_REBUILD, audit_every=0))
    served(policy, LIVE[:2], audit=False)
    assert not policy.cache_audit_due()
    assert policy.cache_status()["audits"] == 0 and math.isnan(policy.cache_status()["audit_error_last"])
    policy.reconfigure_cache(audit_every=1, audit_max_error=0.5)
    policy.infer(LIVE[2], noise(2))
    assert policy.cache_audit_due(), "from the next call on"
