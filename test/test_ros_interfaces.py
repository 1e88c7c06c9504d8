"""The package's ROS interfaces (msg/): fields, constants, and a real publish/subscribe round trip.

Needs the venv that `make venv` builds (ROS 2 Jazzy wheels + msg/ generated into it); skips where rclpy
is not installed. `make test` runs these on ROS_DOMAIN_ID 42 with localhost-only discovery.
"""

from __future__ import annotations

import array
import os
import time

import numpy as np
import pytest

rclpy = pytest.importorskip(
    "rclpy", reason="rclpy is not installed: run `make venv` to add the ROS 2 Jazzy wheels to the venv"
)

from rclpy.context import Context  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402

from rmuscle_ros.msg import ActionChunk, CacheStatus  # noqa: E402

# lark-parser 0.12 (pulled in by the rosidl wheels) imports the deprecated sre_* modules; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:module 'sre_:DeprecationWarning")

ROUND_TRIP_TIMEOUT_S = 10.0

ACTION_CHUNK_FIELDS = {
    "header": "std_msgs/Header",
    "episode_id": "uint64",
    "chunk_id": "uint64",
    "joint_names": "sequence<string>",
    "horizon": "uint32",
    "action_dim": "uint32",
    "control_period_s": "float",
    "actions": "sequence<float>",
    "inference_latency_s": "float",
    "cache_mode": "uint8",
    "cache_similarity": "float",
}
CACHE_STATUS_FIELDS = {
    "header": "std_msgs/Header",
    "episode_id": "uint64",
    "mode": "uint8",
    "similarity": "float",
    "reason": "string",
    "hit_rate": "float",
    "library_episodes": "uint32",
    "window_entries": "uint32",
    "library_bytes": "uint64",
    "library_path": "string",
    "task": "string",
    "task_episodes": "uint32",
    "audits": "uint32",
    "audits_missed": "uint32",
    "audit_error_last": "float",
    "audit_error_median": "float",
    "audit_error_max": "float",
    "audit_trips": "uint32",
}


@pytest.fixture
def ros_context():
    """A private rclpy context, shut down after the test so no ROS state leaks into other tests."""
    context = Context()
    rclpy.init(args=[], context=context)
    try:
        yield context
    finally:
        rclpy.shutdown(context=context)


@pytest.fixture
def executor(ros_context):
    """A SingleThreadedExecutor on the test's context; destroys the nodes added to it afterwards."""
    ex = SingleThreadedExecutor(context=ros_context)
    try:
        yield ex
    finally:
        for node in ex.get_nodes():
            ex.remove_node(node)
            node.destroy_node()
        ex.shutdown()


def _round_trip(executor: SingleThreadedExecutor, msg_type: type, msg: object) -> object:
    """Publishes `msg` from one node and returns what a second node in this process receives."""
    context = executor.context
    # The pid keeps concurrent test runs on one host (same domain) from hearing each other.
    topic = f"/rmuscle_ros_test_{os.getpid()}/{msg_type.__name__.lower()}"
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    publisher_node = rclpy.create_node("interfaces_test_publisher", context=context)
    subscriber_node = rclpy.create_node("interfaces_test_subscriber", context=context)
    executor.add_node(publisher_node)
    executor.add_node(subscriber_node)
    received = []
    subscriber_node.create_subscription(msg_type, topic, received.append, qos)
    publisher = publisher_node.create_publisher(msg_type, topic, qos)

    deadline = time.monotonic() + ROUND_TRIP_TIMEOUT_S
    while publisher.get_subscription_count() == 0:
        assert time.monotonic() < deadline, f"the subscriber on {topic} was not discovered"
        executor.spin_once(timeout_sec=0.05)
    publisher.publish(msg)
    while not received:
        assert time.monotonic() < deadline, f"nothing received on {topic}"
        executor.spin_once(timeout_sec=0.05)
    assert len(received) == 1
    return received[0]


def test_action_chunk_fields_and_constants():
    assert ActionChunk.get_fields_and_field_types() == ACTION_CHUNK_FIELDS
    assert (ActionChunk.CACHE_DENSE, ActionChunk.CACHE_CACHED, ActionChunk.CACHE_FALLBACK) == (0, 1, 2)


def test_cache_status_fields_and_constants():
    assert CacheStatus.get_fields_and_field_types() == CACHE_STATUS_FIELDS
    assert (CacheStatus.CACHE_DENSE, CacheStatus.CACHE_CACHED, CacheStatus.CACHE_FALLBACK) == (0, 1, 2)


def test_action_chunk_round_trips_between_nodes(executor):
    horizon, action_dim = 5, 3
    # Exact in float32, so the comparison below can be exact.
    actions = (np.arange(horizon * action_dim, dtype=np.float32) * 0.25 - 1.0).reshape(horizon, action_dim)
    msg = ActionChunk()
    msg.header.stamp.sec, msg.header.stamp.nanosec = 1_700_000_000, 123_456_789
    msg.header.frame_id = "base_link"
    msg.episode_id = 2**40 + 7
    msg.chunk_id = 12
    msg.joint_names = ["waist", "shoulder", "gripper"]
    msg.horizon, msg.action_dim = horizon, action_dim
    msg.control_period_s = 0.5
    # bytes → array('f') is the cheap way in from numpy (a list of floats is validated element by element).
    msg.actions = array.array("f", actions.tobytes())
    msg.inference_latency_s = 0.125
    msg.cache_mode = ActionChunk.CACHE_CACHED
    msg.cache_similarity = 0.875

    got = _round_trip(executor, ActionChunk, msg)

    assert (got.header.stamp.sec, got.header.stamp.nanosec) == (1_700_000_000, 123_456_789)
    assert got.header.frame_id == "base_link"
    assert (got.episode_id, got.chunk_id) == (2**40 + 7, 12)
    assert list(got.joint_names) == ["waist", "shoulder", "gripper"]
    assert (got.horizon, got.action_dim) == (horizon, action_dim)
    got_actions = np.frombuffer(got.actions, dtype=np.float32).reshape(got.horizon, got.action_dim)
    np.testing.assert_array_equal(got_actions, actions)
    assert (got.control_period_s, got.inference_latency_s) == (0.5, 0.125)
    assert got.cache_mode == ActionChunk.CACHE_CACHED
    assert got.cache_similarity == 0.875
    assert got == msg


def test_cache_status_round_trips_between_nodes(executor):
    msg = CacheStatus()
    msg.header.stamp.sec = 42
    msg.episode_id = 3
    msg.mode = CacheStatus.CACHE_FALLBACK
    msg.similarity, msg.hit_rate = 0.75, 0.5
    msg.reason = "similarity 0.75 below 0.8"
    msg.library_episodes, msg.window_entries = 17, 20
    msg.library_bytes = 5 * 2**32  # beyond uint32
    msg.library_path = "/var/lib/rmuscle/library"
    msg.task, msg.task_episodes = "fold the towel", 4
    msg.audits, msg.audits_missed, msg.audit_trips = 12, 1, 2
    msg.audit_error_last, msg.audit_error_median, msg.audit_error_max = 0.25, 0.125, 0.5

    got = _round_trip(executor, CacheStatus, msg)

    assert got == msg
    assert (got.audits, got.audit_error_max, got.audit_trips) == (12, 0.5, 2)
    assert got.mode == CacheStatus.CACHE_FALLBACK
    assert got.library_bytes == 5 * 2**32
