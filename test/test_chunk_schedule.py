"""The action streamer's schedule: which row of which chunk is commanded when, at what pace, and which
chunks are refused (and that a refusal leaves the chunk in execution in force)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rmuscle_ros.node.chunk_schedule import (
    ChunkRefused,
    ChunkSchedule,
    RefusalReason,
    ScheduleConfig,
    tick_time,
)

MS = 1_000_000
T0 = 10**15  # a clock reading, ns
JOINTS = ("a", "b")


def rows(horizon: int, base: float = 0.0) -> np.ndarray:
    """Row t = [base + t/100, base - t/100]: each row says which one it is."""
    t = np.arange(horizon, dtype=np.float64)[:, None] / 100
    return np.hstack([base + t, base - t])


def offer(s: ChunkSchedule, stamp_ns: int, actions: np.ndarray, now_ns: int, **fields) -> None:
    msg = {"horizon": len(actions), "action_dim": actions.shape[1], "control_period_s": 0.02,
           "joint_names": list(JOINTS), "episode_id": 0, "chunk_id": 0} | fields  # fmt: skip
    s.offer(stamp_ns=stamp_ns, actions=actions.reshape(-1), now_ns=now_ns, **msg)


def schedule(max_step: float = 100.0, max_future_s: float = 0.05) -> ChunkSchedule:
    return ChunkSchedule(ScheduleConfig(JOINTS, 0.02, max_step=max_step, max_future_s=max_future_s))


AT_REST = np.zeros(2)


def test_a_tick_commands_the_row_due_now_skipping_those_the_call_took() -> None:
    s = schedule()
    offer(s, T0, rows(50), now_ns=T0 + 70 * MS)  # arrived 70 ms after its observation
    for now, row in ((T0 + 70 * MS, 3), (T0 + 79 * MS, 3), (T0 + 80 * MS, 4), (T0 + 980 * MS, 49)):
        cmd = s.command(now, AT_REST)
        assert cmd is not None and cmd.row == row and cmd.action.tolist() == rows(50)[row].tolist()
    assert s.command(T0 + 1000 * MS, AT_REST) is None  # ran out: hold


def test_rows_are_taken_when_the_tick_was_due_so_late_callbacks_neither_repeat_nor_skip_one() -> None:
    """The control timer's callbacks run late by whatever the executor was doing (never early). With ticks due
    just before a row's boundary (here 1 ms, each callback 0–2 ms late), rows taken at the callback's time
    repeated one row and skipped the next (found in review); taken at the tick's due time (`tick_time`, from
    the timer's time until its next tick) they are consecutive."""
    period = 20 * MS
    rng = np.random.default_rng(0)
    at_callback, at_due = schedule(), schedule()
    for s in (at_callback, at_due):
        offer(s, T0, rows(50), now_ns=T0)
    taken: dict[str, list[int]] = {"callback": [], "due": []}
    for k in range(1, 50):
        due = T0 + k * period - 1 * MS
        now = due + int(rng.uniform(0, 2) * MS)  # the callback, up to 2 ms late
        until_next = due + period - now  # what the timer says in the callback
        taken["callback"].append(at_callback.command(now, AT_REST).row)
        taken["due"].append(at_due.command(tick_time(now, until_next, period), AT_REST).row)
    assert taken["due"] == list(range(49))
    repeats = sum(a == b for a, b in zip(taken["callback"][:-1], taken["callback"][1:], strict=True))
    assert repeats > 10  # the defect this guards against: about half the rows at this phase


def test_tick_time_is_the_callbacks_time_when_the_timer_cannot_say() -> None:
    period = 20 * MS
    assert tick_time(T0, 20 * MS - 1300, period) == T0 - 1300  # 1.3 µs late
    assert tick_time(T0, None, period) == T0  # a canceled timer
    assert tick_time(T0, 25 * MS, period) == T0  # off the grid (the timer was reset): as it is
    assert tick_time(T0, 0, period) == T0  # overdue by a whole period: as it is


def test_a_newer_chunk_takes_over_from_its_due_row() -> None:
    s = schedule()
    offer(s, T0, rows(50), now_ns=T0 + 20 * MS)
    assert s.command(T0 + 400 * MS, AT_REST).row == 20
    offer(s, T0 + 500 * MS, rows(50, base=1.0), now_ns=T0 + 530 * MS, chunk_id=1)
    cmd = s.command(T0 + 540 * MS, AT_REST)
    assert cmd.chunk.chunk_id == 1 and cmd.row == 2 and cmd.action.tolist() == rows(50, 1.0)[2].tolist()


def test_a_chunk_stamped_a_little_ahead_waits_while_the_previous_one_goes_on() -> None:
    s = schedule()
    offer(s, T0, rows(50), now_ns=T0)
    offer(s, T0 + 130 * MS, rows(50, base=1.0), now_ns=T0 + 100 * MS, chunk_id=1)  # 30 ms ahead: accepted
    assert s.command(T0 + 120 * MS, AT_REST).chunk.chunk_id == 0
    assert s.command(T0 + 130 * MS, AT_REST).chunk.chunk_id == 1


def test_with_a_takeover_delay_every_chunk_takes_over_at_the_same_row_whatever_its_latency() -> None:
    """A fixed execution delay (takeover_delay_s 0.2 s, 10 rows): a fast call's chunk waits while the
    previous one goes on, so a fast and a slow call hand the arms the same rows; a call slower than the
    delay takes over on arrival."""
    s = ChunkSchedule(ScheduleConfig(JOINTS, 0.02, max_step=100.0, takeover_delay_s=0.2))
    offer(s, T0, rows(50), now_ns=T0 + 30 * MS)  # the first chunk waits for its delay too
    assert s.command(T0 + 180 * MS, AT_REST) is None
    assert s.command(T0 + 200 * MS, AT_REST).row == 10
    offer(s, T0 + 500 * MS, rows(50, base=1.0), now_ns=T0 + 540 * MS, chunk_id=1)  # arrived after 2 rows
    cmd = s.command(T0 + 680 * MS, AT_REST)
    assert cmd.chunk.chunk_id == 0 and cmd.row == 34  # the previous chunk goes on until row 10 of this one
    cmd = s.command(T0 + 700 * MS, AT_REST)
    assert cmd.chunk.chunk_id == 1 and cmd.row == 10 and cmd.action.tolist() == rows(50, 1.0)[10].tolist()
    assert s.command(T0 + 1280 * MS, AT_REST).chunk.chunk_id == 1  # its successor's call is slow
    offer(s, T0 + 1000 * MS, rows(50, base=2.0), now_ns=T0 + 1300 * MS, chunk_id=2)  # 15 rows: late
    cmd = s.command(T0 + 1300 * MS, AT_REST)
    assert cmd.chunk.chunk_id == 2 and cmd.row == 15


def test_a_chunk_taking_over_between_a_ticks_due_time_and_its_callback_leaves_no_gap() -> None:
    """A tick's command is for its due time, a few ms before its callback runs; a chunk handed over in
    between whose takeover falls there: the tick still sends the running chunk's row (found in review: the
    chunk's arrival dropped the running one at the arrival's time, and that tick sent nothing)."""
    s = ChunkSchedule(ScheduleConfig(JOINTS, 0.02, max_step=100.0, takeover_delay_s=0.06))
    offer(s, T0, rows(50), now_ns=T0 + 70 * MS)
    assert s.command(T0 + 140 * MS, AT_REST).row == 7
    offer(s, T0 + 103 * MS, rows(50, base=1.0), now_ns=T0 + 165 * MS, chunk_id=1)  # takes over at T0 + 163
    cmd = s.command(T0 + 160 * MS, AT_REST)  # the tick due at T0 + 160, run at T0 + 166
    assert cmd is not None and cmd.chunk.chunk_id == 0 and cmd.row == 8
    assert s.command(T0 + 180 * MS, AT_REST).chunk.chunk_id == 1


def test_a_takeover_delay_past_a_chunks_rows_refuses_it_and_the_running_one_goes_on() -> None:
    s = ChunkSchedule(ScheduleConfig(JOINTS, 0.02, max_step=100.0, takeover_delay_s=0.2))
    offer(s, T0, rows(50), now_ns=T0)
    with pytest.raises(ChunkRefused, match=r"^expired: its 10 rows end before takeover_delay_s") as e:
        offer(s, T0 + 100 * MS, rows(10), now_ns=T0 + 110 * MS, chunk_id=1)
    assert e.value.reason is RefusalReason.EXPIRED
    assert s.command(T0 + 300 * MS, AT_REST).chunk.chunk_id == 0


def test_no_joint_moves_more_than_max_step_per_command_starting_from_the_arm() -> None:
    s = schedule(max_step=0.25)
    far = np.full((50, 2), 1.0)
    offer(s, T0, far, now_ns=T0)
    assert s.command(T0, None) is None  # no joint positions yet: nothing to start from
    got = [s.command(T0 + k * 20 * MS, AT_REST) for k in range(6)]
    assert [c.action[0] for c in got] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert [c.limited for c in got] == [True, True, True, False, False, False]
    # Commands flow: the measured position no longer matters (no tracking bound), the previous command does.
    assert s.command(T0 + 120 * MS, np.full(2, -5.0)).action.tolist() == [1.0, 1.0]


def test_a_target_beyond_a_position_limit_is_commanded_at_the_limit_and_named() -> None:
    """Joint a is limited to [-0.5, 1.2566] (the ViperX shoulder's upper limit, 72 degrees), b is not: a's
    target 2.0 is commanded at the limit and the command names a as clamped; the limit itself as float32
    carries it (3.5e-8 above) is not counted."""
    upper = math.radians(72)
    s = ChunkSchedule(
        ScheduleConfig(JOINTS, 0.02, max_step=100.0, lower=(-0.5, -np.inf), upper=(upper, np.inf))
    )
    on_the_wire = float(np.float32(upper))
    assert on_the_wire > upper
    chunk = np.array([[2.0, 7.0], [-3.0, -7.0], [on_the_wire, 0.0]])
    offer(s, T0, chunk, now_ns=T0)
    got = [s.command(T0 + k * 20 * MS, AT_REST) for k in range(3)]
    assert [c.action.tolist() for c in got] == [[upper, 7.0], [-0.5, -7.0], [upper, 0.0]]
    assert [c.clamped for c in got] == [(0,), (0,), ()]


def test_an_arm_measured_outside_its_limits_comes_in_at_max_step_not_in_one_jump() -> None:
    s = ChunkSchedule(ScheduleConfig(JOINTS, 0.02, max_step=0.1, lower=(-1.0, -1.0), upper=(1.0, 1.0)))
    offer(s, T0, np.full((50, 2), 3.0), now_ns=T0)  # asks past the limit
    measured = np.array([1.25, 0.0])  # a hair outside it (calibration)
    got = [s.command(T0 + k * 20 * MS, measured).action[0] for k in range(4)]
    assert got == pytest.approx([1.15, 1.05, 1.0, 1.0])


def test_an_arm_pushed_past_its_limit_is_never_commanded_further_out_than_it_is() -> None:
    """Measured past a limit by more than its tracking bound (pushed out by hand, or by a collision), the
    arm's commands follow it to within the bound: past the limit, but on the limit's side of the arm, so
    each pulls it back in and none drives it further out; released, it is brought back inside at
    max_step. (A review read the commands past the limit as following the arm out of the cell.)"""
    s = ChunkSchedule(
        ScheduleConfig(
            JOINTS, 0.02, max_step=0.1, lower=(-1.0, -1.0), upper=(1.0, 1.0), max_tracking_error=(0.3, 0.3)
        )
    )
    offer(s, T0, np.full((50, 2), 0.9), now_ns=T0)
    assert s.command(T0, np.full(2, 0.9)).action[0] == pytest.approx(0.9)
    pushed = np.array([1.6, 0.9])
    got = [s.command(T0 + 20 * (1 + k) * MS, pushed).action[0] for k in range(5)]
    assert got == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.3])
    assert all(g <= pushed[0] - 0.3 + 1e-9 for g in got), "never past the bound from the arm, outward"
    arm, k = pushed[0], 6
    for _ in range(10):  # released: the arm goes where it is commanded
        arm = s.command(T0 + 20 * k * MS, np.array([arm, 0.9])).action[0]
        k += 1
    assert arm == pytest.approx(0.9), "back inside, at the chunk's row"


def test_after_a_hold_commands_step_from_the_command_the_arm_held() -> None:
    """A hold (the chunks ran out) leaves the arm on its last command; the next command is at most max_step
    from it, whatever the arm measures. A gripper closed on an object measures open of its command: from
    the measurement, the next command would open the gripper and loosen the grasp."""
    s = schedule(max_step=0.1)
    closed, blocked = 0.62, np.array([1.0, 0.0])  # the object holds the fingers at 1.0
    offer(s, T0, np.full((2, 2), closed), now_ns=T0)  # two rows: 40 ms
    assert s.command(T0, blocked).action[0] == pytest.approx(0.9)  # activation: from the measurement
    assert s.command(T0 + 20 * MS, blocked).action[0] == pytest.approx(0.8)
    assert s.command(T0 + 40 * MS, blocked) is None  # held at 0.8: the chunk ran out
    offer(s, T0 + 60 * MS, np.full((50, 2), closed), now_ns=T0 + 60 * MS, chunk_id=1)
    assert [s.command(T0 + (60 + 20 * k) * MS, blocked).action[0] for k in range(3)] == pytest.approx(
        [0.7, closed, closed]
    ), "the gripper kept closing from its held command, never opened toward the measurement"
    # Deactivated and activated again (an episode reset sends the arms home meanwhile): from the arm.
    s.start(T0 + 200 * MS)
    offer(s, T0 + 200 * MS, np.full((50, 2), 0.0), now_ns=T0 + 200 * MS, chunk_id=2)
    assert s.command(T0 + 200 * MS, np.full(2, 0.6)).action.tolist() == pytest.approx([0.5, 0.5])


def test_an_arm_joint_that_stopped_following_is_not_commanded_further_than_its_bound_from_the_arm() -> None:
    """Torque went off and the arm sagged (or it was moved by hand, or stalled) while commands flowed: a
    joint measured past its tracking bound from its last command has its command moved toward it, at
    max_step, to the bound's edge, not on toward the row, and is named in the command; a joint without a
    bound (a gripper closed on an object) goes on toward its row."""
    s = ChunkSchedule(ScheduleConfig(JOINTS, 0.02, max_step=0.1, max_tracking_error=(0.3, math.inf)))
    offer(s, T0, np.full((50, 2), 0.5), now_ns=T0)
    assert s.command(T0, np.array([0.45, 0.45])).action.tolist() == pytest.approx([0.5, 0.5])
    near = s.command(T0 + 20 * MS, np.array([0.3, 0.3]))  # 0.2 behind: within the bound
    assert near.action.tolist() == pytest.approx([0.5, 0.5]) and near.resynced == ()
    sagged = np.array([-0.5, -0.5])  # 1 rad off its command, and stays there
    got = [s.command(T0 + (40 + 20 * k) * MS, sagged) for k in range(10)]
    assert [c.action[0] for c in got] == pytest.approx(
        [0.4, 0.3, 0.2, 0.1, 0.0, -0.1, -0.2, -0.2, -0.2, -0.2]
    )
    assert [c.resynced for c in got] == [(0,)] * 7 + [()] * 3
    assert all(c.action[1] == pytest.approx(0.5) for c in got), "the unbounded joint is left alone"


def test_a_slow_arm_is_led_by_at_most_the_bound_and_no_command_jumps() -> None:
    """The ALOHA profile's max_step (0.1 rad a period, 5 rad/s) is faster than a ViperX (3.1 rad/s), and
    joint states arrive some periods late: the commands run ahead of the measured arm. They stay within the
    bound of it, and consecutive commands never differ by more than max_step (found in review: stepping
    from the measurement instead made a sawtooth that jumped back 0.2 rad every few periods)."""
    step, bound, speed, late = 0.1, 0.3, 0.062, 2  # the arm: 3.1 rad/s at 50 Hz; its states 2 periods late
    s = ChunkSchedule(ScheduleConfig(JOINTS, 0.02, max_step=step, max_tracking_error=(bound, bound)))
    offer(s, T0, np.full((50, 2), 2.0), now_ns=T0)
    arm, seen, commands = 0.0, [0.0] * (late + 1), []
    for k in range(40):
        measured = seen[-1 - late]
        c = s.command(T0 + 20 * MS * k, np.full(2, measured))
        commands.append(c.action[0])
        assert c.action[0] - measured <= bound + step + 1e-9
        arm += float(np.clip(c.action[0] - arm, -speed, speed))
        seen.append(arm)
    jumps = np.abs(np.diff(commands))
    assert jumps.max() <= step + 1e-9, commands
    assert commands[-1] == pytest.approx(2.0), "it gets there"


def test_joint_states_that_stop_coming_stop_the_commands() -> None:
    """Mid-chunk, the arm's positions are no longer known (the joint states stopped, or are too old): the
    arm holds its last command, and the next command steps from that once they come again."""
    s = schedule(max_step=0.1)
    offer(s, T0, np.full((50, 2), 1.0), now_ns=T0)
    assert s.command(T0, AT_REST).action.tolist() == pytest.approx([0.1, 0.1])
    assert s.command(T0 + 20 * MS, None) is None
    assert s.command(T0 + 40 * MS, AT_REST).action.tolist() == pytest.approx([0.2, 0.2])


def test_max_rows_bounds_how_much_of_a_chunk_is_followed() -> None:
    # A stalled policy: its last chunk is followed for max_rows rows, then the arm holds.
    s = ChunkSchedule(ScheduleConfig(JOINTS, 0.02, max_step=100.0, max_rows=25))
    offer(s, T0, rows(50), now_ns=T0)
    assert s.command(T0 + 480 * MS, AT_REST).row == 24
    assert s.command(T0 + 500 * MS, AT_REST) is None
    offer(s, T0 + 500 * MS, rows(50, base=1.0), now_ns=T0 + 510 * MS, chunk_id=1)  # the next one takes over
    assert s.command(T0 + 520 * MS, np.full(2, 1.0)).row == 1


def test_max_rows_that_end_before_a_chunk_arrives_refuse_it_as_expired() -> None:
    s = ChunkSchedule(ScheduleConfig(JOINTS, 0.02, max_rows=10))
    with pytest.raises(ChunkRefused, match="due 100 ms ago") as e:
        offer(s, T0, rows(50), now_ns=T0 + 300 * MS)  # rows 0-9 were due by T0 + 200 ms
    assert e.value.reason is RefusalReason.EXPIRED


def test_a_clock_that_goes_back_is_a_new_run() -> None:
    """A bag played again or a simulator restarted while the streamer is active: /clock goes back to the
    run's start. The new run's chunks are taken (not refused as stamped before the old ones), the old
    run's last chunk never runs again, and commands start again from the arm's position."""
    s = schedule(max_step=0.25)
    s.start(T0)
    for k in range(10):  # the first run: a chunk every 100 ms, to T0 + 0.9 s
        offer(s, T0 + k * 100 * MS, np.full((50, 2), 1.0), now_ns=T0 + k * 100 * MS + 30 * MS, chunk_id=k)
        s.command(T0 + k * 100 * MS + 30 * MS, np.full(2, 1.0))
    assert s.clock(T0 + 930 * MS) == 0, "time going on is not a jump"
    # The second run: the clock is back at T0, another scene.
    offer(s, T0 + 100 * MS, np.full((50, 2), 0.0), now_ns=T0 + 130 * MS, chunk_id=100)
    cmd = s.command(T0 + 130 * MS, np.full(2, 0.5))
    assert cmd.chunk.chunk_id == 100 and cmd.action.tolist() == pytest.approx([0.25, 0.25]), "from the arm"
    later = [s.command(T0 + (900 + 20 * k) * MS, AT_REST) for k in range(10)]
    assert all(c.chunk.chunk_id == 100 for c in later), "the first run's chunks were forgotten"
    assert s.clock(T0 + 1065 * MS) == 0, "15 ms back (less than a period): jitter, not a new run"


def test_reset_forgets_chunks_and_the_last_command() -> None:
    s = schedule(max_step=0.25)
    offer(s, T0, np.full((50, 2), 1.0), now_ns=T0)
    s.command(T0, np.full(2, 1.0))
    s.reset()
    assert s.command(T0 + 20 * MS, np.full(2, 1.0)) is None and s.chunk_in_hand is None


def test_after_start_chunks_planned_before_it_are_refused_and_later_ones_run() -> None:
    s = schedule()
    offer(s, T0, rows(50), now_ns=T0)
    s.start(T0 + 100 * MS)  # an activation: what was in hand is forgotten
    assert s.chunk_in_hand is None and s.command(T0 + 100 * MS, AT_REST) is None
    with pytest.raises(ChunkRefused, match="stamped 40 ms before commands started") as e:
        offer(s, T0 + 60 * MS, rows(50, base=1.0), now_ns=T0 + 120 * MS)
    assert e.value.reason is RefusalReason.BEFORE_START
    assert s.command(T0 + 120 * MS, AT_REST) is None
    offer(s, T0 + 100 * MS, rows(50, base=2.0), now_ns=T0 + 140 * MS)  # stamped at the start: taken
    assert s.command(T0 + 140 * MS, AT_REST).action.tolist() == rows(50, base=2.0)[2].tolist()


def test_a_start_before_the_clock_runs_takes_every_chunk() -> None:
    s = schedule()
    s.start(0)  # use_sim_time, no /clock yet
    offer(s, T0, rows(50), now_ns=T0)
    assert s.command(T0, AT_REST).row == 0


@pytest.mark.parametrize(
    ("edit", "reason", "detail"),
    [
        ({"joint_names": ["b", "a"]}, RefusalReason.JOINT_NAMES, r"chunk names \['b', 'a'\]"),
        ({"action_dim": 3}, RefusalReason.SHAPE, r"action_dim 3 with 100 values, for 2 joints"),
        ({"horizon": 49}, RefusalReason.SHAPE, r"horizon 49"),
        (
            {"control_period_s": 0.033},
            RefusalReason.PERIOD,
            r"control_period_s 0.033 s, this streamer runs at 0.02 s",
        ),
        ({"nan": True}, RefusalReason.NON_FINITE, r"non-finite actions \(as float32\) for \['b'\]"),
        ({"huge": True}, RefusalReason.NON_FINITE, r"non-finite actions \(as float32\) for \['a'\]"),
        ({"stamp_ns": T0 + 460 * MS}, RefusalReason.FUTURE, r"stamped 60 ms ahead"),
        ({"stamp_ns": T0 - 1100 * MS}, RefusalReason.EXPIRED, r"due 500 ms ago"),
        (
            {"stamp_ns": T0 - 10 * MS},
            RefusalReason.STALE,
            r"10 ms before the chunk in hand \(episode 0, chunk 7\)",
        ),
        # a call that came before any camera's next frame: the node stamps it with the same frame's time
        (
            {"stamp_ns": T0},
            RefusalReason.SAME_OBSERVATION,
            r"stamped as the chunk in hand \(episode 0, chunk 7\): planned from the same camera frames",
        ),
    ],
)
def test_a_refused_chunk_says_why_and_the_running_one_goes_on(
    edit: dict, reason: RefusalReason, detail: str
) -> None:
    s = schedule()
    offer(s, T0, rows(50), now_ns=T0, chunk_id=7)
    bad = rows(50, base=3.0)
    if edit.pop("nan", False):
        bad[10, 1] = np.nan
    if edit.pop("huge", False):  # finite here, but an infinity once sent as float32
        bad[3, 0] = 1e39
    stamp = edit.pop("stamp_ns", T0 + 200 * MS)
    with pytest.raises(ChunkRefused, match=detail) as e:
        offer(s, stamp, bad, now_ns=T0 + 400 * MS, **edit)
    assert e.value.reason is reason and str(e.value).startswith(reason.value)
    cmd = s.command(T0 + 400 * MS, AT_REST)
    assert cmd.chunk.chunk_id == 7 and cmd.action.tolist() == rows(50)[20].tolist()


def test_a_chunk_without_joint_names_is_taken_in_the_streamers_order() -> None:
    s = schedule()
    offer(s, T0, rows(50), now_ns=T0, joint_names=[])
    assert s.command(T0, AT_REST).row == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"joint_names": ("a", "a")}, r"^joint_names: needs distinct"),
        ({"control_period_s": 0.0}, r"^control_period_s: must be > 0"),
        ({"max_step": -0.1}, r"^max_step: must be > 0"),
        ({"max_step": 0.0}, r"^max_step: must be > 0"),
        ({"max_tracking_error": (0.1, 0.0)}, r"^max_tracking_error: each bound must be > 0"),
        ({"max_future_s": float("nan")}, r"^max_future_s: must be >= 0"),
        ({"max_rows": -1}, r"^max_rows: must be >= 0"),
        ({"takeover_delay_s": -0.02}, r"^takeover_delay_s: must be >= 0"),
        ({"takeover_delay_s": float("inf")}, r"^takeover_delay_s: must be >= 0"),
        ({"max_rows": 10, "takeover_delay_s": 0.2}, r"^takeover_delay_s: 0.2 s reaches past max_rows"),
        ({"lower": (0.0,), "upper": (1.0,)}, r"^lower, upper: need one limit per joint \(2\) or none"),
        ({"lower": (0.0, 1.0), "upper": (1.0, 1.0)}, r"^limits of b: need lower < upper"),
        ({"lower": (float("nan"), 0.0), "upper": (1.0, 1.0)}, r"^limits of a: need lower < upper"),
    ],
)
def test_invalid_settings_are_named(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScheduleConfig(**({"joint_names": JOINTS} | fields))


def test_a_clock_that_goes_back_forgets_the_old_runs_start_too() -> None:
    """Found by mutation testing: a streamer activated mid-run, whose bag or simulator then restarts,
    would refuse every new-run chunk stamped before the old activation (BEFORE_START) if the jump kept
    the old start; the arms sat idle until the replayed clock passed it. A jump back of more than a period
    (60 ms here) is a new run; one of less (15 ms) is jitter."""
    s = schedule()
    s.start(T0 + 200 * MS)
    offer(s, T0 + 200 * MS, rows(50), now_ns=T0 + 230 * MS)
    assert s.command(T0 + 230 * MS, AT_REST) is not None
    assert s.clock(T0 + 230 * MS - 60 * MS) == 60 * MS
    offer(s, T0 + 100 * MS, rows(50, base=1.0), now_ns=T0 + 170 * MS, chunk_id=1)  # taken
    assert s.command(T0 + 170 * MS, AT_REST).chunk.chunk_id == 1


def test_a_measured_position_that_is_not_finite_commands_nothing() -> None:
    """Found by mutation testing: with a NaN measured position the first command was NaN, and the next
    skipped max_step (a comparison with NaN is false) and jumped to the row. Nothing is commanded from
    positions that are not all finite."""
    s = schedule(max_step=0.1)
    offer(s, T0, np.full((50, 2), 1.0), now_ns=T0)
    assert s.command(T0, np.array([math.nan, 0.0])) is None
    assert s.command(T0 + 20 * MS, np.array([0.0, math.inf])) is None
    assert s.command(T0 + 40 * MS, AT_REST).action.tolist() == pytest.approx([0.1, 0.1])
