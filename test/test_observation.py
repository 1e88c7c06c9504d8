"""Observation assembly from the newest messages: every refusal carries its reason."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rmuscle_ros.node.observation import DropReason, Limits, ObservationBuffer, ObservationUnavailable

MS = 1_000_000
SLOTS = ("base_0_rgb", "left_wrist_0_rgb")
JOINTS = ("a", "b", "c")


def header(t_ns: int) -> SimpleNamespace:
    return SimpleNamespace(stamp=SimpleNamespace(sec=t_ns // 1_000_000_000, nanosec=t_ns % 1_000_000_000))


def image(t_ns: int, encoding: str = "rgb8", value: int = 7) -> SimpleNamespace:
    return SimpleNamespace(
        header=header(t_ns),
        height=4,
        width=6,
        encoding=encoding,
        is_bigendian=0,
        step=18,
        data=bytes([value] * 72),
    )


def joints(t_ns: int, names=JOINTS, value: float = 0.5) -> SimpleNamespace:
    return SimpleNamespace(header=header(t_ns), name=list(names), position=[value] * len(names))


def buffer() -> ObservationBuffer:
    return ObservationBuffer(len(SLOTS), JOINTS, compressed=False, limits=Limits(100 * MS, 50 * MS, 80 * MS))


def full(t: int) -> ObservationBuffer:
    b = buffer()
    b.put_image(0, image(t))
    b.put_image(1, image(t + 10 * MS))
    b.put_joint_state(joints(t + 5 * MS))
    return b


def reason(b: ObservationBuffer, now: int) -> DropReason:
    with pytest.raises(ObservationUnavailable) as e:
        b.observation(now, "task", SLOTS)
    return e.value.reason


def test_complete_observation() -> None:
    t = 10**12
    obs = full(t).observation(t + 20 * MS, "task", SLOTS)
    assert obs.stamp_ns == t + 10 * MS  # the newest image
    assert obs.images["left_wrist_0_rgb"].shape == (4, 6, 3)
    assert obs.state.tolist() == [0.5, 0.5, 0.5] and obs.prompt == "task"


def test_a_put_says_whether_it_brought_a_first_message() -> None:
    # What the node's start-up wait retries on: a camera's first frame, a joint's first position.
    b, t = buffer(), 10**12
    assert b.put_image(0, image(t)) and not b.put_image(0, image(t + MS))
    assert b.put_joint_state(joints(t, names=("a", "b"))) and not b.put_joint_state(joints(t, names=("b",)))
    assert b.put_joint_state(joints(t, names=("b", "c")))  # "c" is new
    b.clear()
    assert b.put_image(0, image(t)) and b.put_joint_state(joints(t))


def test_two_arms_publishing_the_same_joint_names_are_told_apart_by_their_prefix() -> None:
    # An Interbotix ALOHA: both follower arms' joint_states say "waist", "gripper", ...; the node gives each
    # arm's topic its prefix (joint_name_prefixes), so neither arm overwrites the other.
    b = ObservationBuffer(1, ("left_waist", "left_gripper", "right_waist", "right_gripper"), compressed=False,
                          limits=Limits(100 * MS, 50 * MS, 80 * MS))  # fmt: skip
    t = 10**12
    b.put_image(0, image(t))
    b.put_joint_state(
        SimpleNamespace(header=header(t), name=["waist", "gripper"], position=[0.1, 0.2]), "left_"
    )
    assert reason(b, t) is DropReason.MISSING_JOINTS
    b.put_joint_state(
        SimpleNamespace(header=header(t), name=["waist", "gripper"], position=[0.3, 0.4]), "right_"
    )
    assert b.observation(t, "task", SLOTS[:1]).state.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_a_state_map_reads_another_joint_for_a_slot_and_scales_it() -> None:
    # An ALOHA's gripper state: the finger's position between closed and open, as 0 ... 1.
    state_map = (("a", "b_finger"), np.array([0.0, 0.04]), np.array([1.0, 1 / 0.02]))
    b = ObservationBuffer(1, ("a", "b"), compressed=False, limits=Limits(100 * MS, 50 * MS, 80 * MS),
                          state_map=state_map)  # fmt: skip
    t = 10**12
    b.put_image(0, image(t))
    b.put_joint_state(SimpleNamespace(header=header(t), name=["a", "b"], position=[0.3, 1.2]))
    with pytest.raises(ObservationUnavailable, match=r"no position yet for \['b_finger'\]"):
        b.observation(t, "task", SLOTS[:1])
    b.put_joint_state(SimpleNamespace(header=header(t), name=["b_finger"], position=[0.05]))
    assert b.observation(t, "task", SLOTS[:1]).state.tolist() == pytest.approx([0.3, 0.5])


def test_a_joint_state_whose_names_and_positions_do_not_pair_up_is_not_used() -> None:
    """Other counts of names and positions, or a name twice: which position is which joint's is unknown.
    Nothing of it is stored (zip would give b c's value and keep c's old one), the observation is a
    bad_state drop naming the arm and the fault, and the arm's next well-formed message ends it."""
    b, t = full(10**12), 10**12
    b.put_joint_state(
        SimpleNamespace(header=header(t + 6 * MS), name=["a", "b", "c"], position=[1.0, 3.0]), ""
    )
    with pytest.raises(
        ObservationUnavailable, match=r"does not add up, not used \(a joint state: 3 names and 2 positions"
    ):
        b.observation(t + 20 * MS, "task", SLOTS)
    b.put_joint_state(
        SimpleNamespace(header=header(t + 7 * MS), name=["a", "a", "b"], position=[9.0, 1.0, 2.0]), ""
    )
    with pytest.raises(ObservationUnavailable, match=r"names repeated: \['a'\]") as e:
        b.observation(t + 20 * MS, "task", SLOTS)
    assert e.value.reason is DropReason.BAD_STATE
    b.put_joint_state(joints(t + 8 * MS, value=0.25))
    assert b.observation(t + 20 * MS, "task", SLOTS).state.tolist() == [0.25, 0.25, 0.25]


def test_missing_joints_show_the_names_that_did_arrive() -> None:
    # A prefix left out (or doubled) shows at once: the configured names beside the received ones.
    b, t = buffer(), 10**12
    b.put_image(0, image(t))
    b.put_image(1, image(t))
    b.put_joint_state(joints(t, names=("a", "b", "x")), "left_")
    with pytest.raises(ObservationUnavailable, match=r"no position yet for \['a', 'b', 'c'\]; received "
                       r"\['left_a', 'left_b', 'left_x'\]"):  # fmt: skip
        b.observation(t, "task", SLOTS)


def test_joints_the_state_does_not_read_are_not_stored() -> None:
    """Found in review: every received name was stored, so a publisher of ever new names (or a cell-wide
    /joint_states) grew the buffer without bound and each observation copied them all under its lock.
    Only the names the state reads are stored; a few others are kept for the missing_joints reason."""
    from rmuscle_ros.node.observation import OTHER_NAMES_KEPT

    b, t = full(10**12), 10**12
    for i in range(200):
        b.put_joint_state(joints(t + 5 * MS, names=(*JOINTS, f"other_{i}", f"more_{i}")))
    assert sorted(b._joints) == list(JOINTS) and len(b._other_names) == OTHER_NAMES_KEPT
    obs = b.observation(t + 20 * MS, "task", SLOTS)
    assert obs.state.tolist() == [0.5, 0.5, 0.5]
    b.clear()
    assert not b._other_names


def test_camera_refusals_name_the_topic() -> None:
    t = 10**12
    topics = ("/cam_high/image", "/cam_left_wrist/image")
    b = ObservationBuffer(len(SLOTS), JOINTS, False, Limits(100 * MS, 50 * MS, 80 * MS), topics)
    b.put_image(0, image(t))
    with pytest.raises(
        ObservationUnavailable, match=r"no image yet for left_wrist_0_rgb \(/cam_left_wrist/image\)"
    ):
        b.observation(t, "task", SLOTS)
    b.put_image(1, image(t))
    b.put_joint_state(joints(t))
    with pytest.raises(ObservationUnavailable, match=r"base_0_rgb \(/cam_high/image\) is 150 ms old"):
        b.observation(t + 150 * MS, "task", SLOTS)


def test_each_refusal_has_its_reason() -> None:
    t = 10**12
    b = buffer()
    b.put_image(0, image(t))
    assert reason(b, t) is DropReason.MISSING_CAMERA
    b.put_image(1, image(t))
    assert reason(b, t) is DropReason.MISSING_JOINTS
    b.put_joint_state(joints(t, names=("a", "b")))
    assert reason(b, t) is DropReason.MISSING_JOINTS
    assert reason(full(t), t + 150 * MS) is DropReason.STALE_IMAGE
    stale_joints = buffer()
    stale_joints.put_image(0, image(t))
    stale_joints.put_image(1, image(t))
    stale_joints.put_joint_state(joints(t - 60 * MS))
    assert reason(stale_joints, t + 10 * MS) is DropReason.STALE_JOINTS
    skewed = full(t)
    skewed.put_image(1, image(t + 90 * MS))
    skewed.put_joint_state(joints(t + 45 * MS))
    assert reason(skewed, t + 90 * MS) is DropReason.SKEW
    assert reason(full(t + 10**9), t) is DropReason.FUTURE_STAMP
    nan = full(t)
    nan.put_joint_state(joints(t + 6 * MS, value=float("nan")))
    assert reason(nan, t + 10 * MS) is DropReason.BAD_STATE
    bad = full(t)
    bad.put_image(0, image(t, encoding="yuv422"))
    assert reason(bad, t + 10 * MS) is DropReason.BAD_IMAGE


def test_an_observation_refused_for_timing_decodes_no_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node tries a tick refused for timing again at each new message: such a refusal must cost no
    decoding, so the images are decoded only once every other check has passed."""
    t = 10**12
    skewed = full(t)
    skewed.put_image(1, image(t + 90 * MS, encoding="yuv422"))  # undecodable, and 90 ms after camera 0
    skewed.put_joint_state(joints(t + 45 * MS))
    stale = full(t)
    decoded: list[object] = []
    for b in (skewed, stale):
        monkeypatch.setattr(b, "_decode", decoded.append)
    assert reason(skewed, t + 90 * MS) is DropReason.SKEW
    assert reason(stale, t + 150 * MS) is DropReason.STALE_IMAGE
    assert decoded == []


def test_a_timing_refusal_names_the_kind_of_message_that_can_end_it() -> None:
    """The node wakes a waiting tick only on messages of that kind (`cure`): the stale source's, or the
    oldest of a skew's; other refusals have none."""

    def cure(b: ObservationBuffer, now: int) -> str:
        with pytest.raises(ObservationUnavailable) as e:
            b.observation(now, "task", SLOTS)
        return e.value.cure

    t = 10**12
    assert cure(full(t), t + 150 * MS) == "image:0"  # stale_image: camera 0 is checked first
    stale_joints = buffer()
    stale_joints.put_image(0, image(t))
    stale_joints.put_image(1, image(t))
    stale_joints.put_joint_state(joints(t - 60 * MS))
    assert cure(stale_joints, t + 10 * MS) == "joints"
    camera_behind = full(t)
    camera_behind.put_image(1, image(t + 90 * MS))
    camera_behind.put_joint_state(joints(t + 45 * MS))
    assert cure(camera_behind, t + 90 * MS) == "image:0"  # camera 0, at t, is the oldest
    stale_second = full(t + 150 * MS)
    stale_second.put_image(1, image(t))
    assert cure(stale_second, t + 150 * MS) == "image:1"  # only camera 1's next frame can end it
    # the frames stamped 40 ms ahead of the node's clock (within max_skew_s), the joints' newest 45 ms
    # behind it (not yet stale): 85 ms apart
    joints_behind = buffer()
    joints_behind.put_image(0, image(t + 40 * MS))
    joints_behind.put_image(1, image(t + 40 * MS))
    joints_behind.put_joint_state(joints(t - 45 * MS))
    assert reason(joints_behind, t) is DropReason.SKEW
    assert cure(joints_behind, t) == "joints"
    assert cure(buffer(), t) == ""  # missing_camera: not a timing refusal


def test_clear_forgets_everything() -> None:
    t = 10**12
    b = full(t)
    b.clear()
    assert reason(b, t) is DropReason.MISSING_CAMERA


def test_image_copy_is_independent_of_the_message() -> None:
    """A driver that reuses its message buffer (here a bytearray written over after the observation was
    taken) does not change an observation already taken."""
    t = 10**12
    b = full(t)
    msg = image(t + 15 * MS)
    msg.data = bytearray(msg.data)
    b.put_image(0, msg)
    obs = b.observation(t + 20 * MS, "task", SLOTS)
    msg.data[:] = bytes(len(msg.data))  # the driver's next frame, into the same buffer
    assert np.all(obs.images["base_0_rgb"] == 7)


def test_joint_positions_are_taken_where_the_cameras_saw_the_arm() -> None:
    """Frames reach the node ~40 ms after their capture (their stamps), joint states every 10 ms: the state
    is the arm's position stamped nearest the newest frame, not the newest position, and the cameras'
    delivery delay is no skew (found in review: paired with the newest joint state, 40 ms of camera
    latency dropped most ticks under a 50 ms max_skew_s)."""
    b = ObservationBuffer(len(SLOTS), JOINTS, False, Limits(100 * MS, 50 * MS, 60 * MS))
    t = 10**12
    for k in range(-30, 5):  # 100 Hz up to t + 40 ms, the arm moving: position = its stamp in ms after t
        b.put_joint_state(joints(t + k * 10 * MS, value=k * 10.0))
    b.put_image(0, image(t - 40 * MS))
    b.put_image(1, image(t + 7 * MS))  # captured at t + 7 ms, here 40 ms later
    obs = b.observation(t + 47 * MS, "task", SLOTS)
    assert obs.stamp_ns == t + 7 * MS
    assert obs.state.tolist() == [10.0, 10.0, 10.0], "the position stamped nearest the newest frame"
    # With only the newest position (t + 40 ms) the stamps would span 80 ms, past max_skew_s.


def test_of_positions_stamped_alike_the_last_received_is_taken() -> None:
    """A simulator whose /clock ticks slower than its joint states stamps several positions alike: the
    newest of them is the arm's position."""
    t = 10**12
    b = full(t)  # frames at t and t + 10 ms, joints at t + 5 ms
    for value in (0.625, 0.75, 0.875):  # stamped as the newest frame
        b.put_joint_state(joints(t + 10 * MS, value=value))
    assert b.observation(t + 20 * MS, "task", SLOTS).state.tolist() == [0.875, 0.875, 0.875]


def test_joint_states_stamped_ahead_of_the_node_clock_are_refused_naming_the_topic() -> None:
    """A joint-state host whose clock runs 200 ms ahead: its positions are not taken (the one nearest the
    frames would be the arm long before them), whatever position is picked."""
    t = 10**12
    b = buffer()
    b.put_image(0, image(t))
    b.put_image(1, image(t))
    b.put_joint_state(joints(t - 10 * MS), "", "/follower_left/joint_states")
    b.put_joint_state(joints(t + 200 * MS), "", "/follower_left/joint_states")
    with pytest.raises(
        ObservationUnavailable,
        match=r"^future_stamp: /follower_left/joint_states \(\w\) is stamped 190 ms ahead",
    ):
        b.observation(t + 10 * MS, "task", SLOTS)


def test_an_older_message_does_not_replace_a_newer_one_but_a_clock_that_went_back_restarts() -> None:
    """A second publisher on a topic (or a reordering transport) sends a message stamped before the one
    held: not stored. One stamped more than 0.1 s back is a clock that went back (a bag played again): it
    starts the source again."""
    t = 10**12
    b = full(t)  # images at t and t + 10 ms, joints at t + 5 ms
    b.put_image(1, image(t + 2 * MS, value=99))
    b.put_joint_state(joints(t + 1 * MS, value=9.0))
    obs = b.observation(t + 20 * MS, "task", SLOTS)
    assert obs.stamp_ns == t + 10 * MS and np.all(obs.images["left_wrist_0_rgb"] == 7)
    assert obs.state.tolist() == [0.5, 0.5, 0.5]
    back = t - 5 * 10**9
    b.put_image(0, image(back, value=1))
    b.put_image(1, image(back, value=1))
    b.put_joint_state(joints(back, value=0.25))
    obs = b.observation(back + 10 * MS, "task", SLOTS)
    assert obs.stamp_ns == back and obs.state.tolist() == [0.25, 0.25, 0.25]


def test_stamp_refusals_name_the_source_and_a_stamp_on_another_clock() -> None:
    t = 10**12
    topics = ("/cam_high/image", "/cam_left_wrist/image")
    b = ObservationBuffer(len(SLOTS), JOINTS, False, Limits(100 * MS, 50 * MS, 30 * MS), topics)
    b.put_image(0, image(t))
    b.put_image(1, image(t + 40 * MS))
    b.put_joint_state(joints(t + 40 * MS), "", "/follower_left/joint_states")
    with pytest.raises(
        ObservationUnavailable, match=r"stamps span 40 ms: base_0_rgb \(/cam_high/image\) oldest"
    ):
        b.observation(t + 50 * MS, "task", SLOTS)
    b.put_image(0, image(t + 40 * MS))
    with pytest.raises(
        ObservationUnavailable, match=r"^stale_joints: /follower_left/joint_states \(a\) is 70 ms old$"
    ):
        b.observation(t + 110 * MS, "task", SLOTS)
    with pytest.raises(ObservationUnavailable, match=r"^future_stamp: .* is stamped 1000 ms ahead"):
        b.observation(t + 40 * MS - 1000 * MS, "task", SLOTS)
    unset = ObservationBuffer(len(SLOTS), JOINTS, False, Limits(100 * MS, 50 * MS, 30 * MS), topics)
    unset.put_image(0, image(0))
    with pytest.raises(ObservationUnavailable, match=r"its stamp is 0: the publisher never set header.stamp"):
        unset.observation(t, "task", SLOTS)
    unset.put_image(0, image(t - 7200 * 10**9))
    with pytest.raises(ObservationUnavailable, match=r"another clock"):
        unset.observation(t, "task", SLOTS)


def test_a_joint_state_without_positions_is_skipped() -> None:
    """sensor_msgs/JointState allows empty arrays: a velocity- or effort-only message (a second publisher
    on the topic) carries no position, is no fault, and leaves the positions held as they were."""
    t = 10**12
    b = full(t)
    velocities = SimpleNamespace(header=header(t + 8 * MS), name=list(JOINTS), position=[])
    assert not b.put_joint_state(velocities)
    assert b.observation(t + 20 * MS, "task", SLOTS).state.tolist() == [0.5, 0.5, 0.5]


def test_the_stalest_joint_is_the_one_judged_for_age_and_a_future_stamp_against_the_skew() -> None:
    """Found by mutation testing: one arm's driver dead while the other's goes on must be a stale_joints
    drop naming the dead one's joint, not an observation (or, later, a skew drop); and a joint state
    stamped ahead of the node clock by more than max_skew (less than max_image_age) is future_stamp."""
    b = ObservationBuffer(len(SLOTS), JOINTS, compressed=False, limits=Limits(100 * MS, 50 * MS, 100 * MS))
    t = 10**12
    b.put_image(0, image(t - 40 * MS))
    b.put_image(1, image(t - 40 * MS))
    b.put_joint_state(joints(t - 60 * MS, names=("c",)))
    b.put_joint_state(joints(t, names=("a", "b")))
    with pytest.raises(ObservationUnavailable, match=r"\(c\) is 60 ms old") as e:
        b.observation(t, "task", SLOTS)
    assert e.value.reason is DropReason.STALE_JOINTS and e.value.cure == "joints"
    ahead = ObservationBuffer(len(SLOTS), JOINTS, compressed=False, limits=Limits(100 * MS, 50 * MS, 30 * MS))
    ahead.put_image(0, image(t))
    ahead.put_image(1, image(t))
    ahead.put_joint_state(joints(t + 40 * MS))  # 40 ms ahead: past the 30 ms skew, within the 100 ms age
    assert reason(ahead, t) is DropReason.FUTURE_STAMP
