"""Record scripted demonstrations on the simulated ALOHA as rosbag2 episodes, in a real cell's layout.

    python -m rmuscle_ros.node.record_demos --out demos --episodes 10 [--seed 0] [--camera-rate 30]
                                            [--image-format jpeg|raw]

Each episode is one bag folder (`episode_<k>`, MCAP) holding what an ALOHA cell's recording holds, on
its topics and in its units:
- the three cameras, `/cam_high`, `/cam_left_wrist`, `/cam_right_wrist` `/camera/color/image_rect_raw`
  (`sensor_msgs/Image` rgb8, or `.../compressed` `sensor_msgs/CompressedImage` JPEG, as image_transport
  publishes it; raw frames are 0.9 MB each), at `--camera-rate` Hz;
- both followers' `joint_states` every control period (50 Hz), with the Interbotix names;
- the actions: each arm's `commands/joint_group` (`interbotix_xs_msgs/JointGroupCommand`, six joints) and
  `commands/joint_single` (`JointSingleCommand`, the gripper joint) every period, from the scripted
  demonstrator (rmuscle_ros/sim/scripted.py), in command units.
Beside the bag, `episode.json` holds the task, seed and gym-aloha's reward (best and final, success).

The bags replay into rmuscle_node with `python -m rmuscle_ros.demo --bags ...` (JPEG frames: with
`--param compressed_images=true` and each camera's `/compressed` topic remapped onto the node's). The
simulation runs as fast as it can; the stamps are the simulation's time from `--start-ns`. No ROS
process is needed: the bags are written with the `rosbags` package.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image as PILImage
from rosbags.rosbag2 import Writer
from rosbags.typesys import get_types_from_msg

from rmuscle_ros.node.bags import (
    ALOHA_ARM_COMMAND_TOPIC,
    ALOHA_CAMERA_TOPICS,
    ALOHA_GRIPPER_COMMAND_TOPIC,
    ALOHA_JOINT_STATE_TOPIC,
    STORAGE,
    typestore,
)
from rmuscle_ros.sim.aloha import JOINT_STATE_NAMES, SIDES, AlohaSim, SimConfig
from rmuscle_ros.sim.scripted import EPISODE_STEPS, TransferCubeDemonstrator

START_NS = 1_700_000_000 * 10**9
# The Interbotix command messages' fields (as test/interfaces/interbotix_xs_msgs defines them).
INTERBOTIX_TYPES = {
    "interbotix_xs_msgs/msg/JointGroupCommand": "string name\nfloat32[] cmd\n",
    "interbotix_xs_msgs/msg/JointSingleCommand": "string name\nfloat32 cmd\n",
}
IMAGE_FORMATS = ("jpeg", "raw")
JPEG_QUALITY = 90


def record_episode(
    path: Path,
    seed: int,
    camera_rate_hz: float = 30.0,
    image_format: str = "jpeg",
    start_ns: int = START_NS,
) -> dict[str, Any]:
    """Run one scripted transfer-cube demonstration from `seed` and write it to the bag folder `path`
    (which must not exist). Returns the episode's result (also written to `path`/episode.json)."""
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"image format: one of {list(IMAGE_FORMATS)}, got {image_format!r}")
    if not 0 < camera_rate_hz <= 50:
        raise ValueError(
            f"camera rate: in (0, 50] Hz (one frame per control period at most), got {camera_rate_hz:g}"
        )
    if path.exists():
        raise ValueError(f"{path}: exists; a recording never overwrites one")
    store = typestore()
    for name, definition in INTERBOTIX_TYPES.items():
        store.register(get_types_from_msg(definition, name))
    types = store.types
    image_type = "sensor_msgs/msg/Image" if image_format == "raw" else "sensor_msgs/msg/CompressedImage"
    sim = AlohaSim(SimConfig(task="transfer_cube"))
    try:
        sim.reset(seed)
        demo = TransferCubeDemonstrator(sim)
        period_ns = round(sim.period_s * 1e9)
        frame_ns = round(1e9 / camera_rate_hz)
        closed, opened = sim.config.gripper_joint_range
        counts: dict[str, int] = {}
        with Writer(path, version=9, storage_plugin=STORAGE["mcap"]) as writer:
            connections: dict[str, Any] = {}

            def write(topic: str, msgtype: str, msg: Any, t: int) -> None:
                if topic not in connections:
                    connections[topic] = writer.add_connection(topic, msgtype, typestore=store)
                writer.write(connections[topic], t, store.serialize_cdr(msg, msgtype))
                counts[topic] = counts.get(topic, 0) + 1

            next_frame = start_ns
            for step in range(EPISODE_STEPS):
                t = start_ns + step * period_ns
                header = _header(types, t)
                for side in SIDES:  # the observation at t
                    position, velocity = sim.joint_state(side)
                    msg = types["sensor_msgs/msg/JointState"](
                        header=header, name=list(JOINT_STATE_NAMES), position=_f64(position),
                        velocity=_f64(velocity), effort=_f64([]),
                    )  # fmt: skip
                    write(ALOHA_JOINT_STATE_TOPIC.format(side=side), "sensor_msgs/msg/JointState", msg, t)
                if t >= next_frame:
                    next_frame += frame_ns
                    for camera, topic in zip(sim.config.cameras, ALOHA_CAMERA_TOPICS, strict=False):
                        frame = sim.render(camera)
                        if image_format == "raw":
                            topic_out, msg = topic, _raw(types, header, camera, frame)
                        else:
                            topic_out, msg = f"{topic}/compressed", _jpeg(types, header, camera, frame)
                        write(topic_out, image_type, msg, t)
                targets = demo.act(step)  # the actions decided at t, as the arms receive them
                for side in SIDES:
                    arm, opening = targets[side][:6], float(targets[side][6])
                    group = types["interbotix_xs_msgs/msg/JointGroupCommand"](name="arm", cmd=_f32(arm))
                    write(
                        ALOHA_ARM_COMMAND_TOPIC.format(side=side),
                        "interbotix_xs_msgs/msg/JointGroupCommand",
                        group,
                        t,
                    )
                    single = types["interbotix_xs_msgs/msg/JointSingleCommand"](
                        name="gripper", cmd=closed + opening * (opened - closed)
                    )
                    write(
                        ALOHA_GRIPPER_COMMAND_TOPIC.format(side=side),
                        "interbotix_xs_msgs/msg/JointSingleCommand",
                        single,
                        t,
                    )
                sim.step()
        result = {
            "task": sim.config.task,
            "seed": seed,
            "seconds": round(sim.time_s, 3),
            "best_reward": sim.best_reward,
            "final_reward": sim.reward,
            "max_reward": sim.max_reward,
            "success": sim.reward >= sim.max_reward,  # the cube held off the table at the end
            "image_format": image_format,
            "camera_rate_hz": camera_rate_hz,
            "messages": counts,
            "start_ns": start_ns,
        }
        (path / "episode.json").write_text(json.dumps(result, indent=1))
        return result
    finally:
        sim.close()


def _header(types: Any, t: int) -> Any:
    stamp = types["builtin_interfaces/msg/Time"](sec=t // 10**9, nanosec=t % 10**9)
    return types["std_msgs/msg/Header"](stamp=stamp, frame_id="")


def _f64(values: Any) -> Any:
    return np.asarray(values, dtype=np.float64)


def _f32(values: Any) -> Any:
    return np.asarray(values, dtype=np.float32)


def _raw(types: Any, header: Any, camera: str, frame: Any) -> Any:
    h, w, _ = frame.shape
    header = types["std_msgs/msg/Header"](stamp=header.stamp, frame_id=camera)
    return types["sensor_msgs/msg/Image"](
        header=header, height=h, width=w, encoding="rgb8", is_bigendian=0, step=w * 3, data=frame.reshape(-1)
    )


def _jpeg(types: Any, header: Any, camera: str, frame: Any) -> Any:
    buffer = io.BytesIO()
    PILImage.fromarray(frame).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    header = types["std_msgs/msg/Header"](stamp=header.stamp, frame_id=camera)
    return types["sensor_msgs/msg/CompressedImage"](
        header=header,
        format="rgb8; jpeg compressed bgr8",
        data=np.frombuffer(buffer.getvalue(), dtype=np.uint8),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the episodes (episode_<k> bags)")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="episode k places the cube from seed + k")
    p.add_argument("--camera-rate", type=float, default=30.0, help="frames per second of simulated time")
    p.add_argument("--image-format", choices=IMAGE_FORMATS, default="jpeg")
    args = p.parse_args(argv)
    if args.episodes < 1 or args.seed < 0:
        p.error("--episodes must be >= 1 and --seed >= 0")
    args.out.mkdir(parents=True, exist_ok=True)
    successes = 0
    for k in range(args.episodes):
        path = args.out / f"episode_{k}"
        try:
            result = record_episode(
                path, args.seed + k, args.camera_rate, args.image_format,
                start_ns=START_NS + k * (EPISODE_STEPS + 50) * 20_000_000,  # one clock: 1 s between episodes
            )  # fmt: skip
        except ValueError as e:
            p.error(str(e))
        successes += result["success"]
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        print(
            f"[record] {path}: seed {result['seed']}, reward {result['final_reward']}/{result['max_reward']} "
            f"(best {result['best_reward']}), success {result['success']}, {size / 2**20:.1f} MiB"
        )
    print(f"[record] {successes} of {args.episodes} demonstrations succeeded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
