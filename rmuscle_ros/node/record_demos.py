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
Beside the bag, `episode.json` holds the task, seed and gym-aloha's reward (best and final) and
`success`: the cube held off the table at the episode's end (stricter than gym-aloha's success, which
the sim node reports: the top reward at any step, so a brief touch during the hand-over counts).

An episode is recorded under `episode_<k>.partial/` and moved to `episode_<k>` once complete (bag closed,
episode.json written): an `episode_<k>` folder is always a whole episode. An episode that fails (Ctrl-C,
a full disk, the physics diverging) is removed and named, and the command exits non-zero; run the same
command again and it keeps the complete episodes (checking their episode.json against its settings) and
records the rest. Nothing recorded is ever overwritten. Each episode's files reach the disk (fsync)
before it is renamed into place, and two runs into one `--out` at once are refused (the second exits 75).

The bags replay into rmuscle_node with `python -m rmuscle_ros.demo --bags ...` (JPEG frames: with
`--param compressed_images=true` and each camera's `/compressed` topic remapped onto the node's). The
simulation runs as fast as it can; the stamps are the simulation's time on one clock across the
episodes (episode k starts 1 s after episode k − 1 ends). No ROS process is needed: the bags are written with the `rosbags` package.
"""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import os
import shutil
import signal
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
from rmuscle_ros.sim.aloha import (
    CONTROL_PERIOD_S,
    JOINT_STATE_NAMES,
    SIDES,
    AlohaSim,
    CommandError,
    FrameSchedule,
    SimConfig,
    SimulationDiverged,
)
from rmuscle_ros.sim.scripted import EPISODE_STEPS, TransferCubeDemonstrator

START_NS = 1_700_000_000 * 10**9
# The Interbotix command messages' fields (as test/interfaces/interbotix_xs_msgs defines them).
INTERBOTIX_TYPES = {
    "interbotix_xs_msgs/msg/JointGroupCommand": "string name\nfloat32[] cmd\n",
    "interbotix_xs_msgs/msg/JointSingleCommand": "string name\nfloat32 cmd\n",
}
IMAGE_FORMATS = ("jpeg", "raw")
JPEG_QUALITY = 90
TASK = "transfer_cube"
MAX_SEED = 2**32 - 1  # gym-aloha's placements draw from numpy's legacy seeding


def check_settings(camera_rate_hz: float, image_format: str) -> None:
    """ValueError naming the setting if the recording cannot be made with these."""
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"image format: one of {list(IMAGE_FORMATS)}, got {image_format!r}")
    max_rate = 1.0 / CONTROL_PERIOD_S
    if not 0 < camera_rate_hz <= max_rate:
        raise ValueError(
            f"camera rate: in (0, {max_rate:g}] Hz (one frame per control period at most), got {camera_rate_hz:g}"
        )


def partial_path(path: Path) -> Path:
    """Where the episode bound for `path` is recorded until it is complete (the bag is its `path.name`
    subfolder, so that the bag's own file names are the episode's)."""
    return path.with_name(f"{path.name}.partial")


def record_episode(
    path: Path,
    seed: int,
    camera_rate_hz: float = 30.0,
    image_format: str = "jpeg",
    start_ns: int = START_NS,
) -> dict[str, Any]:
    """Run one scripted transfer-cube demonstration from `seed` and write it to the bag folder `path`
    (which must not exist). Returns the episode's result (also written to `path`/episode.json).

    `path` appears only once the episode is complete: it is recorded under `partial_path(path)` (one
    left by an earlier run that was killed outright is removed first) and renamed at the end. Whatever
    ends it early (an exception, Ctrl-C) removes the partial folder before it propagates; if the folder
    cannot be removed, the exception's notes say where it is."""
    check_settings(camera_rate_hz, image_format)
    if path.exists() or path.is_symlink():
        raise ValueError(f"{path}: exists; a recording never overwrites one")
    partial = partial_path(path)
    if partial.exists() or partial.is_symlink():
        _remove(partial)
    bag = partial / path.name
    try:
        result = _record(bag, seed, camera_rate_hz, image_format, start_ns)
        (bag / "episode.json").write_text(json.dumps(result, indent=1))
        if path.exists() or path.is_symlink():  # made meanwhile: a rename would replace an empty folder
            raise ValueError(f"{path}: exists; a recording never overwrites one")
        _sync_tree(bag)  # the files' contents on disk before the rename names them complete
        bag.rename(path)  # one filesystem: atomic
        partial.rmdir()
        _sync(path.parent)  # the rename itself
    except BaseException as e:
        try:
            if partial.exists() or partial.is_symlink():  # not yet made when the sim failed to load
                _remove(partial)
        except OSError as removal:
            e.add_note(
                f"the unfinished recording is left in {partial} (it could not be removed: {removal}); "
                "the same command removes it, or remove it by hand"
            )
        raise
    return result


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file():
            _sync(file)
    _sync(folder)


def lock_out(out: Path) -> int:
    """Hold an exclusive lock on the folder `out` for this process's life (an `flock` on the folder
    itself: nothing is left in it); returns the descriptor. BlockingIOError if another run holds it:
    two runs would remove each other's partial episodes and rename half-written bags into place."""
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _record(path: Path, seed: int, camera_rate_hz: float, image_format: str, start_ns: int) -> dict[str, Any]:
    """The episode as a bag in `path` (made here; its parent may not exist yet); returns its result."""
    store = typestore()
    for name, definition in INTERBOTIX_TYPES.items():
        store.register(get_types_from_msg(definition, name))
    types = store.types
    image_type = "sensor_msgs/msg/Image" if image_format == "raw" else "sensor_msgs/msg/CompressedImage"
    sim = AlohaSim(SimConfig(task=TASK))
    try:
        sim.reset(seed)
        demo = TransferCubeDemonstrator(sim)
        period_ns = round(sim.period_s * 1e9)
        frames = FrameSchedule(sim.period_s, camera_rate_hz)  # the steps the sim node publishes frames at
        closed, opened = sim.config.gripper_joint_range
        counts: dict[str, int] = {}
        with Writer(path, version=9, storage_plugin=STORAGE["mcap"]) as writer:
            connections: dict[str, Any] = {}

            def write(topic: str, msgtype: str, msg: Any, t: int) -> None:
                if topic not in connections:
                    connections[topic] = writer.add_connection(topic, msgtype, typestore=store)
                writer.write(connections[topic], t, store.serialize_cdr(msg, msgtype))
                counts[topic] = counts.get(topic, 0) + 1

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
                if frames.due(step + 1):
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


def episode_start_ns(k: int) -> int:
    """Episode k's first stamp: one clock across the episodes, 1 s between them."""
    return START_NS + k * (EPISODE_STEPS + 50) * 20_000_000


def recorded_episode(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The result of the complete episode in `path`, if its episode.json records `settings` (SETTINGS'
    values, as this command would record them); a ValueError saying why it is not that episode otherwise."""
    advice = "a recording never overwrites one: move it away or record into another --out"
    try:
        result = json.loads((path / "episode.json").read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path}: exists without an episode.json, not a complete recording; {advice}"
        ) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: its episode.json cannot be read ({e}); {advice}") from None
    if not isinstance(result, dict):
        raise ValueError(f"{path}: its episode.json holds no episode's result; {advice}")
    other = [
        f"{name} {result.get(name)!r}, not {value!r}"
        for name, value in settings.items()
        if result.get(name) != value
    ]
    if other:
        raise ValueError(f"{path}: recorded with other settings ({'; '.join(other)}); {advice}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 when every episode is recorded (now or by an earlier run of the same command), 1
    when one failed (named on stderr; the complete ones are kept), 2 for bad arguments or an `--out`
    holding other recordings, 75 while another run records into the same `--out`, 130 on Ctrl-C."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the episodes (episode_<k> bags)")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="episode k places the cube from seed + k")
    p.add_argument("--camera-rate", type=float, default=30.0, help="frames per second of simulated time")
    p.add_argument("--image-format", choices=IMAGE_FORMATS, default="jpeg")
    args = p.parse_args(argv)
    if args.episodes < 1 or args.seed < 0:
        p.error("--episodes must be >= 1 and --seed >= 0")
    if args.seed + args.episodes - 1 > MAX_SEED:
        p.error(f"--seed + --episodes - 1 must be <= {MAX_SEED} (the simulation's seeds are 32-bit)")
    try:
        check_settings(args.camera_rate, args.image_format)
    except ValueError as e:
        p.error(str(e))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        lock = lock_out(args.out)
    except BlockingIOError:
        print(
            f"[record] {args.out}: another run is recording into it; try again once it has finished",
            file=sys.stderr,
        )
        return 75
    except OSError as e:
        print(f"[record] {args.out}: cannot record into it: {e}", file=sys.stderr)
        return 1
    # SIGTERM (`timeout`, systemd, a CI runner) ends the run as Ctrl-C does: the episode being recorded is
    # removed and named (found in review: it died with 143, silent, its partial folder of up to ~300 MB
    # left until the next run). Only where nothing else handles SIGTERM in this process.
    ours = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    previous = signal.signal(signal.SIGTERM, _terminated) if ours else None
    try:
        return _record_all(args)
    finally:
        if ours:
            signal.signal(signal.SIGTERM, previous)
        os.close(lock)


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _record_all(args: argparse.Namespace) -> int:
    # Every episode is checked before any is recorded: an --out holding other recordings is refused whole.
    earlier: dict[int, dict[str, Any]] = {}
    for k in range(args.episodes):
        path = args.out / f"episode_{k}"
        if path.exists() or path.is_symlink():
            settings = {
                "task": TASK, "seed": args.seed + k, "image_format": args.image_format,
                "camera_rate_hz": args.camera_rate, "start_ns": episode_start_ns(k),
            }  # fmt: skip
            try:
                earlier[k] = recorded_episode(path, settings)
            except ValueError as e:
                print(f"[record] {e}", file=sys.stderr)
                return 2
    successes = sum(bool(r.get("success")) for r in earlier.values())
    complete = len(earlier)
    for k in range(args.episodes):
        path, seed = args.out / f"episode_{k}", args.seed + k
        if k in earlier:
            print(f"[record] {path}: recorded earlier (seed {seed}, success {earlier[k]['success']}), kept")
            continue
        if partial_path(path).exists():
            print(f"[record] {partial_path(path)}: an unfinished recording of an earlier run, removed")
        # Said whichever way the episode fails: what is kept, and how to go on.
        kept = f"{complete} complete episode(s) kept in {args.out}; the same command records the rest"
        try:
            result = record_episode(path, seed, args.camera_rate, args.image_format, episode_start_ns(k))
        except KeyboardInterrupt as e:
            print(f"[record] {path} (seed {seed}): interrupted{_notes(e)}; {kept}", file=sys.stderr)
            return 130
        except (OSError, SimulationDiverged, CommandError) as e:
            print(
                f"[record] {path} (seed {seed}) failed: {type(e).__name__}: {e}{_notes(e)}; {kept}",
                file=sys.stderr,
            )
            return 1
        except Exception as e:  # a bug: its traceback, naming the episode
            e.add_note(f"[record] while recording {path} (seed {seed}); {kept}")
            raise
        complete += 1
        successes += result["success"]
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        print(
            f"[record] {path}: seed {result['seed']}, reward {result['final_reward']}/{result['max_reward']} "
            f"(best {result['best_reward']}), success {result['success']}, {size / 2**20:.1f} MiB"
        )
    print(f"[record] {successes} of {args.episodes} demonstrations succeeded")
    return 0


def _notes(e: BaseException) -> str:
    return "".join(f"; {note}" for note in getattr(e, "__notes__", []))


if __name__ == "__main__":
    sys.exit(main())
