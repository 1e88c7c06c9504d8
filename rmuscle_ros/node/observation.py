"""Assembling one policy observation from the latest sensor messages, or saying why there is none.

Pure Python (no rclpy): the node stores the newest frame per camera and a short history of each joint's
positions here from its callbacks, and the inference worker asks for an observation. Every refusal has a
reason from `DropReason`, which the node counts, logs and reports on /diagnostics, naming the topic at
fault.

Which joint positions go with the frames: a camera frame is stamped when it is captured and reaches the
node tens of ms later, while joint states come every 10-20 ms. Pairing the newest frames with the newest
joint state measured the cameras' delivery delay as skew (found in review: at 40 ms of camera latency,
84 % of ticks would have dropped under the cell profiles' 50 ms `max_skew_s`). So each joint keeps its
latest JOINT_HISTORY_S of positions, and an observation takes, per joint, the position stamped nearest
the newest frame: the arm where the cameras saw it.

A message stamped before the one held for its camera or joint, by up to RESTART_NS (a second
publisher on the topic, a reordering transport), is not stored: it would move the observation back in
time. One stamped further back is a clock that went back (a bag played again, a simulator restarted):
it starts that source's history again.
"""

from __future__ import annotations

import bisect
import enum
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rmuscle_ros.node.images import ImageConversionError, compressed_to_rgb, image_to_rgb
from rmuscle_ros.runtime.policy import Observation

JOINT_HISTORY_S = 0.5  # joint positions kept per joint, back from its newest: covers a camera's latency
JOINT_HISTORY_MAX = 2000  # samples per joint at most (a 1 kHz driver: 2 s), whatever the stamps say
# Names of received joints the state does not read, kept for the missing_joints reason only (a naming
# mismatch shows at a glance); their positions are not stored. Before (found in review) every name was
# stored: a publisher of ever new names grew the buffer without bound (222,158 names and 270 MB in 20 s),
# and each observation copied them all under the lock the callbacks take.
OTHER_NAMES_KEPT = 32
# A stamp further than this from the node clock is not a late or early message but another clock (a
# camera's hardware clock, a message never stamped, use_sim_time on one side only): said so in the reason.
OTHER_CLOCK_NS = 3600 * 1_000_000_000
# A message more than this older than the one held: its clock went back, a new run. Short, so that a clock
# stepped back a little (a simulator restarted, a bag seeked) holds the observations back no longer than it.
RESTART_NS = 100_000_000


class DropReason(enum.Enum):
    MISSING_CAMERA = "missing_camera"  # no image received yet on a camera topic
    MISSING_JOINTS = "missing_joints"  # a configured joint name was never received
    STALE_IMAGE = "stale_image"  # newest image older than max_image_age_s
    STALE_JOINTS = "stale_joints"
    SKEW = "skew"  # the messages' stamps are further apart than max_skew_s
    FUTURE_STAMP = "future_stamp"  # a stamp ahead of the node clock (clock jump or a bad publisher)
    BAD_IMAGE = "bad_image"  # encoding, size or truncated data
    BAD_STATE = "bad_state"  # NaN/Inf joint positions, or names and positions that do not pair up
    INFERENCE_ERROR = "inference_error"  # the policy raised; the node keeps running
    DEVICE_LOST = "device_lost"  # the GPU's CUDA context is lost: no call can run in this process again
    BAD_ACTIONS = "bad_actions"  # the model produced NaN/Inf actions: never published
    PROMPT_TRUNCATED = "prompt_truncated"  # the prompt with the state was longer than the model takes


def joint_state_fault(names: list[str], positions: list[float]) -> str:
    """Why a JointState's names and positions do not pair up ("" if they do): other counts, or a name
    twice. Which position is which joint's is then unknown, and the message is not used."""
    if len(names) != len(positions):
        return f"{len(names)} names and {len(positions)} positions"
    if len(set(names)) != len(names):
        return f"names repeated: {sorted({n for n in names if names.count(n) > 1})}"
    return ""


class ObservationUnavailable(Exception):
    """Why there is no observation. `cure`: the kind of message that could end a timing refusal ("image:<slot>",
    that camera's frame, or "joints": the stale source's, or the oldest of a skew's), "" for the others."""

    def __init__(self, reason: DropReason, detail: str, cure: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.cure = cure


@dataclass(frozen=True)
class Limits:
    max_image_age_ns: int
    max_joint_age_ns: int
    max_skew_ns: int


def stamp_ns(header: Any) -> int:
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


def _clock_hint(stamp: int, now_ns: int) -> str:
    """What a stamp far from the node clock most likely means, for a drop's reason ("" if near it)."""
    if stamp == 0:
        return " (its stamp is 0: the publisher never set header.stamp)"
    if abs(now_ns - stamp) > OTHER_CLOCK_NS:
        return " (another clock: a device's own clock, or use_sim_time set on one side only?)"
    return ""


class ObservationBuffer:
    """The newest camera frame per slot and joint state per topic, guarded by one lock."""

    def __init__(
        self,
        num_cameras: int,
        joint_names: Sequence[str],
        compressed: bool,
        limits: Limits,
        camera_topics: Sequence[str] | None = None,
        state_map: tuple[Sequence[str], np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """camera_topics: the topic feeding each slot, named in the reasons (an operator looks for topics).
        state_map: (the joint read for each joint_names slot, offset, scale), the state being
        (position - offset) * scale (params.state_sources); None: each slot's own joint, unchanged."""
        self._lock = threading.Lock()
        self._topics = tuple(camera_topics) if camera_topics is not None else None
        self._images: list[Any | None] = [None] * num_cameras
        # joint name -> its (stamp ns, position) samples, oldest first, over JOINT_HISTORY_S
        self._joints: dict[str, deque[tuple[int, float]]] = {}
        self._joint_source: dict[str, str] = {}  # joint name -> the topic (or prefix) it came from
        self._other_names: dict[str, None] = {}  # received names the state does not read (OTHER_NAMES_KEPT)
        # Per joint-state topic (its prefix where the topic is not given), what was wrong with its latest
        # message, which was not stored: names and positions that do not pair up. Cleared by the topic's
        # next well-formed message (keyed by topic: two topics with one prefix do not clear each other's).
        self._joint_faults: dict[str, str] = {}
        self._joint_names = tuple(joint_names)
        sources, offset, scale = state_map or (
            joint_names,
            np.zeros(len(joint_names)),
            np.ones(len(joint_names)),
        )
        if len(sources) != len(self._joint_names):
            raise ValueError(f"state_map: {len(sources)} sources for {len(self._joint_names)} joints")
        self._sources = tuple(sources)
        self._read = frozenset(self._sources)
        self._offset, self._scale = np.asarray(offset, np.float64), np.asarray(scale, np.float64)
        self._decode: Callable[[Any], np.ndarray] = compressed_to_rgb if compressed else image_to_rgb
        self.limits = limits

    # Called from subscription callbacks: store only, never convert (the executor must stay quick). Each
    # says whether the message brought something the buffer did not hold yet (a camera's first frame, a
    # joint's first position): what a start-up wait for the first messages looks out for.
    def put_image(self, slot: int, msg: Any) -> bool:
        with self._lock:
            held = self._images[slot]
            if held is not None and 0 < stamp_ns(held.header) - stamp_ns(msg.header) <= RESTART_NS:
                return False  # older than the frame held: not stored (module docstring)
            self._images[slot] = msg
        return held is None

    def put_joint_state(self, msg: Any, prefix: str = "", topic: str = "") -> bool:
        """Store each named position the state reads as `prefix + name` (the arm's topic decides the prefix:
        an Interbotix ALOHA names both arms' joints alike; other names are noted, at most OTHER_NAMES_KEPT,
        for the missing_joints reason only); `topic` names the source in drop reasons. A message whose
        names and positions do not pair up (other counts, a name twice) is not stored: which position
        belongs to which joint is not known, and the next observation is a bad_state drop saying so, until
        the arm sends a well-formed one. One without positions (velocities or efforts only, which the
        message allows) carries nothing for the policy and is skipped."""
        t = stamp_ns(msg.header)
        names, positions = list(msg.name), list(msg.position)
        if names and not positions:
            return False
        fault = joint_state_fault(names, positions)
        source = topic or prefix or "a joint state"
        with self._lock:
            if fault:
                self._joint_faults[source] = fault
                return False
            self._joint_faults.pop(source, None)
            new = False
            for name, position in zip(names, positions, strict=True):
                key = prefix + name
                if key not in self._read:
                    if key not in self._other_names and len(self._other_names) < OTHER_NAMES_KEPT:
                        self._other_names[key] = None
                    continue
                samples = self._joints.get(key)
                if samples is None:
                    samples = self._joints[key] = deque(maxlen=JOINT_HISTORY_MAX)
                    new = True
                elif t < samples[-1][0]:
                    if samples[-1][0] - t <= RESTART_NS:
                        continue  # older than the position held: not stored (module docstring)
                    samples.clear()  # the clock went back: a new run
                samples.append((t, float(position)))
                self._joint_source[key] = source
                while samples[0][0] < t - JOINT_HISTORY_S * 1e9:
                    samples.popleft()
            return new

    def clear(self) -> None:
        with self._lock:
            self._images = [None] * len(self._images)
            self._joints.clear()
            self._joint_source.clear()
            self._other_names.clear()
            self._joint_faults.clear()

    def observation(self, now_ns: int, prompt: str, slot_names: Sequence[str]) -> Observation:
        """The observation at `now_ns`, or ObservationUnavailable with the reason. Stamp = newest image."""
        with self._lock:
            images = list(self._images)
            joints = {n: list(samples) for n, samples in self._joints.items()}
            sources = dict(self._joint_source)
            others = list(self._other_names)
            faults = dict(self._joint_faults)
        lim = self.limits
        # (stamp, what it is, "image" or "joints") of every message the observation uses
        named: list[tuple[int, str, str]] = []
        cameras: list[str] = []
        for slot, msg in enumerate(images):
            camera = (
                slot_names[slot] if self._topics is None else f"{slot_names[slot]} ({self._topics[slot]})"
            )
            if msg is None:
                raise ObservationUnavailable(DropReason.MISSING_CAMERA, f"no image yet for {camera}")
            t = stamp_ns(msg.header)
            if now_ns - t > lim.max_image_age_ns:
                raise ObservationUnavailable(
                    DropReason.STALE_IMAGE,
                    f"{camera} is {(now_ns - t) / 1e6:.0f} ms old{_clock_hint(t, now_ns)}",
                    cure=f"image:{slot}",  # only this camera's next frame can end it
                )
            named.append((t, camera, f"image:{slot}"))
            cameras.append(camera)
        if faults:
            said = "; ".join(f"{source}: {fault}" for source, fault in sorted(faults.items()))
            raise ObservationUnavailable(
                DropReason.BAD_STATE, f"a joint state that does not add up, not used ({said})"
            )
        missing = [n for n in self._sources if n not in joints]
        if missing:
            # The names that did arrive show a naming mismatch (a prefix missing or doubled) at a glance.
            received = sorted({*joints, *others})
            held = f"; received {received[:8]}{' ...' if len(received) > 8 else ''}" if received else ""
            raise ObservationUnavailable(DropReason.MISSING_JOINTS, f"no position yet for {missing}{held}")
        # A joint whose newest position is too old: its driver stopped (whatever the frames' time).
        stale = min(self._sources, key=lambda n: joints[n][-1][0])
        newest_of_stale = joints[stale][-1][0]
        if now_ns - newest_of_stale > lim.max_joint_age_ns:
            raise ObservationUnavailable(
                DropReason.STALE_JOINTS,
                f"{sources.get(stale, stale)} ({stale}) is {(now_ns - newest_of_stale) / 1e6:.0f} ms old"
                + _clock_hint(newest_of_stale, now_ns),
                cure="joints",
            )
        frames_at = max(t for t, _, _ in named)  # only the frames so far: the observation's stamp
        picked = [_nearest(joints[n], frames_at) for n in self._sources]
        raw = np.array([p[1] for p in picked])
        state = ((raw - self._offset) * self._scale).astype(np.float32)
        for n, (t, _) in zip(self._sources, picked, strict=True):
            named.append((t, f"{sources.get(n, n)} ({n})", "joints"))
        # Ahead of the node clock: every source's newest message, not only the positions picked (a joint
        # state host whose clock runs ahead, found in review).
        newest = max(
            [*named, *((joints[n][-1][0], f"{sources.get(n, n)} ({n})", "joints") for n in self._sources)]
        )
        if newest[0] > now_ns + lim.max_skew_ns:
            raise ObservationUnavailable(
                DropReason.FUTURE_STAMP,
                f"{newest[1]} is stamped {(newest[0] - now_ns) / 1e6:.0f} ms ahead of the node clock"
                + _clock_hint(newest[0], now_ns),
            )
        newest, oldest = max(named), min(named)
        if newest[0] - oldest[0] > lim.max_skew_ns:
            raise ObservationUnavailable(
                DropReason.SKEW,
                f"stamps span {(newest[0] - oldest[0]) / 1e6:.0f} ms: {oldest[1]} oldest, {newest[1]} newest",
                cure=oldest[2],
            )
        if not np.isfinite(state).all():
            bad = [n for n, v in zip(self._joint_names, state, strict=True) if not np.isfinite(v)]
            raise ObservationUnavailable(DropReason.BAD_STATE, f"non-finite position for {bad}")
        # Decoded last: an observation refused for its timing costs no decoding (the node tries again at
        # each new message while a tick waits for a later one).
        rgb: dict[str, np.ndarray] = {}
        for slot, (msg, camera) in enumerate(zip(images, cameras, strict=True)):
            try:
                rgb[slot_names[slot]] = self._decode(msg)
            except ImageConversionError as e:
                raise ObservationUnavailable(DropReason.BAD_IMAGE, f"{camera}: {e}") from None
        return Observation(images=rgb, state=state, prompt=prompt, stamp_ns=frames_at)


def _nearest(samples: list[tuple[int, float]], t: int) -> tuple[int, float]:
    """The (stamp, position) stamped nearest `t` among samples in stamp order: of several with one stamp,
    the last received; on a tie between an earlier and a later stamp, the later."""
    # samples[i - 1]: the last at or before t
    i = bisect.bisect_right(samples, t, key=lambda sample: sample[0])
    if i == len(samples):
        return samples[-1]
    if i == 0:
        return samples[0]
    before, after = samples[i - 1], samples[i]
    return before if t - before[0] < after[0] - t else after
