"""How long the node's motion-window jobs take, so that it starts none that would delay the next call.

After publishing a chunk, the node's worker fills the time until the next observation (the arm's motion
window) with jobs: an audit of the cached call just served, then rebuild parts of the cache's window. Each
kind of job keeps its latest times here; a job is not started when the time left is shorter than the
longest of them (`too_long`).

Old times are forgotten after `memory_s`: a window that starts no job measures none, so one outlier (a
first rebuild part after a reset took 520 ms on the H200, ~2 ms after) would otherwise stop every later
window. With no recent time a job is started blind.

With `backoff` (the node's audits), a blind start that overran (the next observation fell due while it
ran: a live call waited for it) doubles the memory, up to `max_memory_s`; a job that ends in time sets it
back. So on a machine where the job never fits (an audit on a CPU whose calls fill the period), blind
starts become rare (after 10, 20, 40 … s, then one every `max_memory_s`) instead of delaying a call every
`memory_s`. Rebuild parts keep a fixed memory: with the back-off on them too, the node's GPU test of a
served repeat found no entry rebuilt in time (its blind parts had overrun the harness's short window),
and a part in flight costs a live call less than an audit.

Times are wall-clock seconds from `time.monotonic()`; no rclpy here. The time left before the next
observation is on the node's clock: with `use_sim_time` that is /clock, which a bag played at `--rate 2` or
a simulator faster than real time (aloha_sim's `real_time_factor`) runs faster than the wall clock.
`ClockRate` measures how much faster, so that the time left is compared with the jobs' times in wall
seconds (found in review: compared as they were, a faster clock's window was overrun).
"""

from __future__ import annotations

from collections import deque

# A job's time steers the motion windows this long (with backoff: doubled after a blind overrun).
JOB_MEMORY_S = 10.0
JOB_MEMORY_MAX_S = 300.0  # at most one blind start this often for a job that never fits
JOB_TIMES_KEPT = 8
# The clock's rate is measured over the latest CLOCK_RATE_SPAN_S of wall time, once it spans at least
# CLOCK_RATE_MIN_SPAN_S (/clock comes at 100 Hz from a bag player: 10 ms steps, 2 % of 0.5 s), from readings
# at least CLOCK_RATE_EVERY_S apart.
CLOCK_RATE_SPAN_S = 5.0
CLOCK_RATE_MIN_SPAN_S = 0.5
CLOCK_RATE_EVERY_S = 0.05
# A step between two readings of more than this many clock seconds per wall second (plus 1 s) is a jump (a
# bag set's next bag, hours later), not a rate: a simulator running as fast as it can stays well below.
CLOCK_JUMP_RATE = 100.0


class JobTimes:
    """One kind of job's latest times and its memory. Not thread-safe: the node's worker uses it alone."""

    def __init__(
        self,
        backoff: bool = False,
        memory_s: float = JOB_MEMORY_S,
        max_memory_s: float = JOB_MEMORY_MAX_S,
        kept: int = JOB_TIMES_KEPT,
    ) -> None:
        if not 0 < memory_s <= max_memory_s:
            raise ValueError(f"memory_s: must be in (0, max_memory_s], got {memory_s!r}, {max_memory_s!r}")
        self.backoff = backoff
        self.base_memory_s = memory_s
        self.memory_s = memory_s
        self.max_memory_s = max_memory_s
        self.times: deque[tuple[float, float]] = deque(maxlen=kept)  # (when it ended, seconds it took)
        self.overruns = 0  # jobs still running when the next observation fell due: each delayed a call

    def recent(self, now: float) -> list[float]:
        return [seconds for when, seconds in self.times if now - when < self.memory_s]

    def too_long(self, now: float, left_s: float | None) -> bool:
        """Whether a job would not end in the `left_s` seconds left before the next observation (None:
        no timer, nothing to delay). With no recent time it is started, blind, but not once the next
        observation is already due (`left_s` ≤ 0: found in review, a blind job started then)."""
        if left_s is None:
            return False
        recent = self.recent(now)
        return left_s <= 0 or (bool(recent) and left_s < max(recent))

    def record(self, now: float, seconds: float, overran: bool, estimated: bool = True) -> None:
        """A job ended at `now` after `seconds`; `overran`: the next observation fell due while it ran.
        `estimated`: it was started because `too_long` said it fits (False: started regardless, as the
        node's window at an episode reset is, which runs until the observation is due; its overruns
        count but do not stretch the memory)."""
        blind = estimated and not self.recent(now - seconds)  # no recent time when it started
        self.times.append((now, seconds))
        self.overruns += overran
        if overran and blind and self.backoff:
            self.memory_s = min(2 * self.memory_s, self.max_memory_s)
        elif not overran:
            self.memory_s = self.base_memory_s


def clock_jumped(clock_step_s: float, wall_step_s: float) -> bool:
    """Whether a clock's step between two readings `wall_step_s` apart is no continuation of its run: it
    went back (a bag played again) or jumped ahead, faster than `CLOCK_JUMP_RATE` (the next bag of a set,
    a simulator restarted later)."""
    return clock_step_s < 0 or clock_step_s > CLOCK_JUMP_RATE * wall_step_s + 1.0


class ClockRate:
    """How fast the node's clock runs against the wall clock, from readings of both (`read`).

    `wall_s(left_s)` turns seconds on the node's clock into wall seconds: divided by the measured rate
    when the clock runs faster than the wall clock, unchanged otherwise. A slower clock is not counted on
    (it may speed up the next moment), nor is a rate not yet measured (its first `CLOCK_RATE_MIN_SPAN_S`):
    those keep the estimate as it was, in the clock's own seconds. The rate is measured over the clock's
    latest uninterrupted run: a clock that stood still between two readings (a paused bag), went back (a
    bag played again) or jumped ahead (`CLOCK_JUMP_RATE`: the next bag of a set) starts it over, so that a
    pause or a jump inside the span does not bend the rate for the span's length (found in review: after a
    4 s pause a 2x clock read as 0.32x for seconds). Not thread-safe: the node's worker uses it alone."""

    def __init__(self) -> None:
        self.readings: deque[tuple[float, int]] = deque()  # (wall s, clock ns), oldest first

    def read(self, wall_s: float, clock_ns: int) -> None:
        readings = self.readings
        if readings:
            wall_step, clock_step = wall_s - readings[-1][0], (clock_ns - readings[-1][1]) * 1e-9
            if clock_step < 0:  # went back
                readings.clear()
            elif wall_step < CLOCK_RATE_EVERY_S:
                return
            elif clock_step == 0 or clock_jumped(clock_step, wall_step):  # stood still, or jumped
                readings.clear()
        readings.append((wall_s, clock_ns))
        while wall_s - readings[0][0] > CLOCK_RATE_SPAN_S:
            readings.popleft()

    def rate(self) -> float | None:
        """Clock seconds per wall second over the span kept; None until it spans CLOCK_RATE_MIN_SPAN_S."""
        if len(self.readings) < 2:
            return None
        (wall0, clock0), (wall1, clock1) = self.readings[0], self.readings[-1]
        if wall1 - wall0 < CLOCK_RATE_MIN_SPAN_S:
            return None
        return (clock1 - clock0) * 1e-9 / (wall1 - wall0)

    def wall_s(self, left_s: float) -> float:
        rate = self.rate()
        return left_s / rate if rate is not None and rate > 1.0 else left_s
