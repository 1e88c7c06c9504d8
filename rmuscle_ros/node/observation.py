"""Assembling one policy observation from the latest sensor messages, or saying why there is none.

Pure Python (no rclpy): the node stores the newest message per topic here from its callbacks and the
inference worker asks for an observation. Every refusal has a reason from `DropReason`, which the node
counts, logs and reports on /diagnostics.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rmuscle_ros.node.images import ImageConversionError, compressed_to_rgb, image_to_rgb
from rmuscle_ros.runtime.policy import Observation


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
    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    max_image_age_ns: int
    max_joint_age_ns: int
    max_skew_ns: int


def stamp_ns(header: Any) -> int:
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


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
        self._joints: dict[str, tuple[int, float]] = {}  # joint name -> (stamp ns, position)
        # Per joint-state prefix (an arm's topic), what was wrong with its latest message, which was not
        # stored: names and positions that do not pair up. Cleared by the arm's next well-formed message.
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
        self._offset, self._scale = np.asarray(offset, np.float64), np.asarray(scale, np.float64)
        self._decode: Callable[[Any], np.ndarray] = compressed_to_rgb if compressed else image_to_rgb
        self.limits = limits

    # Called from subscription callbacks: store only, never convert (the executor must stay quick). Each
    # says whether the message brought something the buffer did not hold yet (a camera's first frame, a
    # joint's first position): what a start-up wait for the first messages looks out for.
    def put_image(self, slot: int, msg: Any) -> bool:
        with self._lock:
            first = self._images[slot] is None
            self._images[slot] = msg
        return first

    def put_joint_state(self, msg: Any, prefix: str = "") -> bool:
        """Store each named position as `prefix + name` (the arm's topic decides the prefix: an Interbotix
        ALOHA names both arms' joints alike). A message whose names and positions do not pair up (other
        counts, a name twice) is not stored: which position belongs to which joint is not known, and the
        next observation is a bad_state drop saying so, until the arm sends a well-formed one."""
        t = stamp_ns(msg.header)
        names, positions = list(msg.name), list(msg.position)
        fault = joint_state_fault(names, positions)
        with self._lock:
            if fault:
                self._joint_faults[prefix] = fault
                return False
            self._joint_faults.pop(prefix, None)
            held = len(self._joints)
            for name, position in zip(names, positions, strict=True):
                self._joints[prefix + name] = (t, float(position))
            return len(self._joints) > held

    def clear(self) -> None:
        with self._lock:
            self._images = [None] * len(self._images)
            self._joints.clear()
            self._joint_faults.clear()

    def observation(self, now_ns: int, prompt: str, slot_names: Sequence[str]) -> Observation:
        """The observation at `now_ns`, or ObservationUnavailable with the reason. Stamp = newest image."""
        with self._lock:
            images = list(self._images)
            joints = dict(self._joints)
            faults = dict(self._joint_faults)
        lim = self.limits
        stamps: list[int] = []
        rgb: dict[str, np.ndarray] = {}
        for slot, msg in enumerate(images):
            camera = (
                slot_names[slot] if self._topics is None else f"{slot_names[slot]} ({self._topics[slot]})"
            )
            if msg is None:
                raise ObservationUnavailable(DropReason.MISSING_CAMERA, f"no image yet for {camera}")
            t = stamp_ns(msg.header)
            if now_ns - t > lim.max_image_age_ns:
                raise ObservationUnavailable(
                    DropReason.STALE_IMAGE, f"{camera} is {(now_ns - t) / 1e6:.0f} ms old"
                )
            stamps.append(t)
            try:
                rgb[slot_names[slot]] = self._decode(msg)
            except ImageConversionError as e:
                raise ObservationUnavailable(DropReason.BAD_IMAGE, f"{camera}: {e}") from None
        if faults:
            said = "; ".join(
                f"{prefix or 'a joint state'}: {fault}" for prefix, fault in sorted(faults.items())
            )
            raise ObservationUnavailable(
                DropReason.BAD_STATE, f"a joint state that does not add up, not used ({said})"
            )
        missing = [n for n in self._sources if n not in joints]
        if missing:
            # The names that did arrive show a naming mismatch (a prefix missing or doubled) at a glance.
            held = f"; received {sorted(joints)[:8]}{' ...' if len(joints) > 8 else ''}" if joints else ""
            raise ObservationUnavailable(DropReason.MISSING_JOINTS, f"no position yet for {missing}{held}")
        raw = np.array([joints[n][1] for n in self._sources])
        state = ((raw - self._offset) * self._scale).astype(np.float32)
        joint_stamps = [joints[n][0] for n in self._sources]
        oldest_joint = min(joint_stamps)
        if now_ns - oldest_joint > lim.max_joint_age_ns:
            raise ObservationUnavailable(
                DropReason.STALE_JOINTS, f"joint state is {(now_ns - oldest_joint) / 1e6:.0f} ms old"
            )
        stamps += joint_stamps
        if max(stamps) > now_ns + lim.max_skew_ns:
            raise ObservationUnavailable(
                DropReason.FUTURE_STAMP,
                f"a stamp is {(max(stamps) - now_ns) / 1e6:.0f} ms ahead of the node clock",
            )
        if max(stamps) - min(stamps) > lim.max_skew_ns:
            raise ObservationUnavailable(
                DropReason.SKEW, f"stamps span {(max(stamps) - min(stamps)) / 1e6:.0f} ms"
            )
        if not np.isfinite(state).all():
            bad = [n for n, v in zip(self._joint_names, state, strict=True) if not np.isfinite(v)]
            raise ObservationUnavailable(DropReason.BAD_STATE, f"non-finite position for {bad}")
        newest_image = max(stamps[: len(images)])
        return Observation(images=rgb, state=state, prompt=prompt, stamp_ns=newest_image)
