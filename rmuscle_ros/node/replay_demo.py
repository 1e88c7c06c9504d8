"""The README's first command: `rmuscle_node` (tiny model, CPU) fed by a replayed ALOHA-like rosbag, twice.

    python -m rmuscle_ros.demo            # this, via rmuscle_ros/demo.py
    python -m rmuscle_ros.demo --synthetic  # the policy alone on synthetic observations, no ROS

Writes an episode bag (3 cameras at 30 Hz, 480×640; joints at 100 Hz), starts the lifecycle node with
config/rmuscle_default.yaml (fused backend, rMuscle cache on, library in a temporary folder) and
use_sim_time, configures and activates it, and replays the bag with /clock: a dense warm-up episode.
Then it resets the episode through `~/reset_episode` (the node records the dense episode into its
library) and replays the same task again, from a second bag that continues the clock where the first
ended: the repeat is served from the cache. `episodes` > 2 replays more repeats the same way, each
bag written just before it plays (a shift of one repeated task; bags between the first and the last
are deleted once played, ~80 MB per second of episode). The node's chunks are recorded to a bag; the
summary gives chunks, rate, latency p50/p99/max and the slowest calls, drops by reason, chunks by
cache mode, hit rate and p50 per episode, and the last `~/cache_status`; the plot shows latency over
time coloured by cache mode and the action trajectories. `action_streamer` runs beside the node (where the
Interbotix command messages are importable: the dev venv has a stand-in) and turns the chunks into the
arms' commands at 50 Hz on the bag's clock; the summary counts what each arm received.

With `bags`, the same run replays recorded episodes instead (one bag per episode, in order; e.g. a
cell's own recordings): each is checked first (readable, and every camera and joint topic the node
subscribes to present after `remap`), and each after the first is moved in time to start `BAG_GAP_NS`
after the one before ends (the player shifts /clock and the header stamps alike), so episodes recorded on
other days replay as one shift on one clock.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import rclpy
import yaml
from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState
from rclpy.exceptions import InvalidParameterTypeException
from rclpy.executors import SingleThreadedExecutor
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter
from std_srvs.srv import Trigger

from rmuscle_ros.msg import ActionChunk, CacheStatus
from rmuscle_ros.node.action_streamer import import_command_messages
from rmuscle_ros.node.bags import (
    ALOHA_ARM_COMMAND_TOPIC,
    ALOHA_CAMERA_TOPICS,
    ALOHA_GRIPPER_COMMAND_TOPIC,
    ALOHA_JOINT_TOPICS,
    ALOHA_ROBOT_INFO_SERVICE,
    FASTDDS_LARGE_FRAMES,
    BagInfo,
    absolute_topic,
    bag_info,
    read_messages,
    recorded_clock,
    write_aloha_episode,
    write_messages,
)
from rmuscle_ros.node.params import (
    MAX_SECONDS,
    REMOVED_PARAMETERS,
    ParameterError,
    check_type,
    load_params_file,
    node_config,
    parameter_defaults,
)
from rmuscle_ros.node.rmuscle_node import RMuscleNode, describe_call
from rmuscle_ros.node.spin import BackgroundSpin, parameter_type_hint
from rmuscle_ros.paths import package_file

# The profiles the demo runs with (config/: paths.package_file); its Fast DDS profile: bags.FASTDDS_LARGE_FRAMES.
CONFIG, ALOHA_CONFIG = "rmuscle_default.yaml", "rmuscle_aloha.yaml"
# The streamer and the sim publish /diagnostics every second of wall clock; their last counts are read
# from one published after the demo's last chunk (waited for up to DIAGNOSTICS_WAIT_S).
DIAGNOSTICS_WAIT_S = 3.0


def _wait_for_later_diagnostics(received: Callable[[], int]) -> None:
    """Wait for the second /diagnostics from now (`received`: how many have come): the first may have been
    published before now and still be on its way, the second was not (a fixed 1.1 s wait assumed
    delivery within 0.1 s, which a loaded machine need not keep). Past DIAGNOSTICS_WAIT_S the last one
    received stands."""
    wanted, deadline = received() + 2, time.monotonic() + DIAGNOSTICS_WAIT_S
    while received() < wanted and time.monotonic() < deadline:
        time.sleep(0.02)


def config_file(name: str) -> Path:
    return package_file("config", name)


# The node's start-up wait for a replayed episode's first messages (sensor_startup_timeout_s, 5 s in the
# demo's profile): each bag plays from a process of its own, started after the episode's reset, which took
# 3.8 s to deliver its first frames on the 2-core development machine, and once more than 5 s (the replay test
# then saw a missing_camera drop). A cell's cameras are already up at a reset; a replay's are not.
REPLAY_STARTUP_S = 20.0
START_NS = 1_700_000_000 * 10**9  # bag time of the first episode
# Between two recorded episodes on the replay's clock. The clock stands still between two plays (the
# player publishes it), so this only puts the next bag's first message after the last one: 10 ms, one
# joint-state period at ALOHA's 100 Hz. Longer gaps are time the node ticks with silent sensors, and
# cost a stale drop per reset (1 s: a stale image; 0.1 s: stale joints).
BAG_GAP_NS = 10_000_000
MODE_NAMES = {
    ActionChunk.CACHE_DENSE: "dense",
    ActionChunk.CACHE_CACHED: "cached",
    ActionChunk.CACHE_FALLBACK: "fallback",
}
MODE_COLOURS = {"dense": "tab:blue", "cached": "tab:green", "fallback": "tab:red"}


CHUNKS_BAG = "action_chunks"  # the run's recorded chunks, in out_dir
CHUNKS_PARTIAL = f"{CHUNKS_BAG}.partial"  # where they are written first (`_save_chunks`)


def _clear_previous_run(out_dir: Path, bags_too: bool) -> None:
    """Remove what an earlier run left in `out_dir`: its summary and plot, and with `bags_too` (a run that
    writes its own episodes) the episode bags such a run wrote, `aloha_episode_<k>`. Found in review: a run
    that failed left the earlier run's summary and plot beside its own first bag, and a run of fewer
    episodes left the earlier run's later bags (~160 MB a second of episode). A run on recorded bags or the
    simulator removes no bag: a user's recording may bear that name (a review found
    `--bags out/aloha_episode_5/…mcap` deleted). Links are left alone. The earlier run's chunks stay until
    this run's replace them (`_save_chunks`)."""
    for name in ("summary.json", "demo.png"):
        path = out_dir / name
        if path.is_file() and not path.is_symlink():
            path.unlink()
    if bags_too:
        for path in out_dir.glob("aloha_episode_*"):
            if path.name[len("aloha_episode_") :].isdigit() and _demo_bag(path):
                shutil.rmtree(path)


def _demo_bag(path: Path) -> bool:
    """A bag folder as the demo writes them: a folder, not a link, with its metadata.yaml."""
    return path.is_dir() and not path.is_symlink() and (path / "metadata.yaml").exists()


def _check_writable_bags(paths: Iterable[Path]) -> None:
    """ValueError, before anything runs, for a path the demo would write a bag at that holds something else:
    a link, a file, or a folder without metadata.yaml (an unclosed recording of the user's?). Found in
    review: the run deleted such folders, and a link made it fail after the whole run, its chunks lost."""
    for path in paths:
        if (path.exists() or path.is_symlink()) and not _demo_bag(path):
            raise ValueError(
                f"{path}: the demo writes a bag there, but it holds something else (a link, a file, or a folder "
                "without metadata.yaml: an unclosed recording?); it is left as it is: move it, or give another --out"
            )


def _fresh(path: Path) -> Path:
    if _demo_bag(path):  # `_check_writable_bags` refused anything else before the run
        shutil.rmtree(path)
    return path


def _save_chunks(out_dir: Path, topic: str, received: list[tuple[int, bytes]]) -> Path:
    """Write the run's chunks (whatever came, an interrupted run's too) as `action_chunks`, replacing an
    earlier run's only once written whole (found in review: they were written after the run, so an
    interrupt lost them all, and the earlier run's had been deleted at the start)."""
    record, partial = out_dir / CHUNKS_BAG, out_dir / CHUNKS_PARTIAL
    if partial.is_dir() and not partial.is_symlink():
        shutil.rmtree(partial)
    # Staged under the record's own name, as record_demos does: rosbags names the bag's file after its
    # folder, and a bag written as `action_chunks.partial` kept `action_chunks.partial.mcap` once moved
    # into place (found on the GPU run of 2026-12-05: a finished recording that read as unfinished).
    partial.mkdir()
    staged = partial / CHUNKS_BAG
    write_messages(staged, topic, "rmuscle_ros/msg/ActionChunk", received)
    _fresh(record)
    staged.rename(record)
    partial.rmdir()
    return record


def run(
    out_dir: Path,
    seconds: float = 6.0,
    domain_id: int = 77,
    overrides: Mapping[str, Any] | None = None,
    episodes: int = 2,
    bags: Sequence[Path] | None = None,
    remap: Mapping[str, str] | None = None,
    stream: bool = True,
    sim: bool = False,
    sim_params: Mapping[str, Any] | None = None,
    discard_failed: bool = False,
    streamer_overrides: Mapping[str, Any] | None = None,
    announce: Callable[[], None] | None = None,
    bags_clock: bool = False,
) -> dict[str, Any]:
    """Replay a warm-up episode, then `episodes` - 1 repeats, with a reset before each; returns the
    summary. Files land in `out_dir`. `overrides`: node parameters (dotted names, e.g. "cache.rho_p")
    over config/rmuscle_default.yaml. `bags`: recorded episodes to replay instead of written ones (then
    `seconds` and `episodes` are theirs); `remap`: bag topic -> the node's topic, over the ALOHA defaults
    (/cam_high/... onto the node's first camera topic, and so on). `stream`: run action_streamer beside
    the node. `sim`: instead of bags, a simulated ALOHA (aloha_sim) in closed loop: the streamer's
    commands move its arms, and each episode is `seconds` of its clock on the same scene; `sim_params`:
    aloha_sim parameters over the demo's (e.g. a trained policy's cameras and placement_spread);
    `discard_failed`: each simulated episode that did not succeed is kept out of the cache's library
    (`discard_episode`), as a cell with a success detector does (bench/sim_success.py's node stage).
    `streamer_overrides`: action_streamer parameters over the demo's (e.g. `takeover_delay_s`).
    `bags_clock`: play each bag on its own recorded /clock (`bags.BagPlayer.play`'s `recorded_clock`: a
    simulator's bags recorded without --use-sim-time), one after another on it as on the log times.
    `announce`: called once every argument has been checked, before anything is written or started (the
    command's banner: before, `--episodes 0` printed "then -1 repeat(s)" above its refusal)."""
    if not 0 <= domain_id <= 232:  # Fast DDS derives ports from it; above 232 they overflow
        raise ValueError(f"domain id: 0 to 232, got {domain_id}")
    params = load_params_file(config_file(CONFIG))
    # A replayed bag has no arm driver to ask what its arms are (the simulated cell answers as one).
    streamer_params: dict[str, Any] = {} if sim else {"robot_info_services": []}
    if sim:  # the simulated arms speak a real ALOHA's gripper units: the node and streamer convert as on one
        node_aloha = load_params_file(config_file(ALOHA_CONFIG))
        params |= {k: node_aloha[k] for k in ("gripper_state_joint", "gripper_state_range")}
        streamer_aloha = load_params_file(config_file(ALOHA_CONFIG), "action_streamer")
        streamer_params["gripper_command_range"] = streamer_aloha["gripper_command_range"]
    streamer_params |= dict(streamer_overrides or {})
    if not sim:  # under the demo's own overrides: a user's value still wins
        params["sensor_startup_timeout_s"] = max(params["sensor_startup_timeout_s"], REPLAY_STARTUP_S)
    params |= dict(overrides or {}) | {"use_sim_time": True}
    unknown = set(params) - set(parameter_defaults()) - {"use_sim_time"} - set(REMOVED_PARAMETERS)
    if unknown:
        raise ValueError(f"not parameters of rmuscle_node: {sorted(unknown)}")
    try:  # the values as configure checks them: refused before the streamer's process starts (3 s sooner)
        cfg = node_config({k: v for k, v in params.items() if k != "use_sim_time"})
    except ParameterError as e:
        raise ValueError(f"invalid parameter {e}") from None
    topics = parameter_defaults() | params
    # camera k of the recording onto the node's slot k; a slot left empty ("") takes none
    camera_remap = {a: t for a, t in zip(ALOHA_CAMERA_TOPICS[:3], topics["camera_topics"], strict=False) if t}
    aloha = camera_remap | dict(zip(ALOHA_JOINT_TOPICS, topics["joint_state_topics"], strict=False))
    remap = merge_remaps(aloha, remap or {})
    recorded = bags is not None
    if sim and (recorded or not stream):
        raise ValueError(
            "sim: the simulated cell needs action_streamer to move its arms, and replays no bags"
        )
    if recorded:
        if not bags:
            raise ValueError("bags: at least one episode to replay")
        bags, episodes = [Path(b) for b in bags], len(bags)
        infos = [_check_bag(b, remap, topics) for b in bags]
        # How long each plays, for the player's time limit: the log times' span (a slow simulator's bag
        # plays longer than its clock's).
        lengths = [info.seconds for info in infos]
        if bags_clock:  # the stamps are on each bag's /clock: the bags follow each other on it
            for k, bag in enumerate(bags):
                clock = recorded_clock(bag)
                if clock is None:
                    raise ValueError(f"bag {bag}: recorded no /clock to replay (--recorded-clock)")
                infos[k] = dataclasses.replace(infos[k], start_ns=clock.first_ns, end_ns=clock.max_ns)
    elif bags_clock:
        raise ValueError("--recorded-clock: only with --bags")
    if episodes < 1:
        raise ValueError(f"episodes: at least 1 (the warm-up), got {episodes}")
    if not recorded and not 0 < seconds <= MAX_SECONDS:  # inf, nan: a clear error, not an overflow
        raise ValueError(
            f"seconds: an episode must last more than 0 s and at most {MAX_SECONDS:g}, got {seconds:g}"
        )
    # Before any process starts: a bad one is refused by name, and nothing is left running. Each episode
    # is judged at `seconds` of the sim's clock (episode_s): the last one's reset comes later than the
    # others', after the streamer's report (it read 7.0 s against 6.0 in the demo).
    sim_settings = _SimCell.settings({"episode_s": seconds} | dict(sim_params or {})) if sim else {}
    if sim:  # its cameras go out in order on the node's camera topics (found in review: `cameras=[top]`
        # against the profile's three ran with no chunk and, in a short episode, no drop to say why)
        from rmuscle_ros.node.aloha_sim import sim_node_config

        sim_cfg = sim_node_config(sim_settings)
        cameras, given, wanted = sim_cfg.cameras, cfg.camera_topics, cfg.camera_inputs
        if given[: len(wanted)] != wanted:  # a topic after an empty entry: not the first slots
            raise ValueError(
                f"--sim: the simulated cell fills the node's first camera slots in order; camera_topics "
                f"{list(given)} leaves one empty before another (replay a bag for that, or name a topic "
                "for each slot up to the last)"
            )
        if len(cameras) != len(wanted):
            raise ValueError(
                f"--sim-param cameras: {list(cameras)} for the node's {len(wanted)} camera_topics "
                f"{list(wanted)}; give the node one topic per camera, in the same order (--param "
                "camera_topics=[...], and a model of as many cameras)"
            )
        # The gripper's units, three ways: the node reads the sim's finger as gripper_state_range, the
        # streamer commands its gripper joint in gripper_command_range. One changed alone (found in review:
        # gripper_joint_range [0, 1] left the gripper never closing) is refused.
        for (sim_name, sim_value), (name, value, where) in (
            (
                ("finger_range", sim_cfg.finger_range),
                ("gripper_state_range", cfg.gripper_state_range, "the node's: --param"),
            ),
            (
                ("gripper_joint_range", sim_cfg.gripper_joint_range),
                (
                    "gripper_command_range",
                    streamer_params["gripper_command_range"],
                    "the streamer's: run()'s",
                ),
            ),
        ):
            if not np.allclose(sim_value, value, rtol=0, atol=1e-6):
                raise ValueError(
                    f"--sim: the sim's {sim_name} {list(sim_value)} and {name} {list(value)} differ: the gripper "
                    f"would be read or commanded in other units; set them alike ({where} {name})"
                )
    if announce is not None:
        announce()
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_previous_run(out_dir, bags_too=not recorded and not sim)
    own_bags = [] if recorded or sim else [out_dir / f"aloha_episode_{k}" for k in range(episodes)]
    _check_writable_bags([out_dir / CHUNKS_BAG, *own_bags])
    partial = out_dir / CHUNKS_PARTIAL  # the demo's own, even half-written (a killed run): replaced
    if partial.is_symlink() or partial.is_file():
        raise ValueError(
            f"{partial}: the demo writes its chunks there first, but it is a link or a file; move it"
        )
    if recorded:  # each bag after the first starts BAG_GAP_NS after the one before it ends, on one clock
        starts = [infos[0].start_ns]
        for info in infos[:-1]:
            starts.append(starts[-1] + info.end_ns - info.start_ns + BAG_GAP_NS)
    else:
        # A repeat is the same task (the same frames and joint motion) one episode later: its bag starts
        # where the one before ends, so the node's clock runs on as on a cell and no frame goes stale.
        bags = [out_dir / f"aloha_episode_{k}" for k in range(episodes)]
        starts = [START_NS + k * round(seconds * 1e9) for k in range(episodes)]
        lengths = [seconds] * episodes

    def write(k: int) -> None:
        if not recorded and not sim:
            write_aloha_episode(
                _fresh(bags[k]), storage="mcap", seconds=seconds, cameras=3, start_ns=starts[k]
            )

    write(0)

    context = rclpy.Context()
    rclpy.init(context=context, domain_id=domain_id)
    try:
        node = RMuscleNode(
            context=context, parameter_overrides=[Parameter(k, value=v) for k, v in params.items()]
        )
    except InvalidParameterTypeException as e:  # e.g. 3 for a float parameter: say which, and how
        rclpy.shutdown(context=context)
        raise ValueError(f"{e} ({parameter_type_hint(e)})") from None
    peer = rclpy.create_node("demo_player", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    executor.add_node(peer)
    spinning = BackgroundSpin(executor)
    topic = f"/{node.get_name()}/action_chunk"
    received: list[tuple[int, bytes]] = []
    peer.create_subscription(
        ActionChunk, topic, lambda raw: received.append((time.time_ns(), raw)), 10, raw=True
    )
    statuses: list[CacheStatus] = []
    peer.create_subscription(CacheStatus, f"/{node.get_name()}/cache_status", statuses.append, 10)
    reset = peer.create_client(Trigger, f"/{node.get_name()}/reset_episode")
    streaming = _Streaming(peer, topic, domain_id, topics, out_dir, stream, streamer_params)
    cell: _SimCell | None = None
    failed: BaseException | None = None  # what ended the run early, if anything: its chunks are saved too
    try:  # from the streamer's start on, whatever fails stops the processes started so far
        if sim:
            cell = _SimCell(peer, domain_id, remap, out_dir, sim_settings)
        # First: its process takes seconds to come up on a loaded CPU, and the node's sensor start-up
        # window (sensor_startup_timeout_s) opens at its activation.
        streaming.start()
        if cell is not None:
            if streaming.process is None:
                raise RuntimeError(
                    f"the simulated cell needs action_streamer, which did not start: {streaming.skipped}"
                )
            cell.wait_running()
        start = time.perf_counter()
        node.trigger_configure()
        if node.cfg is None:
            raise ValueError(f"the node refused its parameters: {node.last_error}")
        if (
            node.trigger_activate() != TransitionCallbackReturn.SUCCESS
        ):  # before, the bag played on regardless
            raise ValueError(f"the node did not activate: {node.last_error or 'see its log'}")
        configure_s = time.perf_counter() - start
        resets = []
        for k in range(episodes):
            if cell is not None:
                # What a cell does between episodes: the streamer stops (the arms hold), the scene is reset and
                # the arms are back at their start, the node starts its next episode, the streamer starts
                # again. Left running, it would go on with the ended episode's last chunk for up to a
                # chunk's length, dragging the arms from their start back toward where they were.
                streaming.pause()
                starts[k] = cell.reset()
                if k > 0:
                    if discard_failed and not cell.results[-1]["success"]:
                        _discard(node)
                    resets.append(_reset(reset))
                streaming.resume()
                cell.run_for(seconds)  # on the sim's clock
                continue
            if k > 0:
                # The bag first (seconds on a loaded CPU): the reset clears the node's buffered messages, and
                # its start-up wait for the new episode's first ones lasts sensor_startup_timeout_s.
                write(k)
                resets.append(_reset(reset))
            # Every node on the bag's clock hears it from the first message: the node, and the streamer.
            clocks = 1 + (streaming.process is not None)
            _play(bags[k], remap, domain_id, lengths[k], starts[k] if recorded else None, clocks, bags_clock)
            time.sleep(1.0)  # the last inference
            if not recorded and 0 < k < episodes - 1:
                shutil.rmtree(bags[k])  # the same frames as the first and the last, at other times
        stats = node.stats()
        # Before the cell's and streamer's reports: a simulated cell's clock runs on, and the node would go on
        # publishing chunks past the last episode.
        node.trigger_deactivate()
        streamed = streaming.stop()
        simulated = cell.stop() if cell is not None else None  # after the streamer's last command
        if simulated is not None and discard_failed and not simulated["episodes"][-1]["success"]:
            _discard(node)  # before cleanup records the last episode
        node.trigger_cleanup()
    except BaseException as e:
        failed = e
        raise
    finally:
        streaming.close()
        if cell is not None:
            cell.close()
        spinning.stop()
        node.destroy_node()
        peer.destroy_node()
        rclpy.shutdown(context=context)
        if failed is not None and received:  # the subscription has stopped: `received` holds still
            try:
                failed.add_note(
                    f"the {len(received)} chunk(s) received are in {_save_chunks(out_dir, topic, received)}"
                )
            except Exception as e:  # never in place of what ended the run
                failed.add_note(f"the {len(received)} chunk(s) received could not be saved: {e}")

    record = _save_chunks(out_dir, topic, received)
    chunks = [m for _, m in read_messages(record, topic)]
    stamps = np.array([c.header.stamp.sec + c.header.stamp.nanosec * 1e-9 for c in chunks])
    t0 = starts[0] * 1e-9
    latencies = [c.inference_latency_s * 1e3 for c in chunks]
    modes = [MODE_NAMES[c.cache_mode] for c in chunks]
    per_episode = []
    for episode in sorted({c.episode_id for c in chunks}):
        counts = Counter(m for c, m in zip(chunks, modes, strict=True) if c.episode_id == episode)
        n = sum(counts.values())
        p50 = statistics.median(
            lat for c, lat in zip(chunks, latencies, strict=True) if c.episode_id == episode
        )
        per_episode.append(
            {"episode": episode, "chunks": n, "modes": dict(counts), "hit_rate": counts["cached"] / n,
             "latency_p50_ms": p50, "bag": bags[episode].name if recorded and episode < len(bags) else None}
        )  # fmt: skip
    by_mode = {
        mode: statistics.median(lat for lat, m in zip(latencies, modes, strict=True) if m == mode)
        for mode in sorted(set(modes))
    }
    last = statuses[-1] if statuses else None
    summary = {
        "chunks": len(chunks),
        # The repeat's bag continues the first one's clock, so this is one rate over both episodes.
        "rate_hz": (len(chunks) - 1) / (stamps[-1] - stamps[0]) if len(chunks) > 1 else 0.0,
        "latency_p50_ms": statistics.median(latencies) if latencies else 0.0,
        "latency_p99_ms": float(np.percentile(latencies, 99)) if latencies else 0.0,
        "latency_max_ms": max(latencies, default=0.0),
        "slowest": stats["slowest_calls"],  # the node's, with where each call's time went
        # from a tick to its call reading the observation (the node's latest 200): motion-window work in flight
        "tick_wait_p50_ms": stats["tick_wait_p50_ms"],
        "tick_wait_max_ms": stats["tick_wait_max_ms"],
        "latency_p50_by_mode_ms": by_mode,
        "drops": stats["drops"],
        "errors": stats["errors"],
        "gc_pause_max_ms": stats["gc_pause_max_ms"],
        "gc_full_collections": stats["gc_full_collections"],
        # The node's motion-window work since activation: entries rebuilt, entries still wanted when a
        # window ended, and jobs (rebuild parts, audits) still running when an observation fell due.
        "motion_window": None
        if stats["cache"] is None
        else {k: stats["cache"][k] for k in ("rebuilds", "rebuilds_deferred", "window_overruns")},
        "episodes": per_episode,
        "resets": resets,
        "cache_status": None
        if last is None
        else {
            "bag_time_s": last.header.stamp.sec + last.header.stamp.nanosec * 1e-9 - t0,
            "episode_id": last.episode_id,
            "mode": MODE_NAMES[last.mode],
            "reason": last.reason,  # why its chunk was not served cached ("" when it was)
            "hit_rate": last.hit_rate,
            "library_episodes": last.library_episodes,
            "window_entries": last.window_entries,
            "library_bytes": last.library_bytes,
            "task": last.task,
            "task_episodes": last.task_episodes,
            "audits": last.audits,
            "audits_missed": last.audits_missed,
            # None before the first audit (the message carries NaN, which JSON has no word for)
            "audit_error_median": last.audit_error_median if last.audits else None,
            "audit_error_max": last.audit_error_max if last.audits else None,
            "audit_trips": last.audit_trips,
        },
        "configure_activate_s": configure_s,
        "streaming": streamed,
        "sim": simulated,
        "bag": "" if sim else ", ".join(str(b) for b in bags if b.exists()),
        "recorded_bags": recorded,
        # Each episode's start on the node's clock (ns): where the chunks' stamps (the recording) begin an episode.
        "episode_starts_ns": [int(t) for t in starts],
        "recorded": str(record),
        "plot": str(out_dir / "demo.png"),
        "summary": str(out_dir / "summary.json"),
    }
    p = parameter_defaults() | params
    weights = Path(p["model.checkpoint"]).name if p["model.checkpoint"] else "random weights"
    what = f"{p['model.preset']} model, {weights}, {p['model.backend']} on {p['model.device']}"
    resets_at = [(start - starts[0]) / 1e9 for start in starts[1:]]
    # The same figures for a program: e.g. hit rates compared across a cell's recordings or between runs.
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    repeats = "its repeat" if episodes == 2 else f"{episodes - 1} repeat(s)"
    title = f"{episodes} recorded episode(s)" if recorded else f"a replayed episode and {repeats}"
    if sim:
        title = f"a simulated ALOHA in closed loop, an episode and {repeats}"
    clock = "the simulation's time" if sim else "bag time"  # the stamps' clock (review: 'bag time' for --sim)
    _plot(out_dir / "demo.png", stamps - t0, latencies, modes, chunks, resets_at, f"{title} ({what})", clock)
    return summary


class _Streaming:
    """action_streamer beside the demo's node, in a process of its own as the launch file starts it on a cell
    (in this process its 50 Hz timer would compete with the node's worker for the interpreter lock), on the
    bag's clock. The demo's peer node drives its lifecycle and counts the arms' commands it sends. Skipped,
    saying why, where the Interbotix command messages are missing."""

    NAME = "action_streamer"

    def __init__(
        self,
        peer: Any,
        chunk_topic: str,
        domain_id: int,
        node_params: Mapping[str, Any],
        out_dir: Path,
        enabled: bool = True,
        extra_params: Mapping[str, Any] | None = None,
    ) -> None:
        self.skipped = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.received: dict[str, list[int]] = {"left": [], "right": []}  # wall-clock receipt, ns
        self.grippers = {"left": 0, "right": 0}
        self.diagnostics: dict[str, str] = {}  # its last /diagnostics values
        self.message = ""  # and its message (the last refusal's reason, if any)
        self.diagnostics_received = 0
        if not enabled:
            self.skipped = "--no-stream"
            return
        try:
            group, single = import_command_messages()
        except ImportError as e:
            self.skipped = str(e)
            return
        for side, times in self.received.items():
            peer.create_subscription(
                group,
                f"commands/{side}/joint_group",
                lambda _m, times=times: times.append(time.time_ns()),
                100,
            )
            peer.create_subscription(
                single, f"commands/{side}/joint_single", lambda _m, side=side: self._gripper(side), 100
            )
        peer.create_subscription(DiagnosticArray, "/diagnostics", self._diagnostics, 10)
        self._change = peer.create_client(ChangeState, f"/{self.NAME}/change_state")
        # The node's joints, topics and period, so that its chunks are the streamer's to execute.
        params = {
            "use_sim_time": True,
            "joint_names": list(node_params["action_joint_names"]),
            "joint_state_topics": list(node_params["joint_state_topics"]),
            "joint_name_prefixes": list(node_params["joint_name_prefixes"]),
            "gripper_joint": node_params["gripper_joint"],
            "control_period_s": float(node_params["control_period_s"]),
        } | dict(extra_params or {})
        params_file = out_dir / "action_streamer_params.yaml"
        params_file.write_text(yaml.safe_dump({self.NAME: {"ros__parameters": params}}))
        self.log = out_dir / "action_streamer.log"
        command = [sys.executable, "-m", "rmuscle_ros.node.action_streamer", "--ros-args"]
        command += ["-r", f"__node:={self.NAME}", "-r", f"action_chunk:={chunk_topic}"]
        command += ["--params-file", str(params_file)]
        env = os.environ | {"ROS_DOMAIN_ID": str(domain_id)}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def _gripper(self, side: str) -> None:
        self.grippers[side] += 1

    def _diagnostics(self, array: Any) -> None:
        for status in array.status:
            if status.name.startswith(f"{self.NAME}:"):
                self.diagnostics = {kv.key: kv.value for kv in status.values}
                self.message = status.message
                self.diagnostics_received += 1

    def _transition(self, transition: int) -> None:
        request = ChangeState.Request()
        request.transition.id = transition
        if not call_service(self._change, request).success:
            raise RuntimeError(f"{self.NAME} refused lifecycle transition {transition}")

    def start(self) -> None:
        if self.process is None:
            return
        try:
            self._transition(Transition.TRANSITION_CONFIGURE)
            self._transition(Transition.TRANSITION_ACTIVATE)
        except (RuntimeError, TimeoutError) as e:  # the demo goes on without it, saying why
            self.close()
            self.process = None
            self.skipped = f"{e} (its log: {self.log})"

    def pause(self) -> None:
        """Deactivate: it stops sending at once and forgets its chunks."""
        if self.process is not None:
            self._transition(Transition.TRANSITION_DEACTIVATE)

    def resume(self) -> None:
        """Activate again: it takes chunks planned from then on (one planned before is refused)."""
        if self.process is not None:
            self._transition(Transition.TRANSITION_ACTIVATE)

    def stop(self) -> dict[str, Any]:
        if self.process is None:
            return {"skipped": self.skipped}
        _wait_for_later_diagnostics(lambda: self.diagnostics_received)  # with the last chunk's commands
        self._transition(Transition.TRANSITION_DEACTIVATE)
        intervals = [np.diff(t) / 1e6 for t in self.received.values() if len(t) > 1]
        d = self.diagnostics
        return {
            "skipped": "",
            "arm_commands": {side: len(t) for side, t in self.received.items()},
            "gripper_commands": dict(self.grippers),
            # The median gap between an arm's consecutive commands: the streaming rate while a chunk was due
            # (the gaps between episodes, when none is, do not move it).
            "interval_p50_ms": float(np.median(np.concatenate(intervals))) if intervals else 0.0,
            "streamer": {k: int(v) for k, v in d.items() if v.isdigit()},
            "streamer_message": self.message,
            # what its check of the arms' drivers (get_robot_info) said last: "checked", "not asked", a problem
            "drivers": d.get("drivers", ""),
        }

    def close(self) -> None:
        stop_processes(self.process)


class _SimCell:
    """The simulated ALOHA (`aloha_sim`) in a process of its own, as its drivers are on a cell, its topics
    remapped onto the node's and the streamer's. The demo's peer node watches its /clock and /diagnostics
    and resets it: every episode starts from the arms' start pose on the same scene (seed_step 0), a task
    repeated as on a cell. It renders its three cameras at CAMERA_RATE_HZ of its clock: ~60 ms of CPU per
    frame on 2 cores, beside the policy."""

    NAME = "aloha_sim"
    CAMERA_RATE_HZ = 10.0

    @classmethod
    def settings(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """The sim's parameters: the demo's, then `params` over them, checked as the sim node checks them
        (ParameterError, a ValueError, naming a bad one)."""
        from rmuscle_ros.node.aloha_sim import sim_defaults, sim_node_config

        settings = {"camera_rate_hz": cls.CAMERA_RATE_HZ, "seed_step": 0} | dict(params)
        sim_node_config(settings)
        # As the sim declares them (check_type: floats where it declares floats): `-p episode_s:=6` is an
        # INTEGER to rclpy, and the sim refused it at start-up (found in review: run(seconds=6, sim=True))
        defaults = sim_defaults()
        declared = {k: check_type(k, v, defaults[k]) for k, v in settings.items()}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in declared.items()}

    def __init__(
        self, peer: Any, domain_id: int, remap: Mapping[str, str], out_dir: Path, settings: Mapping[str, Any]
    ) -> None:
        """`settings`: from `settings()`."""
        from rosgraph_msgs.msg import Clock

        self.clock_ns = 0
        self.diagnostics: dict[str, str] = {}
        self.diagnostics_received = 0
        self.results: list[dict[str, Any]] = []  # one per demo episode
        peer.create_subscription(Clock, "/clock", self._clock, 10)
        peer.create_subscription(DiagnosticArray, "/diagnostics", self._diagnostics, 10)
        self._reset = peer.create_client(Trigger, f"/{self.NAME}/reset")
        # Its ALOHA topics onto the node's (as the bags' are) and onto the streamer's command topics.
        remaps = {t: remap[t] for t in ALOHA_CAMERA_TOPICS if t in remap}
        remaps |= {t: remap[t] for t in ALOHA_JOINT_TOPICS if t in remap}
        for side in ("left", "right"):
            remaps[ALOHA_ARM_COMMAND_TOPIC.format(side=side)] = f"commands/{side}/joint_group"
            remaps[ALOHA_GRIPPER_COMMAND_TOPIC.format(side=side)] = f"commands/{side}/joint_single"
            remaps[ALOHA_ROBOT_INFO_SERVICE.format(side=side)] = f"get_robot_info/{side}"
        command = [sys.executable, "-m", "rmuscle_ros.node.aloha_sim", "--ros-args"]
        for name, value in settings.items():
            command += ["-p", f"{name}:={json.dumps(value)}"]
        for frm, to in remaps.items():
            command += ["-r", f"{frm}:={to}"]
        env = os.environ | {"ROS_DOMAIN_ID": str(domain_id)}
        env.setdefault(
            "FASTRTPS_DEFAULT_PROFILES_FILE", str(config_file(FASTDDS_LARGE_FRAMES))
        )  # its 0.9 MB frames
        self.log = out_dir / "aloha_sim.log"
        with self.log.open("wb") as log:
            self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def _clock(self, msg: Any) -> None:
        self.clock_ns = msg.clock.sec * 10**9 + msg.clock.nanosec

    def _diagnostics(self, array: Any) -> None:
        for status in array.status:
            if status.name.startswith(f"{self.NAME}:"):
                self.diagnostics = {kv.key: kv.value for kv in status.values}
                self.diagnostics_received += 1

    def _wait(self, condition: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.NAME} exited ({self.process.returncode}): {self.log.read_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.NAME}: {what} within {timeout_s:g} s (its log: {self.log})")
            time.sleep(0.02)

    def wait_running(self) -> None:
        self._wait(lambda: self.clock_ns > 0, 60.0, "no /clock")

    def reset(self) -> int:
        """Start the next episode; returns the clock (ns) at its start. The ended one's result is kept, but
        for the first reset's: that ends the time the cell waited for the nodes."""
        response = call_service(self._reset, Trigger.Request())
        if not response.success:
            raise RuntimeError(f"{self.NAME} did not reset: {response.message}")
        ended = json.loads(response.message)
        if self.results or ended["episode"] > 0:
            self.results.append(ended | {"episode": len(self.results)})
        after = self.clock_ns
        self._wait(lambda: self.clock_ns > after, 10.0, "no /clock after the reset")
        return self.clock_ns

    def run_for(self, seconds: float) -> None:
        """Wait until `seconds` of the sim's clock have passed (it may run slower than the wall clock)."""
        end = self.clock_ns + round(seconds * 1e9)
        self._wait(
            lambda: self.clock_ns >= end, 60.0 + 20.0 * seconds, f"{seconds:g} s of its clock did not pass"
        )

    def stop(self) -> dict[str, Any]:
        """The episodes' results (the last one's through one more reset) and the cell's counters."""
        self.reset()
        _wait_for_later_diagnostics(lambda: self.diagnostics_received)
        d = self.diagnostics
        return {
            "episodes": self.results,
            "real_time_factor": float(d.get("real_time_factor", 0.0)),
            "arm_commands": int(d.get("arm_commands", 0)),
            "gripper_commands": int(d.get("gripper_commands", 0)),
            "refused": int(d.get("refused", 0)),
        }

    def close(self) -> None:
        stop_processes(self.process)
        self.process = None


def merge_remaps(defaults: Mapping[str, str], user: Mapping[str, str]) -> dict[str, str]:
    """The ALOHA topics' remaps onto the node's, with the user's --remap over them: a user's remap onto a
    node topic replaces the default one onto it (found in review: both cameras then fed one slot). A
    relative FROM is the root namespace's topic, as the bag names it."""
    claimed = {absolute_topic(to) for to in user.values()}
    kept = {frm: to for frm, to in defaults.items() if absolute_topic(to) not in claimed}
    return kept | {absolute_topic(frm): to for frm, to in user.items()}


IMAGE, COMPRESSED, JOINTS = (
    "sensor_msgs/msg/Image",
    "sensor_msgs/msg/CompressedImage",
    "sensor_msgs/msg/JointState",
)


def _check_bag(bag: Path, remap: Mapping[str, str], params: Mapping[str, Any]) -> BagInfo:
    """A recorded episode the node can run on: readable, and every camera and joint-state topic the node
    subscribes to published by exactly one of its topics once remapped, of the type the node takes there.
    ValueError naming the bag and what is wrong. (Found in review: a bag of compressed frames, or two
    topics onto one camera, played into a node that dropped every observation, without a word.)"""
    if not bag.exists():
        raise ValueError(f"bag {bag}: no such file or folder")
    info = bag_info(bag)
    image = COMPRESSED if params["compressed_images"] else IMAGE
    wanted = {absolute_topic(t): image for t in params["camera_topics"] if t}
    wanted |= {absolute_topic(t): JOINTS for t in params["joint_state_topics"]}
    sources: dict[str, list[tuple[str, str]]] = {}
    for topic, (msgtype, count) in sorted(info.topics.items()):
        if count:  # a topic registered but never published (a camera that died before the recording)
            sources.setdefault(absolute_topic(remap.get(topic, topic)), []).append((topic, msgtype))
    missing = [
        t
        for t in [*params["camera_topics"], *params["joint_state_topics"]]
        if t and absolute_topic(t) not in sources
    ]
    if missing:
        raise ValueError(
            f"bag {bag}: nothing would reach the node's topic(s) {missing}; the bag has "
            f"{sorted(info.topics)}: map one onto each with --remap FROM:=TO"
        )
    for node_topic, msgtype in wanted.items():
        found = sources[node_topic]
        if len(found) > 1:
            raise ValueError(
                f"bag {bag}: {[t for t, _ in found]} would all reach the node's {node_topic}; remap all but one "
                "elsewhere"
            )
        topic, recorded = found[0]
        if recorded != msgtype:
            hint = ""
            if {recorded, msgtype} == {IMAGE, COMPRESSED}:
                hint = f" (compressed_images: {str(recorded == COMPRESSED).lower()})"
            raise ValueError(
                f"bag {bag}: {topic} holds {recorded}; the node's {node_topic} takes {msgtype}{hint}"
            )
    return info


def _play(
    bag: Path,
    remap: Mapping[str, str],
    domain_id: int,
    seconds: float,
    start_ns: int | None = None,
    clock_subscribers: int = 1,
    bags_clock: bool = False,
) -> None:
    """Replay `bag` from a process of its own (`python -m rmuscle_ros.node.bags play`), as `ros2 bag play`
    runs on a cell: in this process its reading and publishing (~80 MB/s of frames) would compete with the
    node's worker for the interpreter lock. (With it here, the GPU soak's p50 was 2-3 ms higher; README,
    "A shift on the GPU".)"""
    command = [sys.executable, "-m", "rmuscle_ros.node.bags", "play", str(bag)]
    command += [f"--remap={frm}:={to}" for frm, to in remap.items()]
    command += [] if start_ns is None else [f"--start-ns={start_ns}"]
    command += [f"--clock-subscribers={clock_subscribers}"] + (["--recorded-clock"] if bags_clock else [])
    env = os.environ | {"ROS_DOMAIN_ID": str(domain_id)}
    # The player publishes 0.9 MB frames: shared-memory segments that hold them (unless the caller chose a
    # Fast DDS profile), as a camera driver on the node's host should (config/fastdds_shm_large_frames.xml).
    env.setdefault("FASTRTPS_DEFAULT_PROFILES_FILE", str(config_file(FASTDDS_LARGE_FRAMES)))
    # The episode's length, the player's wait for subscribers (10 s) and its start-up: a player that
    # hangs stops the demo with this error instead of holding it.
    limit_s = seconds * (2 if bags_clock else 1) + 60.0  # with its /clock, one more pass before it plays
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=limit_s)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"the bag player did not finish {bag} within {limit_s:g} s") from e
    if done.returncode != 0:
        raise RuntimeError(f"the bag player failed on {bag} (exit {done.returncode}): {done.stderr[-2000:]}")
    for (
        line
    ) in done.stderr.splitlines():  # what it warns of (no subscriber matched): not lost (found in review)
        if line.startswith(("no subscriber matched", "note:")):  # note: a /clock of its own (bags.main)
            print(f"[demo] the bag player on {bag.name}: {line}", file=sys.stderr)


def stop_processes(*processes: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    """SIGTERM to each (a ROS executable shuts down cleanly on it), then SIGKILL to any that has not
    exited within `timeout_s`. None entries (processes never started) are passed over."""
    running = [p for p in processes if p is not None]
    for process in running:
        process.terminate()
    for process in running:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _discard(node: Any) -> None:
    """The node's discard_episode, or RuntimeError with its reason if it refused (a call held the policy
    past stall_after_s): the failed attempt would otherwise be recorded into the library."""
    done, note = node.discard_episode()
    if not done:
        raise RuntimeError(f"the node refused to discard the episode: {note}")


def _reset(client: Any) -> str:
    """`~/reset_episode`, or RuntimeError with the node's reason if it refused (a call held the policy past
    stall_after_s): the next bag would otherwise play into the episode before it."""
    response = call_service(client, Trigger.Request())
    if not response.success:
        raise RuntimeError(f"the node refused the episode reset: {response.message}")
    return response.message


def call_service(client: Any, request: Any, timeout_s: float = 30.0) -> Any:
    """A service call answered on an executor spinning in another thread (this thread only waits)."""
    if not client.wait_for_service(timeout_sec=10.0):
        raise TimeoutError(f"service {client.srv_name} is not available")
    future = client.call_async(request)
    deadline = time.monotonic() + timeout_s
    while not future.done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"service {client.srv_name} did not answer within {timeout_s:g} s")
        time.sleep(0.01)
    return future.result()


def _plot(
    path: Path,
    t: np.ndarray,
    latencies: list[float],
    modes: list[str],
    chunks: list[Any],
    resets_at: list[float],
    what: str,
    clock: str = "bag time",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_act) = plt.subplots(2, 1, figsize=(9, 6), constrained_layout=True)
    ax_lat.plot(t, latencies, "-", color="0.75", zorder=1)
    for mode, colour in MODE_COLOURS.items():
        picked = [i for i, m in enumerate(modes) if m == mode]
        if picked:
            ax_lat.scatter(t[picked], np.asarray(latencies)[picked], color=colour, label=mode, zorder=2)
    for at in resets_at:
        ax_lat.axvline(at, color="k", ls="--", lw=0.8)
    if resets_at:
        ax_lat.text(resets_at[0], ax_lat.get_ylim()[1], " reset: the next episode", va="top", fontsize=8)
    ax_lat.legend(title="cache mode", loc="best", fontsize=8)
    ax_lat.set_xlabel(f"{clock} of the observation (s)")
    ax_lat.set_ylabel("inference latency (ms)")
    ax_lat.set_title(f"rmuscle_node on {what}".replace(" (", "\n(", 1), fontsize=10)  # 2 lines: fits
    for c, start in zip(chunks, t, strict=True):
        actions = np.asarray(c.actions, dtype=np.float32).reshape(c.horizon, c.action_dim)
        steps = start + np.arange(c.horizon) * c.control_period_s
        for j in range(c.action_dim):
            ax_act.plot(steps, actions[:, j], color=plt.cm.tab20(j), lw=0.8)
    ax_act.set_xlabel("time (s)")
    ax_act.set_ylabel("action (robot units)")
    structure = " (random weights: no task structure)" if "random weights" in what else ""
    ax_act.set_title(f"action chunks, one line per joint{structure}")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(summary: dict[str, Any]) -> None:
    drops = ", ".join(f"{k} {v}" for k, v in sorted(summary["drops"].items())) or "none"
    print(f"[demo] configure + activate {summary['configure_activate_s']:.2f} s")
    clock = "sim" if summary.get("sim") else "bag"
    print(f"[demo] {summary['chunks']} chunks at {summary['rate_hz']:.2f} Hz ({clock} time)")
    print(
        f"[demo] inference latency p50 {summary['latency_p50_ms']:.1f} ms, p99 {summary['latency_p99_ms']:.1f} ms, "
        f"max {summary['latency_max_ms']:.1f} ms"
    )
    for call in summary["slowest"]:
        print(f"[demo] slow call: {describe_call(call)}")
    by_mode = ", ".join(f"{m} {v:.1f} ms" for m, v in summary["latency_p50_by_mode_ms"].items())
    print(f"[demo] latency p50 by cache mode: {by_mode or 'no chunks'}")
    print(
        f"[demo] calls began {summary['tick_wait_p50_ms']:.1f} ms after their tick (median; max "
        f"{summary['tick_wait_max_ms']:.1f} ms: a rebuild part or audit in flight, or a reset)"
    )
    print(f"[demo] drops by reason: {drops}")
    print(
        f"[demo] garbage collection while active: longest pause {summary['gc_pause_max_ms']:.1f} ms, "
        f"{summary['gc_full_collections']} full collection(s)"
    )
    for e in summary["episodes"]:
        what = e.get("bag") or ("dense warm-up" if e["episode"] == 0 else "repeat of the task")
        modes = ", ".join(f"{m} {e['modes'].get(m, 0)}" for m in MODE_COLOURS)
        print(
            f"[demo] episode {e['episode']} ({what}): {e['chunks']} chunks: {modes}; hit rate {e['hit_rate']:.2f}; "
            f"p50 {e['latency_p50_ms']:.1f} ms"
        )
    for k, message in enumerate(summary["resets"], start=1):
        print(f"[demo] reset before episode {k}: {message}")
    status = summary["cache_status"]
    if status is None:
        print("[demo] no ~/cache_status received")
    else:
        mode = f"{status['mode']} ({status['reason']})" if status.get("reason") else status["mode"]
        print(
            f"[demo] last ~/cache_status ({clock} time {status['bag_time_s']:.1f} s): episode {status['episode_id']}, "
            f"mode {mode}, hit rate {status['hit_rate']:.2f}, library {status['library_episodes']} "
            f"episode(s) / {status['library_bytes'] / 2**20:.1f} MiB ({status['task_episodes']} of task "
            f"{status['task']!r}), window {status['window_entries']} entries"
        )
        audits = (
            f"error against the same call run dense: median {status['audit_error_median']:.4f}, max "
            f"{status['audit_error_max']:.4f}"
            if status["audits"]
            else "none ran"
        )
        print(
            f"[demo] audits of cached calls: {status['audits']} ({audits}); {status['audits_missed']} missed; "
            f"{status['audit_trips']} episode(s) sent dense by one"
        )
    window = summary["motion_window"]
    if window is not None:
        print(
            f"[demo] motion windows: {window['rebuilds']} entries rebuilt, {window['rebuilds_deferred']} left for a "
            f"later window; {window['window_overruns']} job(s) still running when an observation fell due"
        )
    streamed = summary["streaming"]
    if streamed["skipped"]:
        print(f"[demo] action_streamer not run: {streamed['skipped']}")
    else:
        d = streamed["streamer"]
        refused = ", ".join(
            f"{k.removeprefix('refused.')} {v}"
            for k, v in sorted(d.items())
            if k.startswith("refused.") and v
        )
        arms = ", ".join(
            f"{side} {n} arm + {streamed['gripper_commands'][side]} gripper"
            for side, n in streamed["arm_commands"].items()
        )
        print(
            f"[demo] action_streamer (own process, the {clock}'s clock): "
            f"{d.get('chunks_accepted', 0)} chunks executed; "
            f"commands received: {arms}, every {streamed['interval_p50_ms']:.1f} ms (median); "
            f"{d.get('limited', 0)} held back by max_step, {d.get('clamped', 0)} at a joint's position limit, "
            f"{d.get('resynced', 0)} moved toward an arm that did not follow (max_tracking_error); "
            f"{d.get('held', 0)} ticks with no chunk due; "
            f"chunks took over at row {d.get('takeover_row.p50', 0)} (median; max {d.get('takeover_row.max', 0)}); "
            f"chunks refused: {refused or 'none'}; the arms' drivers: {streamed.get('drivers') or 'unknown'}"
        )
    simulated = summary.get("sim")
    if simulated:
        for e in simulated["episodes"]:
            print(
                f"[demo] aloha_sim episode {e['episode']} ({e['task']}, seed {e['seed']}, {e['seconds']:.1f} s): "
                f"reward {e['reward']}/{e['max_reward']}, best {e['best_reward']}, success {e['success']}"
            )
        print(
            f"[demo] aloha_sim (own process): {simulated['arm_commands']} arm + {simulated['gripper_commands']} "
            f"gripper commands taken, {simulated['refused']} refused; real-time factor {simulated['real_time_factor']:.2f}"
        )
    if summary["errors"]:
        print(f"[demo] errors the node survived: {summary['errors']}")
    bags = f"episode bags {summary['bag']}, " if summary["bag"] else ""
    print(
        f"[demo] {bags}recorded chunks {summary['recorded']}, plot {summary['plot']}, summary {summary['summary']}"
    )
