"""The README's first command: `rmuscle_node` (tiny model, CPU) fed by a replayed ALOHA-like rosbag.

    python -m rmuscle_ros.demo            # this, via rmuscle_ros/demo.py
    python -m rmuscle_ros.demo --synthetic  # the policy alone on synthetic observations, no ROS

Writes an episode bag (3 cameras at 30 Hz, 480×640; joints at 100 Hz), starts the lifecycle node with
config/rmuscle_default.yaml and use_sim_time, configures and activates it, replays the bag with /clock,
records the node's chunks to a bag, then prints a summary (chunks, rate, latency p50/p99, drops by
reason) and writes a plot of the latency over time and the action trajectories.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import qos_profile_sensor_data

from rmuscle_ros.msg import ActionChunk
from rmuscle_ros.node.bags import (
    ALOHA_CAMERA_TOPICS,
    ALOHA_JOINT_TOPICS,
    BagPlayer,
    read_messages,
    write_aloha_episode,
    write_messages,
)
from rmuscle_ros.node.params import load_params_file, parameter_defaults
from rmuscle_ros.node.rmuscle_node import RMuscleNode

CONFIG = Path(__file__).resolve().parents[2] / "config" / "rmuscle_default.yaml"


def run(out_dir: Path, seconds: float = 6.0, domain_id: int = 77) -> dict[str, Any]:
    """Replay an episode into the node; returns the summary. Files land in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    bag = out_dir / "aloha_episode"
    if bag.exists():
        for f in bag.iterdir():
            f.unlink()
        bag.rmdir()
    written = write_aloha_episode(bag, storage="mcap", seconds=seconds, cameras=3)

    context = rclpy.Context()
    rclpy.init(context=context, domain_id=domain_id)
    params = load_params_file(CONFIG) | {"use_sim_time": True}
    unknown = set(params) - set(parameter_defaults()) - {"use_sim_time"}
    assert not unknown, f"{CONFIG} has parameters the node does not declare: {unknown}"
    node = RMuscleNode(
        context=context, parameter_overrides=[Parameter(k, value=v) for k, v in params.items()]
    )
    peer = rclpy.create_node("demo_player", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    executor.add_node(peer)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    topic = f"/{node.get_name()}/action_chunk"
    received: list[tuple[int, bytes]] = []
    peer.create_subscription(
        ActionChunk, topic, lambda raw: received.append((time.time_ns(), raw)), 10, raw=True
    )
    try:
        start = time.perf_counter()
        node.trigger_configure()
        node.trigger_activate()
        configure_s = time.perf_counter() - start
        remap = dict(zip(ALOHA_CAMERA_TOPICS[:3], node.cfg.camera_topics, strict=True))
        remap |= dict(zip(ALOHA_JOINT_TOPICS, node.cfg.joint_state_topics, strict=True))
        BagPlayer(peer, bag, qos_profile_sensor_data, remap=remap).play()
        time.sleep(1.0)  # the last inference
        stats = node.stats()
        node.trigger_deactivate()
        node.trigger_cleanup()
    finally:
        executor.shutdown()
        node.destroy_node()
        peer.destroy_node()
        rclpy.shutdown(context=context)
        spinner.join(timeout=5.0)

    record = out_dir / "action_chunks"
    if record.exists():
        for f in record.iterdir():
            f.unlink()
        record.rmdir()
    write_messages(record, topic, "rmuscle_ros/msg/ActionChunk", received)
    chunks = [m for _, m in read_messages(record, topic)]
    stamps = np.array([c.header.stamp.sec + c.header.stamp.nanosec * 1e-9 for c in chunks])
    t0 = written[ALOHA_CAMERA_TOPICS[0]][0] * 1e-9
    latencies = [c.inference_latency_s * 1e3 for c in chunks]
    summary = {
        "chunks": len(chunks),
        "rate_hz": (len(chunks) - 1) / (stamps[-1] - stamps[0]) if len(chunks) > 1 else 0.0,
        "latency_p50_ms": statistics.median(latencies) if latencies else 0.0,
        "latency_p99_ms": float(np.percentile(latencies, 99)) if latencies else 0.0,
        "drops": stats["drops"],
        "configure_activate_s": configure_s,
        "bag": str(bag),
        "recorded": str(record),
        "plot": str(out_dir / "demo.png"),
    }
    _plot(out_dir / "demo.png", stamps - t0, latencies, chunks)
    return summary


def _plot(path: Path, t: np.ndarray, latencies: list[float], chunks: list[Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_act) = plt.subplots(2, 1, figsize=(9, 6), constrained_layout=True)
    ax_lat.plot(t, latencies, "o-")
    ax_lat.set_xlabel("bag time of the observation (s)")
    ax_lat.set_ylabel("inference latency (ms)")
    ax_lat.set_title("rmuscle_node on a replayed episode (tiny model with random weights, CPU)")
    for c, start in zip(chunks, t, strict=True):
        actions = np.asarray(c.actions, dtype=np.float32).reshape(c.horizon, c.action_dim)
        steps = start + np.arange(c.horizon) * c.control_period_s
        for j in range(c.action_dim):
            ax_act.plot(steps, actions[:, j], color=plt.cm.tab20(j), lw=0.8)
    ax_act.set_xlabel("time (s)")
    ax_act.set_ylabel("action (robot units)")
    ax_act.set_title("action chunks, one line per joint (random weights: no task structure)")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(summary: dict[str, Any]) -> None:
    drops = ", ".join(f"{k} {v}" for k, v in sorted(summary["drops"].items())) or "none"
    print(f"[demo] configure + activate {summary['configure_activate_s']:.2f} s")
    print(f"[demo] {summary['chunks']} chunks at {summary['rate_hz']:.2f} Hz (bag time)")
    print(
        f"[demo] inference latency p50 {summary['latency_p50_ms']:.1f} ms, p99 {summary['latency_p99_ms']:.1f} ms"
    )
    print(f"[demo] drops by reason: {drops}")
    print(
        f"[demo] episode bag {summary['bag']}, recorded chunks {summary['recorded']}, plot {summary['plot']}"
    )
