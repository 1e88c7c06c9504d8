"""rmuscle_node with the real middleware: lifecycle services, topics, bad input, repeated cycles.

Transitions go through `~/change_state` exactly as `ros2 lifecycle set` does. Everything runs in this
process on one SingleThreadedExecutor (like the node's own `main`), over real DDS on loopback.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import itertools
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
from conftest import ros_domain

rclpy = pytest.importorskip("rclpy", reason="ROS 2 wheels not installed (make venv installs them)")
pytest.importorskip("rmuscle_ros.msg", reason="interfaces not built (scripts/setup_ros_venv.sh builds them)")

from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from lifecycle_msgs.msg import State, Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rcl_interfaces.msg import Log  # noqa: E402
from rcl_interfaces.srv import SetParameters  # noqa: E402
from rclpy.clock import ClockType  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image, JointState  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

import rmuscle_ros.node.rmuscle_node as node_module  # noqa: E402
from rmuscle_ros.msg import ActionChunk  # noqa: E402
from rmuscle_ros.node.bags import (  # noqa: E402
    ALOHA_CAMERA_TOPICS,
    ALOHA_JOINT_STATE_NAMES,
    ALOHA_JOINT_TOPICS,
    BagPlayer,
    read_messages,
    shift_header_stamp,
    typestore,
    write_aloha_episode,
    write_messages,
)
from rmuscle_ros.node.observation import DropReason, ObservationUnavailable, stamp_ns  # noqa: E402
from rmuscle_ros.node.params import ALOHA_JOINTS  # noqa: E402
from rmuscle_ros.node.replay_demo import START_NS, call_service  # noqa: E402
from rmuscle_ros.node.rmuscle_node import RMuscleNode  # noqa: E402
from rmuscle_ros.node.spin import BackgroundSpin  # noqa: E402

CAMERAS = ("images/base", "images/left_wrist", "images/right_wrist")
# Node names are unique per process: rcl's /rosout routing is keyed by logger (node) name, and a name
# reused after a node is destroyed in another context can leave its log lines unrouted.
_NODE_IDS = itertools.count()
JOINT_TOPICS = ("joint_states/left", "joint_states/right")
# The node's engines, for the tests that run inference: the node's default (CPU), and the graph backend on
# a GPU (CUDA graphs, as a cell runs it; marker `gpu`, run on the device machine).
ENGINES = [
    pytest.param({}, id="cpu"),
    pytest.param(
        {"model.backend": "graph", "model.device": "cuda"},
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="needs a CUDA GPU (run with -m gpu on the device machine)",
            ),
        ],
    ),
]


@dataclass
class Harness:
    """The node under test, a peer node standing in for the robot, and an executor thread."""

    context: Any
    node: RMuscleNode
    peer: Any
    executor: SingleThreadedExecutor
    compressed: bool = False
    chunks: list = field(default_factory=list)
    logs: list = field(default_factory=list)
    trajectories: list = field(default_factory=list)
    diagnostics: list = field(default_factory=list)

    def call(self, client: Any, request: Any, timeout: float = 30.0) -> Any:
        return call_service(client, request, timeout)

    def transition(self, transition_id: int) -> bool:
        req = ChangeState.Request()
        req.transition.id = transition_id
        return self.call(self._change, req).success

    def state(self) -> int:
        return self.call(self._get, GetState.Request()).current_state.id

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return False

    def setup_clients(self) -> None:
        name = self.node.get_name()
        self._change = self.peer.create_client(ChangeState, f"/{name}/change_state")
        self._get = self.peer.create_client(GetState, f"/{name}/get_state")
        self.reset = self.peer.create_client(Trigger, f"/{name}/reset_episode")
        self.peer.create_subscription(ActionChunk, f"/{name}/action_chunk", self.chunks.append, 10)
        self.peer.create_subscription(Log, "/rosout", self.logs.append, 100)
        self.peer.create_subscription(
            JointTrajectory, f"/{name}/joint_trajectory", self.trajectories.append, 10
        )
        self.peer.create_subscription(DiagnosticArray, "/diagnostics", self.diagnostics.append, 10)
        image_type = CompressedImage if self.compressed else Image
        self.image_pubs = [
            self.peer.create_publisher(image_type, t, qos_profile_sensor_data) for t in CAMERAS
        ]
        self.joint_pubs = [
            self.peer.create_publisher(JointState, t, qos_profile_sensor_data) for t in JOINT_TOPICS
        ]

    def now(self) -> Any:
        return self.peer.get_clock().now()

    def publish_observation(
        self, *, skip_camera: int | None = None, image_edit: Callable[[Image], None] | None = None,
        joint_value: float | tuple[float, float] = 0.1, stamp_offset_s: float = 0.0,
    ) -> int:  # fmt: skip
        """One frame per camera (480×640 rgb8) and both arms' joint states (one value, or one per arm),
        stamped now(+offset)."""
        stamp = (self.now() + rclpy.duration.Duration(seconds=stamp_offset_s)).to_msg()
        for i, pub in enumerate(self.image_pubs):
            if i == skip_camera:
                continue
            pixels = np.full((48, 64, 3), 40 * i, np.uint8)
            if self.compressed:
                msg = CompressedImage(format="jpeg", data=_jpeg(pixels))
            else:
                msg = Image(height=48, width=64, encoding="rgb8", step=64 * 3, data=pixels.tobytes())
            msg.header.stamp = stamp
            if image_edit is not None:
                image_edit(msg)
            pub.publish(msg)
        values = joint_value if isinstance(joint_value, tuple) else (joint_value, joint_value)
        for pub, value in zip(self.joint_pubs, values, strict=True):
            js = JointState(name=list(ALOHA_JOINT_STATE_NAMES))  # as an Interbotix arm: alike on both
            js.header.stamp = stamp
            js.position = [value] * len(js.name)
            pub.publish(js)
        return stamp.sec * 1_000_000_000 + stamp.nanosec

    def feed_until(self, predicate: Callable[[], bool], timeout: float = 30.0, **observation: Any) -> bool:
        """Publish observations at ~30 Hz until `predicate` holds."""

        def step() -> bool:
            self.publish_observation(**observation)
            time.sleep(0.03)
            return predicate()

        return self.wait_for(step, timeout)

    def drops(self) -> dict:
        return self.node.stats()["drops"]


def _jpeg(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    PIL.Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


def _recording(publish: Callable[..., int], stamps: list[int]) -> Callable[..., int]:
    def wrapped(**kwargs: Any) -> int:
        stamps.append(publish(**kwargs))
        return stamps[-1]

    return wrapped


@contextlib.contextmanager
def harnesses() -> Iterator[Callable[..., Harness]]:
    """A factory of harnesses (node parameters as keyword arguments), all torn down on exit."""
    made: list[tuple[Harness, BackgroundSpin]] = []

    def make(compressed: bool = False, **params: Any) -> Harness:
        context = rclpy.Context()
        rclpy.init(context=context, domain_id=ros_domain())
        # min_episode_s 0: the tests' episodes last a few calls, each to be recorded (it has its own test)
        defaults = {"warmup": False, "actions_per_inference": 5, "max_image_age_s": 1.0, "max_joint_age_s": 1.0,
                    "max_skew_s": 0.5, "prompt": "pick", "sensor_startup_timeout_s": 0.5,
                    "min_episode_s": 0.0}  # fmt: skip
        overrides = [Parameter(k, value=v) for k, v in (defaults | params).items()]
        n = next(_NODE_IDS)
        node = RMuscleNode(f"rmuscle_test_{n}", context=context, parameter_overrides=overrides)
        peer = rclpy.create_node(f"robot_{n}", context=context)
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(node)
        executor.add_node(peer)
        spinning = BackgroundSpin(executor)
        if compressed:
            node.set_parameters([Parameter("compressed_images", value=True)])
        h = Harness(context, node, peer, executor, compressed=compressed)
        h.setup_clients()
        made.append((h, spinning))
        return h

    try:
        yield make
    finally:
        for h, spinning in made:
            spinning.stop()  # first: the shutdown destroys entities, not under a spinning executor
            if h.node.policy is not None or h.node._worker is not None:
                h.node.on_shutdown(None)
            h.node.destroy_node()
            h.peer.destroy_node()
            rclpy.shutdown(context=h.context)


def test_background_spin_spins_on_after_an_entity_destroyed_under_it() -> None:
    """Jazzy's executor raises InvalidHandle in its thread when another thread destroys a publisher or
    subscription while it builds its wait set (ros2/rclpy#1284; found in review, once in ~5,000 destroy
    cycles): that thread ended and nothing was spun any more. It now spins on; stop still ends it."""
    from rclpy.exceptions import InvalidHandle

    class Raising:
        """An executor whose first spin meets a destroyed entity; later spins run until shutdown."""

        def __init__(self) -> None:
            self.spins, self.down = 0, threading.Event()

        def spin(self) -> None:
            self.spins += 1
            if self.spins == 1:
                raise InvalidHandle("cannot use Destroyable because destruction was requested")
            self.down.wait()

        def shutdown(self) -> None:
            self.down.set()

    executor = Raising()
    spinning = BackgroundSpin(executor)  # type: ignore[arg-type]
    deadline = time.monotonic() + 5.0
    while executor.spins < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert executor.spins == 2 and spinning.thread.is_alive()
    spinning.stop()
    assert not spinning.thread.is_alive()


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    with harnesses() as make:
        yield make


def _observed_state(h: Harness, joint_value: tuple[float, float]) -> dict[str, float]:
    """Configure and activate `h`'s node, publish observations until it can assemble one, and return the
    state it would feed the policy, by joint name."""
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)

    def state() -> np.ndarray | None:
        h.publish_observation(joint_value=joint_value)
        time.sleep(0.03)
        try:
            return h.node._buffer.observation(h.now().nanoseconds, "pick", ("a", "b", "c")).state
        except ObservationUnavailable:
            return None

    assert h.wait_for(lambda: state() is not None), f"no observation; drops {h.drops()}"
    return dict(zip(ALOHA_JOINTS, state().tolist(), strict=True))


def test_each_arm_fills_its_own_joints_though_both_publish_the_same_names(harness) -> None:
    """An Interbotix ALOHA publishes "waist" ... "gripper" on both follower arms' joint_states. The node
    prefixes each topic's names (joint_name_prefixes, left_ / right_ by default), so the state it feeds
    the policy has the left arm's positions in the left_* slots and the right arm's in the right_*."""
    got = _observed_state(harness(), joint_value=(0.25, -0.5))
    assert all(v == 0.25 for k, v in got.items() if k.startswith("left_")), got
    assert all(v == -0.5 for k, v in got.items() if k.startswith("right_")), got


def test_the_gripper_slot_reads_the_finger_and_maps_its_range(harness) -> None:
    """With gripper_state_joint / gripper_state_range (an ALOHA profile), each arm's gripper slot is its
    finger's position mapped from [closed, open] to [0, 1]; the other slots are as published."""
    h = harness(gripper_state_joint="left_finger", gripper_state_range=[0.0, 0.5])
    got = _observed_state(h, joint_value=(0.25, -0.5))
    assert (got["left_gripper"], got["right_gripper"]) == (0.5, -1.0)
    assert (got["left_waist"], got["right_wrist_rotate"]) == (0.25, -0.5)


@pytest.mark.parametrize("engine", ENGINES)
def test_lifecycle_services_and_chunks(harness, engine: dict) -> None:
    h = harness(**engine)
    callbacks = len(gc.callbacks)
    switch_interval = sys.getswitchinterval()
    assert h.state() == State.PRIMARY_STATE_UNCONFIGURED
    assert h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.state() == State.PRIMARY_STATE_INACTIVE
    # What configure loaded (torch, the model) is out of the collector's reach: a full collection while
    # active walks only what came after it.
    assert gc.get_freeze_count() > 0
    assert h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.state() == State.PRIMARY_STATE_ACTIVE
    # Without use_sim_time the inference timer is on the steady clock: on the system clock, a step back
    # of N s (an NTP correction) stopped it for N s (spin.periodic_timer).
    assert h.node._infer_timer.clock.clock_type == ClockType.STEADY_TIME
    gc.collect()  # a full collection while active is a pause every thread sat through: reported
    assert h.node.stats()["gc_full_collections"] >= 1 and h.node.stats()["gc_pause_max_ms"] > 0
    stamps: list[int] = []
    h.publish_observation = _recording(h.publish_observation, stamps)
    assert h.feed_until(lambda: len(h.chunks) >= 3), f"no chunks; drops {h.drops()}"
    chunk = h.chunks[0]
    assert (chunk.horizon, chunk.action_dim) == (50, 14) and len(chunk.actions) == 700
    assert list(chunk.joint_names) == list(ALOHA_JOINTS) and chunk.control_period_s == pytest.approx(0.02)
    assert chunk.header.stamp.sec * 1_000_000_000 + chunk.header.stamp.nanosec in stamps
    assert [c.chunk_id for c in h.chunks[:3]] == [0, 1, 2] and {c.episode_id for c in h.chunks[:3]} == {0}
    assert np.isfinite(np.asarray(chunk.actions)).all() and chunk.inference_latency_s > 0
    assert chunk.cache_mode == ActionChunk.CACHE_DENSE
    # The slowest calls since activation, slowest first, with where their time went: on a GPU, its span.
    slowest = h.node.stats()["slowest_calls"]
    assert 1 <= len(slowest) <= 3 and [c["ms"] for c in slowest] == sorted(
        (c["ms"] for c in slowest), reverse=True
    )
    on_gpu = engine.get("model.device") == "cuda"
    assert all(0 < c["preprocess_ms"] < c["ms"] and (c["gpu_ms"] is not None) == on_gpu for c in slowest)
    assert not on_gpu or all(0 < c["gpu_ms"] < c["ms"] for c in slowest), slowest

    assert h.call(h.reset, Trigger.Request()).success
    before = len(h.chunks)
    assert h.feed_until(lambda: len(h.chunks) > before + 1)
    after_reset = h.chunks[before + 1]  # the chunk in flight during the reset may still say episode 0
    assert (after_reset.episode_id, after_reset.chunk_id) in {(1, 0), (1, 1)}

    assert h.transition(Transition.TRANSITION_DEACTIVATE)
    assert h.state() == State.PRIMARY_STATE_INACTIVE
    # Each tick shortens Python's thread switch interval until the worker runs: the process's own is back.
    assert sys.getswitchinterval() == switch_interval
    settled = len(h.chunks)
    h.feed_until(lambda: False, timeout=0.5)
    assert len(h.chunks) == settled, "an inactive node published"
    assert h.transition(Transition.TRANSITION_CLEANUP)
    assert h.state() == State.PRIMARY_STATE_UNCONFIGURED and h.node.policy is None
    assert len(gc.callbacks) == callbacks
    # The model may be collected again: cleanup unfroze what configure froze. What an unfreeze and a
    # collection leave in the permanent generation is the interpreter's: none on CPython 3.11, 375 objects
    # on the device machine's 3.12 (gc.freeze(); gc.unfreeze(); gc.collect() in a bare process).
    left = gc.get_freeze_count()
    gc.unfreeze()
    gc.collect()
    assert left <= gc.get_freeze_count(), f"cleanup left {left} objects frozen"
    assert h.transition(Transition.TRANSITION_UNCONFIGURED_SHUTDOWN)
    assert h.state() == State.PRIMARY_STATE_FINALIZED


def test_compressed_images_trajectory_and_diagnostics(harness) -> None:
    # Action joints named apart from the state's (a cell commanding its own controllers' joints): the chunk
    # and the trajectory name what the actions drive, action_joint_names (found by a mutation review: with
    # the two alike in every test, joint_names in their place passed)
    actions = [f"{joint}_command" for joint in ALOHA_JOINTS]
    h = harness(compressed=True, publish_joint_trajectory=True, action_joint_names=actions)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 2 and len(h.trajectories) >= 2), f"drops {h.drops()}"
    traj = h.trajectories[0]
    assert list(traj.joint_names) == actions == list(h.chunks[0].joint_names) and len(traj.points) == 50
    # Row i is due i periods after the observation, as the streamer executes it (it was one period late).
    assert [traj.points[i].time_from_start.nanosec for i in (0, 1)] == [0, 20_000_000]
    assert np.allclose(traj.points[0].positions, np.asarray(h.chunks[0].actions[:14]), atol=1e-6)
    # Camera 0 goes silent: its last frame ages past max_image_age_s, a drop to report.
    assert h.feed_until(lambda: h.drops().get("stale_image", 0) > 0, skip_camera=0)

    def reported() -> bool:
        for array in h.diagnostics:
            for status in array.status:
                values = {kv.key: kv.value for kv in status.values}
                ours = h.node.get_name() in status.name
                if ours and int(values.get("chunks", 0)) >= 2 and "drops.stale_image" in values:
                    # the whole call, its preprocessing part, and (no cache: every call dense) by mode
                    latency, pre = float(values["latency_p50_ms"]), float(values["preprocess_p50_ms"])
                    gc_pauses = {"gc_pause_max_ms", "gc_full_collections"} <= set(values)
                    # how long calls waited after their tick for the worker (nothing else to do here)
                    waited = 0 <= float(values["tick_wait_p50_ms"]) <= float(values["tick_wait_max_ms"])
                    dense = float(values["latency_p50_ms.dense"]) > 0
                    # each camera's frame size (the policy letterboxes any aspect without a word)
                    sized = values.get("image_size.base_0_rgb") == "64x48"
                    return 0 < pre < latency and dense and gc_pauses and waited and sized
        return False

    assert h.wait_for(reported, timeout=10.0), "diagnostics never reported chunks, latency and the drop"
    assert sum(log.msg == "camera base_0_rgb: 64x48 frames" for log in h.logs) == 1


def test_a_camera_whose_frame_size_keeps_changing_is_counted_not_logged_every_tick(harness) -> None:
    """Frames of two sizes in turn on one camera topic (two drivers publishing on it): before (found in
    review) a warning a tick. The first change and every 50th are logged, each counted for /diagnostics."""
    h = harness()
    sizes = [np.zeros((48, 64, 3), np.uint8), np.zeros((48, 32, 3), np.uint8)]
    for i in range(101):
        h.node._note_image_sizes({"base_0_rgb": sizes[i % 2]})

    def changes() -> list[str]:
        return [log.msg for log in h.logs if "frames changed" in log.msg]

    assert h.wait_for(lambda: len(changes()) >= 3, timeout=5.0), changes()  # /rosout: asynchronous
    assert changes() == [
        "camera base_0_rgb: frames changed from 64x48 to 32x48",
        "camera base_0_rgb: frames changed from 32x48 to 64x48 (50 changes since activation: two "
        "publishers on its topic?)",
        "camera base_0_rgb: frames changed from 32x48 to 64x48 (100 changes since activation: two "
        "publishers on its topic?)",
    ]
    assert h.node.stats()["image_size_changes"] == {"base_0_rgb": 100}


def test_a_camera_sending_grey_frames_is_warned_of_once(harness) -> None:
    """A mono camera (or a mono8 stream, which the node replicates to three channels) gives a policy trained
    on colour no colour at all: its first frame since activation says so at warn level, naming the camera
    (found in review: accepted without a word). Colour frames, and a flat frame (a capped lens), do not."""
    h = harness()
    ramp = np.arange(48 * 64, dtype=np.uint8).reshape(48, 64)
    grey = np.repeat(ramp[..., None], 3, axis=2)
    colour = grey.copy()
    colour[..., 2] //= 2
    flat = np.zeros((48, 64, 3), np.uint8)
    h.node._note_image_sizes({"base_0_rgb": grey, "left_wrist_0_rgb": colour, "right_wrist_0_rgb": flat})
    h.node._note_image_sizes({"base_0_rgb": grey})  # its later frames: not again

    def warned() -> list[str]:
        return [log.msg for log in h.logs if "is grey" in log.msg]

    assert h.wait_for(lambda: len(warned()) >= 1 and len(h.logs) >= 4, timeout=5.0), h.logs
    assert len(warned()) == 1 and warned()[0].startswith("camera base_0_rgb: its first frame is grey")


def test_each_camera_outage_is_logged_naming_the_camera_and_its_end(harness, monkeypatch) -> None:
    """A camera that stops delivering frames mid-run: the node logs the outage's start at warn level naming
    the camera, and its end when chunks come back, for every outage (found in review: only the first drop
    of a reason since activation was logged, so later outages went unnamed), and /diagnostics names the
    latest drop's reason (`last_drop`)."""
    from rmuscle_ros.node import rmuscle_node

    monkeypatch.setattr(rmuscle_node, "OUTAGE_LOG_INTERVAL_S", 0.0)  # each outage here lasts well under 5 s
    h = harness(max_image_age_s=0.4, max_skew_s=0.2, max_joint_age_s=0.4)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 2), f"drops {h.drops()}"
    for slot, topic in ((1, "images/left_wrist"), (2, "images/right_wrist"), (1, "images/left_wrist")):
        first = len(h.logs)
        assert h.feed_until(lambda: h.node.stats()["failing_ticks"] >= 2, skip_camera=slot), h.drops()
        assert topic in h.node.stats()["last_drop"]
        values = {kv.key: kv.value for kv in h.node._diagnostics().status[0].values}
        assert topic in values["last_drop"], values
        sent = len(h.chunks)
        assert h.feed_until(lambda sent=sent: len(h.chunks) > sent), h.drops()

        def said(level: int, text: str, first: int = first) -> bool:
            return any(log.level == level and text in log.msg for log in h.logs[first:])

        assert h.wait_for(lambda t=topic: said(Log.WARN, t) and said(Log.INFO, "chunks again after"), 5.0), [
            (log.level, log.msg) for log in h.logs[first:]
        ]


def test_a_stale_camera_wakes_no_retry_on_the_other_cameras_frames(harness, monkeypatch) -> None:
    """A tick refused because one camera's frame is too old waits for that camera's next frame only (found
    in review: every healthy camera's frame woke a retry, each reading the whole buffer, ~30 a tick at
    2 × 60 fps while a camera was dead)."""
    h = harness(max_image_age_s=0.4, max_skew_s=0.2, max_joint_age_s=0.4)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 2), f"drops {h.drops()}"
    assert h.feed_until(lambda: h.node.stats()["failing_ticks"] >= 1, skip_camera=1), h.drops()
    buffer, reads = h.node._buffer, []
    read = buffer.observation

    def observation(*args: Any) -> Any:
        reads.append(time.monotonic())
        return read(*args)

    monkeypatch.setattr(buffer, "observation", observation)  # undone at teardown
    dropped = sum(h.drops().values())
    h.feed_until(lambda: False, timeout=1.5, skip_camera=1)  # the other cameras and the joints at ~30 Hz
    ticks = sum(h.drops().values()) - dropped
    # each tick: its try, and one more at the end of its wait (LATE_RETRY_SHARE); before, ~3 here (30 Hz)
    assert ticks >= 5 and len(reads) <= 2 * ticks + 4, f"{len(reads)} buffer reads for {ticks} ticks"


def test_a_sensor_starting_late_is_waited_for_then_reported(harness) -> None:
    # Camera drivers come up at their own pace: ticks before a sensor's first message are a wait, said once
    # on /rosout and on /diagnostics, not drops that would leave the node in WARN for the rest of its run.
    h = harness(sensor_startup_timeout_s=30.0)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: "images/right_wrist" in h.node.stats()["waiting_for"], skip_camera=2)
    h.feed_until(lambda: False, timeout=1.0, skip_camera=2)  # ~10 inference ticks without that camera
    assert h.drops() == {} and h.chunks == []

    def waiting_reported() -> bool:
        statuses = [s for a in h.diagnostics for s in a.status if h.node.get_name() in s.name]
        return any("waiting for the first messages" in s.message and s.level == s.OK for s in statuses)

    assert h.wait_for(waiting_reported, timeout=5.0), "diagnostics never said what the node waits for"
    # (once per sensor: a tick before the first frames of all, on a loaded machine, names another camera
    # first, as a reviewer's reading found the test's one line did not allow)
    name = h.node.get_name()

    def waiting_lines() -> list[str]:  # (logged after the stats that /diagnostics reads: waited for)
        return [log.msg for log in h.logs if log.name == name and "waiting for the first messages" in log.msg]

    assert h.wait_for(lambda: any("images/right_wrist" in m for m in waiting_lines()), timeout=5.0)
    said = waiting_lines()
    assert sum("images/right_wrist" in m for m in said) == 1, said
    assert "images/right_wrist" in said[-1] and all("since the activation" in m for m in said), said
    # The camera comes up: chunks flow, nothing was dropped, the wait is over.
    assert h.feed_until(lambda: len(h.chunks) >= 2), f"drops {h.drops()}"
    assert h.drops() == {} and h.node.stats()["waiting_for"] == ""
    # Past the start-up timeout (the harness's 0.5 s), a camera that never came up is a drop (the
    # parametrised bad-input test below).


def test_the_first_chunk_follows_the_last_sensor_to_come_up(harness) -> None:
    # A tick that finds a sensor not yet heard from waits for it, and the call runs when its first message
    # arrives, not a whole period later: with 3 s between chunks the arm would stand for up to 3 s more.
    # (A replayed bag's first tick, at its first instant, races its first frames the same way.)
    h = harness(sensor_startup_timeout_s=30.0, actions_per_inference=50, control_period_s=0.06)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: h.node.stats()["waiting_for"] != "", skip_camera=2)  # the first tick, at 3 s
    waited = time.monotonic()
    assert h.feed_until(lambda: len(h.chunks) >= 1, timeout=10.0), f"drops {h.drops()}"
    assert time.monotonic() - waited < 2.0, "the first chunk waited for the next tick"
    assert h.drops() == {} and h.node.stats()["waiting_for"] == ""


def test_after_a_reset_the_first_chunk_comes_from_messages_after_it(harness) -> None:
    # A camera's newest frame may still show the scene before the reset (the arms elsewhere, the part
    # already moved): the new episode waits for messages that come after its reset, as after an activation.
    h = harness(sensor_startup_timeout_s=30.0)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 2), f"drops {h.drops()}"
    old = h.publish_observation()
    buffer = h.node._buffer

    def holds_old() -> bool:  # every camera's and joint's newest message is the set just published
        with buffer._lock:
            joints = [samples[-1][0] for samples in buffer._joints.values()]
            images = [None if m is None else stamp_ns(m.header) for m in buffer._images]
        return bool(joints) and set(joints) == set(images) == {old}

    # stored before the reset (found in review: a fixed 50 ms sleep, and an executor behind on the
    # cameras stored them after it, into episode 1)
    assert h.wait_for(holds_old, timeout=5.0)
    assert h.call(h.reset, Trigger.Request()).message.startswith("episode 1")
    time.sleep(0.5)  # ~5 ticks with only the old messages buffered
    early = [(stamp_ns(c.header) - old) / 1e6 for c in h.chunks if c.episode_id == 1]
    assert not early and h.drops() == {}, (early, h.drops())
    fresh = h.publish_observation()
    assert h.wait_for(lambda: any(c.episode_id == 1 for c in h.chunks), timeout=10.0), f"drops {h.drops()}"
    first = next(c for c in h.chunks if c.episode_id == 1)
    assert stamp_ns(first.header) == fresh > old and h.drops() == {}


def test_a_camera_out_across_a_reset_is_named_as_the_episode_s_wait_then_as_a_drop(harness) -> None:
    """A reset empties the buffer, so for sensor_startup_timeout_s every sensor's first message is waited
    for, as after an activation. A camera already out before the reset is named as what the new episode
    waits for, said as such (found in review: it read "waiting for the first messages", as if the node were
    starting), /diagnostics stays ERROR while no chunk goes out, and past the timeout it is a drop again."""
    h = harness(sensor_startup_timeout_s=1.0, max_image_age_s=0.4, max_skew_s=0.2, max_joint_age_s=0.4)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 2), f"drops {h.drops()}"
    error_after = h.node.cfg.error_after_drops
    assert h.feed_until(lambda: h.node.stats()["failing_ticks"] >= error_after, skip_camera=2), h.drops()
    first = len(h.logs)
    assert h.call(h.reset, Trigger.Request()).message.startswith("episode 1")
    assert h.feed_until(lambda: "images/right_wrist" in h.node.stats()["waiting_for"], skip_camera=2)
    status = h.node._diagnostics().status[0]  # now, within the wait (sensor_startup_timeout_s)
    assert status.level == status.ERROR and "since the episode reset" in status.message, status.message

    # (/rosout comes over DDS, after the stats; a healthy camera may be named first: its first frame
    # since the reset may not have come yet; this node's lines only, not another node's on the domain.
    # The test failed 2 in 17 runs in a reviewer's clone, cause not found: another process's run of it
    # on the same domain would name its node alike and feed the same topics, which no filter here undoes)
    def waits() -> list[str]:
        name = h.node.get_name()
        return [
            log.msg
            for log in h.logs[first:]
            if log.name == name and "waiting for the first messages" in log.msg
        ]

    assert h.wait_for(lambda: any("images/right_wrist" in m for m in waits()), timeout=5.0), waits()
    assert all("since the episode reset" in m for m in waits()), waits()
    dropped = sum(h.drops().values())
    assert h.feed_until(lambda: sum(h.drops().values()) > dropped, skip_camera=2), h.node.stats()
    assert h.node.stats()["waiting_for"] == "" and not any(c.episode_id == 1 for c in h.chunks)


def test_a_cell_without_a_base_camera_leaves_its_slot_empty(harness) -> None:
    """camera_topics ["", left wrist, right wrist]: the node subscribes to the two wrists, which fill π0.5's
    wrist slots (slot 0 masked), and chunks flow with no drop (found in review: camera_topics[i] fed slot i,
    so a cell without a base camera could not leave slot 0 empty)."""
    h = harness(camera_topics=["", *CAMERAS[1:]])
    assert h.transition(Transition.TRANSITION_CONFIGURE), h.node.last_error
    assert h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.node.cfg.model.slots == (1, 2)
    subscribed = {h.node.resolve_topic_name(t) for t in CAMERAS}
    assert {t for t in h.node._input_topics if t in subscribed} == {
        h.node.resolve_topic_name(t) for t in CAMERAS[1:]
    }
    assert h.feed_until(lambda: len(h.chunks) >= 3), f"drops {h.drops()}"
    stats = h.node.stats()
    assert stats["drops"] == {} and set(stats["image_sizes"]) == {"left_wrist_0_rgb", "right_wrist_0_rgb"}, (
        stats
    )


def _note_worker_calls(node: Any) -> list[dict[str, Any]]:
    """Each of the worker's calls from now on (`_infer_once`), noted as it starts: its kind, its start
    (monotonic s), the end of the window of the tick waiting for a later message at its start (None if
    none waited), and, once it has returned, whether it published a chunk (None while it runs: the chunk
    reaches a subscriber before the call's logs and motion window are done, found in CI: a test that read
    the calls on the chunk's arrival found none). A test that a waiting tick was served on the message, not
    at its window's end, reads when the serving call started: the chunk's arrival also counts the
    inference, which a loaded machine stretches toward the window's end (a review's run with calls slowed
    by 0.7 s: 0.86 s of a 1 s bound)."""
    calls: list[dict[str, Any]] = []
    infer_once = node._infer_once

    def noted(kind: str = "tick") -> None:
        late, chunk_id = node._late, node.chunk_id
        until = None if late is None else late.until
        call: dict[str, Any] = {"kind": kind, "start": time.monotonic(), "until": until, "published": None}
        calls.append(call)
        try:
            infer_once(kind)
        finally:
            call["published"] = node.chunk_id > chunk_id

    node._infer_once = noted
    return calls


def _served_on_the_message(h: Any, calls: list[dict[str, Any]]) -> bool:
    """Whether the call that published a waiting tick's chunk started well before that tick's window end,
    once a call that published has returned (waited for up to 5 s)."""
    h.wait_for(lambda: any(c["published"] for c in calls), timeout=5.0)
    served = [c for c in calls if c["published"] and c["until"] is not None]
    return bool(served) and served[0]["start"] < served[0]["until"] - 0.5


def test_a_start_up_retry_refused_for_timing_waits_for_a_later_message_as_a_tick_does(harness) -> None:
    """The last camera's first frame ends the start-up wait, but 200 ms behind the others' (past max_skew_s):
    the retry waits for a later message as a tick refused for timing does, instead of leaving the first
    chunk to the next tick, a period later."""
    h = harness(sensor_startup_timeout_s=30.0, actions_per_inference=50, control_period_s=0.06,  # 3 s
                max_skew_s=0.05, max_image_age_s=5.0, max_joint_age_s=5.0)  # fmt: skip
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: "images/right_wrist" in h.node.stats()["waiting_for"], skip_camera=2)
    # Noted from before the last camera's frame: a note installed once `_late` is set misses a retry the
    # worker started before it (woken twice by the frames above), which can still read the set below
    calls = _note_worker_calls(h.node)
    h.publish_observation(skip_camera=2)
    frame = Image(height=48, width=64, encoding="rgb8", step=64 * 3, data=bytes(48 * 64 * 3))
    frame.header.stamp = (h.now() - rclpy.duration.Duration(seconds=0.2)).to_msg()
    h.image_pubs[2].publish(frame)
    assert h.wait_for(lambda: h.node._late is not None, timeout=2.0), h.node.stats()
    h.publish_observation()
    assert h.wait_for(lambda: len(h.chunks) >= 1, timeout=10.0), h.node.stats()
    assert _served_on_the_message(h, calls), f"not before the window's end (1.5 s): {calls}"
    s = h.node.stats()
    assert s["late_served"] == {"skew": 1} and s["drops"] == {} and s["waiting_for"] == "", s


def test_a_first_frame_stored_while_the_tick_reads_the_buffer_still_wakes_the_retry(harness) -> None:
    # The frame lands between the tick's read of the buffer and its decision to wait. The retry is armed
    # before the read, so that frame still wakes it; armed after, the first chunk would slip a period.
    h = harness(sensor_startup_timeout_s=30.0, actions_per_inference=50, control_period_s=0.06)  # 3 s
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    buffer = h.node._buffer
    read, delivered = buffer.observation, []

    def observation(*args: Any) -> Any:
        try:
            return read(*args)
        except ObservationUnavailable:
            if not delivered:  # camera 2's first frame arrives mid-read, through the node's own hook
                frame = Image(height=48, width=64, encoding="rgb8", step=64 * 3, data=bytes(48 * 64 * 3))
                frame.header.stamp = h.now().to_msg()
                delivered.append(h.node._stored(buffer.put_image(2, frame), "image"))
            raise

    buffer.observation = observation
    assert h.feed_until(lambda: bool(delivered), skip_camera=2)  # the first tick, at 3 s
    waited = time.monotonic()
    assert h.feed_until(lambda: len(h.chunks) >= 1, timeout=10.0, skip_camera=2), f"drops {h.drops()}"
    assert time.monotonic() - waited < 2.0, "the frame stored mid-read was missed until the next tick"


def _configure_fails_saying(h: Harness, text: str) -> None:
    # /rosout is how an operator sees the reason. Handshake first: a log line of the node's must arrive.
    def rosout_connected() -> bool:
        h.node.get_logger().info("rosout handshake")
        time.sleep(0.1)
        return any(log.msg == "rosout handshake" for log in h.logs)

    assert h.wait_for(rosout_connected, timeout=10.0)
    assert not h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.state() == State.PRIMARY_STATE_UNCONFIGURED
    assert text in h.node.last_error
    assert h.wait_for(lambda: any(text in log.msg for log in h.logs), timeout=5.0), [
        log.msg for log in h.logs
    ]


def test_non_finite_actions_are_never_published_and_the_node_goes_on(harness) -> None:
    """Never published; counted as bad_actions; after error_after_drops such ticks in a row /diagnostics
    says ERROR with the reason (active, but the arm gets nothing), and one chunk ends that."""
    h = harness(error_after_drops=3)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    engine = h.node.policy.engine
    real = engine.sample_actions
    engine.sample_actions = lambda inputs, noise: torch.full_like(real(inputs, noise), float("nan"))
    before = len(h.chunks)  # a call that ran before the fault may still be published
    assert h.feed_until(lambda: h.drops().get("bad_actions", 0) >= 3), h.drops()
    settled = len(h.chunks)
    assert settled <= before + 1, "a chunk of non-finite actions was published"
    assert h.wait_for(lambda: any("non-finite actions" in log.msg for log in h.logs), timeout=5.0)
    status = h.node._diagnostics().status[0]
    assert status.level == status.ERROR and status.message.startswith("no chunk for the last "), (
        status.message
    )
    assert "bad_actions: the model produced non-finite actions" in status.message
    del engine.sample_actions
    assert h.feed_until(lambda: len(h.chunks) > settled + 1), f"the node stopped publishing: {h.drops()}"
    assert all(np.isfinite(np.asarray(c.actions)).all() for c in h.chunks)
    assert h.state() == State.PRIMARY_STATE_ACTIVE and h.node.stats()["errors"] == {}
    status = h.node._diagnostics().status[0]
    assert status.level == status.WARN, (
        "chunks again: the drops since activation leave a warning, not an error"
    )


def test_an_unexpected_error_in_a_ticks_call_counts_toward_error_and_the_worker_goes_on(harness) -> None:
    """Anything a tick's call raises that the call does not expect (here the observation's assembly) is a
    worker error and that tick's drop: /diagnostics turns ERROR after error_after_drops such ticks (it
    stayed WARN, the worker's errors counting apart from the ticks: found in review)."""
    h = harness(error_after_drops=2)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    buffer = h.node._buffer

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a decoder library's own fault")

    buffer.observation = broken
    assert h.feed_until(lambda: h.drops().get("inference_error", 0) >= 2), h.node.stats()
    status = h.node._diagnostics().status[0]
    assert status.level == status.ERROR, status.message
    assert "the worker raised RuntimeError: a decoder library's own fault" in status.message
    assert h.node.stats()["errors"]["worker"] >= 2
    del buffer.observation
    assert h.feed_until(lambda: len(h.chunks) > 0), f"the node stopped publishing: {h.drops()}"


def test_a_call_that_raises_a_cuda_error_is_one_line_in_diagnostics_and_the_node_goes_on(harness) -> None:
    """A call that raised with the GPU still working (a CUDA error that does not lose the context: a bad
    launch, an out-of-memory error) is an inference_error drop, and the node goes on. PyTorch's CUDA errors
    carry lines of advice after the error; /diagnostics and the log say the error's own line."""
    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    policy = h.node.policy
    real = policy.infer

    def raises(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "CUDA error: invalid argument\nCUDA kernel errors might be asynchronously reported at some other "
            "API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
            "CUDA_LAUNCH_BLOCKING=1"
        )

    policy.infer = raises
    assert policy.device_fault() is None  # the CPU's policy: nothing lost
    assert h.feed_until(lambda: h.drops().get("inference_error", 0) >= 1), h.node.stats()
    values = {v.key: v.value for v in h.node._diagnostics().status[0].values}
    assert values["last_drop"] == "inference_error: RuntimeError: CUDA error: invalid argument", values
    policy.infer = real
    assert h.feed_until(lambda: len(h.chunks) > 0), f"the node stopped publishing: {h.drops()}"


def test_a_profile_loaded_one_parameter_at_a_time_is_taken_by_an_unconfigured_node(harness) -> None:
    """`ros2 param load` sets a file's parameters one at a time, each checked against the others. Before
    (noted in review), the ALOHA profile's `model.preset: pi05` was refused because its checkpoint was
    not set yet, and the node would have configured the default tiny model. Now a value that is valid
    by itself is taken with a warning when only the others disagree; configure checks the whole set; a
    value wrong by itself is still refused, even while such a combination is pending."""
    from pathlib import Path

    from rmuscle_ros.node.params import load_params_file, node_config, parameter_defaults

    profile = load_params_file(Path(__file__).parents[1] / "config" / "rmuscle_aloha.yaml")
    h = harness()
    pending = h.node.set_parameters([Parameter("joint_name_prefixes", value=["left_", "right_", "third_"])])
    assert pending[0].successful, pending[0].reason
    assert not h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.node.last_error.startswith("configure: invalid parameter joint_name_prefixes: needs one entry")
    bad = h.node.set_parameters([Parameter("cache.rho_p", value=5.0)])[0]
    assert not bad.successful and bad.reason.startswith("cache.rho_p"), bad.reason
    bad = h.node.set_parameters([Parameter("max_skew_s", value=-1.0)])[0]
    assert not bad.successful and bad.reason.startswith("max_skew_s: must be > 0"), bad.reason
    for name, value in (("actions_per_inference", 0), ("joint_names", [f"j{i}" for i in range(33)])):
        bad = h.node.set_parameters([Parameter(name, value=value)])[0]  # no preset takes them
        assert not bad.successful and bad.reason.startswith(name), bad.reason
    # several at once (set_parameters_atomically): each new value is checked by itself too (found in the
    # closing review: a blank prompt went through beside a coupled change)
    bad = h.node.set_parameters_atomically(
        [Parameter("joint_state_topics", value=["a", "b", "c"]), Parameter("prompt", value="   ")]
    )
    assert not bad.successful and bad.reason.startswith("prompt: prompt '   ' is blank once cleaned"), (
        bad.reason
    )
    assert h.node.get_parameter("prompt").value != "   "

    for name, value in profile.items():  # in the file's order, as ros2 param load sends them
        result = h.node.set_parameters([Parameter(name, value=value)])[0]
        assert result.successful, f"{name}: {result.reason}"
    now = {name: h.node.get_parameter(name).value for name in parameter_defaults()}
    assert node_config(now).model == node_config(parameter_defaults() | profile).model
    assert node_config(now).joint_name_prefixes == ("left_", "right_")
    # the profile's model files are not on this machine: configure refuses them, naming the file
    assert not h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.state() == State.PRIMARY_STATE_UNCONFIGURED
    assert "/opt/rmuscle/models/pi05_aloha/" in h.node.last_error, h.node.last_error
    assert "does not exist" in h.node.last_error, h.node.last_error


def test_a_topic_name_ros_refuses_fails_configure_naming_it_and_can_be_fixed(harness) -> None:
    """A camera or joint-state topic with a space: configure fails naming the parameter and the topic,
    before the model loads (before, rclpy's exception made configure or activate an ERROR that left the
    node unconfigured with its model loaded, refusing the fix as "read at configure"; found in review)."""
    from rclpy.parameter import Parameter

    good_cameras, good_joints = list(CAMERAS), list(JOINT_TOPICS)
    h = harness(camera_topics=[*good_cameras[:2], "images/right wrist"])
    for name, bad in (("camera_topics", "images/right wrist"), ("joint_state_topics", "joint states/right")):
        assert not h.transition(Transition.TRANSITION_CONFIGURE), name
        assert h.state() == State.PRIMARY_STATE_UNCONFIGURED and h.node.policy is None
        assert f"configure: invalid parameter {name}: {bad!r} is no topic name" in h.node.last_error
        fixed = good_cameras if name == "camera_topics" else good_joints
        assert h.node.set_parameters([Parameter(name, value=fixed)])[0].successful
        if name == "camera_topics":
            h.node.set_parameters(
                [Parameter("joint_state_topics", value=[good_joints[0], "joint states/right"])]
            )
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 1)


def test_a_live_change_is_never_half_seen_by_a_call_waiting_for_the_policy(harness) -> None:
    """A parameter set lands while the worker, woken by a tick, waits for the policy lock: its call runs the
    new prompt with the new limits. Before (found in review), the worker had read the settings before
    taking the lock, so that call ran the replaced prompt with the new limits."""
    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 1), f"drops {h.drops()}"
    node, lock = h.node, h.node._policy_lock
    waiting, go, seen = threading.Event(), threading.Event(), []

    class HeldForTheWorker:  # the policy lock, held up once at the worker's next call
        armed = False

        def __enter__(self) -> None:
            if self.armed and threading.current_thread() is node._worker:
                self.armed = False
                waiting.set()
                go.wait(10.0)
            lock.acquire()

        def __exit__(self, *exc: object) -> None:
            lock.release()

        def acquire(self, *args: Any, **kwargs: Any) -> bool:
            return lock.acquire(*args, **kwargs)

        def release(self) -> None:
            lock.release()

    held = HeldForTheWorker()
    node._policy_lock = held
    infer = node.policy.infer
    node.policy.infer = lambda obs: seen.append((obs.prompt, node._buffer.limits)) or infer(obs)
    try:
        held.armed = True
        assert h.feed_until(waiting.is_set, timeout=10.0)
        # A call that held the lock before the stand-in was installed may have reached infer since, on the
        # old prompt (found in review, with 5 ms more before infer: 1 run in 3). The worker now waits in
        # the stand-in, so from here on only the held call can reach infer.
        seen.clear()
        result = node.set_parameters_atomically(
            [Parameter("prompt", value="place the cup"), Parameter("max_skew_s", value=0.3)]
        )
        assert result.successful, result.reason
        go.set()
        assert h.feed_until(lambda: len(seen) >= 1, timeout=10.0), f"drops {h.drops()}"
        assert seen[0][0] == "place the cup" and seen[0][1].max_skew_ns == 300_000_000, seen[0]
    finally:
        go.set()
        node._policy_lock = lock
        del node.policy.infer


def test_an_integer_for_a_float_is_taken_live_and_the_clock_is_fixed_while_active(harness) -> None:
    """`ros2 param set <node> max_skew_s 1` sends an integer: taken as 1.0 (found in review: rclpy refused
    it as "Wrong parameter type" without naming the parameter). `use_sim_time` set on an active node is
    refused naming what to do (found in review: taken, it left the timers on their clock while stamps
    were read on the other, and every observation was dropped as future-stamped); inactive, it is taken."""
    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 1), f"drops {h.drops()}"
    service = h.peer.create_client(SetParameters, f"/{h.node.get_name()}/set_parameters")

    def set_over_service(name: str, value: object) -> Any:
        ask = SetParameters.Request(parameters=[Parameter(name, value=value).to_parameter_msg()])
        return h.call(service, ask).results[0]

    answer = set_over_service("max_skew_s", 1)
    assert answer.successful, answer.reason
    assert h.node.get_parameter("max_skew_s").type_ == Parameter.Type.DOUBLE
    assert h.node.cfg.max_skew_s == 1.0 and h.node._buffer.limits.max_skew_ns == 1_000_000_000
    wrong = set_over_service("max_skew_s", "0.2")  # other mismatches are still refused
    assert not wrong.successful and h.node.cfg.max_skew_s == 1.0
    clock = set_over_service("use_sim_time", True)
    assert not clock.successful and clock.reason.startswith("use_sim_time: ") and "deactivate" in clock.reason
    assert not h.node.get_parameter("use_sim_time").value
    # its current value again, as a `ros2 param dump` applied whole carries it, is no change: taken
    same = h.node.set_parameters_atomically(
        [Parameter("use_sim_time", value=False), Parameter("prompt", value="place")]
    )
    assert same.successful, same.reason
    assert h.node.cfg.prompt == "place"
    sent = len(h.chunks)
    assert h.feed_until(lambda: len(h.chunks) > sent + 1), f"drops {h.drops()}"
    assert h.transition(Transition.TRANSITION_DEACTIVATE)
    assert set_over_service("use_sim_time", True).successful
    assert set_over_service("use_sim_time", False).successful


def test_a_prompt_too_long_for_the_model_is_refused_and_never_runs(harness) -> None:
    """Past the model's token length the prompt's tail, the state and "Action:", would be cut off: the
    actions would not depend on where the arms are. Such a prompt fails configure and is refused live,
    naming the token counts; a call whose prompt was cut off all the same publishes nothing (a
    prompt_truncated drop). Before (found in review) the prompt was cut off silently."""
    import dataclasses

    from rclpy.parameter import Parameter

    long = "pick up the cube " * 60
    h = harness(prompt=long)
    assert not h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.node.last_error.startswith(
        "configure: invalid parameter prompt: "
    ) and "the model takes 200" in (h.node.last_error), h.node.last_error
    assert h.node.set_parameters([Parameter("prompt", value="pick")])[0].successful
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    refused = h.node.set_parameters([Parameter("prompt", value=long)])[0]
    assert not refused.successful and "the state and 'Action:' at its end would be cut off" in refused.reason
    assert h.feed_until(lambda: len(h.chunks) >= 1)
    policy, real = h.node.policy, h.node.policy.infer
    policy.infer = lambda obs: dataclasses.replace(real(obs), prompt_truncated=True)
    assert h.feed_until(lambda: h.drops().get("prompt_truncated", 0) >= 2), h.drops()
    settled = len(h.chunks)
    time.sleep(0.3)
    assert len(h.chunks) <= settled + 1, "a chunk of a cut-off prompt was published"


def test_an_activate_that_raises_fails_cleanly_and_the_next_one_runs(harness) -> None:
    """Whatever raises while activating (a timer, a subscription rclpy refuses) is a FAILURE naming it,
    with what was made undone: the node stays configured, and the next activate runs."""
    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE)
    real = h.node.create_timer

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no timer today")

    h.node.create_timer = refused
    assert not h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.state() == State.PRIMARY_STATE_INACTIVE and h.node._subs == [] and h.node._worker is None
    assert h.node.last_error == "activate: RuntimeError: no timer today"
    h.node.create_timer = real

    class Unstartable(threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    node_module = sys.modules[type(h.node).__module__]
    real_threading = node_module.threading
    node_module.threading = SimpleNamespace(Thread=Unstartable, Event=threading.Event, Lock=threading.Lock)
    try:  # a worker that never started is not joined: the failure is clean too (found in review)
        assert not h.transition(Transition.TRANSITION_ACTIVATE)
    finally:
        node_module.threading = real_threading
    assert h.state() == State.PRIMARY_STATE_INACTIVE and h.node._worker is None
    assert h.node.last_error == "activate: RuntimeError: can't start new thread"
    assert h.transition(Transition.TRANSITION_ACTIVATE) and h.feed_until(lambda: len(h.chunks) >= 1)


def test_two_publishers_on_an_input_topic_are_reported(harness) -> None:
    """A second source on a joint-state topic (a joint_state_publisher beside the arm's driver, a bag player
    left running): the node would mix both in its observations. /diagnostics warns naming the topic and
    both nodes, and the node logs it once (found in review: nothing said so)."""
    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 1)
    other = rclpy.create_node("stale_joint_publisher", context=h.context)
    try:
        other.create_publisher(JointState, JOINT_TOPICS[0], qos_profile_sensor_data)

        def warned() -> bool:
            return any(
                s.level == s.WARN
                and f"2 publishers on /{JOINT_TOPICS[0]}" in s.message
                and "/stale_joint_publisher" in s.message
                for a in h.diagnostics
                for s in a.status
            )

        assert h.feed_until(warned), [s.message for a in h.diagnostics[-3:] for s in a.status]
        assert any(f"publishers on /{JOINT_TOPICS[0]}" in log.msg for log in h.logs)
    finally:
        other.destroy_node()


def test_a_camera_topic_carrying_another_type_is_an_error_naming_both_types(harness) -> None:
    """compressed_images set while a camera's topic carries raw images (a launch remapping onto
    `image_rect_raw`, found in review): nothing arrives, and the ticks only said `missing_camera`.
    /diagnostics says ERROR naming the topic and both types, and the node logs it once per topic. (The raw
    publisher is in a context of its own, as a camera driver is another process: one DDS participant
    cannot hold one topic under two types.)"""
    h = harness(compressed=True, camera_topics=[*CAMERAS[:2], "images/raw_camera"])
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    context = rclpy.Context()
    rclpy.init(context=context, domain_id=ros_domain())
    driver = rclpy.create_node("raw_camera_driver", context=context)
    try:
        driver.create_publisher(Image, "/images/raw_camera", qos_profile_sensor_data)
        said = (
            "/images/raw_camera carries sensor_msgs/msg/Image, the node takes sensor_msgs/msg/CompressedImage"
        )

        def reported() -> bool:
            return any(s.level == s.ERROR and said in s.message for a in h.diagnostics for s in a.status)

        assert h.feed_until(reported), [s.message for a in h.diagnostics[-3:] for s in a.status]
        assert sum(said in log.msg for log in h.logs) == 1
        assert h.chunks == []
    finally:
        driver.destroy_node()
        rclpy.shutdown(context=context)


def test_use_sim_time_without_a_clock_is_reported_not_silent(harness, monkeypatch) -> None:
    """use_sim_time set and nothing publishing /clock (a simulator stopped, a sim profile on a real cell): no
    tick runs, so no chunk and no drop. /diagnostics (on the steady clock) turns ERROR naming /clock, and
    the node logs it once (found in review: before, the node published nothing at all). A /clock that
    stops after it ran (a player paused, between bags) is a WARN after CLOCK_PAUSED_S (10 s)."""
    from rmuscle_ros.node import rmuscle_node

    monkeypatch.setattr(rmuscle_node, "CLOCK_SILENT_S", 1.0)
    h = harness(use_sim_time=True)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)

    def reported() -> bool:
        return any(
            s.level == s.ERROR and "use_sim_time is set and no /clock has come in" in s.message
            for a in h.diagnostics
            for s in a.status
        )

    assert h.wait_for(reported, timeout=10.0), [s.message for a in h.diagnostics for s in a.status]
    assert h.wait_for(lambda: any("no /clock has come in" in log.msg for log in h.logs), timeout=5.0)
    assert h.chunks == []
    monkeypatch.setattr(rmuscle_node, "CLOCK_PAUSED_S", 1.0)
    from builtin_interfaces.msg import Time
    from rosgraph_msgs.msg import Clock

    h.peer.create_publisher(Clock, "/clock", 10).publish(Clock(clock=Time(sec=1_700_000_000)))
    heard = len(h.diagnostics)

    def paused() -> bool:
        return any(
            s.level == s.WARN and "/clock has not moved for" in s.message
            for a in h.diagnostics[heard:]
            for s in a.status
        )

    assert h.wait_for(paused, timeout=10.0), [s.message for a in h.diagnostics[heard:] for s in a.status]


def _hold_calls(engine: Any) -> tuple[threading.Event, threading.Event]:
    """From now on each call of `engine` (its sample_actions) waits, as on a GPU that stopped answering,
    until the second event returned is set (60 s at most); the first is set once a call waits. The test
    undoes it with `del engine.sample_actions`, then sets the second."""
    real, entered, release = engine.sample_actions, threading.Event(), threading.Event()

    def held(inputs: Any, noise: Any) -> Any:
        entered.set()
        release.wait(timeout=60.0)
        return real(inputs, noise)

    engine.sample_actions = held
    return entered, release


def test_each_warning_alone_turns_diagnostics_to_warn(harness) -> None:
    """/diagnostics says WARN for each of these on its own, with no drop beside it: an error the node
    survived (a reset refused), a second publisher on an input topic, ticks that fell due while the worker
    was busy. Found by a mutation review: in the tests each came with another warning (drops, the refused
    reset's error), so dropping any one from the level passed, and an operator watching the level would
    have seen OK."""
    from diagnostic_msgs.msg import DiagnosticStatus

    ok, warn = DiagnosticStatus.OK, DiagnosticStatus.WARN
    # no sensor: the ticks wait, no drops; one tick a second: none merges unless the test holds the worker
    h = harness(sensor_startup_timeout_s=3600.0, actions_per_inference=50, control_period_s=0.02)

    def status() -> DiagnosticStatus:
        return h.node._diagnostics().status[0]

    assert h.transition(Transition.TRANSITION_CONFIGURE), h.node.last_error
    assert status().level == ok, status()
    # An error alone: a reset refused while the policy is held (a hung call) past stall_after_s.
    assert h.node._policy_lock.acquire(timeout=10.0)
    try:
        assert h.node.reset_episode() == 0
    finally:
        h.node._policy_lock.release()
    assert h.node.stats()["errors"] == {"reset": 1} and status().level == warn, status()

    assert h.transition(Transition.TRANSITION_CLEANUP) and h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.transition(Transition.TRANSITION_ACTIVATE)
    assert status().level == ok, status()
    # A second publisher on a joint-state topic alone.
    other = rclpy.create_node("second_joint_publisher", context=h.context)
    try:
        other.create_publisher(JointState, JOINT_TOPICS[1], qos_profile_sensor_data)
        assert h.wait_for(lambda: "2 publishers on" in status().message, timeout=10.0), status()
        assert status().level == warn, status()
    finally:
        other.destroy_node()
    assert h.wait_for(lambda: status().level == ok, timeout=10.0), status()
    # A tick merged behind a busy worker alone: the policy held across a tick (a call over the period).
    assert h.node._policy_lock.acquire(timeout=10.0)
    try:
        assert h.wait_for(lambda: h.node.stats()["ticks_merged"] >= 1, timeout=10.0), h.node.stats()
    finally:
        h.node._policy_lock.release()
    assert h.wait_for(lambda: h.node.stats()["stalled_s"] == 0.0, timeout=10.0)
    stats = h.node.stats()
    assert stats["drops"] == {} and stats["errors"] == {}, stats
    assert status().level == warn and "fell due while the worker was still busy" in status().message, status()


def test_a_call_that_does_not_return_turns_diagnostics_to_error_until_it_does(harness) -> None:
    """A hung call (a GPU that stops answering, a deadlock) gives no chunk and no drop: the ticks wait for
    the worker. /diagnostics says ERROR once a tick has waited stall_after_s, naming what the worker runs,
    logs it once, and when the call returns the node goes on and counts the stall and the merged ticks."""
    # 1 s: a tick waits about a call's length (~0.3 s here), so under a loaded CI machine's slower calls a
    # 0.5 s bound counted more stalls than the one held (found in review; HISTORY has 4 counted for 1)
    h = harness(stall_after_s=1.0)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 1)
    engine = h.node.policy.engine
    _, release = _hold_calls(engine)
    try:
        assert h.feed_until(lambda: h.node.stats()["stalled_s"] >= 1.1), h.node.stats()["stalled_s"]
        status = h.node._diagnostics().status[0]
        assert status.level == status.ERROR, status.message
        assert status.message.startswith("stalled: a tick has waited "), status.message
        assert "for the inference worker (in a call; stall_after_s 1)" in status.message
        assert float({kv.key: kv.value for kv in status.values}["stalled_s"]) >= 1.1
        assert h.wait_for(lambda: any("inference stalled" in log.msg for log in h.logs), timeout=5.0)
        # A parameter set or a reset meanwhile waits at most stall_after_s for the worker, then is refused
        # saying why: waiting on, it held the executor, and /diagnostics went silent (found in review).
        ask = SetParameters.Request(parameters=[Parameter("prompt", value="place").to_parameter_msg()])
        started = time.monotonic()
        answer = h.call(h.peer.create_client(SetParameters, f"/{h.node.get_name()}/set_parameters"), ask)
        refusal = "not applied: the inference worker has held the policy for over 1 s (stall_after_s), running a call"
        assert not answer.results[0].successful and refusal in answer.results[0].reason, answer.results[0]
        assert time.monotonic() - started < 5.0 and h.node.get_parameter("prompt").value == "pick"
        reset = h.call(h.reset, Trigger.Request())
        assert not reset.success and "episode 0 (not reset: the inference worker has held" in reset.message
        assert h.node.episode_id == 0 and h.node.stats()["errors"].get("reset") == 1
        heard = len(h.diagnostics)
        assert h.wait_for(lambda: len(h.diagnostics) > heard + 1, timeout=5.0), "the executor was held"
        published = len(h.chunks)
    finally:
        del engine.sample_actions
        release.set()
    assert h.feed_until(lambda: len(h.chunks) > published + 1), (
        "the node did not go on after the call returned"
    )
    assert h.wait_for(lambda: any("took a tick after" in log.msg for log in h.logs), timeout=5.0)
    stats = h.node.stats()
    # (at least one: a later call of over stall_after_s on a loaded machine would count one more)
    assert stats["stalls"] >= 1 and stats["stalled_s"] < 1.0 and stats["drops"] == {}, stats
    # The ticks that fell due during the hung call (one every 0.1 s) were served by one call, counted as
    # such, and its wait counts from the oldest of them (found in review: from the latest, ~0.1 s at most)
    assert stats["ticks_merged"] >= 5 and stats["tick_wait_max_ms"] >= 1100.0, stats
    logged = sum("inference stalled" in log.msg for log in h.logs)
    assert 1 <= logged <= stats["stalls"], f"logged once per stall at most: {logged}, {stats['stalls']}"
    status = h.node._diagnostics().status[0]
    # no longer stalled; a warning stays for the reset it refused (errors.reset), and for the ticks merged
    # behind the hung call (for MERGED_WARN_S: no drop, yet they got no call of their own; found in review)
    assert status.level == status.WARN and "stalled" not in status.message, status.message
    assert "fell due while the worker was still busy" in status.message, status.message
    assert int({kv.key: kv.value for kv in status.values}["ticks_merged_lately"]) >= 5, status.values


def _stand_in_for_the_exit(monkeypatch) -> list[int]:
    """The stall exit, recorded instead of ending the test's process; its backstop (which would end it)
    not armed. Returns the statuses the node asked to exit with."""
    ended: list[int] = []
    monkeypatch.setattr(node_module, "end_process", ended.append)
    monkeypatch.setattr(node_module, "arm_exit_backstop", lambda seconds: None)
    return ended


def _exits_while(
    h: Harness, ended: list[int], release: threading.Event, blocking: Callable[[], object]
) -> None:
    """Run `blocking` (a reset or a deactivation asked for over its service: the executor's thread then
    waits on work the test holds) in a thread; the stall exit must be asked for (status 70) meanwhile.
    Then the held work is released and the thread joined, whatever happened."""
    waiting = threading.Thread(target=blocking)
    waiting.start()
    try:
        assert h.wait_for(lambda: bool(ended), timeout=10.0), "no exit"
        assert ended == [70]
    finally:
        release.set()
        waiting.join(timeout=30.0)


def _said_fatal(h: Harness, pattern: str) -> bool:
    """Whether a fatal line on /rosout matches `pattern` (a regular expression) within 5 s."""
    said = re.compile(pattern)
    return h.wait_for(lambda: any(said.search(log.msg) and log.level == Log.FATAL for log in h.logs), 5.0)


def test_a_pause_of_the_whole_process_is_no_stall_for_the_exit(harness, monkeypatch) -> None:
    """A process paused (SIGSTOP, `docker pause`, a debugger) and resumed finds a tick that has waited all
    that time, but the worker had no time to go on either: the watchdog skips its late look and counts the
    stall from the resume, so exit_after_stall_s ends the process only if the stall lasts that long after
    it (found by a mutation review: with the late look not skipped, or the stall counted from the tick,
    a node paused for 9 s was ended at once on its resume). Driven on the watchdog's loop with a stepped
    clock: looks every WATCHDOG_PERIOD_S, one 9 s late."""
    from types import SimpleNamespace

    from rmuscle_ros.node.params import node_config

    h = harness()
    node, clock, ended = h.node, [0.0], []
    steps = iter([node_module.WATCHDOG_PERIOD_S] * 4 + [9.0] + [node_module.WATCHDOG_PERIOD_S] * 40)

    def wait(timeout: float) -> bool:
        step = next(steps, None)
        if step is None:
            return True  # stopped
        clock[0] += step
        return False

    monkeypatch.setattr(node_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(node._watchdog_stop, "wait", wait)
    monkeypatch.setattr(node, "_end_stalled", lambda what, doing, limit: ended.append((clock[0], what)))
    monkeypatch.setattr(node, "cfg", node_config({"exit_after_stall_s": 3.0}))
    monkeypatch.setattr(node, "_tick_waiting_since", 0.0)  # a tick waits from the start on
    node._watch_for_stalls()
    # 1 s of stall, a 9 s pause (resumed at 10 s), then 3 s of stall after the resume: the exit at 13 s
    assert [at for at, _ in ended] == [13.0], ended
    assert ended[0][1].startswith("a tick has waited 13.0 s for the inference worker"), ended


def test_a_stall_past_exit_after_stall_s_ends_the_process_for_its_supervisor(harness, monkeypatch) -> None:
    """With exit_after_stall_s, a tick that has waited that long for a hung call ends the process (status
    70, a fatal log naming the stall, /diagnostics saying so first): the node cannot end the call, and a
    deactivation or shutdown would wait for it. The stall is reported at stall_after_s, before. (The exit
    itself, here recorded: the next test runs the node as its own process.)"""
    ended = _stand_in_for_the_exit(monkeypatch)
    h = harness(stall_after_s=0.5, exit_after_stall_s=1.5)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 1)
    refused = h.node.set_parameters([Parameter("exit_after_stall_s", value=0.4)])[0]  # live, checked
    assert not refused.successful and "above stall_after_s, got 0.4 against 0.5 s" in refused.reason, refused
    engine = h.node.policy.engine
    _, release = _hold_calls(engine)
    try:
        assert h.feed_until(lambda: h.node.stats()["stalled_s"] >= 0.6)
        assert not ended, "ended at the stall's report, not past exit_after_stall_s"
        assert h.feed_until(lambda: bool(ended), timeout=10.0), "no exit"
        assert ended == [node_module.SUPERVISOR_EXIT_STATUS] == [70]
        assert _said_fatal(
            h, re.escape("(in a call; exit_after_stall_s 1.5): ending the process with status 70")
        )
        # the wait when the exit was decided, as the fatal line says it (found in review: the stats read
        # after the exit also counted the reporting and a loaded machine's delays, ~0.3 s on an idle one)
        fatal = next(log.msg for log in h.logs if log.level == Log.FATAL)
        stalled = float(re.search(r"a tick has waited ([0-9.]+) s", fatal).group(1))
        # the watchdog looks every WATCHDOG_PERIOD_S, and a look up to WATCHDOG_LATE_S late still counts
        assert 1.5 <= stalled < 1.5 + node_module.WATCHDOG_PERIOD_S + node_module.WATCHDOG_LATE_S, fatal
        assert h.wait_for(
            lambda: any(
                d.status[0].message.startswith("ending the process: inference stalled") for d in h.diagnostics
            ),
            timeout=5.0,
        )
    finally:
        del engine.sample_actions
        release.set()


def test_a_reset_whose_recording_hangs_ends_the_process_past_exit_after_stall_s(harness, monkeypatch) -> None:
    """A reset records the finished episode on the executor's thread, holding the policy: a library disk
    that hangs there holds the executor, and no tick falls due to count a stall. Past exit_after_stall_s
    the watchdog ends the process all the same, naming the reset. (Asked for over the service, as a cell
    does: its callback runs on the executor's thread, which the harness's peer shares, so the log line
    arrives once the reset is released.)"""
    ended = _stand_in_for_the_exit(monkeypatch)
    h = harness(stall_after_s=0.5, exit_after_stall_s=1.0)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 1)
    policy, release = h.node.policy, threading.Event()
    real = policy.reset_episode

    def hung() -> int | None:  # the library's write, on a disk that does not answer
        release.wait(timeout=60.0)
        return real()

    policy.reset_episode = hung
    try:
        _exits_while(h, ended, release, lambda: h.call(h.reset, Trigger.Request()))
    finally:
        del policy.reset_episode
    # (the cache is off here; with it on, the reset names the library's recording)
    assert _said_fatal(
        h, r"inference stalled: an episode reset has run \d+\.\d s \(starting the next episode; exit"
    )
    assert h.node.episode_id == 1


def test_a_deactivation_waiting_for_a_hung_call_ends_the_process_past_exit_after_stall_s(
    harness, monkeypatch
) -> None:
    """A call that hangs just after its tick, then a deactivation (or Ctrl-C's shutdown): it waits for the
    worker on the executor's thread, so no tick falls due to count a stall. Found in review: the process
    then hung for good. Past exit_after_stall_s the watchdog, which outlives the wait, ends it."""
    ended = _stand_in_for_the_exit(monkeypatch)
    # one tick a second: none falls due between the hung call's and the deactivation
    h = harness(stall_after_s=0.5, exit_after_stall_s=1.0, actions_per_inference=50)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 1)
    engine = h.node.policy.engine
    entered, release = _hold_calls(engine)
    try:
        assert h.feed_until(entered.is_set), "no call started"
        _exits_while(h, ended, release, lambda: h.transition(Transition.TRANSITION_DEACTIVATE))
    finally:
        release.set()
        del engine.sample_actions
    assert _said_fatal(
        h,
        r"inference stalled: a deactivation or shutdown has waited \d+\.\d s for the inference worker \(in a call",
    )


_ENDED_BY_A_STALL = """
import sys, threading, time
import rclpy
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from rmuscle_ros.node.bags import ALOHA_JOINT_STATE_NAMES
from rmuscle_ros.node.rmuscle_node import RMuscleNode
from rmuscle_ros.node.spin import spin_node

library = sys.argv[1]

def feed(node, peer):
    cameras = [peer.create_publisher(Image, t, qos_profile_sensor_data)
               for t in ("images/base", "images/left_wrist", "images/right_wrist")]
    arms = [peer.create_publisher(JointState, t, qos_profile_sensor_data)
            for t in ("joint_states/left", "joint_states/right")]
    while True:
        stamp = peer.get_clock().now().to_msg()
        for pub in cameras:
            msg = Image(height=48, width=64, encoding="rgb8", step=192, data=bytes(48 * 192))
            msg.header.stamp = stamp
            pub.publish(msg)
        for pub in arms:
            msg = JointState(name=list(ALOHA_JOINT_STATE_NAMES), position=[0.1] * len(ALOHA_JOINT_STATE_NAMES))
            msg.header.stamp = stamp
            pub.publish(msg)
        time.sleep(0.03)

def make():
    node = RMuscleNode()
    assert node.trigger_configure().name == "SUCCESS", node.last_error
    policy = node.policy
    real = policy.infer
    def hangs_after_three(obs):  # a GPU that stops answering: the call never returns
        if node.chunk_id >= 3:
            threading.Event().wait()
        return real(obs)
    policy.infer = hangs_after_three
    node.trigger_activate()
    threading.Thread(target=feed, args=(node, rclpy.create_node("cell")), daemon=True).start()
    return node

params = ("warmup:=false", "cache.enabled:=true", "model.backend:=fused", f"cache.library_path:={library}",
          "actions_per_inference:=5", "max_image_age_s:=1.0", "max_joint_age_s:=1.0", "max_skew_s:=0.5",
          "prompt:=pick", "stall_after_s:=0.5", "exit_after_stall_s:=1.0")
sys.exit(spin_node(make, ["rmuscle_node", "--ros-args", *[a for p in params for a in ("-p", p)]]))
"""


def test_a_hung_call_ends_the_node_s_process_with_its_status_and_frees_the_library(tmp_path) -> None:
    """The node as its own process, its call hung for good after 3 chunks: past exit_after_stall_s the
    process ends with status 70 (neither hung in its worker nor killed), saying why with the threads'
    stacks, and the library's lock went with it, so the process a supervisor starts next opens it."""
    from rmuscle_ros.cache.lock import LibraryLock

    library = tmp_path / "library"
    script = tmp_path / "node.py"
    script.write_text(_ENDED_BY_A_STALL)
    env = os.environ | {"ROS_DOMAIN_ID": str(ros_domain(62))}
    run = subprocess.run(
        [sys.executable, str(script), str(library)], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 70, run.stderr[-2000:]
    assert "exit_after_stall_s 1): ending the process with status 70" in run.stderr, run.stderr[-2000:]
    assert "episode 0 (3 chunk(s) published) is not recorded" in run.stderr, run.stderr[-2000:]
    assert " in hangs_after_three" in run.stderr, "no stack showing where the call hung"
    lock = LibraryLock.take(library)  # LibraryBusy if the ended process still held it
    assert not lock.read_only, lock.read_only
    lock.release()


# What torch raises after an asynchronous CUDA fault, and what the context's check then says (the CPU tests'
# stand-in for a lost GPU; test_a_real_cuda_fault_ends_the_node_s_process_and_frees_the_library faults a
# real one)
_CUDA_FAULT = "CUDA error: an illegal memory access was encountered"


def _lose_the_gpu(policy: Any, monkeypatch: pytest.MonkeyPatch, *, calls: bool = True) -> None:
    """From now on `policy`'s check of the GPU (`device_fault`) says the context is lost and, with `calls`,
    each of its calls raises as after an asynchronous CUDA fault. Undone before the harness's teardown
    (`harness` first among a test's fixtures), whose shutdown would otherwise end the test's process."""

    def raises(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_CUDA_FAULT)

    if calls:
        monkeypatch.setattr(policy, "infer", raises)
    monkeypatch.setattr(policy, "device_fault", lambda **wait: f"AcceleratorError: {_CUDA_FAULT}")


def test_a_lost_gpu_ends_the_process_at_once_saying_why(harness, monkeypatch) -> None:
    """A CUDA fault (an illegal address, an uncorrectable ECC error, a GPU fallen off the bus) loses the
    process's CUDA context for good: every later call raises, and letting the model go would abort the
    process (bench/probe_lost_gpu.py). The node ends it at once, status 70, whatever exit_after_stall_s (0
    here: never for a stall), with a fatal line naming the fault and a last /diagnostics ERROR saying so.
    Found in review: each tick was an inference_error drop, the process up and useless, and a cleanup or
    shutdown would have crashed it."""
    from diagnostic_msgs.msg import DiagnosticStatus

    ended = _stand_in_for_the_exit(monkeypatch)
    h = harness()
    assert h.node.get_parameter("exit_after_stall_s").value == 0.0
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 2)
    _lose_the_gpu(h.node.policy, monkeypatch)
    assert h.feed_until(lambda: bool(ended), timeout=10.0), "no exit"
    assert ended[0] == node_module.SUPERVISOR_EXIT_STATUS == 70
    said = (
        f"the GPU's CUDA context is lost (AcceleratorError: {_CUDA_FAULT}; the call raised RuntimeError: "
        f"{_CUDA_FAULT}): no call can run in this process again, only a new process gets a working GPU: "
        "ending the process with status 70 for its supervisor to start it again; episode 0 ("
    )
    assert _said_fatal(h, re.escape(said))
    assert h.wait_for(
        lambda: any(
            s.level == DiagnosticStatus.ERROR and s.message.startswith(f"ending the process: {said}")
            for d in h.diagnostics
            for s in d.status
        ),
        timeout=5.0,
    ), "no last /diagnostics"
    assert h.drops().get("device_lost", 0) >= 1 and "inference_error" not in h.drops(), h.drops()
    assert h.transition(Transition.TRANSITION_DEACTIVATE)  # no tick after the exit's stand-in is undone


@pytest.mark.parametrize("when", ["reset", "discard", "cleanup", "configure", "rebuild", "audit", "prompt"])
def test_a_gpu_lost_between_calls_ends_the_process_before_the_episode_is_let_go(
    harness, monkeypatch, tmp_path, when: str
) -> None:
    """A context lost while no call runs (a fault in the motion window's rebuild, an ECC error, a GPU
    fallen off the bus) shows first at a reset, a discard or a cleanup, which let go of the episode's GPU
    states, or in a motion-window job (a rebuild, an audit), which raises; a fault in configure's warm-up
    fails the configure, which lets the model go.
    On a lost context letting go aborts the process (bench/probe_lost_gpu.py: discard, close) before
    anything says why. The node asks first, and ends the process as after a call (status 70, naming
    where it found the fault), before the cache or the model lets anything go."""
    from rmuscle_ros.runtime.policy import Policy

    ended = _stand_in_for_the_exit(monkeypatch)
    let_go: list[int] = []  # how many exits the node had asked for when the cache or model let go

    def counted(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            let_go.append(len(ended))
            return method(*args, **kwargs)

        return call

    cache = {"cache.enabled": True, "model.backend": "fused", "cache.library_path": str(tmp_path / "lib")}
    if when == "configure":  # the warm-up's first CUDA call meets the fault
        monkeypatch.setattr(Policy, "close", counted(Policy.close))
        monkeypatch.setattr(
            Policy, "warmup", lambda self, prompt: _lose_the_gpu(self, monkeypatch) or self.infer()
        )
        h = harness(**cache, warmup=True)
        assert not h.transition(Transition.TRANSITION_CONFIGURE)
        found = (
            f"found before the failed configure released the model (it raised RuntimeError: {_CUDA_FAULT})"
        )
    else:
        h = harness(**cache, **({"cache.audit_every": 1} if when == "audit" else {}))
        assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
        assert h.feed_until(lambda: len(h.chunks) >= 2)
        policy = h.node.policy
        for name in ("reset_episode", "discard_episode", "close"):
            monkeypatch.setattr(policy, name, counted(getattr(policy, name)))
    if when in ("rebuild", "audit"):
        # After the reset recorded episode 0 the worker refills the window from it (a rebuild), and audits
        # the next episode's first cached call (cache.audit_every 1). The job meets the fault.
        lost: list[bool] = []

        def job(*args: Any, **kwargs: Any) -> Any:
            lost.append(True)
            raise RuntimeError(_CUDA_FAULT)

        monkeypatch.setattr(policy, "rebuild_cache_slice" if when == "rebuild" else "audit_cache", job)
        fault = f"AcceleratorError: {_CUDA_FAULT}"
        monkeypatch.setattr(policy, "device_fault", lambda **wait: fault if lost else None)
        assert h.call(h.reset, Trigger.Request()).success
        assert h.feed_until(lambda: bool(ended), timeout=20.0), f"no exit; chunks {len(h.chunks)}"
        found = f"found when {'a rebuild' if when == 'rebuild' else 'an audit'} raised RuntimeError: {_CUDA_FAULT}"
    elif when != "configure":
        if when == "prompt":  # between episodes, where a new task has the cache's retrieval state follow it
            monkeypatch.setattr(policy, "expect_task", counted(policy.expect_task))
            assert h.call(h.reset, Trigger.Request()).success and let_go == [
                0,
                0,
            ]  # a reset sets the task too
        _lose_the_gpu(policy, monkeypatch, calls=False)
    if when == "reset":
        h.call(h.reset, Trigger.Request())
        found = "found before the reset of episode 0"
    elif when == "discard":
        h.node.discard_episode()
        found = "found before the discard of episode 0"
    elif when == "cleanup":
        assert h.transition(Transition.TRANSITION_DEACTIVATE)
        assert not ended, "a deactivation lets go of nothing"
        h.transition(Transition.TRANSITION_CLEANUP)
        found = "found before the cleanup released the model"
    elif when == "prompt":  # the next task, set live
        h.node.set_parameters([Parameter("prompt", value="stack the cups")])
        found = "found before prompt changed"
    # The node goes on past the stand-in exit, and a job that raises again asks for another (status 70
    # after the exit's 0.2 s for its last words): stopped here, while the stand-ins are in force, or it
    # ended the test's process once they were undone (found in a fresh clone's run).
    if h.node._worker is not None:
        assert h.transition(Transition.TRANSITION_DEACTIVATE)
    assert ended and set(ended) == {70}, ended
    if when in ("rebuild", "audit"):
        assert let_go == [0], let_go  # the reset, before the fault
    elif when == "prompt":
        assert let_go == [0, 0, 1], let_go  # the reset before the fault; the new task after the exit
    else:
        assert let_go and let_go[0] == 1, (ended, let_go)
    said = (
        f"the GPU's CUDA context is lost (AcceleratorError: {_CUDA_FAULT}; {found}): no call can run in "
        "this process again, only a new process gets a working GPU: ending the process with status 70"
    )
    assert _said_fatal(h, re.escape(said)), [m.msg for m in h.logs][-5:]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu on the device machine)"
)
@pytest.mark.parametrize("when", ["in_a_call", "between_calls"])
def test_a_real_cuda_fault_ends_the_node_s_process_and_frees_the_library(tmp_path, when: str) -> None:
    """The node as its own process on the graph backend; after 3 chunks a kernel stores to an illegal
    address (the process's CUDA context is then lost for good): inside the 4th call, or between calls (the
    inputs left to go stale, so that no call runs), followed by an episode reset. The process ends with
    status 70 at once (exit_after_stall_s 0: not the stall exit), naming the fault and where it was found
    in one line, and its library's lock went with it."""
    from bench.probe_lost_gpu import WILD_STORE
    from rmuscle_ros.cache.lock import LibraryLock

    library = tmp_path / "library"
    (tmp_path / "wild_store.py").write_text(WILD_STORE)
    script = tmp_path / "node.py"
    fault = "            import torch\n            from wild_store import fault_the_gpu\n            fault_the_gpu(torch)\n"
    if when == "in_a_call":
        faulting = _ENDED_BY_A_STALL.replace("            threading.Event().wait()\n", fault)
        found = r"the call raised (.*?)"
    else:  # the calls run on; the feed stops after 3 chunks, faults the GPU and asks for a reset
        faulting = _ENDED_BY_A_STALL.replace("            threading.Event().wait()\n", "            pass\n")
        faulting = faulting.replace("    while True:\n", "    while node.chunk_id < 3:\n").replace(
            "        time.sleep(0.03)\n",
            "        time.sleep(0.03)\n"
            "    time.sleep(2.0)  # past max_image_age_s: the ticks drop, no call runs\n"
            "    import torch\n    from std_msgs.msg import Empty\n    from wild_store import fault_the_gpu\n"
            "    reset = peer.create_publisher(Empty, '/rmuscle_node/reset_episode', 10)\n"
            "    try:\n        fault_the_gpu(torch)\n    except Exception as e:\n"
            "        print('faulted:', type(e).__name__, file=sys.stderr, flush=True)\n"
            "    for _ in range(50):  # until a reset arrives (the node's subscription may match late)\n"
            "        reset.publish(Empty())\n        time.sleep(0.1)\n"
            "    print('the node outlived its resets', file=sys.stderr, flush=True)\n"
            "    import os\n    os._exit(3)\n",
        )
        found = r"found before (the reset of episode 0)"
    faulting = faulting.replace('"model.backend:=fused"', '"model.backend:=graph", "model.device:=cuda"')
    faulting = faulting.replace('"exit_after_stall_s:=1.0"', '"exit_after_stall_s:=0.0"')
    assert faulting.count("fault_the_gpu(torch)") == 1 and "exit_after_stall_s:=0.0" in faulting
    script.write_text(faulting)
    env = os.environ | {"ROS_DOMAIN_ID": str(ros_domain(63))}
    run = subprocess.run(
        [sys.executable, str(script), str(library)], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 70, (run.returncode, run.stderr[-3000:])
    said = re.search(rf"the GPU's CUDA context is lost \((.*?); {found}\): no call", run.stderr)
    assert said and "illegal memory access" in said.group(1), run.stderr[-3000:]
    assert "\n" not in said.group(0), "one line (not PyTorch's advice lines)"
    assert "a working GPU: ending the process with status 70" in run.stderr, run.stderr[-3000:]
    lock = LibraryLock.take(library)  # LibraryBusy if the ended process still held it
    assert not lock.read_only, lock.read_only
    lock.release()


# rmuscle_node's own main (spin_node) in a process of its own, fed observations until it has published 6
# chunks of its first episode, then stopped by a signal, as ros2 launch or a terminal's Ctrl-C stops it.
_STOPPED_BY_A_SIGNAL = """
import os, signal, subprocess, sys, threading, time
import rclpy
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Empty
import rmuscle_ros.cache.library as library_module
from rmuscle_ros.node.bags import ALOHA_JOINT_STATE_NAMES
from rmuscle_ros.node.rmuscle_node import RMuscleNode
from rmuscle_ros.node.spin import spin_node

library, signum, when = sys.argv[1], getattr(signal, sys.argv[2]), sys.argv[3]
REPEAT = '''
import os, sys, time
pid, signum = int(sys.argv[1]), int(sys.argv[2])
for _ in range(600):  # 30 s at most; over once the node's process is gone (this one's parent then changes)
    time.sleep(0.05)
    if os.getppid() != pid:
        break
    os.kill(pid, signum)
'''
write_started = threading.Event()
if when != "once":  # a write that takes a while, as a long episode's at full size (~1 MB a call, fsynced)
    real_save = library_module.save_file
    def slow_save(*args, **kwargs):
        write_started.set()
        time.sleep(1.5)
        return real_save(*args, **kwargs)
    library_module.save_file = slow_save

def during_the_write():
    # The signal goes while an episode file is being written, however long the node took to start that
    # write: a fixed wait (0.7 s) missed it on a loaded 2-core machine, and the signal came first.
    if not write_started.wait(60):
        print("no episode write started within 60 s", file=sys.stderr, flush=True)
    write_started.clear()

def feed(node, peer):
    cameras = [peer.create_publisher(Image, t, qos_profile_sensor_data)
               for t in ("images/base", "images/left_wrist", "images/right_wrist")]
    arms = [peer.create_publisher(JointState, t, qos_profile_sensor_data)
            for t in ("joint_states/left", "joint_states/right")]
    reset = peer.create_publisher(Empty, "/rmuscle_node/reset_episode", 10)
    while node.chunk_id < 6:
        stamp = peer.get_clock().now().to_msg()
        for pub in cameras:
            msg = Image(height=48, width=64, encoding="rgb8", step=192, data=bytes(48 * 192))
            msg.header.stamp = stamp
            pub.publish(msg)
        for pub in arms:
            msg = JointState(name=list(ALOHA_JOINT_STATE_NAMES), position=[0.1] * len(ALOHA_JOINT_STATE_NAMES))
            msg.header.stamp = stamp
            pub.publish(msg)
        time.sleep(0.03)
    if when == "during_reset":  # the reset's write of episode 0 is under way on the executor's thread
        reset.publish(Empty())
        during_the_write()
    if when in ("during_cleanup", "during_shutdown"):  # a transition's write, asked for by an operator
        from lifecycle_msgs.msg import Transition
        from lifecycle_msgs.srv import ChangeState
        from rclpy.executors import SingleThreadedExecutor
        spinner = SingleThreadedExecutor()
        spinner.add_node(peer)
        threading.Thread(target=spinner.spin, daemon=True).start()
        change = peer.create_client(ChangeState, "/rmuscle_node/change_state")
        steps = ([Transition.TRANSITION_DEACTIVATE, Transition.TRANSITION_CLEANUP] if when == "during_cleanup"
                 else [Transition.TRANSITION_ACTIVE_SHUTDOWN])
        for step in steps:
            done = change.call_async(ChangeState.Request(transition=Transition(id=step)))
            while step != steps[-1] and not done.done():
                time.sleep(0.02)
        during_the_write()
    os.kill(os.getpid(), signum)
    if when == "together":  # ros2 launch's SIGINT and a terminal's, at once
        os.kill(os.getpid(), signum)
    if when == "twice":  # again, while the shutdown writes the episode
        during_the_write()
        os.kill(os.getpid(), signum)
    if when == "repeated":  # every 50 ms until the process ends, the interpreter's teardown included (a
        # launch without a terminal forwards a SIGINT the node had from the terminal too; an operator), from
        # another process: this one's threads stop running before the teardown ends
        subprocess.Popen([sys.executable, "-c", REPEAT, str(os.getpid()), str(int(signum))],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

def make():
    node = RMuscleNode()
    assert node.trigger_configure().name == "SUCCESS", node.last_error
    node.trigger_activate()
    threading.Thread(target=feed, args=(node, rclpy.create_node("cell")), daemon=True).start()
    return node

params = ("warmup:=false", "cache.enabled:=true", "model.backend:=fused", f"cache.library_path:={library}",
          "actions_per_inference:=5", "max_image_age_s:=1.0", "max_joint_age_s:=1.0", "max_skew_s:=0.5",
          "prompt:=pick", "min_episode_s:=0.0")
# exiting=True, as the executable's main
sys.exit(spin_node(make, ["rmuscle_node", "--ros-args", *[a for p in params for a in ("-p", p)]], exiting=True))
"""


def test_a_call_that_ends_after_a_deactivation_began_is_neither_published_nor_counted(harness) -> None:
    """A deactivation waits for the call in flight; its chunk is not published then, and nothing counts it:
    the stats' chunks are those published, and the episode's next chunk, after the next activation, takes
    the next id (found in review: the chunk was counted and its id used, a gap in the episode's ids)."""
    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 2)
    engine = h.node.policy.engine
    entered, release = _hold_calls(engine)
    deactivated: list[bool] = []
    stopping = threading.Thread(
        target=lambda: deactivated.append(h.transition(Transition.TRANSITION_DEACTIVATE))
    )
    try:
        assert h.feed_until(entered.is_set), "no call started"
        held_id = h.node.chunk_id  # the id the held call's chunk would take
        stopping.start()
        assert h.wait_for(h.node._stop.is_set, timeout=10.0), "the deactivation did not begin"
    finally:
        release.set()
        stopping.join(timeout=30.0)
        del engine.sample_actions
    assert deactivated == [True] and h.state() == State.PRIMARY_STATE_INACTIVE
    counted = h.node.stats()["chunks"]
    assert counted == held_id, "the held call's chunk was counted"
    assert h.wait_for(lambda: len(h.chunks) >= counted, timeout=5.0), (len(h.chunks), counted)
    time.sleep(0.3)  # a chunk published late would arrive by now
    ids = [c.chunk_id for c in h.chunks]
    assert {c.episode_id for c in h.chunks} == {0} and ids == list(range(counted)), (ids, counted)
    assert h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) > counted)
    assert h.chunks[counted].chunk_id == counted, "the episode's next chunk skipped an id"


def test_a_reset_cut_short_still_starts_the_next_episode_on_fresh_observations(harness) -> None:
    """A Ctrl-C during a reset's library write ends the cache's episode all the same (its reset does so in a
    finally), and the node's episode and observation buffer follow: before (found in a loaded run of the
    signal test below), the worker could run one call on the frames from before the reset, counted in the
    next episode, which shutdown then recorded as a library episode of one call."""
    h = harness()
    _observed_state(h, joint_value=(0.1, 0.1))  # active, with a full observation in the buffer
    node, policy = h.node, h.node.policy
    reset = policy.reset_episode

    def cut_short() -> int | None:
        reset()
        raise KeyboardInterrupt

    policy.reset_episode = cut_short
    with pytest.raises(KeyboardInterrupt):
        node.reset_episode()
    assert node.episode_id == 1 and node.chunk_id == 0
    with pytest.raises(ObservationUnavailable):
        node._buffer.observation(h.now().nanoseconds, "pick", ("a", "b", "c"))
    assert node._policy_lock.acquire(timeout=1.0), "the lock went back"
    node._policy_lock.release()


@pytest.mark.parametrize(
    ("signal_name", "when"),
    [
        ("SIGINT", "once"),
        ("SIGTERM", "once"),
        ("SIGINT", "twice"),
        ("SIGINT", "together"),
        ("SIGINT", "repeated"),
        ("SIGTERM", "repeated"),
        ("SIGINT", "during_reset"),
        ("SIGINT", "during_cleanup"),
        ("SIGTERM", "during_shutdown"),
    ],
)
def test_a_signal_while_active_records_the_episode_in_progress(tmp_path, signal_name: str, when: str) -> None:
    """Ctrl-C, or ros2 launch's SIGINT/SIGTERM, while the node is active mid-episode: the node ends as its
    shutdown transition would, and the episode in progress is in the library (destroying the node alone
    ran none of that, and the recording was lost; found in review). Found in a later review: a second
    Ctrl-C while the shutdown wrote the episode ended the write (lost, a traceback, no teardown), now it is
    said and ignored; and a Ctrl-C during a reset's write lost the finished episode, now written at
    shutdown. A third: a signal during the cleanup or shutdown transition's write (an operator's
    `ros2 lifecycle set`, then Ctrl-C) lost the episode without a word; it now takes effect after the
    write. And two at once (ros2 launch's and the terminal's): the second could land before the shutdown
    held signals, and none ran (seen once in 8 runs of the streamer); held from the first one on now.
    And one every 50 ms until the end (found on 2026-12-05 with ros2 launch run without a terminal, which
    forwards its SIGINT to nodes that had the terminal's: one that came during the interpreter's teardown,
    after the shutdown had put Python's handlers back, ended the process with -2; ignored now)."""
    library = tmp_path / "library"
    script = tmp_path / "node.py"
    script.write_text(_STOPPED_BY_A_SIGNAL)
    env = os.environ | {"ROS_DOMAIN_ID": str(ros_domain(60))}
    run = subprocess.run(
        [sys.executable, str(script), str(library), signal_name, when],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    index = json.loads((library / "index.json").read_text())
    assert len(index["episodes"]) == 1 and index["episodes"][0]["calls"] >= 6, index["episodes"]
    assert index["episodes"][0]["meta"]["session_episode"] == "0", index["episodes"]
    if when == "during_reset":  # its first write was cut short; the id it took is not reused
        assert "episode 0, whose write was interrupted or failed, written as library episode 1" in run.stderr
    else:
        assert "episode in progress recorded as library episode 0" in run.stderr, run.stderr[-2000:]
    if when.startswith("during_") and when != "during_reset":
        transition = when.removeprefix("during_")
        assert f"{transition}: episode in progress recorded as library episode 0" in run.stderr
        if (
            signal_name == "SIGINT"
        ):  # a SIGTERM only shuts the context down (rclpy's handler): nothing to hold
            said = f"rmuscle_node: SIGINT held until the {transition} has recorded the episode in progress"
            assert said in run.stderr, run.stderr[-2000:]
    if when == "twice":
        assert "rmuscle_node: SIGINT ignored: shutting down, recording the episode in progress" in run.stderr
    if when == "repeated":  # the other process did signal it, while the episode was written (1.5 s)
        said = f"rmuscle_node: {signal_name} ignored: shutting down, recording the episode in progress"
        assert run.stderr.count(said) >= 2, run.stderr[-2000:]


def test_every_executable_entry_point_runs_main_as_a_process_that_ends(monkeypatch) -> None:
    """The console scripts (pyproject.toml), libexec/ (where launch_ros and `ros2 run` look) and `python -m`
    each run the node's main with exiting=True, so that a signal during the interpreter's teardown is
    ignored (found in review: the console scripts ran main() and still died of a second SIGINT, -2)."""
    import importlib

    root = Path(__file__).resolve().parents[1]
    # [project.scripts]' `name = "module:function"` lines (tomllib is Python 3.11+; the package takes 3.10)
    scripts = dict(re.findall(r'^(\w+) = "([\w.]+:\w+)"$', (root / "pyproject.toml").read_text(), re.M))
    for name in ("rmuscle_node", "action_streamer", "aloha_sim"):
        module_name, function = scripts[name].split(":")
        module = importlib.import_module(module_name)
        asked: list[bool] = []

        def spin(make: Any, argv: Any = None, *, exiting: bool = False, asked: list[bool] = asked) -> int:
            asked.append(exiting)
            return 0

        monkeypatch.setattr(module, "spin_node", spin)
        assert getattr(module, function)() == 0 and asked == [True], (name, asked)
        wrapper = (root / "libexec" / name).read_text()
        assert f"from {module_name} import {function}\n" in wrapper and f"sys.exit({function}())" in wrapper
        source = Path(module.__file__).read_text()
        assert source.rstrip().endswith(f'if __name__ == "__main__":\n    sys.exit({function}())'), name


def test_destroying_an_active_node_stops_its_worker_and_records_the_episode(harness, tmp_path) -> None:
    """A program that tears the node down without its shutdown transition (an exception in its own code,
    then destroy_node and rclpy.shutdown, as the demo's teardown did): the worker thread is stopped and the
    episode in progress recorded. Before, the worker outlived rclpy.shutdown, the process aborted
    ("terminate called without an active exception") and the episode was lost (found in review)."""
    library = tmp_path / "library"
    h = harness(**{"cache.enabled": True, "model.backend": "fused", "cache.library_path": str(library)})
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 3)
    worker = h.node._worker
    h.executor.remove_node(h.node)  # as a program's teardown: no executor runs the node's callbacks now
    h.node.destroy_node()
    assert worker is not None and not worker.is_alive() and h.node._worker is None and h.node.policy is None
    index = json.loads((library / "index.json").read_text())
    assert len(index["episodes"]) == 1 and index["episodes"][0]["calls"] >= 3, index["episodes"]


def test_a_call_far_slower_than_the_median_is_logged_with_where_its_time_went(harness) -> None:
    h = harness()
    assert h.wait_for(lambda: h.node.get_logger().info("rosout handshake") or any(
        log.msg == "rosout handshake" for log in h.logs), timeout=10.0)  # fmt: skip
    call = {"ms": 250.0, "mode": "cached", "episode": 2, "chunk": 7, "preprocess_ms": 1.5, "gpu_ms": 9.0}
    h.node._log_if_slow(call, [10.0] * 19)  # too few calls to judge
    h.node._log_if_slow({**call, "ms": 29.0}, [10.0] * 20)  # within the median + 20 ms
    h.node._log_if_slow(call, [10.0] * 20)
    said = "slow call: 250.0 ms (cached, episode 2 chunk 7: preprocess 1.5 ms, GPU 9.0 ms, other 239.5 ms)"
    assert h.wait_for(lambda: any(said in log.msg for log in h.logs), timeout=5.0), [
        log.msg for log in h.logs
    ]
    assert sum("slow call" in log.msg for log in h.logs) == 1


def test_invalid_parameter_fails_configure_and_says_why(harness) -> None:
    _configure_fails_saying(harness(**{"cache.rho_p": 2.0}), "cache.rho_p")


def test_a_misspelt_parameter_fails_configure_naming_it(harness) -> None:
    """rclpy drops an override the node never declares: a params file's typo would leave the default in
    force without a word (found in review). Names that look like the node's are refused; others, meant
    for other nodes, are logged and left (a second review found them refused)."""
    _configure_fails_saying(harness(**{"max_image_age": 0.05}), "max_image_age: unknown parameter")
    _configure_fails_saying(
        harness(**{"cache.simlarity_threshold": 0.9}), "cache.simlarity_threshold: unknown"
    )
    _configure_fails_saying(harness(**{"cache.speculate": False}), "cache.speculate: no longer a parameter")
    # A `cache:` key that lost its indentation reads as `record`: it was logged as another node's (found in
    # review: recording stayed on)
    _configure_fails_saying(harness(record=False), "record: unknown parameter; did you mean cache.record?")
    # Other nodes' parameters (a `/**:` section, a global -p: robot_description and the like) pass.
    shared = harness(**{"robot_name": "aloha", "use_sim_time": False})
    assert shared.transition(Transition.TRANSITION_CONFIGURE), shared.node.last_error


def test_a_parameter_left_without_a_value_is_named_and_the_node_lives_on(harness) -> None:
    """An empty list in a params file (`joint_name_prefixes: []`) or `null` reads as unset in rclpy: before
    (found in review) configure ended in ERROR with nothing said, and the next `ros2 param set` ended the
    process. An empty list is the empty list (here refused by the prefixes' own check); a null is named."""
    from rclpy.parameter import Parameter

    h = harness(joint_name_prefixes=None)
    _configure_fails_saying(
        h, "joint_name_prefixes: needs one entry per joint_state_topics entry (2), got []"
    )
    assert h.node.set_parameters([Parameter("max_skew_s", value=0.2)])[0].successful
    assert h.node.set_parameters([Parameter("joint_name_prefixes", value=["left_", "right_"])])[0].successful
    assert h.transition(Transition.TRANSITION_CONFIGURE), h.node.last_error
    _configure_fails_saying(harness(max_skew_s=None), "max_skew_s: has no value (null in the params file?)")


def test_with_a_noise_seed_each_episode_draws_its_own_noise_the_same_in_every_run(harness) -> None:
    """noise_seed: an episode's calls draw from (noise_seed, episode id), so a benchmark's dense and cached
    runs of the same scenes get the same noise call for call; without it, one stream for the node's life."""
    h = harness(noise_seed=3)
    assert h.transition(Transition.TRANSITION_CONFIGURE), h.node.last_error
    policy = h.node.policy
    assert policy._noise.initial_seed() == 3 * 1_000_003 + h.node.episode_id
    first = h.node.reset_episode()
    assert policy._noise.initial_seed() == 3 * 1_000_003 + first
    plain = harness()
    assert plain.transition(Transition.TRANSITION_CONFIGURE), plain.node.last_error
    seed = plain.node.policy._noise.initial_seed()
    plain.node.reset_episode()
    assert plain.node.policy._noise.initial_seed() == seed, "one stream, not reseeded"
    # A seed from a nanosecond clock: folded into the generator's 64 bits (it overflowed them, found in
    # review, and left configure half done).
    clock = harness(noise_seed=1_796_282_733_808_472_478)
    assert clock.transition(Transition.TRANSITION_CONFIGURE), clock.node.last_error
    assert clock.node.policy._noise.initial_seed() == (1_796_282_733_808_472_478 * 1_000_003) % 2**64


def test_missing_checkpoint_fails_configure(harness, tmp_path) -> None:
    _configure_fails_saying(
        harness(**{"model.checkpoint": str(tmp_path / "absent.safetensors")}), "absent.safetensors"
    )


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"image_edit": lambda m: setattr(m, "encoding", "yuv422")}, "bad_image"),
        ({"image_edit": lambda m: setattr(m, "data", bytes(m.data[:100]))}, "bad_image"),
        ({"joint_value": float("nan")}, "bad_state"),
        ({"skip_camera": 2}, "missing_camera"),
        ({"stamp_offset_s": 30.0}, "future_stamp"),
        ({"stamp_offset_s": -30.0}, "stale_image"),
    ],
)
def test_bad_input_gives_no_chunk_and_the_node_stays_active(harness, bad: dict, reason: str) -> None:
    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)

    assert h.feed_until(lambda: h.drops().get(reason, 0) > 0, **bad), (
        f"expected a {reason} drop, got {h.drops()}"
    )
    assert h.chunks == [] and h.state() == State.PRIMARY_STATE_ACTIVE
    # Good input afterwards gives chunks again.
    assert h.feed_until(lambda: len(h.chunks) > 0)


def _publish_skewed(h: Harness) -> None:
    """Cameras 1 and 2 and the joints stamped 200 ms back, camera 0 now: a skew of 200 ms."""
    time.sleep(0.3)  # past everything held, so that the older stamps are stored
    h.publish_observation(stamp_offset_s=-0.2)
    frame = Image(height=48, width=64, encoding="rgb8", step=64 * 3, data=bytes(48 * 64 * 3))
    frame.header.stamp = h.now().to_msg()
    h.image_pubs[0].publish(frame)


def test_a_tick_refused_for_timing_is_served_by_a_later_message_or_dropped_after_its_window(
    harness, monkeypatch
) -> None:
    """A tick whose observation is refused for its messages' timing (here skew: one camera's frame 200 ms
    newer than the others') waits for a later message for half the period before it counts as a drop:
    one late or dropped camera frame no longer costs the whole period's chunk (found in review). Served,
    it is a chunk and `late_served`; not served in time, the drop it would have been. A tick every 2 s
    (a 1 s window). The served case failed twice in fresh-clone runs and once on CI, a chunk coming with no
    late_served: the count came after the chunk was published (fixed 2026-12-04; the period, widened
    from 1 s before the cause was found, stays)."""
    h = harness(actions_per_inference=50, control_period_s=0.04, max_skew_s=0.05, max_image_age_s=5.0,
                max_joint_age_s=5.0)  # fmt: skip
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) > 0), f"drops {h.drops()}"
    # The warm-up's sets arrive message by message: a tick that read one half-delivered saw their gap as
    # skew, which on a loaded machine passes 50 ms, and waited (served late, or dropped). The counts below
    # are this test's ticks, on top of the warm-up's, taken once no tick waits (as the sibling test does).
    assert h.wait_for(lambda: h.node._late is None, timeout=5.0), h.node.stats()
    late_before, skew_drops_before = dict(h.node.stats()["late_served"]), h.drops().get("skew", 0)
    served_once = late_before | {"skew": late_before.get("skew", 0) + 1}

    # Not served: the drop, once the window has passed.
    _publish_skewed(h)
    assert h.wait_for(lambda: h.node._late is not None, timeout=5.0), f"no tick waited: {h.node.stats()}"
    waited_since = time.monotonic()
    assert h.wait_for(lambda: h.drops().get("skew", 0) == skew_drops_before + 1, timeout=5.0), h.node.stats()
    assert time.monotonic() - waited_since > 0.5, "dropped before the window (1 s) had passed"
    assert h.node.stats()["late_served"] == late_before
    # Served: a whole new set of messages while the tick waits is its chunk, counted as served before
    # the chunk is out (found in CI: a reader of the stats that had the chunk could find it not yet counted)
    publish, at_publish = h.node._publish_chunk, []

    def published(*args: Any) -> None:
        at_publish.append(h.node.stats()["late_served"])
        publish(*args)

    monkeypatch.setattr(h.node, "_publish_chunk", published)
    _publish_skewed(h)
    assert h.wait_for(lambda: h.node._late is not None, timeout=5.0), f"no tick waited: {h.node.stats()}"
    chunks, dropped = len(h.chunks), h.drops().get("skew", 0)
    h.publish_observation()
    assert h.wait_for(lambda: len(h.chunks) > chunks, timeout=5.0), h.node.stats()
    s = h.node.stats()
    assert s["late_served"] == served_once and s["drops"].get("skew", 0) == dropped, s
    assert at_publish[0] == served_once, at_publish  # (a later tick's chunk may be out too)
    assert s["failing_ticks"] == 0, s
    # Served, but its call fails: the tick's drop, not also a served tick (found in review).
    _publish_skewed(h)
    assert h.wait_for(lambda: h.node._late is not None, timeout=5.0), f"no tick waited: {h.node.stats()}"
    engine = h.node.policy.engine

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the model failed")

    engine.sample_actions = failing
    h.publish_observation()
    assert h.wait_for(lambda: h.drops().get("inference_error", 0) == 1, timeout=5.0), h.node.stats()
    assert h.node.stats()["late_served"] == served_once
    del engine.sample_actions
    # An episode reset ends a waiting tick without a drop: its retries took the reset's wake, and the
    # cache's refill for the next episode never ran (found in review).
    _publish_skewed(h)
    assert h.wait_for(lambda: h.node._late is not None, timeout=5.0), f"no tick waited: {h.node.stats()}"
    dropped = dict(h.drops())
    h.node.reset_episode()
    assert h.node._late is None and h.drops() == dropped


def test_a_message_stored_while_a_refused_tick_reads_the_buffer_still_wakes_its_retry(harness) -> None:
    """A tick refused for skew, whose curing messages land between its read of the buffer and its decision
    to wait: nothing was waiting when they were stored, so they woke nothing, and the tick was served only
    at its window's end, 1.5 s later here (found in review). Now it is retried at once."""
    h = harness(actions_per_inference=50, control_period_s=0.06,  # a 3 s period, a 1.5 s window
                max_skew_s=0.05, max_image_age_s=5.0, max_joint_age_s=5.0)  # fmt: skip
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) > 0), f"drops {h.drops()}"
    buffer, node = h.node._buffer, h.node
    read, refused_at = buffer.observation, []

    def observation(*args: Any) -> Any:
        try:
            return read(*args)
        except ObservationUnavailable as e:
            if e.reason is DropReason.SKEW and not refused_at:  # a whole fresh set arrives mid-read, over DDS
                stored = dict(node._stored_counts)
                h.publish_observation()
                assert h.wait_for(
                    lambda: (
                        all(
                            node._stored_counts[f"image:{i}"] > stored.get(f"image:{i}", 0)
                            for i in range(len(CAMERAS))
                        )
                        and node._stored_counts["joints"] >= stored.get("joints", 0) + len(JOINT_TOPICS)
                    ),
                    timeout=2.0,
                ), node._stored_counts
                refused_at.append(time.monotonic())
            raise

    buffer.observation = observation
    # A tick of the warm-up above may have been served late already (a fresh clone's run on a loaded
    # machine counted 2 here): this tick's is counted on top of those.
    served_before = h.node.stats()["late_served"].get("skew", 0)
    calls = _note_worker_calls(node)
    _publish_skewed(h)
    chunks = len(h.chunks)
    assert h.wait_for(lambda: bool(refused_at), timeout=5.0), h.node.stats()
    assert h.wait_for(lambda: len(h.chunks) > chunks, timeout=10.0), h.node.stats()
    assert _served_on_the_message(h, calls), f"served at the window's end (1.5 s), not at once: {calls}"
    assert h.node.stats()["late_served"].get("skew", 0) == served_before + 1, h.node.stats()


def test_a_bad_image_is_named_by_its_topic_and_an_activation_starts_the_counts_over(harness) -> None:
    """The bad_image drop names the camera's topic as the other drops do; after a deactivation (an
    operator fixing the camera) the drops, the ticks without a chunk and the last drop that /diagnostics
    reports "since activation" start over (both found in review: ERROR at once with the old reason), and
    so does the chunk rate (a later review: the time spent inactive was counted in it, for 200 chunks)."""
    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 2) and h.node.stats()["rate_hz"] > 0
    assert h.feed_until(
        lambda: h.drops().get("bad_image", 0) > 0, image_edit=lambda m: setattr(m, "encoding", "yuv422")
    )
    assert h.node.stats()["last_drop"].startswith(
        "bad_image: base_0_rgb (/images/base): unsupported encoding"
    )
    assert h.transition(Transition.TRANSITION_DEACTIVATE) and h.transition(Transition.TRANSITION_ACTIVATE)
    s = h.node.stats()
    assert (s["drops"], s["failing_ticks"], s["last_drop"], s["slowest_calls"]) == ({}, 0, "", []), s
    assert s["rate_hz"] == 0.0, s
    assert h.feed_until(lambda: len(h.chunks) > 0)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_cpu_threads_set_at_configure_and_restored_by_zero(harness) -> None:
    """cpu_threads sets PyTorch's CPU threads at configure, as a thread started afterwards (the worker,
    at activate) sees them; 0 at a later configure gives back PyTorch's own number. (A process-wide
    setting: restored here whatever happens.)"""
    import torch

    def seen_by_a_new_thread() -> int:
        seen: list[int] = []
        worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        worker.start()
        worker.join()
        return seen[0]

    own = torch.get_num_threads()
    try:
        h = harness(cpu_threads=1)
        assert h.transition(Transition.TRANSITION_CONFIGURE)
        assert seen_by_a_new_thread() == 1
        assert h.transition(Transition.TRANSITION_CLEANUP)
        h.node.set_parameters([Parameter("cpu_threads", value=0)])
        assert h.transition(Transition.TRANSITION_CONFIGURE)
        assert seen_by_a_new_thread() == own
    finally:
        torch.set_num_threads(own)


_TIMERS_IMPORT_NOTHING = """
import collections, os, sys
import rclpy
from rclpy.parameter import Parameter
from rmuscle_ros.node.rmuscle_node import RMuscleNode
context = rclpy.Context()
rclpy.init(context=context, domain_id=int(os.environ.get("ROS_DOMAIN_ID", "42")))
params = [Parameter("warmup", value=False), Parameter("cache.enabled", value=True), Parameter("model.backend", value="fused")]
node = RMuscleNode("rmuscle_timers", context=context, parameter_overrides=params)
node.trigger_configure()
assert node.policy is not None, node.last_error
with node._stats_lock:  # what the timers find once calls have run
    node.latencies_ms.extend([20.0, 30.0])
    node._preprocess_ms.extend([2.0, 3.0])
    node._latencies_by_mode["dense"] = collections.deque([20.0, 30.0])
before = set(sys.modules)
node._diagnostics()
assert node._cache_status_message() is not None
print(sorted(set(sys.modules) - before))
node.trigger_cleanup()
node.destroy_node()
rclpy.shutdown(context=context)
"""


def test_the_executors_timers_import_nothing_once_configured() -> None:
    """While active, the executor thread's timers (/diagnostics, ~/cache_status) must not import modules:
    an import holds the GIL, and the worker's inference waits. On the H200 the first /diagnostics (np.percentile imports numpy.ma) made
    the dense episode's 2nd or 3rd call take 44-102 ms against ~19; configure now runs that path once. In a
    fresh process: a module an earlier test imported would hide the import."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _TIMERS_IMPORT_NOTHING], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def _rss_mb() -> float:
    """Resident memory, after a collection and glibc handing freed heap back to the system (malloc_trim):
    what is still allocated, not what the allocator happens to keep (it swung by ~29 MB steps either way
    between cycles that ran calls)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_repeated_cycles_leak_no_threads_or_memory(harness) -> None:
    """40 configure-activate-deactivate-cleanup cycles after 10 to warm up, one in five running inference
    calls while active (found in review: with no sensor messages no call, no worker job ever ran). Memory
    may grow at most 0.4 MB a cycle, as before (100 cycles until 1d2e560, then 50: 51 s of the suite's 11
    min), judged by the median of 8 blocks of 5 cycles (each with one cycle of calls): a leak grows every
    block, while the process's resident memory also steps by ~40 MB now and then, in any block, up and
    sometimes back down (run alone on 2026-12-05, windows of 30 cycles: [-1.4, 40.0, 2.1, 0.2], [39.4, 0.2, 42.5, 3.4],
    [2.4, 78.5, -1.0, 2.7] MB; a review's runs had it in the first window after the warm-up 4 times in 5,
    and one test run failed on it). The steps are glibc's per-thread malloc arenas (each activation's
    worker thread allocates in one), in the cycles that run calls only: 45 cycles alone on 2026-12-05 had
    steps of 36.7, 33.6, 4.2, -5.4 MB by default and none past 0.2 MB with MALLOC_ARENA_MAX=1 set before
    the process started (mallopt in a running process did not remove them, its arenas already made).
    Checked to fail with 0.5 MB kept per cleanup."""
    h = harness()

    def cycle(with_calls: bool) -> None:
        for t in (Transition.TRANSITION_CONFIGURE, Transition.TRANSITION_ACTIVATE):
            assert h.transition(t)
        if with_calls:
            published = len(h.chunks)
            assert h.feed_until(lambda: len(h.chunks) >= published + 2), f"no chunks; drops {h.drops()}"
        for t in (Transition.TRANSITION_DEACTIVATE, Transition.TRANSITION_CLEANUP):
            assert h.transition(t)

    for k in range(10):  # allocator pools, DDS entities and caches reach their steady state
        cycle(with_calls=k % 5 == 0)
    threads, block, blocks = _threads(), 5, 8
    grown = []  # MB per block of cycles
    for _ in range(blocks):
        rss = _rss_mb()
        for k in range(block):
            cycle(with_calls=k == 0)
        grown.append(_rss_mb() - rss)
    assert _threads() <= threads, f"threads grew over {block * blocks} lifecycle cycles"
    assert statistics.median(grown) < 0.4 * block, (
        f"memory grew {[round(g, 1) for g in grown]} MB by {block} cycles"
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_rosbag_replay_gives_timed_chunks(harness, tmp_path, storage: str, engine: dict) -> None:
    """An ALOHA-like bag (3 cameras at 30 Hz, 480×640; joints at 100 Hz) replayed with its own timing
    and /clock into the node (use_sim_time), its output recorded to a bag and checked from that bag."""
    bag = tmp_path / f"episode_{storage}"
    written = write_aloha_episode(bag, storage=storage, seconds=3.0, cameras=3)
    h = harness(
        use_sim_time=True,
        actions_per_inference=25,
        max_image_age_s=0.25,
        max_joint_age_s=0.1,
        max_skew_s=0.1,
        **engine,
    )
    topic = f"/{h.node.get_name()}/action_chunk"
    received: list[tuple[int, bytes]] = []
    h.peer.create_subscription(
        ActionChunk, topic, lambda raw: received.append((time.time_ns(), raw)), 10, raw=True
    )
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    remap = dict(zip(ALOHA_CAMERA_TOPICS[:3], CAMERAS, strict=True)) | dict(
        zip(ALOHA_JOINT_TOPICS, JOINT_TOPICS, strict=True)
    )
    player = BagPlayer(h.peer, bag, qos_profile_sensor_data, remap=remap)
    player.play()
    assert player.published == sum(len(v) for v in written.values())
    time.sleep(1.0)  # the last chunk's inference
    record = tmp_path / "chunks"
    write_messages(record, topic, "rmuscle_ros/msg/ActionChunk", received)
    chunks = [m for _, m in read_messages(record, topic)]

    period_s = 25 * 0.02  # a chunk every 25 actions at 50 Hz, in bag (sim) time
    assert 3 <= len(chunks) <= 3.0 / period_s, f"{len(chunks)} chunks; drops {h.drops()}"
    assert [c.chunk_id for c in chunks] == list(range(len(chunks)))
    image_stamps = set(written[ALOHA_CAMERA_TOPICS[0]])
    stamps = [c.header.stamp.sec * 10**9 + c.header.stamp.nanosec for c in chunks]
    assert all(s in image_stamps for s in stamps), "a chunk is not stamped with an observation's time"
    # One chunk per period on average. On this 2-core CI machine an inference (480×640 frames, while the
    # bag plays) can outlast the period: that chunk comes late and the next tick is served right after it.
    gaps = np.diff(stamps) / 1e9
    slowest = max(c.inference_latency_s for c in chunks)
    assert (gaps > 0).all(), gaps
    assert period_s - 0.1 <= gaps.mean() <= max(period_s, slowest) + 0.25, (gaps, slowest)
    assert all((c.horizon, c.action_dim, len(c.actions)) == (50, 14, 700) for c in chunks)


def test_a_bag_played_faster_reports_its_rate_on_both_clocks(harness, tmp_path) -> None:
    """A bag at `--rate 2` is served about twice as often per wall second as per second of its /clock:
    /diagnostics gives both (`rate_hz`, `rate_hz_clock`; found in review: only the wall rate, 2.96 Hz where
    the bag's own clock got 0.74 Hz at 4x). A chunk every 50 actions of 40 ms (2 s of the bag), so that a
    call fits the second of wall time between ticks with room to spare: at 1 s of the bag calls
    slowed by 0.3 s, as on a machine twice as slow as this one, merged ticks (a review's run). The ratio is
    held to the rate the player reached, which a loaded machine keeps below 2. The bag played again an
    hour of its clock later (the next bag of a set) is counted from its start (found in review: the jump
    read as 0.0 Hz). The rate reached is the player's own, first message to last (with the 0.5 s it waits
    for discovery counted in, a CI run's 1.86 against the node's 2.41 failed), and the wall rate is read
    from when chunks were published, each up to a call's latency after its tick: in that run the first
    call took ~1 s, which shortened the chunks' wall span by as much. The bounds allow for that."""
    from rmuscle_ros.node.bags import bag_info

    bag = tmp_path / "episode"
    seconds = 14.0
    write_aloha_episode(bag, seconds=seconds, cameras=3, size=(48, 64))
    h = harness(use_sim_time=True, actions_per_inference=50, control_period_s=0.04, max_image_age_s=0.25,
                max_joint_age_s=0.1, max_skew_s=0.1)  # fmt: skip
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    remap = dict(zip(ALOHA_CAMERA_TOPICS[:3], CAMERAS, strict=True)) | dict(
        zip(ALOHA_JOINT_TOPICS, JOINT_TOPICS, strict=True)
    )
    player = BagPlayer(h.peer, bag, qos_profile_sensor_data, remap=remap)
    player.play(rate=2.0)
    reached = player.played_s / player.wall_s  # bag seconds per wall second
    stats = h.node.stats()
    assert stats["chunks"] >= 5 and stats["ticks_merged"] == 0, (stats, h.drops())
    assert stats["rate_hz_clock"] == pytest.approx(0.5, rel=0.25), stats  # one every 2 s of the bag
    ratio = stats["rate_hz"] / stats["rate_hz_clock"]
    clock_span = (stats["chunks"] - 1) / stats[
        "rate_hz_clock"
    ]  # bag seconds from the first chunk to the last
    wall_span, lag = clock_span / reached, stats["latency_p99_ms"] / 1e3  # with 7 chunks, p99 is the slowest
    lowest, highest = clock_span / (wall_span + lag), clock_span / max(wall_span - lag, 0.1 * wall_span)
    assert 0.9 * lowest <= ratio <= 1.1 * highest, (stats, reached)
    status = h.node._diagnostics().status[0]
    assert f"({stats['rate_hz_clock']:.1f} Hz on /clock)" in status.message, status.message

    player = BagPlayer(h.peer, bag, qos_profile_sensor_data, remap=remap)
    player.play(rate=2.0, start_ns=bag_info(bag).end_ns + 3600 * 10**9)
    again = h.node.stats()
    assert again["chunks"] >= stats["chunks"] + 5, (again, h.drops())
    assert again["rate_hz_clock"] == pytest.approx(0.5, rel=0.25), again
    if reached < 1.5:  # the wall and clock rates then too close for the ratio to tell them apart
        pytest.skip(f"the player reached {reached:.2f}x of the bag's rate 2, below 1.5x (a loaded machine)")


# The demo's node and player in a domain of this test run's own: 100 above its DDS domain (the Makefile's
# ROS_TEST_DOMAIN_ID), apart from the harness's nodes, rather than the demo's fixed default 77, so that two
# test runs at once on one host, given different domains, do not hear each other's demos.
DEMO_DOMAIN = ("--domain-id", str(ros_domain(100)))


def test_a_sqlite3_bag_under_a_path_with_uri_characters_is_refused_naming_them(tmp_path) -> None:
    """rosbags opens sqlite3 bags through a URI, where '#', '?' and '%' cut or escape the path: a Humble
    cell's bag under `shift #3/` read as "unable to open database file", though it was there, and one
    written there landed in a stray file (found in review). Refused, naming the character; MCAP is fine."""
    import shutil

    from rmuscle_ros.node.bags import bag_info

    good = tmp_path / "ok" / "ep0"
    write_aloha_episode(good, storage="sqlite3", seconds=0.2, cameras=1, joint_topics=())
    moved = tmp_path / "shift #3" / "ep0"
    moved.parent.mkdir()
    shutil.copytree(good, moved)
    with pytest.raises(ValueError, match=r"a sqlite3 bag under a path with '#'.*rename the folder"):
        bag_info(moved)
    with pytest.raises(ValueError, match=r"a sqlite3 bag under a path with '%'"):
        write_aloha_episode(tmp_path / "100% good" / "ep0", storage="sqlite3", seconds=0.2, cameras=1)
    assert not (tmp_path / "100% good").exists() or not any((tmp_path / "100% good").iterdir())
    mcap = tmp_path / "shift #4" / "ep0"
    write_aloha_episode(mcap, storage="mcap", seconds=0.2, cameras=1, joint_topics=())
    assert bag_info(mcap).topics


def test_bag_info_counts_every_message_of_a_topic_and_spans_the_first_to_the_last(tmp_path) -> None:
    """What the demo plans a replay of recorded bags from (each after the first starts where the one before
    ends, on one clock) and checks a bag with: the span from the first message's time to the last's, each
    topic's messages over every connection that recorded it (a topic recorded by two publishers' offers, as
    rosbag2 does), and a bag whose topics hold no message refused. Found by a mutation review: an end time
    of the start, a count of one connection's, or an empty bag accepted passed the fast tests."""
    from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime
    from rosbags.rosbag2 import Writer

    from rmuscle_ros.node.bags import STORAGE, bag_info

    written = write_aloha_episode(tmp_path / "episode", seconds=0.3, cameras=2, size=(4, 4))
    info = bag_info(tmp_path / "episode")
    every = [t for stamps in written.values() for t in stamps]
    # (rosbags' end time is the last message's plus 1 ns)
    assert info.start_ns == min(every) and 0 <= info.end_ns - max(every) <= 1
    assert info.seconds == pytest.approx(0.29)
    assert {topic: n for topic, (_, n) in info.topics.items()} == {t: len(s) for t, s in written.items()}
    store = typestore()
    text = store.types["std_msgs/msg/String"]
    raw = bytes(store.serialize_cdr(text(data="hi"), "std_msgs/msg/String"))
    twice, empty = tmp_path / "twice", tmp_path / "empty"
    with Writer(twice, version=9, storage_plugin=STORAGE["mcap"]) as writer:
        never = QosTime(sec=0, nsec=0)
        offers = [
            [Qos(QosHistory.KEEP_LAST, 1, reliability, QosDurability.VOLATILE, never, never,
                 QosLiveliness.AUTOMATIC, never, False)]
            for reliability in (QosReliability.RELIABLE, QosReliability.BEST_EFFORT)
        ]  # fmt: skip
        first, second = (
            writer.add_connection("/log", "std_msgs/msg/String", typestore=store, offered_qos_profiles=offer)
            for offer in offers
        )
        for k, connection in enumerate((first, first, second)):
            writer.write(connection, 10**18 + k, raw)
    assert bag_info(twice).topics == {"/log": ("std_msgs/msg/String", 3)}
    with Writer(empty, version=9, storage_plugin=STORAGE["mcap"]) as writer:
        writer.add_connection("/log", "std_msgs/msg/String", typestore=store)
    with pytest.raises(ValueError, match=r"empty: holds no message"):
        bag_info(empty)


def test_an_interrupted_demo_keeps_the_chunks_it_received(tmp_path, monkeypatch) -> None:
    """Ctrl-C (or a bag refused) in the second episode: the chunks received were only written after the
    run, so all were lost, and the earlier run's recording had been deleted at the start (found in review).
    They are now written as the run ends, whatever ended it, replacing the earlier run's, and the error
    says where."""
    from rmuscle_ros.node import replay_demo

    earlier = tmp_path / "action_chunks"
    write_messages(earlier, "/rmuscle_node/action_chunk", "rmuscle_ros/msg/ActionChunk", [])
    stale = tmp_path / "action_chunks.partial"  # a killed run's half-written save: the demo's own, replaced
    stale.mkdir()
    (stale / "action_chunks.partial_0.mcap").write_bytes(b"\x89MCAP0\r\n")
    played = []
    play = replay_demo._play

    def play_then_interrupt(*args, **kwargs):
        played.append(args[0])
        if len(played) == 2:
            raise KeyboardInterrupt
        return play(*args, **kwargs)

    monkeypatch.setattr(replay_demo, "_play", play_then_interrupt)
    overrides = {"actions_per_inference": 50}
    with pytest.raises(KeyboardInterrupt) as interrupted:
        replay_demo.run(tmp_path, seconds=3, domain_id=ros_domain(101), overrides=overrides, stream=False)
    chunks = [m for _, m in read_messages(earlier, "/rmuscle_node/action_chunk")]
    assert chunks and {c.episode_id for c in chunks} == {0}, "the first episode's chunks"
    assert any(f"chunk(s) received are in {earlier}" in note for note in interrupted.value.__notes__)
    assert not (tmp_path / "action_chunks.partial").exists()
    # its file named as a finished bag (it kept `action_chunks.partial.mcap`, found on a GPU run)
    assert [p.name for p in earlier.glob("*.mcap")] == ["action_chunks.mcap"]


def test_the_demo_exits_non_zero_when_the_node_served_no_chunk(tmp_path, monkeypatch) -> None:
    """A run whose node published nothing (every observation dropped) prints its summary, which says why,
    and exits 1 for a script or CI job to see. Found by a mutation review: an exit status of 0 either way
    passed."""
    from rmuscle_ros.demo import main
    from rmuscle_ros.node import replay_demo

    printed: list[dict] = []
    monkeypatch.setattr(replay_demo, "print_summary", printed.append)
    for chunks, status in ((0, 1), (3, 0)):
        monkeypatch.setattr(replay_demo, "run", lambda out_dir, chunks=chunks, **_: {"chunks": chunks})
        assert main(["--out", str(tmp_path), *DEMO_DOMAIN]) == status
    assert printed == [{"chunks": 0}, {"chunks": 3}]


def test_the_demo_refuses_to_write_its_bags_over_what_it_did_not_write(tmp_path) -> None:
    """A link where the demo writes its chunks made it fail after the whole run, its chunks lost, and a
    folder without metadata.yaml (an unclosed recording) where it writes an episode was deleted (found in
    review). Both are refused before anything runs, and left as they are."""
    from rmuscle_ros.node import replay_demo

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "action_chunks").symlink_to(elsewhere)
    with pytest.raises(
        ValueError, match=r"action_chunks: the demo writes a bag there, but it holds something"
    ):
        replay_demo.run(tmp_path, seconds=1, domain_id=ros_domain(101), stream=False)
    (tmp_path / "action_chunks").unlink()
    unclosed = tmp_path / "aloha_episode_1"
    unclosed.mkdir()
    (unclosed / "aloha_episode_1_0.mcap").write_bytes(b"\x89MCAP0\r\n")
    with pytest.raises(ValueError, match=r"aloha_episode_1: the demo writes a bag there"):
        replay_demo.run(tmp_path, seconds=1, domain_id=ros_domain(101), stream=False)
    assert (unclosed / "aloha_episode_1_0.mcap").exists() and elsewhere.is_dir()
    for leftover in unclosed.iterdir():
        leftover.unlink()
    unclosed.rmdir()
    (tmp_path / "action_chunks.partial").symlink_to(elsewhere)  # its own first write's place: not a link
    with pytest.raises(ValueError, match=r"action_chunks\.partial: the demo writes its chunks there first"):
        replay_demo.run(tmp_path, seconds=1, domain_id=ros_domain(101), stream=False)


def test_replay_demo_prints_a_summary_and_writes_a_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from rmuscle_ros.demo import main

    # The node rebuilds cache entries only in the time left between calls. At the default 2 Hz a call on a
    # loaded 2-core CPU (the bag replay runs in this process) can take 0.3-0.6 s of the 0.5 s period, and
    # a 3 s repeat was once served all dense. One chunk a second (4 per episode) leaves the motion window
    # room for several entries: with a busy-loop process beside it, 3 of 4 were cached in each of 3 runs.
    # The first repeat's first call is always dense. Two repeats: a shift goes on past the first.
    # What an earlier run of more episodes left: its last bag and its summary go (a review found them
    # left); a folder of the user's stays.
    write_aloha_episode(tmp_path / "aloha_episode_5", seconds=0.1, cameras=1, joint_topics=())
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "aloha_episode_notes").mkdir()
    args = [
        *DEMO_DOMAIN,
        "--seconds",
        "4",
        "--episodes",
        "3",
        "--param",
        "actions_per_inference=50",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "chunks at" in out and "latency p50" in out and "drops by reason" in out
    assert "max " in out and out.count("[demo] slow call: ") == 3 and "preprocess " in out
    assert "garbage collection while active: longest pause" in out
    # The rMuscle story: a dense warm-up episode, recorded at the reset, then its repeat from the cache.
    assert "episode 0 (dense warm-up)" in out and "episode 2 (repeat of the task)" in out
    assert "reset before episode 1: episode 1 (episode 0 recorded as library episode 0)" in out
    assert "reset before episode 2: episode 2" in out and "last ~/cache_status" in out
    assert (
        "library 1 episode(s) / " in out and "(1 of task 'pick up the cube and place it in the bin')" in out
    )
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    chunks = [m for _, m in read_messages(tmp_path / "action_chunks", "/rmuscle_node/action_chunk")]
    warmup = [c.cache_mode for c in chunks if c.episode_id == 0]
    assert warmup and set(warmup) == {ActionChunk.CACHE_DENSE}
    # The first tick falls on the bag's first instant, before or after its first frames: either way the
    # first chunk is of that instant's frames (a tick that waited retries when they arrive), not of the
    # frames a period (1 s) later.
    first = chunks[0].header.stamp
    assert first.sec * 10**9 + first.nanosec - START_NS < 0.25e9, first
    for episode in (1, 2):
        repeat = [c.cache_mode for c in chunks if c.episode_id == episode]
        assert ActionChunk.CACHE_CACHED in repeat, (episode, repeat, out)
    # action_streamer, in its own process on the bag's clock, executed every chunk: each arm got its
    # commands every control period (20 ms) while a chunk was due.
    assert "action_streamer (own process, the bag's clock): " in out
    assert "chunks refused: none; the arms' drivers: not asked" in out  # a bag has no driver to ask
    summary = json.loads((tmp_path / "summary.json").read_text())
    # A reset clears the node's buffered messages; each bag's first frames end that wait (no drop).
    assert "missing_camera" not in summary["drops"], summary["drops"]
    # One cached call in 10 audited (the profile's cache.audit_every): the first repeat's first, at least.
    assert "[demo] audits of cached calls: " in out
    audits = summary["cache_status"]
    assert audits["audits"] >= 1 and 0 < audits["audit_error_median"] <= audits["audit_error_max"], audits
    assert (audits["reason"] == "") == (audits["mode"] == "cached"), audits  # why not cached, if not
    # The repeats were served from entries the motion windows rebuilt, and the summary says how many.
    window = summary["motion_window"]
    assert window["rebuilds"] >= 2 and window["window_overruns"] >= 0, window
    assert f"[demo] motion windows: {window['rebuilds']} entries rebuilt" in out
    streamed = summary["streaming"]
    assert streamed["skipped"] == "" and streamed["streamer"]["chunks_accepted"] == len(chunks)
    assert streamed["interval_p50_ms"] == pytest.approx(20.0, abs=2.0)
    assert (
        min(streamed["arm_commands"].values()) >= 300
        and streamed["gripper_commands"] == streamed["arm_commands"]
    )
    # The warm-up's bag and the last repeat's are kept; the one between was deleted once played.
    assert [b.name for b in sorted(tmp_path.glob("aloha_episode_*"))] == [
        "aloha_episode_0",
        "aloha_episode_2",
        "aloha_episode_notes",
    ]


def test_replay_demo_stopped_by_sigterm_stops_the_processes_it_started(tmp_path) -> None:
    """`kill`, `timeout` or a CI runner's SIGTERM ends the demo as Ctrl-C does: its action_streamer and
    bag player are stopped, not left running (found in review: SIGTERM ended the demo at once, and the
    streamer, or with --sim the simulator still publishing /clock, ran on re-parented)."""
    import signal

    def children(pid: int) -> set[int]:
        found: set[int] = set()
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found |= {int(c) for c in (task / "children").read_text().split()}
        return found

    def alive(pid: int) -> bool:
        with contextlib.suppress(OSError):
            return "zombie" not in Path(f"/proc/{pid}/status").read_text()
        return False

    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    demo = subprocess.Popen(
        [sys.executable, "-m", "rmuscle_ros.demo", "--seconds", "10", "--out", str(tmp_path), *DEMO_DOMAIN],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and len(started) < 2:  # the streamer, then the bag's player
            started |= children(demo.pid)
            time.sleep(0.2)
        assert len(started) >= 2, f"the demo started {started}"
        demo.send_signal(signal.SIGTERM)
        _, err = demo.communicate(timeout=60)
        assert demo.returncode == 130 and "[demo] interrupted" in err, (demo.returncode, err[-2000:])
        assert "Traceback" not in err, err[-2000:]
        assert not [pid for pid in started if alive(pid)], started
    finally:  # after the checks: a failed run leaves nothing on DEMO_DOMAIN for the next demo tests (review)
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid in started:
            if alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def test_the_demo_reads_the_streamer_s_counts_from_a_diagnostics_published_after_its_last_chunk(
    monkeypatch,
) -> None:
    """The streamer's and the sim's last counts come from the second /diagnostics after the demo's end:
    the first may have been published before it (a fixed 1.1 s wait assumed it came within 0.1 s of its
    period); with none coming the wait ends after DIAGNOSTICS_WAIT_S."""
    from rmuscle_ros.node import replay_demo

    received, started = [0], threading.Event()

    def deliver() -> None:  # one in flight at the call, then one a period later
        time.sleep(0.05)
        received[0] += 1
        time.sleep(0.3)
        received[0] += 1

    def count() -> int:  # the deliveries start at the wait's first look
        if not started.is_set():
            started.set()
            threading.Thread(target=deliver).start()
        return received[0]

    start = time.monotonic()
    replay_demo._wait_for_later_diagnostics(count)
    assert received[0] == 2 and 0.3 < time.monotonic() - start < 2.0
    monkeypatch.setattr(replay_demo, "DIAGNOSTICS_WAIT_S", 0.2)
    start = time.monotonic()
    replay_demo._wait_for_later_diagnostics(lambda: received[0])
    assert 0.2 <= time.monotonic() - start < 1.0


def test_replay_demo_refuses_bad_parameters_by_name(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each refused before anything is written or started, and before the banner (found in review: a value
    configure refuses, e.g. ρp = 3, was refused only once the streamer's process and the node were up, 3 s
    later; `--episodes 0` printed "then -1 repeat(s)" above its refusal)."""
    from rmuscle_ros.demo import main

    for param, says in (
        ("cache.rho_q=0.5", "not parameters of rmuscle_node: ['cache.rho_q']"),
        ("cache.rho_p", "expected NAME=VALUE"),
        ("cache.rho_p=3", "invalid parameter cache.rho_p: must be in (0, 1], got 3.0"),  # an int for a float
        ("cache.rho_p=", "--param cache.rho_p: '' is no parameter value"),
        ("cache.rho_p=3.0", "invalid parameter cache.rho_p: must be in (0, 1], got 3.0"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["--seconds", "1", "--param", param, "--out", str(tmp_path)])
        assert exit_.value.code == 2
        printed = capsys.readouterr()
        assert says in printed.err and printed.out == "", (param, printed)
    for option, says in (
        (["--episodes", "0"], "episodes: at least 1"),
        (["--seconds", "0"], "seconds: an episode"),
        (["--seconds", "inf"], "seconds: an episode must last more than 0 s and at most 3600"),
        (["--calls", "0"], "--calls: at least 1, got 0"),
        (["--synthetic", "--param", "prompt=x"], "--param / --sim-param: for the node"),
        (["--synthetic", "--config", str(tmp_path / "absent.yaml")], "no such file"),
        (["--domain-id", "233"], "domain id: 0 to 232, got 233"),
        (["--sim-param", "seed=3", "--seconds", "0"], "--sim-param: only with --sim"),  # a mutation review
        (
            ["--sim", "--sim-param", "cameras=[top]"],
            "--sim-param cameras: ['top'] for the node's 3 camera_topics",
        ),
        (
            ["--sim", "--param", 'camera_topics=["", images/left_wrist, images/right_wrist]'],
            "--sim: the simulated cell fills the node's first camera slots in order",
        ),
        # the gripper's units changed on one side only (found in review: the gripper never closed)
        (
            ["--sim", "--sim-param", "gripper_joint_range=[0.0, 1.0]"],
            "--sim: the sim's gripper_joint_range [0.0, 1.0] and gripper_command_range [0.6197, 1.6214] differ",
        ),
        (
            ["--sim", "--param", "gripper_state_range=[0.02, 0.06]"],
            "--sim: the sim's finger_range [0.044, 0.0579] and gripper_state_range [0.02, 0.06] differ",
        ),
    ):
        with pytest.raises(SystemExit) as exit_:
            main([*option, "--out", str(tmp_path)])
        assert exit_.value.code == 2
        printed = capsys.readouterr()
        assert says in printed.err and printed.out == "", (option, printed)
    assert not any(tmp_path.iterdir()), "a refused demo wrote into --out"
    # --param likewise: an int for a float parameter, or in a list of floats, is that float (found by a
    # mutation review: passed on as an int, rclpy refuses it at the node's start)
    from rmuscle_ros.demo import parse_param
    from rmuscle_ros.node.params import parameter_defaults

    defaults = parameter_defaults()
    for name, text, value in (("cache.rho_p", "1", 1.0), ("gripper_state_range", "[0, 1]", [0.0, 1.0]),
                              ("actions_per_inference", "50", 50), ("prompt", "a: b # c", "a: b # c")):  # fmt: skip
        parsed = parse_param(name, text, defaults)
        assert parsed == value and type(parsed) is type(value), (name, parsed)
        assert all(type(v) is float for v in parsed) if isinstance(parsed, list) else True
    # run() from Python with an int where the sim declares a float: passed on as a float (`-p episode_s:=6`
    # was an INTEGER to rclpy, and the sim refused it at start-up; found in review)
    from rmuscle_ros.node.replay_demo import _SimCell

    settings = _SimCell.settings({"episode_s": 6, "finger_range": [0, 1], "seed": 3})
    assert settings["episode_s"] == 6.0 and isinstance(settings["episode_s"], float)
    assert settings["finger_range"] == [0.0, 1.0] and isinstance(settings["seed"], int)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path / "a_file")])
    assert exit_.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err


def test_the_player_skips_types_not_installed_and_waits_only_for_the_remapped_topics(
    harness, tmp_path
) -> None:
    """A cell's own recording carries more than cameras and joints: a topic whose message type is not
    installed here (a driver's own) is skipped and named, and one nobody subscribes to (/chatter) is
    published without being waited for: only the topics remapped onto the node are."""
    from rosbags.highlevel import AnyReader
    from rosbags.rosbag2 import Writer
    from rosbags.typesys import get_types_from_msg

    from rmuscle_ros.node.bags import STORAGE

    aloha, bag = tmp_path / "aloha", tmp_path / "cell"
    write_aloha_episode(aloha, seconds=0.5)
    store = typestore()
    store.register(get_types_from_msg("float64 position", "cell_driver/msg/GripperCommand"))
    Grip, String = store.types["cell_driver/msg/GripperCommand"], store.types["std_msgs/msg/String"]
    with AnyReader([aloha]) as reader, Writer(bag, version=9, storage_plugin=STORAGE["mcap"]) as writer:
        recorded = reader.message_count
        out = {
            c.topic: writer.add_connection(c.topic, c.msgtype, typestore=store) for c in reader.connections
        }
        grip = writer.add_connection("/gripper/cmd", "cell_driver/msg/GripperCommand", typestore=store)
        chatter = writer.add_connection("/chatter", "std_msgs/msg/String", typestore=store)
        extra = [(reader.start_time + k * 10**8, k) for k in range(5)]
        events = [(t, out[c.topic], bytes(raw)) for c, t, raw in reader.messages()]
        events += [
            (t, grip, bytes(store.serialize_cdr(Grip(position=0.1 * k), Grip.__msgtype__))) for t, k in extra
        ]
        events += [
            (t, chatter, bytes(store.serialize_cdr(String(data="hi"), String.__msgtype__))) for t, _ in extra
        ]
        for t, connection, raw in sorted(events, key=lambda e: e[0]):
            writer.write(connection, t, raw)
    h = harness(use_sim_time=True)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.node._infer_timer.clock.clock_type == ClockType.ROS_TIME  # it follows the bag's /clock
    remap = dict(zip(ALOHA_CAMERA_TOPICS[:3], CAMERAS, strict=True)) | dict(
        zip(ALOHA_JOINT_TOPICS, JOINT_TOPICS, strict=True)
    )
    player = BagPlayer(h.peer, bag, qos_profile_sensor_data, remap=remap)
    start = time.monotonic()
    player.play(wait_for_subscribers_s=8.0)
    assert time.monotonic() - start < 5.0, "it waited for a topic nobody subscribes to"
    assert player.skipped == {"/gripper/cmd": "cell_driver/msg/GripperCommand"}
    assert player.published == recorded + 5, "the cameras, the joints and /chatter; not the gripper's"


def test_the_player_offers_each_topic_the_qos_its_recording_did_and_keeps_the_clock_moving(
    harness, tmp_path
) -> None:
    """A reliable subscriber (a logger) and a transient-local one (robot_state_publisher's
    /robot_description) receive what their recorded publishers offered, where a best-effort, volatile replay
    reached neither; topics whose offers differ, or that recorded none, keep the player's default (rosbag2's
    rule). /clock goes on through a 1 s gap in the recording instead of standing still until the next
    message. Both found in review."""
    from types import SimpleNamespace as Ns

    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime
    from rosbags.rosbag2 import Writer
    from rosgraph_msgs.msg import Clock
    from std_msgs.msg import String

    from rmuscle_ros.node.bags import STORAGE, recorded_qos

    never = QosTime(sec=0, nsec=0)

    def offered(reliability: QosReliability, durability: QosDurability) -> Qos:
        return Qos(
            QosHistory.KEEP_LAST,
            1,
            reliability,
            durability,
            never,
            never,
            QosLiveliness.AUTOMATIC,
            never,
            False,
        )

    reliable = offered(QosReliability.RELIABLE, QosDurability.VOLATILE)
    latched = offered(QosReliability.RELIABLE, QosDurability.TRANSIENT_LOCAL)
    store = typestore()
    bag, t0 = tmp_path / "cell", 1_700_000_000 * 10**9
    with Writer(bag, version=9, storage_plugin=STORAGE["mcap"]) as writer:
        log = writer.add_connection(
            "/log", "std_msgs/msg/String", typestore=store, offered_qos_profiles=[reliable]
        )
        urdf = writer.add_connection(
            "/robot_description", "std_msgs/msg/String", typestore=store, offered_qos_profiles=[latched]
        )
        text = store.types["std_msgs/msg/String"]
        writer.write(urdf, t0, bytes(store.serialize_cdr(text(data="<robot/>"), "std_msgs/msg/String")))
        for k, t in enumerate((t0, t0 + 10**8, t0 + 11 * 10**8)):  # a 1 s gap before the last
            writer.write(log, t, bytes(store.serialize_cdr(text(data=str(k)), "std_msgs/msg/String")))
    h = harness()
    got: dict[str, list] = {"/log": [], "/robot_description": [], "/clock": []}
    h.peer.create_subscription(String, "/log", got["/log"].append, 10)  # reliable, volatile
    latched_sub = QoSProfile(
        depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL
    )
    h.peer.create_subscription(String, "/robot_description", got["/robot_description"].append, latched_sub)
    h.peer.create_subscription(Clock, "/clock", got["/clock"].append, 100)
    player = BagPlayer(h.peer, bag, qos_profile_sensor_data, remap={})
    player.play(wait_for_subscribers_s=5.0)
    assert h.wait_for(lambda: len(got["/log"]) == 3 and len(got["/robot_description"]) == 1, timeout=5.0), got
    assert player.unmatched == []
    in_gap = [
        m for m in got["/clock"] if t0 + 10**8 < m.clock.sec * 10**9 + m.clock.nanosec < t0 + 11 * 10**8
    ]
    assert len(in_gap) >= 20, f"/clock moved {len(in_gap)} times in the recording's 1 s gap"
    times = [m.clock.sec * 10**9 + m.clock.nanosec for m in got["/clock"]]
    assert times == sorted(times), "the bag's clock never goes back"
    # What the recording does not settle keeps the player's default.
    mixed = [Ns(ext=Ns(offered_qos_profiles=[reliable])), Ns(ext=Ns(offered_qos_profiles=[latched]))]
    assert recorded_qos(mixed, qos_profile_sensor_data) is qos_profile_sensor_data
    assert (
        recorded_qos([Ns(ext=Ns(offered_qos_profiles=[]))], qos_profile_sensor_data)
        is qos_profile_sensor_data
    )
    assert (
        recorded_qos([Ns(ext=Ns(offered_qos_profiles=[latched]))], 10).durability
        == DurabilityPolicy.TRANSIENT_LOCAL
    )
    # A topic nobody subscribes to under its remapped name, and /clock short of the subscribers asked for:
    # named as published.
    lonely = BagPlayer(h.peer, bag, qos_profile_sensor_data, remap={"/log": "/nobody_listens"})
    lonely.play(wait_for_subscribers_s=0.3, clock_subscribers=2)
    assert lonely.unmatched == ["/nobody_listens", "/clock (1 of 2 subscribers)"], lonely.unmatched


def test_a_moved_bag_moves_every_stamp_and_plays_its_own_clock_not_the_recorded_one(
    harness, tmp_path
) -> None:
    """`--start-ns` on a cell's recording: stamps move in messages of this package's types (ActionChunk)
    and further inside a message (a Time field; each transform of a /tf message), and a /clock recorded in
    the bag is not replayed beside the player's own, shifted one. Before (found in review) those stamps
    stayed on the recorded day and the recorded /clock made sim time jump back and forth."""
    from builtin_interfaces.msg import Time as TimeMsg
    from rosbags.rosbag2 import Writer
    from rosgraph_msgs.msg import Clock

    from rmuscle_ros.node.bags import STORAGE

    store = typestore(with_interfaces=True)
    Time, Header = store.types["builtin_interfaces/msg/Time"], store.types["std_msgs/msg/Header"]
    ClockT, Chunk = store.types["rosgraph_msgs/msg/Clock"], store.types["rmuscle_ros/msg/ActionChunk"]
    recorded, moved_to = 1_700_000_000 * 10**9, 1_800_000_000 * 10**9
    bag = tmp_path / "cell"
    with Writer(bag, version=9, storage_plugin=STORAGE["mcap"]) as writer:
        clock = writer.add_connection("/clock", ClockT.__msgtype__, typestore=store)
        when = writer.add_connection("/stamp", Time.__msgtype__, typestore=store)
        chunks = writer.add_connection("/chunks", Chunk.__msgtype__, typestore=store)
        for k in range(5):
            t = recorded + k * 10**8
            at = Time(sec=t // 10**9, nanosec=t % 10**9)
            writer.write(clock, t, bytes(store.serialize_cdr(ClockT(clock=at), ClockT.__msgtype__)))
            writer.write(when, t, bytes(store.serialize_cdr(at, Time.__msgtype__)))
            chunk = Chunk(header=Header(stamp=at, frame_id=""), episode_id=0, chunk_id=k, joint_names=[],
                          horizon=1, action_dim=1, control_period_s=0.02, actions=np.zeros(1, np.float32),
                          inference_latency_s=0.0, cache_mode=0, cache_similarity=0.0)  # fmt: skip
            writer.write(chunks, t, bytes(store.serialize_cdr(chunk, Chunk.__msgtype__)))
    h = harness()
    got: dict[str, list] = {"/clock": [], "/stamp": [], "/chunks": []}
    for topic, kind in (("/clock", Clock), ("/stamp", TimeMsg), ("/chunks", ActionChunk)):
        h.peer.create_subscription(kind, topic, got[topic].append, 50)
    player = BagPlayer(h.peer, bag, 10, remap={})
    player.play(wait_for_subscribers_s=5.0, start_ns=moved_to)
    assert h.wait_for(lambda: len(got["/stamp"]) == 5 and len(got["/chunks"]) == 5, timeout=5.0), got
    assert player.skipped == {"/clock": "rosgraph_msgs/msg/Clock"}
    seconds = {topic: sorted({m.sec if topic == "/stamp" else (m.clock.sec if topic == "/clock" else
                                                               m.header.stamp.sec) for m in msgs})
               for topic, msgs in got.items()}  # fmt: skip
    assert all(sec // 10**8 == 18 for secs in seconds.values() for sec in secs), seconds


def _simulator_recorded(
    bag: Path, seconds: float, sim0: int, wall0: int, **topics: Any
) -> dict[str, list[int]]:
    """An ALOHA-like episode as a simulator's cell records it with a recorder on the wall clock: header
    stamps and a /clock (every 10 ms) on the simulator's clock from `sim0`, which ran at 0.8 of real time;
    log times on the wall clock from `wall0`. Returns the header stamps per topic."""
    from rosbags.highlevel import AnyReader
    from rosbags.rosbag2 import Writer

    from rmuscle_ros.node.bags import STORAGE

    on_sim_time = bag.with_name(bag.name + "_on_sim_time")
    written = write_aloha_episode(on_sim_time, seconds=seconds, cameras=3, start_ns=sim0, **topics)
    store = typestore()
    ClockT, Time = store.types["rosgraph_msgs/msg/Clock"], store.types["builtin_interfaces/msg/Time"]

    def logged(t: int) -> int:
        return wall0 + round((t - sim0) / 0.8)

    with AnyReader([on_sim_time]) as reader, Writer(bag, version=9, storage_plugin=STORAGE["mcap"]) as writer:
        out = {
            c.topic: writer.add_connection(c.topic, c.msgtype, typestore=store) for c in reader.connections
        }
        clock = writer.add_connection("/clock", ClockT.__msgtype__, typestore=store)
        events = [(logged(t), out[c.topic], bytes(raw)) for c, t, raw in reader.messages()]
        for t in range(sim0, sim0 + round(seconds * 1e9), 10**7):
            at = ClockT(clock=Time(sec=t // 10**9, nanosec=t % 10**9))
            events.append((logged(t), clock, bytes(store.serialize_cdr(at, ClockT.__msgtype__))))
        for t, connection, raw in sorted(events, key=lambda e: e[0]):
            writer.write(connection, t, raw)
    shutil.rmtree(on_sim_time)
    return written


def test_a_simulators_bag_recorded_without_sim_time_plays_on_its_own_clock(
    harness, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bag recorded from a simulator by a recorder on the wall clock: log times on the wall clock, header
    stamps and the recorded /clock on the simulator's (here 0.8 of real time, a day back). On the player's
    clock (from the log times) the node would find every observation a day old; `recorded_clock` replays
    the bag's own /clock (as `ros2 bag play` without --clock does), moved with the stamps by `start_ns`,
    and the node serves chunks from it. The command says so when the clocks differ; a bag without /clock
    is refused for it by name."""
    from rosgraph_msgs.msg import Clock

    from rmuscle_ros.node import bags

    sim0, wall0, moved = 1_700_000_000 * 10**9, 1_700_086_400 * 10**9, 1_800_000_000 * 10**9
    bag = tmp_path / "recorded"
    written = _simulator_recorded(bag, 2.0, sim0, wall0)
    assert bags.recorded_clock(bag) == bags.RecordedClock(sim0, sim0, sim0 + 1_990_000_000, wall0 - sim0)

    h = harness(use_sim_time=True, actions_per_inference=25, max_image_age_s=0.25, max_joint_age_s=0.1,
                max_skew_s=0.1)  # fmt: skip
    clocks: list[int] = []
    h.peer.create_subscription(
        Clock, "/clock", lambda m: clocks.append(m.clock.sec * 10**9 + m.clock.nanosec), 100
    )
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    remap = dict(zip(ALOHA_CAMERA_TOPICS[:3], CAMERAS, strict=True)) | dict(
        zip(ALOHA_JOINT_TOPICS, JOINT_TOPICS, strict=True)
    )
    player = BagPlayer(h.peer, bag, qos_profile_sensor_data, remap=remap)
    player.play(start_ns=moved, recorded_clock=True)
    assert player.skipped == {} and player.published == sum(len(v) for v in written.values())
    assert h.wait_for(lambda: len(h.chunks) >= 2, timeout=3.0), f"{len(h.chunks)} chunks; drops {h.drops()}"
    assert not {"stale_image", "future_stamp", "stale_joints"} & set(h.drops()), h.drops()
    image_stamps = {t - sim0 + moved for t in written[ALOHA_CAMERA_TOPICS[0]]}
    assert all(stamp_ns(c.header) in image_stamps for c in h.chunks), "not stamped with a frame's time"
    assert h.wait_for(lambda: clocks and max(clocks) == moved + 1_990_000_000, timeout=2.0), clocks[-3:]
    assert min(clocks) == moved
    assert clocks == sorted(clocks), "the recorded /clock went back"

    episode = tmp_path / "no_clock"
    write_aloha_episode(episode, seconds=0.1, cameras=1, joint_topics=())
    with pytest.raises(bags.BagRefused, match=r"no_clock: recorded no /clock to replay"):
        BagPlayer(h.peer, episode, qos_profile_sensor_data).play(recorded_clock=True)
    # The command notes the other clock; here it then refuses a start outside ROS time before playing.
    assert bags.main(["play", str(bag), "--start-ns=-5000000000", "--wait-for-subscribers=0"]) == 2
    err = capsys.readouterr().err
    assert (
        "note: the bag's own /clock is 8.64e+04 s behind its log times" in err and "outside ROS time" in err
    )
    assert bags.main(["play", str(bag), "--recorded-clock", "--start-ns=-1", "--wait-for-subscribers=0"]) == 2
    err = capsys.readouterr().err
    assert "note:" not in err and "would play from -1 to 1989999999 ns, outside ROS time" in err
    # A /clock that cannot be read (here a truncated message; an unindexed MCAP out of time order alike) is
    # refused by name, with or without the option (found in review: a traceback).
    damaged = tmp_path / "damaged_clock"
    write_messages(damaged, "/clock", "rosgraph_msgs/msg/Clock", [(wall0, b"\x00\x01\x00\x00\x01\x00")])
    with pytest.raises(SystemExit) as usage:  # read for the note: a usage error, before rclpy starts
        bags.main(["play", str(damaged), "--wait-for-subscribers=0"])
    assert usage.value.code == 2
    assert "damaged_clock: its /clock cannot be read (error: " in capsys.readouterr().err
    assert bags.main(["play", str(damaged), "--recorded-clock", "--wait-for-subscribers=0"]) == 2
    assert "damaged_clock: its /clock cannot be read (error: " in capsys.readouterr().err


def test_recordings_a_recorder_left_unclosed_or_out_of_order_are_refused_saying_so(harness, tmp_path) -> None:
    """A recorder that crashed leaves no metadata.yaml, or an MCAP file without its end: each refusal says
    the recording was not closed and what repairs it. An unindexed MCAP (rosbag2's fastwrite preset writes
    one) whose messages are out of time order passes the first check and is refused by name when the
    player reaches that point; before (found in review), the player died there with a traceback."""
    from io import BytesIO

    from rosbags.rosbag2 import Writer
    from rosbags.rosbag2.storage_mcap import (
        write_record,
        write_string,
        write_uint16,
        write_uint32,
        write_uint64,
    )

    from rmuscle_ros.node.bags import STORAGE, BagRefused, bag_info

    crashed = tmp_path / "crashed"
    write_aloha_episode(crashed, seconds=0.2)
    (crashed / "metadata.yaml").unlink()
    with pytest.raises(ValueError, match=r"crashed: no metadata.yaml .* not closed .* `ros2 bag reindex`"):
        bag_info(crashed)
    crashed_sqlite = tmp_path / "crashed_sqlite"  # Humble's default storage
    write_aloha_episode(crashed_sqlite, seconds=0.2, storage="sqlite3")
    (crashed_sqlite / "metadata.yaml").unlink()
    with pytest.raises(ValueError, match=r"crashed_sqlite: no metadata.yaml beside its crashed_sqlite.db3"):
        bag_info(crashed_sqlite)
    cut = tmp_path / "cut"
    write_aloha_episode(cut, seconds=0.2)
    mcap = next(cut.glob("*.mcap"))
    mcap.write_bytes(mcap.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"cut: cannot be read .* not closed .* `mcap recover`"):
        bag_info(cut)

    # An unchunked, unindexed MCAP whose third message is stamped before the second.
    store, topic = typestore(), "/log"
    disorder = tmp_path / "disorder"
    with Writer(disorder, version=9, storage_plugin=STORAGE["mcap"]) as writer:  # its metadata.yaml
        connection = writer.add_connection(topic, "std_msgs/msg/String", typestore=store)
        for t in (1, 2, 3):
            writer.write(connection, 10**18 + t * 10**8, b"\x00\x01\x00\x00\x01\x00\x00\x00\x00")
    definition, _ = store.generate_msgdef("std_msgs/msg/String", ros_version=2)
    out = BytesIO(b"\x89MCAP0\r\n")
    out.seek(0, 2)

    def record(opcode: int, *fields: tuple[Any, Any]) -> None:
        body = BytesIO()
        for write, value in fields:
            if write is None:
                body.write(value)  # raw bytes
            else:
                write(body, value)
        write_record(out, opcode, body)

    meta = BytesIO()
    write_string(meta, "offered_qos_profiles")
    write_string(meta, "[]")
    record(0x01, (write_string, "ros2"), (write_string, "rosbag2"))  # header
    record(0x03, (write_uint16, 1), (write_string, "std_msgs/msg/String"), (write_string, "ros2msg"),
           (write_uint32, len(definition)), (None, definition.encode()))  # fmt: skip
    record(0x04, (write_uint16, 1), (write_uint16, 1), (write_string, topic), (write_string, "cdr"),
           (write_uint32, len(meta.getvalue())), (None, meta.getvalue()))  # fmt: skip
    for t in (1, 3, 2):
        when = 10**18 + t * 10**8
        record(0x05, (write_uint16, 1), (write_uint32, 0), (write_uint64, when), (write_uint64, when),
               (None, b"\x00\x01\x00\x00\x01\x00\x00\x00\x00"))  # fmt: skip
    record(0x0F, (write_uint32, 0))  # data end
    record(0x02, (write_uint64, 0), (write_uint64, 0), (write_uint32, 0))  # footer
    out.write(b"\x89MCAP0\r\n")
    next(disorder.glob("*.mcap")).write_bytes(out.getvalue())
    assert bag_info(disorder).topics[topic] == ("std_msgs/msg/String", 3)
    player = BagPlayer(harness().peer, disorder, 10)
    with pytest.raises(BagRefused, match=r"disorder: cannot be read on in time order after 2 messages"):
        player.play()


def test_bags_the_player_cannot_play_are_refused_saying_why(harness, tmp_path) -> None:
    """A ROS 1 bag (not CDR: published as it is it reaches nobody), a bag of types none installed here,
    and, for the demo's --bags, a camera topic registered but without messages, are refused naming the
    bag; a Humble sqlite3 bag, which embeds no message definitions, is read (found in review)."""
    import sqlite3

    from rosbags.highlevel import AnyReader
    from rosbags.rosbag1 import Writer as Ros1Writer
    from rosbags.rosbag2 import Writer
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    from rmuscle_ros.node.bags import STORAGE, bag_info
    from rmuscle_ros.node.params import parameter_defaults
    from rmuscle_ros.node.replay_demo import _check_bag

    noetic = get_typestore(Stores.ROS1_NOETIC)
    ros1 = tmp_path / "noetic.bag"
    with Ros1Writer(ros1) as writer:
        connection = writer.add_connection("/chatter", "std_msgs/msg/String", typestore=noetic)
        writer.write(
            connection,
            10**18,
            noetic.serialize_ros1(noetic.types["std_msgs/msg/String"](data="hi"), "std_msgs/msg/String"),
        )
    with pytest.raises(ValueError, match=r"noetic\.bag: a ROS 1 bag; convert it to rosbag2 first"):
        bag_info(ros1)

    humble = tmp_path / "humble"
    write_aloha_episode(humble, seconds=0.2, storage="sqlite3")
    database = sqlite3.connect(next(humble.glob("*.db3")))
    database.execute("DELETE FROM message_definitions")
    database.commit()
    database.close()
    assert bag_info(humble).topics[ALOHA_JOINT_TOPICS[0]][1] > 0

    store = typestore()
    store.register(get_types_from_msg("float64 position", "cell_driver/msg/GripperCommand"))
    alien = tmp_path / "alien"
    with Writer(alien, version=9, storage_plugin=STORAGE["mcap"]) as writer:
        connection = writer.add_connection("/gripper/cmd", "cell_driver/msg/GripperCommand", typestore=store)
        grip = store.types["cell_driver/msg/GripperCommand"](position=0.1)
        writer.write(connection, 10**18, bytes(store.serialize_cdr(grip, grip.__msgtype__)))
    with pytest.raises(
        ValueError, match=r"alien: nothing to play: no topic's message type is installed here"
    ):
        BagPlayer(harness().peer, alien, 10).play()

    died = tmp_path / "died"
    write_aloha_episode(tmp_path / "full", seconds=0.2)
    with (
        AnyReader([tmp_path / "full"]) as reader,
        Writer(died, version=9, storage_plugin=STORAGE["mcap"]) as writer,
    ):
        out = {
            c.topic: writer.add_connection(c.topic, c.msgtype, typestore=typestore())
            for c in reader.connections
        }
        for c, t, raw in reader.messages():
            if c.topic != ALOHA_CAMERA_TOPICS[0]:  # the high camera died: its topic seen, nothing recorded
                writer.write(out[c.topic], t, bytes(raw))
    params = parameter_defaults()
    remap = dict(zip(ALOHA_CAMERA_TOPICS[:3], params["camera_topics"], strict=True)) | dict(
        zip(ALOHA_JOINT_TOPICS, params["joint_state_topics"], strict=True)
    )
    with pytest.raises(
        ValueError, match=r"died: nothing would reach the node's topic\(s\) \['images/base'\]"
    ):
        _check_bag(died, remap, params)


def test_a_bag_of_other_types_or_two_topics_onto_one_camera_is_refused_before_playing(tmp_path) -> None:
    """A cell that records its cameras compressed (or a node left on raw frames), and two recorded topics
    onto one of the node's: before (found in review) both played into a node that dropped every
    observation, the player's warning swallowed. A user's --remap onto a node topic replaces the ALOHA
    default onto it."""
    from rosbags.rosbag2 import Writer

    from rmuscle_ros.node.bags import STORAGE
    from rmuscle_ros.node.params import parameter_defaults
    from rmuscle_ros.node.replay_demo import _check_bag, merge_remaps

    store = typestore()
    types = store.types
    header = types["std_msgs/msg/Header"](
        stamp=types["builtin_interfaces/msg/Time"](sec=1, nanosec=0), frame_id=""
    )
    frame = types["sensor_msgs/msg/CompressedImage"](header=header, format="jpeg", data=np.zeros(4, np.uint8))
    joints = types["sensor_msgs/msg/JointState"](
        header=header, name=["waist"], position=np.zeros(1), velocity=np.zeros(0), effort=np.zeros(0)
    )
    bag = tmp_path / "compressed"
    with Writer(bag, version=9, storage_plugin=STORAGE["mcap"]) as writer:
        for topic, msg in [
            *((t, frame) for t in ALOHA_CAMERA_TOPICS[:3]),
            *((t, joints) for t in ALOHA_JOINT_TOPICS),
        ]:
            connection = writer.add_connection(topic, msg.__msgtype__, typestore=store)
            writer.write(connection, 10**9, bytes(store.serialize_cdr(msg, msg.__msgtype__)))
    params = parameter_defaults()
    aloha = dict(zip(ALOHA_CAMERA_TOPICS[:3], params["camera_topics"], strict=True)) | dict(
        zip(ALOHA_JOINT_TOPICS, params["joint_state_topics"], strict=True)
    )
    with pytest.raises(
        ValueError,
        match=(
            r"compressed: /cam_high/camera/color/image_rect_raw holds sensor_msgs/msg/CompressedImage; the node's "
            r"/images/base takes sensor_msgs/msg/Image \(compressed_images: true\)"
        ),
    ):
        _check_bag(bag, aloha, params)
    assert _check_bag(bag, aloha, params | {"compressed_images": True}).topics

    # --remap /cam_low/…:=images/base: the low camera replaces the high one on the node's base slot.
    low = ALOHA_CAMERA_TOPICS[3]
    merged = merge_remaps(aloha, {low: "images/base"})
    assert merged[low] == "images/base" and ALOHA_CAMERA_TOPICS[0] not in merged
    assert merge_remaps(aloha, {low: "/images/base"}) == merged | {low: "/images/base"}, (
        "same topic, written absolute"
    )
    both = aloha | {low: "images/base"}  # two recorded cameras onto one slot, by hand
    four = tmp_path / "four"
    write_aloha_episode(four, seconds=0.1, cameras=4)
    with pytest.raises(
        ValueError, match=r"four: \['/cam_high/.*', '/cam_low/.*'\] would all reach the node's /images/base"
    ):
        _check_bag(four, both, params)
    assert _check_bag(four, merged, params).topics


def test_the_player_finds_service_event_and_action_types_not_only_messages() -> None:
    """A Jazzy recording holds `…/_service_event` topics (`pkg/srv/X_Event`) and actions' status: their
    classes are looked up by their kind (found in review: always in pkg.msg, skipped as not installed)."""
    from rmuscle_ros.node.bags import _message_class

    assert _message_class("rcl_interfaces/srv/GetParameters_Event").__name__ == "GetParameters_Event"
    assert _message_class("sensor_msgs/msg/JointState").__name__ == "JointState"
    with pytest.raises(ImportError):
        _message_class("cell_driver/msg/GripperCommand")


def test_the_player_moves_a_messages_header_stamp_and_nothing_else() -> None:
    """`--start-ns` replays a bag as if recorded later (or earlier): each header stamp moves by the offset,
    byte for byte the rest of the message stays; a stamp never set (zero) stays zero."""
    store = typestore()
    Header, Time = store.types["std_msgs/msg/Header"], store.types["builtin_interfaces/msg/Time"]
    JointStateT = store.types["sensor_msgs/msg/JointState"]
    for sec, nanosec, offset in ((1_700_000_000, 999_999_999, 2), (1_700_000_005, 1, -3 * 10**9 - 2)):
        msg = JointStateT(
            header=Header(stamp=Time(sec=sec, nanosec=nanosec), frame_id="arm"), name=["a", "b"],
            position=np.array([0.1, -0.2]), velocity=np.zeros(0), effort=np.zeros(0),
        )  # fmt: skip
        raw = bytes(store.serialize_cdr(msg, "sensor_msgs/msg/JointState"))
        moved = store.deserialize_cdr(shift_header_stamp(raw, offset), "sensor_msgs/msg/JointState")
        total = sec * 10**9 + nanosec + offset
        assert (moved.header.stamp.sec, moved.header.stamp.nanosec) == divmod(total, 10**9)
        assert moved.header.frame_id == "arm" and list(moved.name) == ["a", "b"]
        assert np.array_equal(moved.position, msg.position)
        assert shift_header_stamp(raw, offset)[12:] == raw[12:]
    unset = JointStateT(header=Header(stamp=Time(sec=0, nanosec=0), frame_id=""), name=[],
                        position=np.zeros(0), velocity=np.zeros(0), effort=np.zeros(0))  # fmt: skip
    raw = bytes(store.serialize_cdr(unset, "sensor_msgs/msg/JointState"))
    assert shift_header_stamp(raw, 10**9) == raw
    # XCDR2 little-endian (0x0007, another middleware's) is little-endian too (found in review: only 0x0001
    # was, so the stamp was read and written big-endian)
    xcdr2 = b"\x00\x07" + bytes(store.serialize_cdr(msg, "sensor_msgs/msg/JointState"))[2:]
    assert struct.unpack_from("<iI", shift_header_stamp(xcdr2, 10**9), 4) == (msg.header.stamp.sec + 1, 1)
    # Found by a mutation review: a stamp moved past int32 seconds, and stamps inside a message that begins
    # with a header (a Path's poses), were not checked.
    from rmuscle_ros.node.bags import MAX_TIME_NS, _stamps_in

    with pytest.raises(ValueError, match="falls outside ROS time"):
        shift_header_stamp(bytes(store.serialize_cdr(msg, "sensor_msgs/msg/JointState")), MAX_TIME_NS)
    where = {t: _stamps_in(t, store.fielddefs) for t in ("nav_msgs/msg/Path", "sensor_msgs/msg/JointState",
                                                        "std_msgs/msg/String", "builtin_interfaces/msg/Time")}  # fmt: skip
    assert where == {"nav_msgs/msg/Path": "nested", "sensor_msgs/msg/JointState": "header",
                     "std_msgs/msg/String": "", "builtin_interfaces/msg/Time": "nested"}  # fmt: skip


def test_the_player_takes_relative_remaps_and_refuses_what_it_cannot_play_by_name(harness, tmp_path) -> None:
    """Found in review, each silent or a traceback before: a relative `--remap FROM` (as `ros2 bag play`
    takes it) matched nothing; a NaN rate played unpaced; header stamps on another clock than the log
    times (a simulator's, a device's) raised a ValueError mid-replay with --start-ns; a second play reported
    the first one's unmatched topics."""
    from rclpy.qos import qos_profile_sensor_data

    from rmuscle_ros.node import bags

    assert bags.parse_remaps(["follower_left/joint_states:=joints_rel"]) == {
        "/follower_left/joint_states": "joints_rel"
    }
    episode = tmp_path / "episode"
    write_aloha_episode(episode, seconds=0.2)
    peer = harness().peer
    received: list[Any] = []
    peer.create_subscription(JointState, "/joints_rel", received.append, qos_profile_sensor_data)
    relative = ALOHA_JOINT_TOPICS[0].lstrip("/")
    player = BagPlayer(peer, episode, qos_profile_sensor_data, remap={relative: "/joints_rel"})
    player.play(wait_for_subscribers_s=5.0, clock_subscribers=0)
    assert player.unmatched == [] and received, f"unmatched {player.unmatched}, received {len(received)}"
    for rate in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="rate must be a finite number > 0"):
            player.play(rate)
    # A stale report: nobody subscribes to /nobody; a play after it that waits for nobody reports nothing.
    lonely = BagPlayer(peer, episode, qos_profile_sensor_data, remap={ALOHA_JOINT_TOPICS[1]: "/nobody"})
    lonely.play(wait_for_subscribers_s=0.2, clock_subscribers=0)
    assert lonely.unmatched == ["/nobody"]
    lonely.play()  # no wait, so nothing unmatched
    assert lonely.unmatched == []
    # --rate 0.5 plays at half the recorded pace at most (an upper bound, whatever the load; a mutation
    # review found a player that took the rate for its inverse passing: the rate-2 test skips when slow)
    lonely.play(rate=0.5)
    assert 0 < lonely.played_s / lonely.wall_s <= 0.5 * 1.01, (lonely.played_s, lonely.wall_s)
    # Joint states stamped on a device's clock (5 s since its start), logged on the host's (2026).
    store, logged = typestore(), 1_796_000_000 * 10**9
    Header, Time = store.types["std_msgs/msg/Header"], store.types["builtin_interfaces/msg/Time"]
    JointStateT = store.types["sensor_msgs/msg/JointState"]
    device = tmp_path / "device_clock"

    def joint_state(nanosec: int) -> bytes:
        stamp = Header(stamp=Time(sec=5, nanosec=nanosec), frame_id="")
        msg = JointStateT(
            header=stamp, name=["a"], position=np.zeros(1), velocity=np.zeros(0), effort=np.zeros(0)
        )
        return bytes(store.serialize_cdr(msg, "sensor_msgs/msg/JointState"))

    raws = [joint_state(k * 10**7) for k in range(3)]
    write_messages(
        device, "/joints", "sensor_msgs/msg/JointState", [(logged + k * 10**7, r) for k, r in enumerate(raws)]
    )
    with pytest.raises(
        bags.BagRefused, match=r"device_clock: /joints: .* not on the clock its messages were logged"
    ):
        BagPlayer(peer, device, qos_profile_sensor_data).play(start_ns=logged - 86_400 * 10**9)
    # A stamp inside a message (a /tf transform's, a Time field) is checked the same way.
    stamp = Time(sec=5, nanosec=0)
    with pytest.raises(ValueError, match="falls outside ROS time"):
        bags._shift_times(stamp, -86_400 * 10**9)
    assert (stamp.sec, stamp.nanosec) == (5, 0), "left as it was"


def test_replay_demo_replays_recorded_episodes_on_one_clock(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m rmuscle_ros.demo --bags …`: a cell's own recordings, one bag per episode, with its own
    topic names (--remap) and recorded on other days (here the second one a day *before* the first). Each
    bag after the first is moved to start 10 ms after the one before ends, so the node sees one clock: the
    second episode is served from the first one's memory, and its chunks are stamped after the first's."""
    from rmuscle_ros.demo import main

    cameras = ("/rig/cam_top", "/rig/cam_left", "/rig/cam_right")
    arms = ("/rig/arm_left/joints", "/rig/arm_right/joints")
    bags = [tmp_path / "monday", tmp_path / "sunday"]
    for bag, start_s in zip(bags, (1_700_086_400, 1_700_000_000), strict=True):
        write_aloha_episode(
            bag, seconds=4.0, start_ns=start_s * 10**9, camera_topics=cameras, joint_topics=arms
        )
    node_topics = ("images/base", "images/left_wrist", "images/right_wrist", "joint_states/left",
                   "joint_states/right")  # fmt: skip
    remaps = [f"--remap={frm}:={to}" for frm, to in zip((*cameras, *arms), node_topics, strict=True)]
    out = tmp_path / "out"
    args = [
        "--bags",
        *map(str, bags),
        *remaps,
        "--param",
        "actions_per_inference=50",
        "--out",
        str(out),
        *DEMO_DOMAIN,
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "on 2 recorded episode(s)" in printed
    assert "episode 0 (monday)" in printed and "episode 1 (sunday)" in printed
    assert "reset before episode 1: episode 1 (episode 0 recorded as library episode 0)" in printed
    chunks = [m for _, m in read_messages(out / "action_chunks", "/rmuscle_node/action_chunk")]
    first = [c for c in chunks if c.episode_id == 0]
    second = [c for c in chunks if c.episode_id == 1]
    assert first and second, printed
    assert ActionChunk.CACHE_CACHED in {c.cache_mode for c in second}, printed
    stamp = lambda c: c.header.stamp.sec * 10**9 + c.header.stamp.nanosec  # noqa: E731
    assert min(map(stamp, second)) > max(map(stamp, first)) >= 1_700_086_400 * 10**9
    assert "future_stamp" not in printed, printed
    summary = json.loads((out / "summary.json").read_text())  # the printed figures, for a program
    assert [(e["bag"], e["chunks"]) for e in summary["episodes"]] == [
        ("monday", len(first)),
        ("sunday", len(second)),
    ]
    assert summary["episodes"][1]["hit_rate"] > 0 and summary["recorded_bags"] is True
    # Every figure is what the recorded chunks say, printed as in summary.json (found by a mutation review:
    # a hit rate of the dense chunks, a rate over one chunk too many, or medians over every mode passed).
    from collections import Counter
    from statistics import median

    from rmuscle_ros.node.replay_demo import MODE_NAMES

    for e, got in zip(summary["episodes"], (first, second), strict=True):
        modes = Counter(MODE_NAMES[c.cache_mode] for c in got)
        assert e["modes"] == dict(modes) and e["hit_rate"] == modes["cached"] / len(got), e
        assert (
            f"episode {e['episode']} ({e['bag']}): {len(got)} chunks: dense {modes['dense']}, cached "
            f"{modes['cached']}, fallback {modes['fallback']}; hit rate {e['hit_rate']:.2f}" in printed
        )
    seconds = [stamp(c) / 1e9 for c in chunks]
    assert (
        summary["chunks"] == len(chunks) and f"{len(chunks)} chunks at {summary['rate_hz']:.2f} Hz" in printed
    )
    assert summary["rate_hz"] == pytest.approx((len(chunks) - 1) / (seconds[-1] - seconds[0]), rel=1e-6)
    latencies = [(c.inference_latency_s * 1e3, MODE_NAMES[c.cache_mode]) for c in chunks]
    assert summary["latency_p50_ms"] == pytest.approx(median(lat for lat, _ in latencies))
    assert summary["latency_p50_by_mode_ms"] == pytest.approx(
        {m: median(lat for lat, mode in latencies if mode == m) for m in {mode for _, mode in latencies}}
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["monday", "out", "sunday"], "the bags are kept"


def test_replay_demo_plays_a_simulators_bags_on_their_own_clock(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--bags … --recorded-clock`: two episodes a simulator's cell recorded on the wall clock (stamps on
    the simulator's, which ran at 0.8 of real time), the second 100 s of simulated time after the first.
    Each plays on its own /clock, moved to follow the one before on it: the second is served from the
    first one's memory, and every chunk is stamped on the simulator's clock."""
    from rmuscle_ros.demo import main

    sim0, wall0 = 1_700_000_000 * 10**9, 1_796_000_000 * 10**9
    bags = [tmp_path / "sim_a", tmp_path / "sim_b"]
    for k, bag in enumerate(bags):
        _simulator_recorded(bag, 3.0, sim0 + k * 100 * 10**9, wall0 + k * 200 * 10**9)
    out = tmp_path / "out"
    args = ["--bags", *map(str, bags), "--recorded-clock", "--param", "actions_per_inference=50"]
    assert main([*args, "--out", str(out), *DEMO_DOMAIN]) == 0
    printed = capsys.readouterr().out
    chunks = [m for _, m in read_messages(out / "action_chunks", "/rmuscle_node/action_chunk")]
    first = [stamp_ns(c.header) for c in chunks if c.episode_id == 0]
    second = [c for c in chunks if c.episode_id == 1]
    assert first and second, printed
    assert ActionChunk.CACHE_CACHED in {c.cache_mode for c in second}, printed
    assert sim0 <= min(first) and max(first) < min(stamp_ns(c.header) for c in second) < sim0 + 10 * 10**9
    summary = json.loads((out / "summary.json").read_text())
    assert "stale_image" not in summary["drops"] and "future_stamp" not in summary["drops"], summary["drops"]


def test_replay_of_recorded_bags_refuses_what_the_node_could_not_run_naming_it(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rmuscle_ros.demo import main

    bag = tmp_path / "episode"
    write_aloha_episode(bag, seconds=0.5, camera_topics=("/a", "/b", "/c"))
    for args, says in (
        ([str(tmp_path / "missing")], "no such file or folder"),
        ([str(bag)], "nothing would reach the node's topic(s) ['images/base', 'images/left_wrist', "
                     "'images/right_wrist']; the bag has ['/a', '/b', '/c', "),
        ([str(tmp_path)], "cannot be read"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            main(["--bags", *args, "--out", str(tmp_path / "out")])
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err, args
    with pytest.raises(SystemExit):
        main(["--remap", "/a:=images/base", "--out", str(tmp_path / "out")])
    assert "--remap: only with --bags" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a bag without /clock of its own
        main(["--bags", str(bag), "--remap", "/a:=images/base", "--remap", "/b:=images/left_wrist",
              "--remap", "/c:=images/right_wrist", "--recorded-clock", "--out", str(tmp_path / "out")])  # fmt: skip
    assert "episode: recorded no /clock to replay (--recorded-clock)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--recorded-clock", "--out", str(tmp_path / "out")])
    assert "--recorded-clock: only with --bags" in capsys.readouterr().err


def test_the_bag_player_command_refuses_bad_arguments_by_name(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rmuscle_ros.node.bags import main

    for args, says in (
        ([str(tmp_path / "missing")], "no such file or folder"),
        ([str(tmp_path), "--remap", "/a/b"], "expected FROM:=TO"),
        ([str(tmp_path), "--rate", "0"], "--rate must be a finite number > 0"),
        ([str(tmp_path), "--rate", "nan"], "--rate must be a finite number > 0, got nan"),
        (
            [str(tmp_path), "--wait-for-subscribers", "-1"],
            "--wait-for-subscribers must be a finite number ≥ 0",
        ),
        ([str(tmp_path)], f"bag {tmp_path}: cannot be read"),  # a folder that is no bag
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["play", *args])
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err, args
    # A start time that would put /clock before 0 (or past int32 seconds) is refused before anything is
    # published: one negative /clock raised inside every node on the bag's clock (found in review).
    bag = tmp_path / "episode"
    write_aloha_episode(bag, seconds=0.1, cameras=1, joint_topics=())
    for start in ("-5000000000", str(2**31 * 10**9)):
        assert main(["play", str(bag), f"--start-ns={start}", "--wait-for-subscribers=0"]) == 2
        assert "outside ROS time" in capsys.readouterr().err, start


def test_the_bag_player_alone_takes_the_large_frame_profile_and_says_when_it_falls_behind(tmp_path) -> None:
    """`python -m rmuscle_ros.node.bags play` on its own, as on a cell: without a Fast DDS profile its raw
    frames went over fragmented UDP and a subscriber lost 20-50 % of them, and at a rate the host could not
    keep it said only how many it published (found in review). It takes the package's large-frame profile
    when none is set, saying so, and says when it played slower than asked."""
    bag = tmp_path / "episode"
    write_aloha_episode(bag, seconds=1.0, cameras=1, size=(48, 64), joint_topics=())
    env = {k: v for k, v in os.environ.items() if k != "FASTRTPS_DEFAULT_PROFILES_FILE"}
    env["ROS_DOMAIN_ID"] = str(ros_domain(157))
    cmd = [sys.executable, "-m", "rmuscle_ros.node.bags", "play", str(bag), "--rate", "1000",
           "--wait-for-subscribers=0"]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "note: Fast DDS profile" in run.stderr and "fastdds_shm_large_frames.xml" in run.stderr
    assert "slower than --rate 1000" in run.stderr, run.stderr
    assert "published" in run.stdout


def test_a_transition_that_raises_is_logged_and_the_node_released(harness, tmp_path) -> None:
    """rclpy turns an exception in a transition into error processing without a word of it, and its own
    on_error released nothing (found in review: e.g. a GPU fault in cleanup's empty_cache). The exception
    is logged and kept in last_error; error processing stops the worker, records the episode in progress
    and frees the model; the node is unconfigured, and configures again."""
    library = tmp_path / "library"
    h = harness(**{"cache.enabled": True, "model.backend": "fused", "cache.library_path": str(library)})
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.feed_until(lambda: len(h.chunks) >= 3)
    node, stop = h.node, h.node._stop_activity
    failed: list[bool] = []

    def stop_failing_once() -> None:
        if not failed:
            failed.append(True)
            raise RuntimeError("a stand-in fault")
        stop()

    node._stop_activity = stop_failing_once  # type: ignore[method-assign]
    assert not h.transition(Transition.TRANSITION_DEACTIVATE)
    assert h.state() == State.PRIMARY_STATE_UNCONFIGURED
    assert node.last_error == "deactivate: RuntimeError: a stand-in fault"
    for said in ("deactivate: RuntimeError: a stand-in fault", "error processing: stopping the worker"):
        assert h.wait_for(lambda said=said: any(said in log.msg for log in h.logs), timeout=5.0), said
    assert node._worker is None and node.policy is None
    index = json.loads((library / "index.json").read_text())
    assert len(index["episodes"]) == 1 and index["episodes"][0]["calls"] >= 3, index["episodes"]
    assert h.transition(Transition.TRANSITION_CONFIGURE), node.last_error
