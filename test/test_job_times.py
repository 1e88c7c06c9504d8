"""The motion window's estimate of its jobs (job_times.py): a job is not started when its recent times say
it would delay the next call; an old outlier is forgotten; a job that never fits is retried blind ever
more rarely instead of delaying a call every JOB_MEMORY_S."""

from __future__ import annotations

import itertools

import pytest

from rmuscle_ros.node.job_times import (
    CLOCK_JUMP_RATE,
    CLOCK_RATE_EVERY_S,
    CLOCK_RATE_SPAN_S,
    JOB_MEMORY_MAX_S,
    JOB_MEMORY_S,
    ClockRate,
    JobTimes,
    clock_jumped,
)


def test_a_job_longer_than_the_time_left_is_not_started() -> None:
    jobs = JobTimes()
    jobs.times.append((100.0, 0.3))
    jobs.times.append((101.0, 0.05))
    assert jobs.too_long(now=102.0, left_s=0.2), "the longest recent time decides"
    assert not jobs.too_long(now=102.0, left_s=0.4)
    assert not jobs.too_long(now=102.0, left_s=None), "no timer: nothing to delay"


def test_an_old_outlier_is_forgotten_so_that_a_new_time_can_replace_it() -> None:
    """A first rebuild part after a reset took 520 ms on the H200 (~2 ms after): remembered for ever, it
    would stop every later window, which would then measure nothing newer."""
    jobs = JobTimes()
    jobs.times.append((0.0, 0.52))
    assert jobs.too_long(now=1.0, left_s=0.48)
    assert not jobs.too_long(now=JOB_MEMORY_S + 0.1, left_s=0.48), "started blind"
    assert jobs.too_long(now=JOB_MEMORY_S + 0.1, left_s=0.0), "not blind once the observation is due"
    assert jobs.too_long(now=JOB_MEMORY_S + 0.1, left_s=-0.05)
    jobs.record(now=JOB_MEMORY_S + 0.2, seconds=0.002, overran=False)
    assert not jobs.too_long(now=JOB_MEMORY_S + 1.0, left_s=0.48)
    assert jobs.memory_s == JOB_MEMORY_S and jobs.overruns == 0


def test_a_job_that_never_fits_is_retried_blind_ever_more_rarely() -> None:
    """An audit on a CPU whose calls fill the period: every blind start delays a call. The memory doubles
    after each such overrun (10, 20, 40 ... s, at most JOB_MEMORY_MAX_S), so over ten minutes the job
    delays a handful of calls instead of one every 10 s; one that then fits sets the memory back."""
    jobs = JobTimes(backoff=True)
    now, starts = 0.0, []
    while now < 600.0:
        now += 0.5  # a motion window every 0.5 s with 0.05 s left
        if not jobs.too_long(now, left_s=0.05):
            starts.append(now)
            now += 0.45
            jobs.record(now, 0.45, overran=True)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert len(starts) <= 7, starts
    assert gaps == sorted(gaps) and gaps[0] >= JOB_MEMORY_S and max(gaps) <= JOB_MEMORY_MAX_S + 1.0, gaps
    assert jobs.overruns == len(starts)
    assert not jobs.too_long(now + JOB_MEMORY_MAX_S + 1.0, left_s=1.0)
    jobs.record(now + JOB_MEMORY_MAX_S + 1.5, 0.45, overran=False)
    assert jobs.memory_s == JOB_MEMORY_S


def test_an_estimated_job_that_overran_does_not_stretch_the_memory() -> None:
    """Only a blind start doubles it: an estimated one that overran left its own long time, which the
    estimate reads for JOB_MEMORY_S."""
    jobs = JobTimes(backoff=True)
    jobs.times.append((0.0, 0.1))
    assert not jobs.too_long(now=1.0, left_s=0.2)
    jobs.record(now=1.5, seconds=0.5, overran=True)
    assert jobs.memory_s == JOB_MEMORY_S and jobs.overruns == 1
    assert jobs.too_long(now=2.0, left_s=0.2)


def test_a_job_started_regardless_that_overran_does_not_stretch_the_memory() -> None:
    """The node's window at an episode reset starts parts without the estimate, until the observation is
    due: its last part overruns by design. It counts as an overrun, and the memory stays."""
    jobs = JobTimes(backoff=True)
    assert not jobs.too_long(now=0.0, left_s=0.1)  # a window with nothing to do: no job, no record
    jobs.record(now=5.0, seconds=0.2, overran=True, estimated=False)
    assert jobs.memory_s == JOB_MEMORY_S and jobs.overruns == 1


def test_without_backoff_a_blind_overrun_is_counted_and_the_memory_stays() -> None:
    """Rebuild parts: a window's first parts on a GPU can each take hundreds of ms once; the memory stays
    JOB_MEMORY_S, so each is retried after it."""
    jobs = JobTimes()
    assert not jobs.too_long(now=0.0, left_s=0.05)
    jobs.record(now=0.5, seconds=0.5, overran=True)
    assert jobs.memory_s == JOB_MEMORY_S and jobs.overruns == 1
    assert jobs.too_long(now=1.0, left_s=0.05) and not jobs.too_long(now=0.5 + JOB_MEMORY_S, left_s=0.05)


def test_bad_memories_are_refused() -> None:
    with pytest.raises(ValueError, match="memory_s"):
        JobTimes(memory_s=0.0)
    with pytest.raises(ValueError, match="memory_s"):
        JobTimes(memory_s=20.0, max_memory_s=10.0)


def test_a_clock_faster_than_the_wall_clock_leaves_less_wall_time() -> None:
    """With use_sim_time the time left is on /clock: at twice real time (a bag at `--rate 2`) 0.4 s of it
    is 0.2 s of wall time, which a 0.3 s job does not fit."""
    rate = ClockRate()
    assert rate.wall_s(0.4) == 0.4, "no rate measured yet: the clock's seconds, as before"
    for k in range(11):  # 1 s of wall time, read every 0.1 s, the clock at 2x
        rate.read(100.0 + 0.1 * k, 50_000_000_000 + 200_000_000 * k)
    assert rate.rate() == pytest.approx(2.0)
    assert rate.wall_s(0.4) == pytest.approx(0.2)
    jobs = JobTimes()
    jobs.times.append((101.0, 0.3))
    assert jobs.too_long(now=101.0, left_s=rate.wall_s(0.4))


def test_a_slow_or_paused_clock_is_not_counted_on_and_a_clock_sent_back_starts_over() -> None:
    rate = ClockRate()
    for k in range(11):  # half real time
        rate.read(float(k) / 10, 100_000_000 * k // 2)
    assert rate.rate() == pytest.approx(0.5)
    assert rate.wall_s(0.4) == 0.4, "a slow clock may speed up at any moment: its seconds as they are"
    for k in range(11, 30):  # paused
        rate.read(float(k) / 10, 500_000_000)
    assert rate.wall_s(0.4) == 0.4
    rate.read(3.0, 0)  # played again from the start
    assert list(rate.readings) == [(3.0, 0)] and rate.rate() is None
    for k in range(1, 5):  # fast, but not yet over CLOCK_RATE_MIN_SPAN_S
        rate.read(3.0 + 0.1 * k, 400_000_000 * k)
    assert rate.rate() is None


def test_a_pause_or_a_jump_starts_the_rate_over_instead_of_bending_it() -> None:
    """A bag set played at 2x whose clock stops between bags (4 s), then runs on: the rate is the run's
    since the pause, not 2 s of clock over 5 s of wall (found in review: 0.32x, so no correction for
    seconds). The next bag hours ahead is a jump, not a clock at 1800x."""
    rate, wall, clock = ClockRate(), 0.0, 10.0
    for _ in range(20):  # 2 s at 2x
        wall, clock = wall + 0.1, clock + 0.2
        rate.read(wall, round(clock * 1e9))
    for _ in range(40):  # paused 4 s
        wall += 0.1
        rate.read(wall, round(clock * 1e9))
    for _ in range(6):  # 0.6 s at 2x again
        wall, clock = wall + 0.1, clock + 0.2
        rate.read(wall, round(clock * 1e9))
    assert rate.rate() == pytest.approx(2.0) and rate.wall_s(0.4) == pytest.approx(0.2)
    clock += 3600.0  # the next bag, an hour later
    wall += 0.1
    rate.read(wall, round(clock * 1e9))
    assert rate.rate() is None and len(rate.readings) == 1
    for _ in range(6):
        wall, clock = wall + 0.1, clock + 0.3
        rate.read(wall, round(clock * 1e9))
    assert rate.rate() == pytest.approx(3.0)


def test_the_clock_rate_forgets_readings_older_than_its_span_and_reads_at_most_so_often() -> None:
    rate = ClockRate()
    for k in range(int(CLOCK_RATE_SPAN_S * 20)):  # 10 s: 1x for 5 s, then 3x
        wall = 0.1 * k
        rate.read(wall, int(1e9 * (wall if wall <= 5.0 else 5.0 + 3 * (wall - 5.0))))
    assert rate.rate() == pytest.approx(3.0, rel=0.05), "the first 5 s at 1x have left the span"
    assert rate.readings[-1][0] - rate.readings[0][0] <= CLOCK_RATE_SPAN_S
    kept, last = len(rate.readings), rate.readings[-1]
    rate.read(rate.readings[-1][0] + CLOCK_RATE_EVERY_S / 2, rate.readings[-1][1] + 1)
    # (the count alone did not tell, found by a mutation review: a reading kept pushed the oldest out)
    assert len(rate.readings) == kept and rate.readings[-1] == last, (
        "a reading too close to the last is not kept"
    )


def test_a_job_that_never_fits_is_still_tried_once_every_max_memory() -> None:
    """The back-off stops doubling at JOB_MEMORY_MAX_S: on a machine whose calls fill the period for hours,
    the audits are still tried every 5 minutes, so that they resume once the load drops (found by a
    mutation review: uncapped, the memory grew to hours, and the 10 minutes the other test runs never
    reached the cap)."""
    jobs = JobTimes(backoff=True)
    now, starts = 0.0, []
    while now < 3600.0:
        now += 0.5
        if not jobs.too_long(now, left_s=0.05):
            starts.append(now)
            now += 0.45
            jobs.record(now, 0.45, overran=True)
    assert jobs.memory_s == JOB_MEMORY_MAX_S
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert max(gaps) <= JOB_MEMORY_MAX_S + 1.0 and 3600.0 - starts[-1] <= JOB_MEMORY_MAX_S + 1.0, gaps


def test_a_job_started_with_a_recent_time_is_no_blind_start_though_the_time_aged_meanwhile() -> None:
    """Whether a start was blind is decided by the times known when it started (`now - seconds`), not when
    it ended: a long job whose estimate was still fresh at its start, and had aged out by its end, does not
    stretch the memory (found by a mutation review)."""
    jobs = JobTimes(backoff=True)
    jobs.times.append((0.0, 0.1))
    jobs.record(now=JOB_MEMORY_S + 2.0, seconds=5.0, overran=True)  # started at JOB_MEMORY_S - 3: estimated
    assert jobs.memory_s == JOB_MEMORY_S and jobs.overruns == 1


def test_a_clock_sent_back_is_a_jump_whatever_the_wall_time() -> None:
    """A bag played again: /diagnostics' rate on the node's clock starts over from it (found by a mutation
    review: only the ClockRate, which checks going back itself, exercised the check)."""
    assert clock_jumped(-0.001, 10.0) and clock_jumped(-100.0, 1.0)
    assert not clock_jumped(0.0, 1.0) and not clock_jumped(2.0, 1.0)
    assert clock_jumped(CLOCK_JUMP_RATE * 1.0 + 1.5, 1.0)
