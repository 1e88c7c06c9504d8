"""Which action of which chunk the arms should hold now: the action streamer's clock arithmetic (no rclpy).

An `ActionChunk` says: row t of `actions` is due at `stamp + t * control_period_s`, where the stamp is the
time of the observation it was computed from. By the time a chunk arrives its first rows are already past
(the call took its latency), so a tick at time `now` commands row `(now - stamp) // period` of the newest
chunk that has started. `now` is the time the tick was due (`tick_time`), not the time its callback ran: a
callback a millisecond late next to a row's boundary would repeat one row and skip the next. A newer chunk
takes over from its first due row; one stamped slightly ahead of this clock waits for its time while the
previous one goes on. When the newest chunk has run out, nothing is commanded: a position-controlled arm
holds its last command.

With `takeover_delay_s` > 0 a newer chunk takes over only at `stamp + takeover_delay_s` (from the row due
then), the previous one going on until then, however early it arrived; one that arrives later takes over
on arrival. So every chunk takes over at the same row whatever its call's latency (below the delay): the
arms execute the same plan on a fast machine and a slow one, and a faster policy changes nothing they do.

Commands start (`start`) at the streamer's activation: a chunk stamped before then is refused, since its
observation may show an arm and a scene that have changed while nothing was commanded (an episode reset,
the arms sent home), and following it would move the arms back toward that past.

No command moves any joint by more than `max_step` from the previous command. The first command after
activation (or a reset) is measured from the arm's own joint positions, so a chunk that starts far from
where the arm is brings it there at that pace instead of in one jump. After a hold (the chunks ran out)
the next command is measured from the last one, which a position-controlled arm holds meanwhile: a
gripper closed on an object measures open of its command, and starting from the measurement would open
the command and loosen the grip. So nothing else may command the arms while the streamer is active (an
episode reset deactivates it first).

Every command needs the arm's measured positions (joint states that stopped coming stop the commands: the
arm holds, and /diagnostics says why), and a joint with a tracking bound (`max_tracking_error`: the arm
joints, not the grippers) is never commanded further than that from where it is measured
(`Command.resynced` names a joint whose last command was): its command moves toward the arm, at most
`max_step` a period, until it is within the bound, instead of on toward the row. An arm whose torque
went off and sagged, one moved by hand or stalled against an obstacle, is then not snapped back toward a
command it stopped following when it moves again; an arm slower than its commands (or whose joint
states lag them) is led by at most the bound, a speed limit that follows the arm. A command still never
moves more than `max_step` from the one before.

With position limits (`lower`, `upper`, per joint), a row's target beyond a joint's limit is commanded at
the limit (`Command.clamped` names those joints): a policy in the wrong units, or one asking past the arm's
travel, does not reach the motors' own limits, where an Interbotix arm's Dynamixel servos refuse the goal
and the arm stays where it was. The limit applies to the target before `max_step`: the first command after
activation steps from the measured position toward a target inside the limits, so an arm measured a hair
outside them (calibration) comes in at that pace, not in one jump.

A clock that goes back by more than a period (a bag played again, a simulator restarted: /clock back to
its start) is a new run: the chunks in hand and the last command are forgotten as at an activation
(`clock`), or every fresh chunk would be refused as stamped before them, and the old run's last chunk
would run again once the clock reached its stamp.

A chunk that cannot be executed as it says is refused with a `ChunkRefused` naming the reason; the chunk in
execution, if any, stays in force.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np


class RefusalReason(enum.Enum):
    SHAPE = "shape"  # horizon x action_dim does not match the actions, or action_dim the joints
    JOINT_NAMES = "joint_names"  # names other joints, or the same ones in another order
    PERIOD = "period"  # another control period than the streamer's
    NON_FINITE = "non_finite"  # a NaN or infinite action
    STALE = "stale"  # stamped before the chunk in execution
    # stamped the same as the newest chunk: planned from the same camera frames (a call that came before any
    # camera's next frame, a camera slower than the calls); the one in hand goes on. Routine, not a fault.
    SAME_OBSERVATION = "same_observation"
    EXPIRED = "expired"  # its last row was due before it arrived
    FUTURE = "future"  # stamped further ahead of this clock than max_future_s
    BEFORE_START = "before_start"  # stamped before commands started (the streamer's activation)


class ChunkRefused(ValueError):
    def __init__(self, reason: RefusalReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class ScheduleConfig:
    joint_names: tuple[str, ...]  # the action order the streamer expects
    control_period_s: float = 0.02
    max_step: float = 0.1  # largest change of one joint between consecutive commands (their units); > 0
    max_future_s: float = 0.05  # how far ahead of this clock a chunk's stamp may be (clock disagreement)
    # Rows of a chunk executed at most, from its first: past them the arm holds until a newer chunk comes
    # (a stalled policy's plan is not followed to its end). 0: every row.
    max_rows: int = 0
    # A chunk takes over no earlier than this long after its stamp (a fixed execution delay, see the module
    # docstring). 0: as soon as it arrives.
    takeover_delay_s: float = 0.0
    # Each joint's position limits, in joint_names order (their units; -inf / inf: none). (): no limits.
    lower: tuple[float, ...] = ()
    upper: tuple[float, ...] = ()
    # Per joint, in joint_names order: how far from its measured position a joint may be commanded (see the
    # module docstring; inf: any distance, for a gripper closed on an object, which measures open of its
    # command). (): no joint is bounded.
    max_tracking_error: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.joint_names or len(set(self.joint_names)) != len(self.joint_names):
            raise ValueError(f"joint_names: needs distinct entries, got {list(self.joint_names)}")
        if len(self.lower) != len(self.upper) or len(self.lower) not in (0, len(self.joint_names)):
            raise ValueError(
                f"lower, upper: need one limit per joint ({len(self.joint_names)}) or none, got "
                f"{len(self.lower)} and {len(self.upper)}"
            )
        for name, lo, hi in zip(self.joint_names, self.lower, self.upper, strict=False):
            if not lo < hi:  # NaN fails too
                raise ValueError(f"limits of {name}: need lower < upper, got [{lo!r}, {hi!r}]")
        if not (self.control_period_s > 0 and math.isfinite(self.control_period_s)):
            raise ValueError(f"control_period_s: must be > 0, got {self.control_period_s!r}")
        # 0 was "no limit" before (found in review: an operator setting 0 as the safest value got the
        # first command straight at the chunk's row); a large value is the way to ask for no ramp.
        if not (self.max_step > 0 and math.isfinite(self.max_step)):
            raise ValueError(
                f"max_step: must be > 0 (the most a joint moves per period), got {self.max_step!r}"
            )
        if len(self.max_tracking_error) not in (0, len(self.joint_names)):
            raise ValueError(
                f"max_tracking_error: needs one bound per joint ({len(self.joint_names)}) or none, got "
                f"{len(self.max_tracking_error)}"
            )
        if not all(e > 0 for e in self.max_tracking_error):  # NaN fails too
            raise ValueError(
                f"max_tracking_error: each bound must be > 0, got {list(self.max_tracking_error)}"
            )
        if not (self.max_future_s >= 0 and math.isfinite(self.max_future_s)):
            raise ValueError(f"max_future_s: must be >= 0, got {self.max_future_s!r}")
        if self.max_rows < 0:
            raise ValueError(f"max_rows: must be >= 0 (0: every row), got {self.max_rows}")
        if not (self.takeover_delay_s >= 0 and math.isfinite(self.takeover_delay_s)):
            raise ValueError(f"takeover_delay_s: must be >= 0 (0: on arrival), got {self.takeover_delay_s!r}")
        if self.max_rows and self.takeover_delay_s >= self.max_rows * self.control_period_s:
            raise ValueError(
                f"takeover_delay_s: {self.takeover_delay_s:g} s reaches past max_rows ({self.max_rows} rows of "
                f"{self.control_period_s:g} s): every chunk would take over after its last row, and nothing be sent"
            )

    @property
    def period_ns(self) -> int:
        return round(self.control_period_s * 1e9)


@dataclass(frozen=True)
class Chunk:
    start_ns: int  # when row 0 is due (the observation's stamp)
    actions: np.ndarray  # (horizon, joints), float64
    episode_id: int
    chunk_id: int
    takeover_ns: int  # from when it may take over from the chunk before: start_ns + takeover_delay_s


@dataclass(frozen=True)
class Command:
    action: np.ndarray  # what the joints are commanded to, in joint_names order
    chunk: Chunk
    row: int  # the chunk's row it came from
    limited: bool  # max_step held back at least one joint
    clamped: tuple[int, ...] = ()  # the joints (indices) whose target lay beyond a position limit
    # the joints (indices) measured further than max_tracking_error from their last command: moved toward
    # the arm instead of toward the row
    resynced: tuple[int, ...] = ()


def tick_time(now_ns: int, until_next_ns: int | None, period_ns: int) -> int:
    """When a periodic timer's tick was due, from its callback's time `now_ns` and the timer's time until
    its next tick (rclpy's `Timer.time_until_next_call()`, read in the callback): the callback runs
    late by `period_ns - until_next_ns` (the executor was busy), never early. Ticks' due times are a
    period apart, so the rows taken at them are consecutive, where those taken at `now_ns` repeated one
    row and skipped the next when callbacks ran late next to a row's boundary (~2 % of rows at ±1 ms: found
    in review). `now_ns` as it is when the timer cannot say (canceled: None; or an answer off the grid)."""
    if until_next_ns is None:
        return now_ns
    late = period_ns - until_next_ns
    return now_ns - late if 0 <= late < period_ns else now_ns


class ChunkSchedule:
    """The chunks in hand and the last command. Not thread-safe: the streamer calls it from one executor."""

    def __init__(self, cfg: ScheduleConfig) -> None:
        self.cfg = cfg
        self._chunks: list[Chunk] = []  # by start: the running one and any waiting for their time
        self._last: np.ndarray | None = None  # the previous command, since commands started
        self._started_ns = 0  # chunks stamped before this are refused
        self._now_ns: int | None = None  # the latest time this schedule was asked at (`clock`)

    def reset(self) -> None:
        """Forget the chunks and the last command (deactivation): the next command starts from the arm."""
        self._chunks.clear()
        self._last = None

    def start(self, now_ns: int) -> None:
        """Commands start at `now_ns` (an activation): forget what was in hand, and refuse chunks stamped
        before it. 0: a clock not running yet, every chunk is taken (none can predate this one's start)."""
        self.reset()
        self._started_ns = now_ns
        self._now_ns = now_ns or None

    def clock(self, now_ns: int) -> int:
        """Note the time; a clock that went back by more than a period is a new run (see the module
        docstring): the chunks and the last command are forgotten. Returns how far it went back (ns; 0:
        it did not).
        `offer` and `command` call it; a caller that also keeps timed state (joint positions) calls it
        first, to forget that state too."""
        if not now_ns:  # use_sim_time before the first /clock: no time yet
            return 0
        back = self._now_ns - now_ns if self._now_ns is not None else 0
        if back > self.cfg.period_ns:
            # Forget as at an activation; but the new run's start is not known, so no chunk is refused as
            # stamped before it: the old run's chunks still in flight are stamped ahead of this clock now.
            self.reset()
            self._started_ns, self._now_ns = 0, now_ns
            return back
        self._now_ns = now_ns if self._now_ns is None else max(self._now_ns, now_ns)
        return 0

    def offer(
        self,
        *,
        stamp_ns: int,
        actions: np.ndarray | list[float],
        horizon: int,
        action_dim: int,
        control_period_s: float,
        joint_names: list[str] | tuple[str, ...],
        episode_id: int,
        chunk_id: int,
        now_ns: int,
    ) -> Chunk:
        """Take a chunk (an ActionChunk's fields), or raise ChunkRefused saying why it cannot run."""
        cfg = self.cfg
        self.clock(now_ns)
        names = tuple(joint_names)
        if names and names != cfg.joint_names:
            raise ChunkRefused(
                RefusalReason.JOINT_NAMES,
                f"chunk names {list(names)}, this streamer drives {list(cfg.joint_names)}",
            )
        flat = np.asarray(actions, dtype=np.float64).reshape(-1)
        if action_dim != len(cfg.joint_names) or horizon < 1 or flat.size != horizon * action_dim:
            raise ChunkRefused(
                RefusalReason.SHAPE,
                f"horizon {horizon} x action_dim {action_dim} with {flat.size} values, for "
                f"{len(cfg.joint_names)} joints",
            )
        if not math.isclose(control_period_s, cfg.control_period_s, rel_tol=1e-3):
            raise ChunkRefused(
                RefusalReason.PERIOD,
                f"control_period_s {control_period_s:g} s, this streamer runs at {cfg.control_period_s:g} s",
            )
        rows = flat.reshape(horizon, action_dim)
        # Commands cross the wire as float32: a value beyond its range would arrive as an infinity.
        sendable = np.isfinite(rows) & (np.abs(rows) <= np.finfo(np.float32).max)
        if not sendable.all():
            bad = sorted({cfg.joint_names[j] for j in np.argwhere(~sendable)[:, 1]})
            raise ChunkRefused(RefusalReason.NON_FINITE, f"non-finite actions (as float32) for {bad}")
        ahead = stamp_ns - now_ns
        if ahead > cfg.max_future_s * 1e9:
            raise ChunkRefused(
                RefusalReason.FUTURE,
                f"stamped {ahead / 1e6:.0f} ms ahead of this clock (max_future_s {cfg.max_future_s:g} s)",
            )
        if stamp_ns < self._started_ns:
            raise ChunkRefused(
                RefusalReason.BEFORE_START,
                f"stamped {(self._started_ns - stamp_ns) / 1e6:.0f} ms before commands started (activation): "
                "planned from an observation the arms and scene may have changed since",
            )
        # its last row followed: max_rows of them, if set
        end_ns = stamp_ns + (min(horizon, cfg.max_rows) if cfg.max_rows else horizon) * cfg.period_ns
        if end_ns <= now_ns:
            raise ChunkRefused(
                RefusalReason.EXPIRED, f"its last action was due {(now_ns - end_ns) / 1e6:.0f} ms ago"
            )
        takeover_ns = stamp_ns + round(cfg.takeover_delay_s * 1e9)
        if takeover_ns >= end_ns:
            raise ChunkRefused(
                RefusalReason.EXPIRED,
                f"its {horizon} rows end before takeover_delay_s ({cfg.takeover_delay_s:g} s) has passed",
            )
        newest = self._chunks[-1] if self._chunks else None
        if newest is not None and stamp_ns == newest.start_ns:
            raise ChunkRefused(
                RefusalReason.SAME_OBSERVATION,
                f"stamped as the chunk in hand (episode {newest.episode_id}, chunk {newest.chunk_id}): "
                "planned from the same camera frames",
            )
        if newest is not None and stamp_ns < newest.start_ns:
            raise ChunkRefused(
                RefusalReason.STALE,
                f"stamped {(newest.start_ns - stamp_ns) / 1e6:.0f} ms before the chunk in hand "
                f"(episode {newest.episode_id}, chunk {newest.chunk_id})",
            )
        chunk = Chunk(stamp_ns, rows.copy(), episode_id, chunk_id, takeover_ns)
        # Superseded chunks go at the next command, at its tick's due time: dropped here, at the arrival's
        # time, a chunk taking over between a tick's due time and its callback left that tick without a
        # row (found in review).
        self._chunks.append(chunk)
        return chunk

    def _drop_superseded(self, now_ns: int) -> None:
        """Keep the newest chunk that has taken over and any that wait for their time."""
        started = [i for i, c in enumerate(self._chunks) if c.takeover_ns <= now_ns]
        if started:
            del self._chunks[: started[-1]]

    def command(self, now_ns: int, measured: np.ndarray | None) -> Command | None:
        """What to command at `now_ns`, or None: no chunk due (hold), or no joint positions to start from.

        `measured`: the arm's joint positions in joint_names order (None while some are unknown or not
        recent, or any not finite: nothing is commanded); used as the previous command when commands
        start, so the first one is also limited by max_step, and to keep each joint within
        max_tracking_error of it.
        """
        self.clock(now_ns)
        self._drop_superseded(now_ns)
        running = self._chunks[0] if self._chunks and self._chunks[0].takeover_ns <= now_ns else None
        row = -1 if running is None else (now_ns - running.start_ns) // self.cfg.period_ns
        rows = len(running.actions) if running is not None else 0
        if self.cfg.max_rows:
            rows = min(rows, self.cfg.max_rows)
        if running is None or row >= rows:
            return None  # holding: the arm holds the last command, which the next one steps from
        if measured is None or not np.isfinite(measured).all():
            # not where the arm is (a NaN would pass max_step: a comparison with it is false; found by
            # mutation testing): the arm holds its last command until it is known again
            return None
        previous = self._last if self._last is not None else measured
        target = running.actions[row]
        clamped: tuple[int, ...] = ()
        if self.cfg.lower:
            within = np.clip(target, self.cfg.lower, self.cfg.upper)
            # 1e-6: a target at the limit that crossed the wire as float32 is not counted as beyond it
            clamped = tuple(int(i) for i in np.flatnonzero(np.abs(within - target) > 1e-6))
            target = within
        step = self.cfg.max_step
        # A joint within a step of its target gets the target itself. The 1e-6 is for values that crossed
        # the wire as float32, a step whose remainder rounded a hair above max_step.
        strayed = np.zeros(len(previous), dtype=bool)
        if self.cfg.max_tracking_error:
            # Within the bound of the arm: the target clipped to it. A command already outside it (the arm
            # stopped following) moves toward it from there, at max_step like any command.
            bound = np.asarray(self.cfg.max_tracking_error)
            strayed = np.abs(measured - previous) > bound + 1e-9
            target = np.clip(target, measured - bound, measured + bound)
        held_back = np.abs(target - previous) > step + 1e-6
        action = np.where(held_back, previous + np.clip(target - previous, -step, step), target)
        resynced = tuple(int(i) for i in np.flatnonzero(strayed))
        self._last = action
        return Command(
            action=action,
            chunk=running,
            row=int(row),
            limited=bool(held_back.any()),
            clamped=clamped,
            resynced=resynced,
        )

    @property
    def chunk_in_hand(self) -> Chunk | None:
        return self._chunks[-1] if self._chunks else None
