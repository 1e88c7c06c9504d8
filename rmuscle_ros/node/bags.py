"""rosbag2 files without rosbag2_py (not on PyPI): write, replay with original timing, record.

- `write_aloha_episode` writes an ALOHA-like episode (cameras at 30 Hz, 480×640 rgb8; both follower
  arms' joint states at 100 Hz) as MCAP or sqlite3, with the `rosbags` package.
- `BagPlayer` publishes a bag's messages (their CDR bytes, unchanged) on their topics at the recorded
  pace, with /clock, which is what `ros2 bag play --clock` does; nodes run with use_sim_time. With
  `start_ns` it moves the bag in time: /clock and every header stamp shifted by the same offset, so that
  episodes recorded on other days replay one after another on one clock. With `recorded_clock` it
  replays the bag's own /clock instead (what `ros2 bag play` without `--clock` does): a simulator's bag
  recorded without `--use-sim-time` has its header stamps on that clock, not on the log times.
- `bag_info` says what a bag holds (time span, topics with their types and counts), to check it first.
- `write_messages` records received messages (e.g. the node's ActionChunks) into a bag.

As a command, what `ros2 bag play --clock` does, in a process of its own (as on a cell, where the player
is not the node's process):

    python -m rmuscle_ros.node.bags play BAG [--remap FROM:=TO ...] [--rate R] [--wait-for-subscribers S]
                                             [--start-ns NS] [--recorded-clock]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import struct
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from rosbags.highlevel import AnyReader
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.typesys import Stores, get_types_from_msg, get_typestore

from rmuscle_ros.paths import package_file

# Fast DDS's shared-memory profile with segments large enough for raw camera frames (config/): a publisher of
# 0.9 MB frames without it sends them over fragmented UDP, and a subscriber lost 20-50 % of a bag's frames
# (found in review, the player run on its own: `main` below). The demo sets it for every process it starts.
FASTDDS_LARGE_FRAMES = "fastdds_shm_large_frames.xml"
# The player says when it played slower than asked (below this share of --rate).
PACE_WARN = 0.9

ALOHA_CAMERA_TOPICS = (
    "/cam_high/camera/color/image_rect_raw",
    "/cam_left_wrist/camera/color/image_rect_raw",
    "/cam_right_wrist/camera/color/image_rect_raw",
    "/cam_low/camera/color/image_rect_raw",
)
# The Interbotix follower arms' topics, per side ("left", "right").
ALOHA_JOINT_STATE_TOPIC = "/follower_{side}/joint_states"
ALOHA_ARM_COMMAND_TOPIC = "/follower_{side}/commands/joint_group"  # JointGroupCommand, group "arm"
ALOHA_GRIPPER_COMMAND_TOPIC = "/follower_{side}/commands/joint_single"  # JointSingleCommand, "gripper"
ALOHA_ROBOT_INFO_SERVICE = "/follower_{side}/get_robot_info"  # interbotix_xs_msgs/RobotInfo, the driver's
ALOHA_JOINT_TOPICS = tuple(ALOHA_JOINT_STATE_TOPIC.format(side=side) for side in ("left", "right"))
ALOHA_ARM_JOINTS = ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate", "gripper")
# What an Interbotix follower arm's joint_states carries: the same names on both arms (the topic tells the
# arm), the gripper's two finger positions after its joint.
ALOHA_JOINT_STATE_NAMES = (*ALOHA_ARM_JOINTS, "left_finger", "right_finger")
STORAGE = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}
CLOCK_HZ = 100.0  # /clock messages per wall-clock second between a bag's messages (BagPlayer.play)
MAX_TIME_NS = 2**31 * 10**9  # builtin_interfaces/Time holds int32 seconds: a stamp must stay below
# A recorded /clock further than this from the log times is taken for another clock (the command's note)
CLOCK_HINT_NS = 10**9


def typestore(with_interfaces: bool = False) -> Any:
    """The ROS 2 Jazzy typestore, optionally with this package's messages registered (their .msg files:
    paths.package_file; FileNotFoundError naming the folder if it holds none)."""
    store = get_typestore(Stores.ROS2_JAZZY)
    if with_interfaces:
        folder = package_file("msg")
        definitions = sorted(folder.glob("*.msg"))
        if not definitions:
            raise FileNotFoundError(f"no .msg definitions of rmuscle_ros in {folder}")
        for msg in definitions:
            store.register(get_types_from_msg(msg.read_text(), f"rmuscle_ros/msg/{msg.stem}"))
    return store


def write_aloha_episode(
    path: Path,
    *,
    storage: str = "mcap",
    seconds: float = 3.0,
    cameras: int = 3,
    image_hz: float = 30.0,
    joint_hz: float = 100.0,
    size: tuple[int, int] = (480, 640),
    start_ns: int = 1_700_000_000 * 10**9,
    camera_topics: Sequence[str] = ALOHA_CAMERA_TOPICS,
    joint_topics: Sequence[str] = ALOHA_JOINT_TOPICS,
) -> dict[str, list[int]]:
    """Write a synthetic episode; returns the header stamps (ns) written per topic. The topics default to
    an ALOHA cell's (camera k on camera_topics[k], the left and right arms on joint_topics)."""
    store = typestore()
    types = store.types
    Image, JointState, Header, Time = (  # message classes
        types["sensor_msgs/msg/Image"],
        types["sensor_msgs/msg/JointState"],
        types["std_msgs/msg/Header"],
        types["builtin_interfaces/msg/Time"],
    )
    h, w = size
    base = np.add.outer(np.arange(h, dtype=np.uint16), np.arange(w, dtype=np.uint16))

    def header(t: int, frame_id: str) -> Any:
        return Header(stamp=Time(sec=t // 10**9, nanosec=t % 10**9), frame_id=frame_id)

    def image(t: int, cam: int, i: int) -> Any:
        frame = ((base + 7 * i + 60 * cam) % 256).astype(np.uint8)  # a moving gradient per camera
        rgb = np.repeat(frame[:, :, None], 3, axis=2)
        return Image(
            header=header(t, f"cam{cam}"),
            height=h,
            width=w,
            encoding="rgb8",
            is_bigendian=0,
            step=w * 3,
            data=rgb.reshape(-1),
        )

    def joints(t: int, i: int) -> Any:
        position = 0.3 * np.sin(np.linspace(0, 1, 9) + 2 * np.pi * 0.5 * i / joint_hz)
        return JointState(
            header=header(t, ""),
            name=list(ALOHA_JOINT_STATE_NAMES),
            position=position.astype(np.float64),
            velocity=np.zeros(0),
            effort=np.zeros(0),
        )

    # What to write when, in time order; each message is made as it is written (found in review: made
    # all at once, the frames took ~80 MB of memory per second of episode).
    events: list[tuple[int, str, str, Callable[[], Any]]] = []
    for cam in range(cameras):
        for i in range(int(seconds * image_hz)):
            t = start_ns + round(i * 1e9 / image_hz)
            events.append((t, camera_topics[cam], "sensor_msgs/msg/Image", partial(image, t, cam, i)))
    for topic in joint_topics:
        for i in range(int(seconds * joint_hz)):
            t = start_ns + round(i * 1e9 / joint_hz)
            events.append((t, topic, "sensor_msgs/msg/JointState", partial(joints, t, i)))
    events.sort(key=lambda e: e[0])
    stamps: dict[str, list[int]] = {}
    _check_sqlite_path(path, storage == "sqlite3")
    with Writer(path, version=9, storage_plugin=STORAGE[storage]) as writer:
        connections = {}
        for t, topic, msgtype, make in events:
            if topic not in connections:
                connections[topic] = writer.add_connection(topic, msgtype, typestore=store)
            writer.write(connections[topic], t, store.serialize_cdr(make(), msgtype))
            stamps.setdefault(topic, []).append(t)
    return stamps


@dataclass(frozen=True)
class BagInfo:
    start_ns: int  # the first message's bag time
    end_ns: int  # the last one's
    topics: dict[str, tuple[str, int]]  # topic -> (message type, message count)

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def bag_info(path: Path) -> BagInfo:
    """What a bag holds, read from its metadata (no message is read). ValueError naming the bag if it
    cannot be opened or holds no message."""
    storage = (
        sorted(f for f in path.glob("*") if f.suffix in (".mcap", ".db3", ".zstd")) if path.is_dir() else []
    )
    if storage and not (path / "metadata.yaml").exists():
        raise ValueError(
            f"bag {path}: no metadata.yaml beside its {storage[0].name}: the recording was not closed (a "
            "recorder that crashed or was killed); `ros2 bag reindex` writes it"
        )
    try:
        with _reader(path) as reader:
            topics: dict[str, tuple[str, int]] = {}
            for c in reader.connections:
                count = topics.get(c.topic, (c.msgtype, 0))[1]
                topics[c.topic] = (c.msgtype, count + c.msgcount)
            start, end = reader.start_time, reader.end_time
    except BagRefused:
        raise
    except Exception as e:  # rosbags raises its own types for every kind of unreadable bag
        hint = ""
        if "end magic" in str(e):  # an MCAP file whose writer never wrote its end
            hint = "; the MCAP file was not closed (a recorder that crashed or was killed): `mcap recover` repairs it"
        raise ValueError(f"bag {path}: cannot be read ({type(e).__name__}: {e}){hint}") from None
    if not topics or sum(n for _, n in topics.values()) == 0:
        raise ValueError(f"bag {path}: holds no message")
    return BagInfo(start, end, topics)


class BagRefused(ValueError):
    """A bag this player will not play, with the reason."""


# Characters rosbags' sqlite3 storage cannot have in a bag's path: it opens the database through a URI
# (`file:<path>?immutable=1`), where these end or escape the path (found in review: a Humble cell's bag
# under `shift #3/` read as "unable to open database file", and a written one landed in a stray file).
SQLITE_URI_CHARACTERS = "#?%"


def _check_sqlite_path(path: Path, sqlite: bool) -> None:
    """BagRefused naming the character, for a sqlite3 bag whose path holds one of SQLITE_URI_CHARACTERS."""
    bad = sorted(set(SQLITE_URI_CHARACTERS) & set(str(path.absolute())))
    if sqlite and bad:
        raise BagRefused(
            f"bag {path}: a sqlite3 bag under a path with {' '.join(repr(c) for c in bad)}, which the sqlite3 "
            "reader (rosbags) cannot open; rename the folder, or link to it from a path without "
            f"{' '.join(SQLITE_URI_CHARACTERS)}"
        )


def _reader(path: Path) -> AnyReader:
    """A rosbag2 reader whose types come from the bag, or for a bag that embeds none (recorded before
    ROS 2 Iron, e.g. a Humble cell's sqlite3 bags) from Jazzy's and this package's. A ROS 1 bag is
    refused: its messages are not CDR, and published as they are they would reach nobody."""
    _check_sqlite_path(path, path.is_dir() and any(path.glob("*.db3")))
    reader = AnyReader([path], default_typestore=typestore(with_interfaces=True))
    if not reader.is2:
        raise BagRefused(f"bag {path}: a ROS 1 bag; convert it to rosbag2 first (rosbags-convert)")
    return reader


@dataclass(frozen=True)
class RecordedClock:
    """What a bag's own /clock says (a simulator's, recorded with the rest)."""

    first_ns: int  # the first /clock message's time
    min_ns: int
    max_ns: int
    log_ahead_ns: int  # the first /clock message's log time minus its clock: ~0 when both are one clock


def _leading_time(raw: bytes) -> tuple[str, int, int]:
    """The Time a CDR-serialised message begins with (a header's stamp, a rosgraph_msgs/Clock's clock): the
    first thing after CDR's 4-byte encapsulation, int32 sec and uint32 nanosec in the byte order the
    encapsulation names (odd identifiers, 0x0001 CDR or 0x0007 XCDR2 among them: little-endian; found in
    review: only 0x0001 was taken as such). Returns (struct byte order, sec, nanosec)."""
    order = "<" if raw[1] & 1 else ">"
    sec, nanosec = struct.unpack_from(f"{order}iI", raw, 4)
    return order, sec, nanosec


def _clock_ns(raw: bytes) -> int:
    """A CDR-serialised rosgraph_msgs/Clock's time (ns)."""
    _, sec, nanosec = _leading_time(raw)
    return sec * 10**9 + nanosec


def _recorded_clock(reader: AnyReader, path: Path, first_only: bool = False) -> RecordedClock | None:
    """The bag's own /clock (None if it recorded none). A whole pass over an MCAP whose /clock is
    interleaved with the frames; `first_only`: its first message alone (min and max are then that one's).
    BagRefused for a bag that cannot be read so, as the player refuses it (found in review: a traceback)."""
    connections = [c for c in reader.connections if c.topic == "/clock"]
    if not connections:
        return None
    first: tuple[int, int] | None = None  # (clock, log time) of the first message
    lo = hi = 0
    try:
        for _, t, raw in reader.messages(connections):
            ns = _clock_ns(raw)
            if first is None:
                first, lo, hi = (ns, t), ns, ns
                if first_only:
                    break
            lo, hi = min(lo, ns), max(hi, ns)
    except Exception as e:  # rosbags' ReaderError (out of time order), struct.error (a truncated Clock)
        raise BagRefused(
            f"bag {path}: its /clock cannot be read ({type(e).__name__}: {e}); `mcap recover` or `ros2 bag "
            "reindex` may repair it"
        ) from None
    if first is None:
        return None
    return RecordedClock(first[0], lo, hi, first[1] - first[0])


def recorded_clock(path: Path, first_only: bool = False) -> RecordedClock | None:
    """The bag's own /clock, or None if it recorded none (reads only the /clock messages; `first_only`: the
    first). BagRefused if they cannot be read."""
    with _reader(path) as reader:
        return _recorded_clock(reader, path, first_only)


HEADER, TIME = "std_msgs/msg/Header", "builtin_interfaces/msg/Time"


def _stamps_in(msgtype: str, fielddefs: Mapping[str, Any]) -> str:
    """Where a message type's stamps are: "header" (only in the std_msgs/Header it begins with, whose stamp
    is patched in the raw bytes), "nested" (a Header or Time further in, e.g. each transform of a /tf
    message, each pose of a path: deserialised, shifted and serialised again), or "" (none)."""

    def holds_time(name: str, seen: frozenset[str]) -> bool:
        if name in (HEADER, TIME):
            return True
        if name in seen or name not in fielddefs:
            return False
        return any(_field_type(f) and holds_time(_field_type(f), seen | {name}) for f in fielddefs[name][1])

    fields = fielddefs.get(msgtype, (None, []))[1]
    later = any(_field_type(f) and holds_time(_field_type(f), frozenset({msgtype})) for f in fields[1:])
    if fields and _field_type(fields[0]) == HEADER and not later:  # e.g. an image: its bytes stay as they are
        return "header"
    return "nested" if holds_time(msgtype, frozenset()) else ""


def _field_type(field: Any) -> str:
    """The message type a rosbags field definition names, itself or as its sequence's element ("" if a
    primitive)."""
    _, (_kind, detail) = field
    if isinstance(detail, str):
        return detail
    if isinstance(detail, tuple) and detail and isinstance(detail[0], tuple):  # (element, size)
        _element_kind, element = detail[0]
        return element if isinstance(element, str) and "/" in element else ""
    return ""


def _moved_stamp(sec: int, nanosec: int, offset_ns: int) -> tuple[int, int]:
    """(sec, nanosec) moved by `offset_ns`; ValueError for a time outside ROS time (`MAX_TIME_NS`)."""
    total = sec * 10**9 + nanosec + offset_ns
    if not 0 <= total < MAX_TIME_NS:
        raise ValueError(f"a stamp moved by {offset_ns} ns falls outside ROS time ({total // 10**9} s)")
    return divmod(total, 10**9)


def _shift_times(msg: Any, offset_ns: int) -> None:
    """Move every builtin_interfaces/Time inside a deserialised message by `offset_ns` (zero stamps, never
    set, stay zero), in place; ValueError for one moved outside ROS time, as `shift_header_stamp`."""
    if getattr(msg, "__msgtype__", "") == TIME:
        if msg.sec or msg.nanosec:
            msg.sec, msg.nanosec = _moved_stamp(msg.sec, msg.nanosec, offset_ns)
        return
    if not dataclasses.is_dataclass(msg):
        return
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        for item in value if isinstance(value, list) else [value]:
            if dataclasses.is_dataclass(item):
                _shift_times(item, offset_ns)


def shift_header_stamp(raw: bytes, offset_ns: int) -> bytes:
    """A CDR-serialised message that begins with a std_msgs/Header, its stamp (`_leading_time`) moved by
    `offset_ns`. A zero stamp (never set by its publisher) stays zero."""
    order, sec, nanosec = _leading_time(raw)
    if sec == 0 and nanosec == 0:
        return raw
    sec, nanosec = _moved_stamp(sec, nanosec, offset_ns)
    out = bytearray(raw)
    struct.pack_into(f"{order}iI", out, 4, sec, nanosec)
    return bytes(out)


def recorded_qos(connections: Sequence[Any], default: Any) -> Any:
    """The QoS to replay a topic with, from what its recorded publishers offered (the connections'
    `offered_qos_profiles`): their reliability and durability when every one offered the same, as `ros2
    bag play` replays them. Where the recording settles nothing (no offer recorded, e.g. the bags
    `write_aloha_episode` writes, or offers that differ), `default`; there `ros2 bag play` offers reliable
    and volatile, this player the caller's default (best effort from the CLI and the demo, as before it
    read the offers). The depth stays `default`'s. A reliable, transient-local replay
    reaches the subscribers that ask for it (a robot_state_publisher's /robot_description, a reliable
    logger) as well as best-effort ones; best effort would reach none of them."""
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

    base = QoSProfile(depth=default) if isinstance(default, int) else default
    offers = [q for c in connections for q in (getattr(c.ext, "offered_qos_profiles", None) or [])]
    kinds = {(q.reliability.name, q.durability.name) for q in offers}
    if len(kinds) != 1:
        return base
    reliability, durability = kinds.pop()
    if reliability not in ("SYSTEM_DEFAULT", "RELIABLE", "BEST_EFFORT") or durability not in (
        "SYSTEM_DEFAULT",
        "TRANSIENT_LOCAL",
        "VOLATILE",
    ):
        return base  # UNKNOWN, BEST_AVAILABLE: not an offer to replay as it was
    return QoSProfile(
        history=base.history,
        depth=base.depth,
        reliability=ReliabilityPolicy[reliability],
        durability=DurabilityPolicy[durability],
    )


def _message_class(msgtype: str) -> Any:
    """The installed class of `pkg/kind/Name`: kind is msg, or srv for a service's event topic
    (`…/_service_event`, `pkg/srv/X_Event`; found in review: always read from msg, those were skipped as
    not installed). An action's feedback topic (`pkg/action/X_FeedbackMessage`, which rosidl does not
    export from pkg.action) is still skipped as not installed."""
    package, kind, name = msgtype.split("/")
    return getattr(importlib.import_module(f"{package}.{kind}"), name)


class BagPlayer:
    """Publishes a bag into a live ROS graph at the recorded pace (with /clock), from an rclpy node."""

    def __init__(self, node: Any, path: Path, qos: Any, remap: Mapping[str, str] | None = None) -> None:
        from rosgraph_msgs.msg import Clock

        # Keys as the bag names its topics (absolute): `ros2 bag play` resolves a relative FROM in the root
        # namespace (found in review: `follower_left/joint_states:=…` matched nothing here, silently).
        self.node, self.path = node, path
        self.remap = {absolute_topic(frm): to for frm, to in (remap or {}).items()}
        self._clock_pub = node.create_publisher(Clock, "/clock", 10)
        self._clock_type = Clock
        self._qos = qos  # each topic's QoS where its recording says none (`recorded_qos`)
        self.published = 0
        self.skipped: dict[str, str] = {}  # topic -> message type not installed here (e.g. a driver's own)
        # Awaited topics (and /clock) that no subscriber had matched when the wait for them ran out.
        self.unmatched: list[str] = []
        # The latest play's pace, from its first message to its last (the waits for subscribers left out):
        # bag seconds played, and wall seconds taken. A player that fell behind (a loaded machine) publishes
        # what is due at once, so the bag's seconds per wall second can run above `rate` for a while.
        self.played_s = self.wall_s = 0.0

    def play(
        self,
        rate: float = 1.0,
        wait_for_subscribers_s: float = 0.0,
        start_ns: int | None = None,
        clock_subscribers: int = 1,
        clock_hz: float = CLOCK_HZ,
        recorded_clock: bool = False,
    ) -> None:
        """Blocks until every message has been published at its recorded time (scaled by `rate`).
        `wait_for_subscribers_s`: first wait up to this long for every topic to have a subscriber, and
        /clock `clock_subscribers` of them (every node on the bag's clock: one that matched late would
        run behind it), as discovery between processes takes longer than within one (then 0.5 s more).
        `start_ns`: play the bag as if it had been recorded from that time on: /clock and the header stamp
        of every message that has one move by the same offset (the rest of each message is unchanged).

        A cell's recordings hold more than cameras and joints: topics whose message type is not installed
        here (a driver's own, e.g. a gripper command) are skipped (`skipped`), and with a remap only the
        remapped topics are waited for, since nobody may subscribe to the rest (/tf, diagnostics, ...).
        Each topic is published with the QoS its recorded publishers offered (`recorded_qos`).

        /clock also moves between messages, `clock_hz` times a second of wall time (as `ros2 bag play
        --clock` does): a gap in the recording (a camera that stopped) does not stop the bag's time, so
        timers on it run on and a node can see its inputs go stale. A bag whose messages cannot be read in
        time order is refused (`BagRefused`) when the player reaches that point.

        `recorded_clock`: publish the bag's own /clock messages, at their recorded pace, instead of a clock
        made from the log times (no ticks between them: a simulator publishes one every step). `start_ns`
        then moves that clock to start there, and the header stamps with it. A bag without /clock is
        refused."""
        if self._clock_pub is None:
            raise RuntimeError("this BagPlayer is closed")
        if not (math.isfinite(rate) and rate > 0):  # NaN passed `rate <= 0` and played unpaced (review)
            raise ValueError(f"rate must be a finite number > 0, got {rate}")
        self.unmatched = []  # this play's (found in review: a second play reported the first one's)
        self.played_s = self.wall_s = 0.0
        with _reader(self.path) as reader:
            if not reader.message_count:
                raise BagRefused(f"bag {self.path}: holds no message")
            if recorded_clock:  # the stamps are on the bag's /clock: it starts at start_ns
                clock = _recorded_clock(reader, self.path)
                if clock is None:
                    raise BagRefused(
                        f"bag {self.path}: recorded no /clock to replay; play it on the player's clock (made "
                        "from the log times) instead"
                    )
                offset = 0 if start_ns is None else start_ns - clock.first_ns
                first, last = clock.min_ns + offset, clock.max_ns + offset
            else:
                offset = 0 if start_ns is None else start_ns - reader.start_time
                first, last = reader.start_time + offset, reader.end_time + offset
            # before anything is published, /clock included (0 is a time: `ros2 bag record --use-sim-time`
            # stamps what came before the first /clock with it)
            if not 0 <= first <= last < MAX_TIME_NS:
                raise BagRefused(
                    f"bag {self.path}: would play from {first} to {last} ns, outside ROS time (0 to "
                    f"{MAX_TIME_NS} ns: a builtin_interfaces/Time's seconds are int32); check --start-ns"
                )
            fielddefs = reader.typestore.fielddefs
            stamps = {c.topic: _stamps_in(c.msgtype, fielddefs) if offset else "" for c in reader.connections}
            pubs: dict[str, Any] = {}
            try:
                for c in reader.connections:
                    if c.topic in pubs or c.topic in self.skipped:
                        continue
                    if c.topic == "/clock":  # the recorded one, or this player's own, shifted with the stamps
                        if not recorded_clock:
                            self.skipped[c.topic] = c.msgtype
                        continue
                    try:
                        message_class = _message_class(c.msgtype)
                    except (ImportError, AttributeError):
                        self.skipped[c.topic] = c.msgtype
                        continue
                    same_topic = [k for k in reader.connections if k.topic == c.topic]
                    pubs[c.topic] = self.node.create_publisher(
                        message_class, self.remap.get(c.topic, c.topic), recorded_qos(same_topic, self._qos)
                    )
                if not pubs:
                    raise BagRefused(
                        f"bag {self.path}: nothing to play: no topic's message type is installed here "
                        f"({', '.join(f'{t} {m}' for t, m in sorted(self.skipped.items()))})"
                    )
                deadline = time.monotonic() + wait_for_subscribers_s
                awaited = [pub for topic, pub in pubs.items() if not self.remap or topic in self.remap]

                def waiting() -> bool:
                    return self._clock_pub.get_subscription_count() < clock_subscribers or any(
                        pub.get_subscription_count() == 0 for pub in awaited
                    )

                while time.monotonic() < deadline and waiting():
                    time.sleep(0.05)
                if wait_for_subscribers_s > 0 and waiting():
                    self.unmatched = [
                        self.remap.get(t, t)
                        for t, pub in pubs.items()
                        if pub in awaited and not pub.get_subscription_count()
                    ]
                    clocks = self._clock_pub.get_subscription_count()
                    if clocks < clock_subscribers:
                        self.unmatched.append(f"/clock ({clocks} of {clock_subscribers} subscribers)")
                time.sleep(0.5)  # discovery: let subscribers match before the first message
                tick_s = 1.0 / clock_hz if clock_hz > 0 else math.inf
                wall0, bag0 = time.monotonic(), None
                played = set(pubs) | ({"/clock"} if recorded_clock else set())
                messages = reader.messages([c for c in reader.connections if c.topic in played])
                while True:
                    try:
                        connection, t, raw = next(messages)
                    except StopIteration:
                        break
                    except Exception as e:  # rosbags' ReaderError: e.g. an unindexed MCAP out of time order
                        raise BagRefused(
                            f"bag {self.path}: cannot be read on in time order after {self.published} messages "
                            f"({type(e).__name__}: {e}); `mcap recover` or `ros2 bag reindex` may repair it"
                        ) from None
                    bag0 = t if bag0 is None else bag0
                    due = wall0 + (t - bag0) / 1e9 / rate
                    while (delay := due - time.monotonic()) > 0:
                        time.sleep(min(delay, tick_s))
                        if not recorded_clock and time.monotonic() < due:  # the bag's time between messages
                            now = bag0 + round((time.monotonic() - wall0) * rate * 1e9)
                            self._publish_clock(min(now, t) + offset)
                    if recorded_clock:
                        if connection.topic == "/clock":
                            self._publish_clock(_clock_ns(raw) + offset)  # within [first, last]: checked
                            continue
                    else:
                        self._publish_clock(t + offset)
                    where = stamps[connection.topic]
                    try:
                        if where == "header":
                            raw = shift_header_stamp(raw, offset)
                        elif where == "nested":
                            msg = reader.typestore.deserialize_cdr(raw, connection.msgtype)
                            _shift_times(msg, offset)
                            raw = reader.typestore.serialize_cdr(msg, connection.msgtype)
                    except ValueError as e:  # a traceback mid-replay before (found in review)
                        why = (
                            "its stamps are not on the bag's /clock"
                            if recorded_clock
                            else "its stamps are not on the clock its messages were logged on (a simulator's "
                            "or a device's own? --recorded-clock replays a recorded /clock)"
                        )
                        raise BagRefused(
                            f"bag {self.path}: {connection.topic}: {e}; {why}, so they cannot move with "
                            "--start-ns"
                        ) from None
                    pubs[connection.topic].publish(bytes(raw))  # the recorded CDR bytes (stamp aside)
                    self.published += 1
                    self.played_s, self.wall_s = (t - bag0) / 1e9, time.monotonic() - wall0
            finally:  # a refusal, a failed read, Ctrl-C: the caller's node keeps no publisher of ours
                for pub in pubs.values():
                    self.node.destroy_publisher(pub)

    def close(self) -> None:
        """Destroy the /clock publisher (the topics' own go at the end of each play)."""
        if self._clock_pub is not None:
            self.node.destroy_publisher(self._clock_pub)
            self._clock_pub = None

    def _publish_clock(self, t_ns: int) -> None:
        clock = self._clock_type()
        clock.clock.sec, clock.clock.nanosec = divmod(t_ns, 10**9)
        self._clock_pub.publish(clock)


def write_messages(
    path: Path, topic: str, msgtype: str, messages: Iterable[tuple[int, bytes]], storage: str = "mcap"
) -> None:
    """Record (receive time ns, serialized CDR) pairs of one topic into a bag."""
    store = typestore(with_interfaces=True)
    _check_sqlite_path(path, storage == "sqlite3")
    with Writer(path, version=9, storage_plugin=STORAGE[storage]) as writer:
        connection = writer.add_connection(topic, msgtype, typestore=store)
        for t, raw in messages:
            writer.write(connection, t, raw)


def read_messages(path: Path, topic: str) -> list[tuple[int, Any]]:
    """(bag time ns, deserialized message) for every message on `topic`, in order."""
    with _reader(path) as reader:
        connections = [c for c in reader.connections if c.topic == topic]
        return [
            (t, reader.deserialize(raw, c.msgtype)) for c, t, raw in reader.messages(connections=connections)
        ]


def absolute_topic(topic: str) -> str:
    """A topic name as resolved in the root namespace, where the node and the player run here."""
    return "/" + topic.lstrip("/")


def parse_remaps(items: Iterable[str]) -> dict[str, str]:
    """`--remap FROM:=TO` arguments (as `ros2 bag play --remap` takes them) -> {FROM: TO}, FROM made
    absolute (`absolute_topic`: a bag names its topics so); ValueError naming the first malformed one."""
    remap = {}
    for item in items:
        frm, sep, to = item.partition(":=")
        if not sep or not frm.strip("/") or not to:
            raise ValueError(f"--remap {item!r}: expected FROM:=TO")
        remap[absolute_topic(frm)] = to
    return remap


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Replay a rosbag2 file with /clock (ros2 bag play --clock).")
    sub = p.add_subparsers(dest="command", required=True)
    play = sub.add_parser("play", help="publish a bag's messages at their recorded pace, with /clock")
    play.add_argument("bag", type=Path)
    play.add_argument(
        "--remap", action="append", default=[], metavar="FROM:=TO", help="a topic remap (repeatable)"
    )
    play.add_argument("--rate", type=float, default=1.0, help="playback speed (1 = recorded pace)")
    play.add_argument(
        "--wait-for-subscribers", type=float, default=10.0, metavar="S",
        help="wait up to S seconds for every topic to have a subscriber before the first message",
    )  # fmt: skip
    play.add_argument(
        "--clock-subscribers", type=int, default=1, metavar="N",
        help="wait (as for --wait-for-subscribers) for N subscribers of /clock: every node on the bag's clock",
    )  # fmt: skip
    play.add_argument(
        "--start-ns", type=int, default=None, metavar="NS",
        help="move the bag in time to start at NS (ROS time, ns): /clock and header stamps shift together",
    )  # fmt: skip
    play.add_argument(
        "--recorded-clock", action="store_true",
        help="replay the bag's own /clock (a simulator's, recorded without --use-sim-time) instead of a "
        "clock made from the log times",
    )  # fmt: skip
    args = p.parse_args(argv)
    try:
        remap = parse_remaps(args.remap)
    except ValueError as e:
        p.error(str(e))
    if not args.bag.exists():
        p.error(f"bag {args.bag}: no such file or folder")
    if not (math.isfinite(args.rate) and args.rate > 0):
        p.error(f"--rate must be a finite number > 0, got {args.rate:g}")
    if not (math.isfinite(args.wait_for_subscribers) and args.wait_for_subscribers >= 0):
        p.error(f"--wait-for-subscribers must be a finite number ≥ 0, got {args.wait_for_subscribers:g}")
    try:  # a folder that is no bag, a ROS 1 bag, an empty one: said plainly, not a traceback
        bag_info(args.bag)
        clock = None if args.recorded_clock else recorded_clock(args.bag, first_only=True)  # for the note
    except (ValueError, OSError) as e:  # OSError: this package's message definitions not found (paths)
        p.error(str(e))
    if clock is not None and abs(clock.log_ahead_ns) > CLOCK_HINT_NS:
        # Its stamps are then likely on that clock, and every node on the player's clock would find them
        # hours or years old (the node drops such observations): say how to play it.
        print(
            f"note: the bag's own /clock is {abs(clock.log_ahead_ns) / 1e9:.3g} s "
            f"{'behind' if clock.log_ahead_ns > 0 else 'ahead of'} its log times (a simulator's, recorded "
            "without --use-sim-time?); if its stamps are on that clock, --recorded-clock replays it",
            file=sys.stderr,
        )
    if "FASTRTPS_DEFAULT_PROFILES_FILE" not in os.environ:  # read when rclpy creates its participant
        profile = package_file("config", FASTDDS_LARGE_FRAMES)
        os.environ["FASTRTPS_DEFAULT_PROFILES_FILE"] = str(profile)
        print(f"note: Fast DDS profile {profile} (shared memory for raw frames; FASTRTPS_DEFAULT_PROFILES_FILE "
              "was unset)", file=sys.stderr)  # fmt: skip
    import rclpy
    from rclpy.qos import qos_profile_sensor_data

    rclpy.init()
    node = rclpy.create_node("bag_player")
    try:
        player = BagPlayer(node, args.bag, qos_profile_sensor_data, remap=remap)
        try:
            player.play(
                args.rate,
                wait_for_subscribers_s=args.wait_for_subscribers,
                start_ns=args.start_ns,
                clock_subscribers=args.clock_subscribers,
                recorded_clock=args.recorded_clock,
            )
        except (BagRefused, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if player.unmatched:
            print(
                f"no subscriber matched {', '.join(player.unmatched)} within {args.wait_for_subscribers:g} s "
                "(none there, or one asking for a QoS the recording did not offer): played all the same",
                file=sys.stderr,
            )
        print(f"published {player.published} messages from {args.bag}")
        if player.wall_s > 0 and player.played_s / player.wall_s < PACE_WARN * args.rate:
            print(
                f"warning: played {player.played_s:.2f} s of the bag in {player.wall_s:.2f} s of wall time, "
                f"{player.played_s / player.wall_s:.2g}x, slower than --rate {args.rate:g}: this host could not "
                "publish it faster; its subscribers saw the messages later than the bag's timing",
                file=sys.stderr,
            )
        for topic, msgtype in sorted(player.skipped.items()):
            why = (
                "the player publishes its own /clock (--recorded-clock: the bag's)"
                if topic == "/clock"
                else "not installed here"
            )
            print(f"skipped {topic} ({msgtype}): {why}")
    finally:
        node.destroy_node()
        rclpy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
