"""`action_streamer`: an rclpy LifecycleNode that executes `rmuscle_node`'s action chunks on Interbotix arms.

`rmuscle_node` publishes a chunk of future actions every few control periods; an Interbotix X-series arm
(an ALOHA follower) takes one position command at a time, per joint group, on
`<robot>/commands/joint_group` (`interbotix_xs_msgs/JointGroupCommand`) and, for its gripper,
`<robot>/commands/joint_single` (`JointSingleCommand`). Every control period this node sends each arm the
row of the newest chunk that is due then (`chunk_schedule`: rows the call's latency made past are
skipped, a newer chunk takes over from its due row, nothing is sent once the newest has run out, no arm
joint's target is past its position limit (`arm_joint_limits`, the ViperX 300 6DOF's by default), and no
joint moves more than `max_step` per period, starting from the arm's measured position at activation and
from the command the arm holds after a hold; no arm joint is commanded further than `max_tracking_error`
from where it is measured; nothing is sent while the arms' joint states are not recent).

Lifecycle: configure validates the parameters (FAILURE names the bad one) and checks that the Interbotix
messages are importable; activate subscribes to the chunks and the arms' joint states, starts the control
timer and asks each arm's driver what it is (`robot_info_services`, below); deactivate stops sending at
once and forgets the chunks (the next activation starts from the arm again, and refuses chunks stamped
before it). Between episodes a cell deactivates it while the scene is reset and the arms go home, and
activates it again after: otherwise the chunk in hand, planned for the episode that ended, goes on
driving the arms for up to a chunk's length. A refused chunk (bad shape, other joints, another period,
non-finite values, stale, expired, stamped ahead of this clock or before the activation) is logged with
its reason and counted on /diagnostics; the chunk in execution goes on. /diagnostics also says at which
row the latest chunks took over (`takeover_row.p50` / `.max`, of the latest TAKEOVERS_KEPT): the rows
their calls' latency cost, in control periods, which is what a slower policy costs the arms. With
`takeover_delay_s` every chunk takes over at the same row, its call's latency permitting (`chunks_late`
counts those that came after it): a fixed execution delay.

What the drivers are asked, at every activation (the modes can be changed while the streamer is inactive):
the arm group `arm_group_name` must have `arm_joints` in that order (JointGroupCommand carries positions
in the group's order only: another order would send each value to another joint), be in a position mode
(in `velocity`, `pwm` or `current` mode the driver would take the positions as those), and
`arm_joint_limits` must lie within its limits (its URDF's); the gripper joint must be in a position mode;
and no arm's command or joint-state topic may be another arm's driver's (crossed remaps: `_crossed_remaps`).
Until every arm has answered, nothing is sent (the arms hold) and /diagnostics warns; a mismatch is logged as an
error, /diagnostics says ERROR naming it, and nothing is sent until the next activation. While active, an
arm whose driver's service goes away or whose joint states stop for DRIVER_RECHECK_S (a driver restarting
comes back with its launch modes) is asked again, and nothing is sent meanwhile.

The chunk stamps are observation times, so this node's clock must be the one the cameras and the policy
node stamp with (the system clock on a cell; /clock with use_sim_time when replaying a bag). A clock that
goes back by more than a period (a bag played again, a simulator restarted) is a new run: the chunks, the
last command and the joint states are forgotten, and `clock_jumps` on /diagnostics counts it.
"""

from __future__ import annotations

import importlib
import math
import sys
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import SetParametersResult
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import JointState

from rmuscle_ros.node.chunk_schedule import (
    ChunkRefused,
    ChunkSchedule,
    RefusalReason,
    ScheduleConfig,
    tick_time,
)
from rmuscle_ros.node.observation import joint_state_fault, stamp_ns
from rmuscle_ros.node.params import (
    ALOHA_JOINTS,
    MAX_SECONDS,
    ParameterError,
    check_closed_open,
    flat_config,
    flat_defaults,
    parameter_defaults,
)
from rmuscle_ros.node.spin import (
    clock_change_refused,
    integers_taken_as_floats,
    node_full_name,
    parameter_values,
    periodic_timer,
    same_value,
    spin_node,
    undeclared_overrides,
    unresolvable_topic,
)

COMMAND_MESSAGES = "interbotix_xs_msgs.msg"  # JointGroupCommand, JointSingleCommand
INFO_SERVICES = "interbotix_xs_msgs.srv"  # RobotInfo, the xs_sdk's get_robot_info
# The xs_sdk's operating modes in which a joint's command is a position in rad; the others take it as a
# velocity, a PWM, a current, or (linear_position, a gripper's) a finger position in m.
POSITION_MODES = ("position", "ext_position", "current_based_position")
# The drivers answer in float32: a limit within this (rad) of the configured one is the same.
LIMIT_TOLERANCE = 1e-4
ROBOT_INFO_POLL_S = 0.1  # while an arm's answer is awaited: how often the service is looked for
ROBOT_INFO_RETRY_S = 2.0  # a request unanswered this long is sent again
ROBOT_INFO_WARN_S = 2.0  # an arm that has not answered this long after it was asked is logged and warned
# An arm whose joint states stopped this long after its check passed (a driver restarting: it comes back with
# its launch modes, an ALOHA follower's gripper in linear_position) is asked again before more is sent.
DRIVER_RECHECK_S = 1.0
# How long the ROS graph may take to show which nodes serve the drivers' services and take the arms' topics
# (discovery can lag the service's answer) before the crossed-remaps check is given up, with a warning.
GRAPH_WAIT_S = 2.0
UNKNOWN_NODE = "_NODE_NAME_UNKNOWN_"  # rmw's name for an endpoint whose node is not known yet
REFUSAL_LOG_PERIOD_S = 1.0  # at most one refusal logged per this many seconds (each one is counted)
# /diagnostics warns for this long after a chunk is refused (then OK again: the counts stay). Routine, never
# warning: a chunk planned before the latest activation (a call in flight at an episode reset), and one
# planned from the same camera frames as the chunk in hand (a camera slower than the calls).
REFUSAL_WARN_S = 30.0
ROUTINE_REFUSALS = frozenset({RefusalReason.BEFORE_START.value, RefusalReason.SAME_OBSERVATION.value})
TAKEOVERS_KEPT = 100  # the takeover rows /diagnostics summarises: the latest chunks'
CLAMP_LOG_PERIOD_S = 5.0  # at most one clamped command logged per this many seconds (each one is counted)
RESYNC_LOG_PERIOD_S = 1.0  # at most one resynced command logged per this many seconds (each one is counted)
# /diagnostics warns while at least this share of the commands since the last report were held at a
# position limit (a policy asking past the arm's travel, in other units, miscalibrated), and for
# REFUSAL_WARN_S after an arm joint strayed past max_tracking_error.
CLAMP_WARN_SHARE = 0.5
# [lower, upper] (rad) of the ViperX 300 6DOF's waist, shoulder, elbow, forearm_roll, wrist_angle and
# wrist_rotate: Interbotix's aloha_vx300s.urdf.xacro (±(pi - 1e-5); -106, 72; -101, 92; -107, 128 degrees).
_ROLL = math.pi - 1e-5
VX300S_JOINTS = ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate")
VX300S_LIMITS = (
    *(-_ROLL, _ROLL),  # waist
    *(math.radians(-106), math.radians(72)),  # shoulder
    *(math.radians(-101), math.radians(92)),  # elbow
    *(-_ROLL, _ROLL),  # forearm_roll
    *(math.radians(-107), math.radians(128)),  # wrist_angle
    *(-_ROLL, _ROLL),  # wrist_rotate
)


@dataclass(frozen=True)
class StreamerConfig:
    """The streamer's parameters (validated). Defaults: an ALOHA cell's two Interbotix follower arms."""

    # The chunks' action order; a chunk naming other joints is refused.
    joint_names: tuple[str, ...] = ALOHA_JOINTS
    # The arms' joint states, with the prefix that makes each arm's names unique (as in rmuscle_node).
    joint_state_topics: tuple[str, ...] = ("joint_states/left", "joint_states/right")
    joint_name_prefixes: tuple[str, ...] = ("left_", "right_")
    # One arm per prefix: its joint group (the arm joints, in the group's order, unprefixed) and its gripper.
    arm_joints: tuple[str, ...] = VX300S_JOINTS
    arm_group_name: str = "arm"
    arm_command_topics: tuple[str, ...] = ("commands/left/joint_group", "commands/right/joint_group")
    gripper_joint: str = "gripper"  # "": the arms have no gripper command
    gripper_command_topics: tuple[str, ...] = ("commands/left/joint_single", "commands/right/joint_single")
    # The gripper joint's command for the chunk's gripper value 0 and 1: [closed, open]. An ALOHA policy's
    # gripper action is its opening, 0 closed ... 1 open; [0, 1] sends the value as it is.
    gripper_command_range: tuple[float, float] = (0.0, 1.0)
    control_period_s: float = 0.02  # one command per arm per period; a chunk's period must be the same
    max_step: float = 0.1  # the most one joint's command moves per period (command units: rad); > 0
    # Each arm joint's position limits (rad), [lower, upper] per arm_joints entry in its order, for every
    # arm: a target beyond one is commanded at the limit and counted (`clamped`). The default is the
    # ALOHA's ViperX 300 6DOF follower (Interbotix aloha_vx300s URDF; gym-aloha's MuJoCo ranges are the
    # same). -.inf / .inf: no limit, only without the activation's driver check (robot_info_services [],
    # or a driver without a robot_description), which refuses limits past the driver's. The gripper's are
    # its gripper_command_range (`position_limits`).
    arm_joint_limits: tuple[float, ...] = VX300S_LIMITS
    max_future_s: float = 0.05  # a chunk stamped further ahead of this node's clock is refused
    # Rows of each chunk executed at most (past them the arms hold until a newer chunk): bounds how long a
    # stalled policy's last plan is followed. 0: every row (a 50-row chunk at 50 Hz: 1 s).
    max_rows: int = 0
    # A chunk takes over no earlier than this long after its stamp, the previous one going on meanwhile, so
    # that the arms follow the same rows of each plan however long its call took (below the delay; a
    # later chunk takes over on arrival and is counted, `chunks_late`). 0: as soon as it arrives.
    takeover_delay_s: float = 0.0
    max_joint_age_s: float = 0.1  # joint positions older than this do not count as where the arm is
    # No arm joint is commanded further than this (rad) from where it is measured: one that strayed past it
    # from its last command (torque off and the arm sagged, moved by hand, stalled against an obstacle, a
    # motor restarted, or an arm slower than its commands) has its command moved toward it, at most
    # max_step a period, instead of on toward the row; counted (`resynced`) and warned. The grippers are
    # not checked (closed on an object, one measures open of its command). .inf: no check.
    max_tracking_error: float = 0.3
    # Per arm, its driver's get_robot_info service (interbotix_xs_msgs/RobotInfo: the xs_sdk's
    # `<robot_name>/get_robot_info`), asked at each activation: nothing is sent until each answer says the
    # group has arm_joints in that order, in a position mode, within its limits, and the gripper joint is
    # in a position mode. []: not asked (a driver without the service; a replayed bag has no driver).
    robot_info_services: tuple[str, ...] = ("get_robot_info/left", "get_robot_info/right")

    def __post_init__(self) -> None:
        for name in ("joint_names", "joint_state_topics", "arm_joints", "arm_command_topics"):
            values = getattr(self, name)
            if not values or any(not v for v in values) or len(set(values)) != len(values):
                raise ParameterError(f"{name}: needs distinct, non-empty entries, got {list(values)}")
        arms = len(self.joint_name_prefixes)
        if len(self.joint_state_topics) != arms:
            raise ParameterError(
                f"joint_name_prefixes: needs one entry per joint_state_topics entry ({len(self.joint_state_topics)}), "
                f"got {list(self.joint_name_prefixes)}"
            )
        if len(self.arm_command_topics) != arms:
            raise ParameterError(
                f"arm_command_topics: needs one topic per arm (joint_name_prefixes has {arms}), "
                f"got {list(self.arm_command_topics)}"
            )
        if self.gripper_joint and len(self.gripper_command_topics) != arms:
            raise ParameterError(
                f"gripper_command_topics: needs one topic per arm (joint_name_prefixes has {arms}), "
                f"got {list(self.gripper_command_topics)}"
            )
        services = self.robot_info_services
        if services and (len(services) != arms or any(not v for v in services) or len(set(services)) != arms):
            raise ParameterError(
                f"robot_info_services: needs one distinct, non-empty service per arm (joint_name_prefixes has "
                f"{arms}), or [] not to ask the drivers, got {list(services)}"
            )
        if not self.arm_group_name:
            raise ParameterError("arm_group_name: must not be empty")
        for prefix in self.joint_name_prefixes:
            for joint in (*self.arm_joints, *([self.gripper_joint] if self.gripper_joint else [])):
                if prefix + joint not in self.joint_names:
                    raise ParameterError(
                        f"joint_names: has no {prefix + joint!r} (joint_name_prefixes {prefix!r} + {joint!r}), "
                        f"so that arm's command would have no value for it"
                    )
        check_closed_open("gripper_command_range", self.gripper_command_range)
        limits = self.arm_joint_limits
        if limits == VX300S_LIMITS and self.arm_joints != VX300S_JOINTS:
            raise ParameterError(
                f"arm_joint_limits: the default is the ViperX 300 6DOF's, for its joints {list(VX300S_JOINTS)} "
                f"in that order; set the limits of arm_joints {list(self.arm_joints)}"
            )
        if len(limits) != 2 * len(self.arm_joints):
            raise ParameterError(
                f"arm_joint_limits: needs [lower, upper] per arm_joints entry ({2 * len(self.arm_joints)} "
                f"values), got {len(limits)}"
            )
        for joint, lo, hi in zip(self.arm_joints, limits[::2], limits[1::2], strict=True):
            if not lo < hi:  # NaN fails too
                raise ParameterError(f"arm_joint_limits: {joint} needs lower < upper, got [{lo!r}, {hi!r}]")
        if not self.max_tracking_error > 0:  # NaN fails too
            raise ParameterError(
                f"max_tracking_error: must be > 0 (.inf: no check), got {self.max_tracking_error!r}"
            )
        if not (self.max_joint_age_s > 0 and math.isfinite(self.max_joint_age_s)):
            raise ParameterError(f"max_joint_age_s: must be > 0, got {self.max_joint_age_s!r}")
        # As the node's (found in review: a period of 1e10 s configured, then activate failed silently).
        for name in ("control_period_s", "max_joint_age_s", "max_future_s", "takeover_delay_s"):
            if getattr(self, name) > MAX_SECONDS:
                raise ParameterError(
                    f"{name}: must be at most {MAX_SECONDS:g} s, got {getattr(self, name)!r}"
                )
        try:
            self.schedule()
        except ValueError as e:
            raise ParameterError(str(e)) from None

    def schedule(self) -> ScheduleConfig:
        return ScheduleConfig(
            self.joint_names,
            self.control_period_s,
            self.max_step,
            self.max_future_s,
            self.max_rows,
            self.takeover_delay_s,
            *self.position_limits(),
            self.tracking_bounds(),
        )

    def tracking_bounds(self) -> tuple[float, ...]:
        """max_tracking_error per joint, in joint_names order: the arm joints', none (inf) for the rest."""
        bounds = [math.inf] * len(self.joint_names)
        for indices in self.arm_indices():
            for i in indices:
                bounds[i] = self.max_tracking_error
        return tuple(bounds)

    def position_limits(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(lower, upper) in joint_names order, in command units: each arm's joints from arm_joint_limits,
        each gripper between its closed and open commands (gripper_command_range), the rest unlimited. A
        policy's gripper opening past 0 … 1 would otherwise be commanded past the gripper's calibrated
        travel, into its end stop (found in review)."""
        lower, upper = [-math.inf] * len(self.joint_names), [math.inf] * len(self.joint_names)
        for indices in self.arm_indices():
            for k, i in enumerate(indices):
                lower[i], upper[i] = self.arm_joint_limits[2 * k], self.arm_joint_limits[2 * k + 1]
        closed, opened = self.gripper_command_range
        for i in self.gripper_indices():
            lower[i], upper[i] = min(closed, opened), max(closed, opened)
        return tuple(lower), tuple(upper)

    def arm_indices(self) -> list[list[int]]:
        """Per arm, the action indices of its group's joints, in the group's order."""
        return [[self.joint_names.index(p + j) for j in self.arm_joints] for p in self.joint_name_prefixes]

    def gripper_indices(self) -> list[int]:
        if not self.gripper_joint:
            return []
        return [self.joint_names.index(p + self.gripper_joint) for p in self.joint_name_prefixes]

    def to_commands(self, rows: np.ndarray) -> np.ndarray:
        """A chunk's rows in the arms' command units: each gripper column mapped onto gripper_command_range."""
        closed, opened = self.gripper_command_range
        out = np.array(rows, dtype=np.float64)
        for i in self.gripper_indices():
            out[:, i] = closed + out[:, i] * (opened - closed)
        return out


def streamer_defaults() -> dict[str, Any]:
    return flat_defaults(StreamerConfig)


def streamer_config(params: Mapping[str, Any]) -> StreamerConfig:
    """Validate `params` (the node's parameter values) and build the StreamerConfig."""
    return flat_config(StreamerConfig, params)


def import_command_messages() -> tuple[type, type]:
    """(JointGroupCommand, JointSingleCommand), or ImportError saying where they come from."""
    try:
        module = importlib.import_module(COMMAND_MESSAGES)
    except ImportError as e:
        raise ImportError(
            f"{COMMAND_MESSAGES} is not importable ({e}): the Interbotix arms' command messages come with the "
            "cell's Interbotix workspace (interbotix_ros_core); source it before starting action_streamer"
        ) from None
    return module.JointGroupCommand, module.JointSingleCommand


def import_robot_info() -> type:
    """RobotInfo (the service's type), or ImportError saying where it comes from."""
    try:
        return importlib.import_module(INFO_SERVICES).RobotInfo
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"{INFO_SERVICES}.RobotInfo is not importable ({e}): it comes with the cell's Interbotix workspace "
            "(interbotix_ros_core); source it, or set robot_info_services: [] for arms whose driver has none"
        ) from None


def robot_info_problem(cfg: StreamerConfig, group: Any, gripper: Any | None) -> str:
    """What in one arm's driver's answers (RobotInfo responses: its group `cfg.arm_group_name`, its joint
    `cfg.gripper_joint` or None without a gripper) would make the streamer's commands wrong; "" if nothing."""
    name = cfg.arm_group_name
    joints = list(group.joint_names)
    if not joints:
        return f"the driver has no joint group {name!r} (arm_group_name)"
    if joints != list(cfg.arm_joints):
        return (
            f"the driver's group {name!r} has the joints {joints}, arm_joints says {list(cfg.arm_joints)}: a "
            "command carries positions in the group's order, so they would go to other joints"
        )
    set_mode = (
        "with the driver's set_operating_modes service (interbotix_xs_msgs/srv/OperatingModes) or its modes "
        "file, then activate the streamer again"
    )
    if group.mode not in POSITION_MODES:
        return (
            f"the driver's group {name!r} is in {group.mode!r} mode, which would take the position commands as "
            f"{group.mode} commands; set it to one of {list(POSITION_MODES)} {set_mode}"
        )
    lower, upper = list(group.joint_lower_limits), list(group.joint_upper_limits)
    if lower or upper:  # none from a driver without a robot_description: nothing to check against (logged)
        if len(lower) != len(joints) or len(upper) != len(joints):
            return f"the driver's answer has {len(lower)} lower and {len(upper)} upper limits for {len(joints)} joints"
        limits = cfg.arm_joint_limits
        for k, joint in enumerate(joints):
            lo, hi = limits[2 * k], limits[2 * k + 1]
            if lo < lower[k] - LIMIT_TOLERANCE or hi > upper[k] + LIMIT_TOLERANCE:
                return (
                    f"arm_joint_limits: {joint} [{lo:.5g}, {hi:.5g}] reaches past the driver's limits "
                    f"[{lower[k]:.5g}, {upper[k]:.5g}] (its URDF's); set them within"
                )
    if gripper is not None:
        if not list(gripper.joint_names):
            return f"the driver has no joint {cfg.gripper_joint!r} (gripper_joint)"
        if gripper.mode not in POSITION_MODES:
            launch = (
                " (an ALOHA follower's modes file starts its gripper in linear_position, metres between the "
                "fingers; Interbotix aloha's follower setup puts it in current_based_position)"
                if gripper.mode == "linear_position"
                else ""
            )
            return (
                f"the driver's {cfg.gripper_joint!r} is in {gripper.mode!r} mode, which would take its position "
                f"commands (rad) as {gripper.mode} commands{launch}; set it to one of {list(POSITION_MODES)} "
                f"{set_mode}"
            )
    return ""


@dataclass
class _DriverCheck:
    """One arm's get_robot_info: its client, and this activation's answers and verdict."""

    service: str  # resolved
    client: Any
    answers: dict[str, Any] = field(default_factory=dict)  # "group" / "gripper" -> the driver's response
    futures: list[Any] = field(default_factory=list)  # the latest requests'
    sent_at: float = -math.inf  # time.monotonic() of the latest request
    problem: str = ""  # what the answers showed to be wrong
    passed_at: float | None = None  # time.monotonic() when the answers passed; None: they have not
    asked_since: float = -math.inf  # time.monotonic() since when an answer is wanted
    wait_logged: bool = False  # that no answer came within ROBOT_INFO_WARN_S
    generation: int = 0  # counts resets: an answer to a request made before the latest one is dropped

    @property
    def passed(self) -> bool:
        return self.passed_at is not None

    def drop_requests(self) -> None:
        """Forget the requests in flight (their answers would never be taken) and the answers so far."""
        for future in self.futures:
            self.client.remove_pending_request(future)
        self.futures, self.answers = [], {}

    def reset(self, now: float) -> None:
        """Ask again: what the driver answered before no longer counts (its requests are dropped)."""
        self.drop_requests()
        self.sent_at, self.problem, self.passed_at = -math.inf, "", None
        self.asked_since, self.wait_logged = now, False
        self.generation += 1


class ActionStreamerNode(LifecycleNode):
    def __init__(self, node_name: str = "action_streamer", **kwargs: Any) -> None:
        super().__init__(node_name, **kwargs)
        for name, default in streamer_defaults().items():
            self.declare_parameter(name, default)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        integers_taken_as_floats(self)
        self.cfg: StreamerConfig | None = None
        self._schedule: ChunkSchedule | None = None
        self._messages: tuple[type, type] | None = None
        # Each arm's publisher with the action indices it sends (joint_names.index lookups done once).
        self._arm_pubs: list[tuple[Any, list[int]]] = []
        self._gripper_pubs: list[tuple[Any, int]] = []
        self._diag_pub: Any = None
        self._subs: list[Any] = []
        self._timers: list[Any] = []
        self._joints: dict[str, tuple[int, float]] = {}  # prefixed joint name -> (stamp ns, position)
        self._counts: Counter[str] = Counter()
        self._refused: Counter[str] = Counter()
        self._last_refusal = ""
        self._last_refusal_logged = -math.inf
        self._last_fault_at = -math.inf  # time.monotonic() of the latest refusal that is not routine
        self._last_fault = ""  # its message (a routine refusal after it does not hide it)
        self._waiting_reported = 0  # waiting_for_joints at the latest /diagnostics
        self._last_clamp = ""  # the latest command held at a position limit, what its chunk asked for
        self._last_clamp_logged = -math.inf
        self._clamped_reported = self._commands_reported = 0  # the counts at the latest /diagnostics
        self._last_resync = ""  # the latest command moved toward the arm, and where the arm was
        self._last_resync_at = self._last_resync_logged = -math.inf
        self._last_command: Any = None  # chunk_schedule.Command
        self._takeover_rows: deque[int] = deque(maxlen=TAKEOVERS_KEPT)  # each chunk's first executed row
        # The newest chunk that came before this node had a time (use_sim_time, no /clock yet): offered at
        # the first tick, which comes with the clock, instead of refused as stamped ~55 years ahead.
        self._before_clock: Any = None
        self._robot_info: Any = None  # RobotInfo, with robot_info_services
        self._checks: list[_DriverCheck] = []  # per arm, with robot_info_services
        # The ROS graph's verdict on crossed remaps, once every arm's answers passed: "pending", "ok" or the
        # problem; and since when it is wanted (time.monotonic()).
        self._graph = "pending"
        self._graph_since = -math.inf
        self._joints_arrived: list[float] = []  # per arm: time.monotonic() of its latest joint states
        self._control_timer: Any = None  # while active

    # -- lifecycle ---------------------------------------------------------------------------------------
    def _on_set_parameters(self, params: list[Any]) -> SetParametersResult:
        """`ros2 param set` (or `param load`): every parameter is read at configure, so a configured streamer
        refuses a change, saying how to make it; unconfigured, configure checks it. Before (found in
        review) a change was accepted and `get` showed it while the arms ran on the old value."""
        clock = clock_change_refused(self, params, bool(self._timers), "streamer")
        if clock:
            return SetParametersResult(successful=False, reason=clock)
        if self.cfg is None:
            return SetParametersResult(successful=True)
        current = parameter_values(self, streamer_defaults(), strict=False)  # [] in a file reads as unset
        changed = sorted(
            p.name for p in params if p.name in current and not same_value(p.value, current[p.name])
        )
        if not changed:
            return SetParametersResult(successful=True)
        return SetParametersResult(
            successful=False,
            reason=f"{changed[0]}: read at configure; deactivate and clean up the streamer, set it, then "
            "configure again",
        )

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        # A misspelt key in the params file is dropped by rclpy: refused here, or its default would move
        # the arms (found in review: `max_steps: 0.04` configured with max_step 0.1).
        unknown, others = undeclared_overrides(self, streamer_defaults(), others_names=parameter_defaults())
        if others:
            self.get_logger().info(f"configure: parameters given that are not this node's, ignored: {others}")
        try:
            if unknown:
                raise ParameterError(f"{sorted(unknown)[0]}: not a parameter of action_streamer")
            cfg = streamer_config(parameter_values(self, streamer_defaults()))
            bad = unresolvable_topic(
                self,
                cfg,
                ("joint_state_topics", "arm_command_topics", "gripper_command_topics"),
                services=("robot_info_services",),
            )
            if bad:
                raise ParameterError(bad)
            messages = import_command_messages()
            robot_info = import_robot_info() if cfg.robot_info_services else None
        except (ParameterError, ImportError) as e:
            self.get_logger().error(f"configure failed: {e}")
            return TransitionCallbackReturn.FAILURE
        self.cfg, self._messages, self._robot_info = cfg, messages, robot_info
        self._schedule = ChunkSchedule(cfg.schedule())
        group, single = messages
        try:
            for t, indices in zip(cfg.arm_command_topics, cfg.arm_indices(), strict=True):
                self._arm_pubs.append((self.create_lifecycle_publisher(group, t, 10), indices))
            for t, index in zip(
                cfg.gripper_command_topics, cfg.gripper_indices(), strict=False
            ):  # none: no gripper
                self._gripper_pubs.append((self.create_lifecycle_publisher(single, t, 10), index))
            self._diag_pub = self.create_lifecycle_publisher(DiagnosticArray, "/diagnostics", 10)
            for service in cfg.robot_info_services:
                client = self.create_client(robot_info, service)
                self._checks.append(_DriverCheck(self.resolve_service_name(service), client))
        except Exception as e:  # a clean FAILURE, the node unconfigured with nothing left made
            self._release()
            self.get_logger().error(f"configure failed: {type(e).__name__}: {e}")
            return TransitionCallbackReturn.FAILURE
        self.get_logger().info(
            f"configured: {len(cfg.arm_command_topics)} arms, {len(cfg.joint_names)} joints, "
            f"{1 / cfg.control_period_s:.0f} Hz, max_step {cfg.max_step:g}, arm joint limits "
            + ", ".join(
                f"{j} [{lo:.4g}, {hi:.4g}]"
                for j, lo, hi in zip(
                    cfg.arm_joints, cfg.arm_joint_limits[::2], cfg.arm_joint_limits[1::2], strict=True
                )
            )
            + (
                f"; at each activation the arms' drivers are asked ({', '.join(c.service for c in self._checks)})"
                if self._checks
                else "; robot_info_services is []: the arms' joint order and operating modes are not checked"
            )
        )
        return super().on_configure(state)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            self._start_streaming()
        except Exception as e:  # a clean FAILURE, the node stays configured with nothing left running
            self._stop_streaming()
            self.get_logger().error(f"activate failed: {type(e).__name__}: {e}")
            return TransitionCallbackReturn.FAILURE
        return super().on_activate(state)

    def _start_streaming(self) -> None:
        """Activate's subscriptions and timers; the schedule starts."""
        from rmuscle_ros.msg import ActionChunk  # generated interfaces: imported where the node needs them

        cfg = self.cfg
        assert cfg is not None
        self._subs.append(self.create_subscription(ActionChunk, "action_chunk", self._on_chunk, 10))
        for arm, topic in enumerate(cfg.joint_state_topics):
            self._subs.append(
                self.create_subscription(
                    JointState,
                    topic,
                    lambda msg, arm=arm: self._on_joints(msg, arm),
                    qos_profile_sensor_data,
                )
            )
        steady = Clock(clock_type=ClockType.STEADY_TIME)
        self._control_timer = periodic_timer(self, cfg.control_period_s, self._on_tick)
        self._timers = [
            self._control_timer,
            # On the wall clock: a replayed bag's /clock stops between bags, the diagnostics should not.
            self.create_timer(1.0, self._publish_diagnostics, clock=steady),
        ]
        # The drivers are asked again: their modes may have been changed while this node was inactive.
        for check in self._checks:
            check.reset(time.monotonic())
        self._graph = "pending"
        self._joints_arrived = [-math.inf] * len(cfg.joint_state_topics)
        if self._checks:
            self._timers.append(self.create_timer(ROBOT_INFO_POLL_S, self._ask_drivers, clock=steady))
        assert self._schedule is not None
        # Chunks planned before now are refused: the arms may have been moved since (an episode reset).
        self._schedule.start(self.get_clock().now().nanoseconds)
        # a fault or a stray arm before the deactivation no longer warns (counts stay)
        self._last_fault_at = self._last_resync_at = -math.inf

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_streaming()
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState | None) -> TransitionCallbackReturn:
        self._stop_streaming()
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def _stop_streaming(self) -> None:
        for timer in self._timers:
            self.destroy_timer(timer)
        for sub in self._subs:
            self.destroy_subscription(sub)
        self._timers, self._subs, self._control_timer = [], [], None
        if self._schedule is not None:
            self._schedule.reset()
        self._joints.clear()
        self._last_command = self._before_clock = None
        for check in self._checks:  # an answer that comes now is not the next activation's
            check.reset(-math.inf)

    def _release(self) -> None:
        for check in self._checks:
            self.destroy_client(check.client)
        self._checks = []
        pubs = [pub for pub, _ in (*self._arm_pubs, *self._gripper_pubs)]
        for pub in (*pubs, *([self._diag_pub] if self._diag_pub else [])):
            self.destroy_lifecycle_publisher(pub)
        self._arm_pubs, self._gripper_pubs, self._diag_pub = [], [], None
        self.cfg = self._schedule = self._messages = self._robot_info = None

    # -- the drivers' answers -----------------------------------------------------------------------------
    def _ask_drivers(self) -> None:
        """Every ROBOT_INFO_POLL_S while active. An arm's driver whose answers are wanted is asked once its
        service is there, again if unanswered after ROBOT_INFO_RETRY_S, and named in the log once it has not
        answered for ROBOT_INFO_WARN_S. An arm that passed is asked again when its driver's service goes
        away, or its joint states stop for DRIVER_RECHECK_S (a driver that restarted comes back with the
        modes of its launch)."""
        cfg, robot_info = self.cfg, self._robot_info
        if cfg is None or robot_info is None:
            return
        now = time.monotonic()
        for arm, check in enumerate(self._checks):
            gone = self._driver_gone(arm, check, now) if check.passed else ""
            if gone:
                check.reset(now)
                if self._graph == "ok":
                    self._graph = "pending"
                # As after an activation: the arm may have moved meanwhile (a driver that restarted after a
                # fault, its torque off), so commands start again from where it is, with chunks planned after.
                assert self._schedule is not None
                self._schedule.start(self.get_clock().now().nanoseconds)
                self._last_command = None
                self.get_logger().warning(
                    f"{check.service}: {gone}; nothing is sent to the arms until its driver answers again"
                )
        self._check_graph(now)
        pending = [c for c in self._checks if not c.passed and not c.problem]
        requests = [("group", "group", cfg.arm_group_name)]
        if cfg.gripper_joint:
            requests.append(("gripper", "single", cfg.gripper_joint))
        for check in pending:
            if now - check.sent_at >= ROBOT_INFO_RETRY_S and check.client.service_is_ready():
                check.drop_requests()  # unanswered ones are not kept for ever
                check.sent_at = now
                for kind, cmd_type, name in requests:
                    future = check.client.call_async(robot_info.Request(cmd_type=cmd_type, name=name))
                    check.futures.append(future)
                    future.add_done_callback(
                        partial(self._on_answer, check, kind, check.generation, len(requests))
                    )
            if now - check.asked_since >= ROBOT_INFO_WARN_S and not check.wait_logged:
                check.wait_logged = True
                self.get_logger().warning(
                    f"no answer from {check.service} (the arm driver's get_robot_info) for "
                    f"{now - check.asked_since:.1f} s: nothing is sent to the arms until it answers. Is the "
                    "driver running, the remap right? robot_info_services: [] skips the check for a driver "
                    "without that service"
                )

    def _driver_gone(self, arm: int, check: _DriverCheck, now: float) -> str:
        """Why an arm's passed check no longer holds ("" while it does): its service went away, or its joint
        states, which came up to DRIVER_RECHECK_S before the check passed or since, have not come for
        DRIVER_RECHECK_S since the pass or the latest (on the wall clock: a simulated or replayed clock may
        jump)."""
        if not check.client.service_is_ready():
            return "its get_robot_info went away (the driver stopped?)"
        arrived = self._joints_arrived[arm]
        assert check.passed_at is not None
        # Joint states that came around the pass and stopped: not ones already gone before it (a driver that
        # answers with its arm's states still missing is not asked again every second).
        flowing = arrived >= check.passed_at - DRIVER_RECHECK_S
        if flowing and now - max(arrived, check.passed_at) >= DRIVER_RECHECK_S:
            return f"its joint states stopped for {DRIVER_RECHECK_S:g} s or more (the driver restarted?)"
        return ""

    def _on_answer(self, check: _DriverCheck, kind: str, generation: int, want: int, future: Any) -> None:
        """One of an arm's driver's answers: once it has given all, check them against the parameters."""
        cfg = self.cfg
        if cfg is None or generation != check.generation or check.passed or check.problem:
            return  # an answer to a request made before the check was reset, or after the verdict
        check.answers[kind] = future.result()
        if len(check.answers) < want:
            return
        problem = robot_info_problem(cfg, check.answers["group"], check.answers.get("gripper"))
        if problem:
            check.problem = f"{check.service}: {problem}"
            self.get_logger().error(
                f"{check.problem}. Nothing is sent to the arms until the streamer is activated again"
            )
            return
        check.passed_at = time.monotonic()
        group, gripper = check.answers["group"], check.answers.get("gripper")
        if not list(group.joint_lower_limits):
            self.get_logger().warning(
                f"{check.service}: the driver gave no joint limits (started without a robot_description?): "
                "arm_joint_limits are not checked against the arm's"
            )
        self.get_logger().info(
            f"{check.service}: group {cfg.arm_group_name!r} has {list(cfg.arm_joints)} in {group.mode!r} mode"
            + (f"; {cfg.gripper_joint!r} in {gripper.mode!r} mode" if gripper is not None else "")
        )
        self._graph_since = check.passed_at
        self._check_graph(check.passed_at)

    def _check_graph(self, now: float) -> None:
        """Once every arm's answers passed: the crossed-remaps check, again at each poll while the graph does
        not yet show the nodes (given up after GRAPH_WAIT_S, with a warning)."""
        if self._graph != "pending" or not self._checks or not all(c.passed for c in self._checks):
            return
        crossed, settled = self._crossed_remaps()
        if crossed:
            self._graph = crossed
            self.get_logger().error(
                f"{crossed}. Nothing is sent to the arms until the streamer is activated again"
            )
        elif settled:
            self._graph = "ok"
        elif now - self._graph_since >= GRAPH_WAIT_S:
            self._graph = "ok"
            self.get_logger().warning(
                f"the ROS graph did not show which nodes serve {', '.join(c.service for c in self._checks)} and "
                f"take the arms' topics within {GRAPH_WAIT_S:g} s: crossed remaps between the arms not checked"
            )

    def _crossed_remaps(self) -> tuple[str, bool]:
        """(problem, settled): the problem is "" unless an arm's command or joint-state topic is another arm's:
        taken (or published) by the node that answers another arm's get_robot_info (crossed remaps would send
        the left arm's plan to the right arm). A topic between the streamer and a driver (a relay, a safety
        filter) is no evidence, nor is one node that drives every arm. Not settled while the graph does not
        yet name a service's node or a topic's endpoint's."""
        cfg = self.cfg
        assert cfg is not None
        servers = [self._serving_node(check.service) for check in self._checks]
        if None in servers:
            return "", False
        if len(set(servers)) < len(servers):
            return "", True
        settled = True
        for i, check in enumerate(self._checks):
            topics = [(cfg.arm_command_topics[i], self.get_subscriptions_info_by_topic, "taken")]
            if cfg.gripper_joint:
                topics.append((cfg.gripper_command_topics[i], self.get_subscriptions_info_by_topic, "taken"))
            topics.append((cfg.joint_state_topics[i], self.get_publishers_info_by_topic, "published"))
            for topic, endpoints, verb in topics:
                resolved = self.resolve_topic_name(topic)
                nodes = {(e.node_name, e.node_namespace) for e in endpoints(resolved)}
                settled = settled and all(name != UNKNOWN_NODE for name, _ in nodes)
                others = [j for j, other in enumerate(servers) if j != i and other in nodes]
                if others:
                    j = others[0]
                    problem = (
                        f"{resolved}, the arm's topic beside {check.service}, is {verb} by "
                        f"{node_full_name(*servers[j])}, which answers {self._checks[j].service} (another arm's): "
                        "crossed remaps"
                    )
                    return problem, True
        return "", settled

    def _serving_node(self, service: str) -> tuple[str, str] | None:
        """(name, namespace) of the node that serves `service` (resolved), if the graph shows one."""
        for name, namespace in self.get_node_names_and_namespaces():
            try:
                services = self.get_service_names_and_types_by_node(name, namespace)
            except Exception:  # the node left meanwhile
                continue
            if any(found == service for found, _ in services):
                return name, namespace
        return None

    def _drivers_ok(self) -> bool:
        """Every arm's driver has answered, its answers match the parameters, and the remaps are not crossed."""
        return not self._checks or (all(check.passed for check in self._checks) and self._graph == "ok")

    def _drivers_problem(self) -> str:
        """What an arm's driver answered wrong, or the crossed remaps ("" if nothing, so far)."""
        problems = [c.problem for c in self._checks if c.problem]
        if self._graph not in ("pending", "ok"):
            problems.append(self._graph)
        return problems[0] if problems else ""

    def _drivers_state(self) -> str:
        """For /diagnostics: "not asked", "checked", "waiting for <what>", or the first problem."""
        if not self._checks:
            return "not asked"
        problem = self._drivers_problem()
        if problem:
            return problem
        waiting = [c.service for c in self._checks if not c.passed]
        if waiting:
            return f"waiting for {', '.join(waiting)}"
        if self._graph == "pending":
            return "waiting for the ROS graph to show the drivers' nodes"
        return "checked"

    # -- callbacks ---------------------------------------------------------------------------------------
    def _on_joints(self, msg: JointState, arm: int) -> None:
        """One arm's joint states (`joint_state_topics[arm]`), its names prefixed with its prefix."""
        assert self.cfg is not None
        prefix = self.cfg.joint_name_prefixes[arm]
        self._joints_arrived[arm] = time.monotonic()  # its driver is publishing (for _driver_gone)
        names, positions = list(msg.name), list(msg.position)
        if joint_state_fault(names, positions):
            # which position is which joint's is not known: not taken as where the arm is (counted)
            self._counts["bad_joint_states"] += 1
            return
        t = stamp_ns(msg.header)
        for name, position in zip(names, positions, strict=True):
            self._joints[prefix + name] = (t, float(position))

    def _measured(self, now_ns: int) -> np.ndarray | None:
        """The arm's joint positions in action order, if every one is known and recent enough."""
        cfg = self.cfg
        assert cfg is not None
        held = [self._joints.get(n) for n in cfg.joint_names]
        if not all(self._usable(h, now_ns) for h in held):
            return None
        return np.array([h[1] for h in held if h is not None])

    def _usable(self, reading: tuple[int, float] | None, now_ns: int) -> bool:
        """A joint's (stamp, position) is a reading of where it is now: known, finite, and no older than
        max_joint_age_s (nor stamped further ahead than that: a clock that went back)."""
        cfg = self.cfg
        assert cfg is not None
        return (
            reading is not None
            and abs(now_ns - reading[0]) <= cfg.max_joint_age_s * 1e9
            and math.isfinite(reading[1])
        )

    def _on_chunk(self, msg: Any) -> None:
        schedule = self._schedule
        if schedule is None:
            return
        now = self.get_clock().now().nanoseconds
        if now == 0:  # simulated time that has not started: hold the newest chunk for the first tick
            if self._before_clock is None:
                self.get_logger().info(
                    "a chunk came before the first /clock (use_sim_time): held until it comes"
                )
            self._before_clock = msg
            return
        cfg = self.cfg
        assert cfg is not None
        self._note_clock(now)
        try:
            actions = np.asarray(msg.actions, dtype=np.float64)
            if msg.action_dim == len(cfg.joint_names) and actions.size % len(cfg.joint_names) == 0:
                # In command units from here on: the rate limit compares them with the measured joints.
                actions = cfg.to_commands(actions.reshape(-1, len(cfg.joint_names)))
            chunk = schedule.offer(
                stamp_ns=stamp_ns(msg.header),
                actions=actions,
                horizon=int(msg.horizon),
                action_dim=int(msg.action_dim),
                control_period_s=float(msg.control_period_s),
                joint_names=list(msg.joint_names),
                episode_id=int(msg.episode_id),
                chunk_id=int(msg.chunk_id),
                now_ns=now,
            )
            self._counts["chunks_accepted"] += 1
            if cfg.takeover_delay_s > 0 and now > chunk.takeover_ns:
                self._counts["chunks_late"] += 1  # its call took longer than the delay
        except ChunkRefused as e:
            self._refuse(e.reason.value, f"episode {msg.episode_id} chunk {msg.chunk_id} refused: {e}")
        except Exception as e:  # a message this node cannot read at all: counted, never fatal
            self._refuse("error", f"episode {msg.episode_id} chunk {msg.chunk_id} unreadable: {e!r}")

    def _refuse(self, reason: str, message: str) -> None:
        self._refused[reason] += 1
        self._last_refusal = message
        now = time.monotonic()
        if reason not in ROUTINE_REFUSALS:
            self._last_fault_at, self._last_fault = now, message
        if now - self._last_refusal_logged >= REFUSAL_LOG_PERIOD_S:
            self._last_refusal_logged = now
            self.get_logger().warning(message)

    def _note_clock(self, now: int) -> None:
        """A clock that went back (a bag played again, a simulator restarted while this node is active) is a
        new run: the schedule forgets its chunks and last command (ChunkSchedule.clock), and the joint
        positions of the old run are forgotten too; commands start again from the arms' positions."""
        assert self._schedule is not None
        back = self._schedule.clock(now)
        if back:
            self._joints.clear()
            self._last_command = None
            self._counts["clock_jumps"] += 1
            self.get_logger().warning(
                f"the clock went back {back / 1e9:.3f} s (a bag played again, a simulator restarted): the "
                "chunks in hand and the joint states are forgotten, commands start again from the arms' positions"
            )

    def _on_tick(self) -> None:
        cfg, schedule, messages = self.cfg, self._schedule, self._messages
        if cfg is None or schedule is None or messages is None:
            return
        if self._before_clock is not None:
            early, self._before_clock = self._before_clock, None
            self._on_chunk(early)
        now = self.get_clock().now().nanoseconds
        self._note_clock(now)
        drivers_ok = self._drivers_ok()
        measured = self._measured(now) if drivers_ok else None  # None: nothing is commanded
        # The rows due when this tick was, not when its callback runs (a busy executor makes it late).
        timer = self._control_timer
        tick = tick_time(
            now, timer.time_until_next_call() if timer is not None else None, schedule.cfg.period_ns
        )
        command = schedule.command(tick, measured)
        if command is None:
            if schedule.chunk_in_hand is None or measured is not None:
                self._counts["held"] += 1
            else:
                self._counts["waiting_for_joints" if drivers_ok else "waiting_for_drivers"] += 1
            return
        last = self._last_command
        if last is None or command.chunk is not last.chunk:
            self._takeover_rows.append(command.row)
        group, single = messages
        action = command.action
        for pub, indices in self._arm_pubs:
            pub.publish(group(name=cfg.arm_group_name, cmd=[float(action[i]) for i in indices]))
        for pub, index in self._gripper_pubs:
            pub.publish(single(name=cfg.gripper_joint, cmd=float(action[index])))
        self._counts["commands"] += 1
        self._counts["limited"] += command.limited
        if command.clamped:
            self._note_clamped(command)
        if command.resynced:
            assert measured is not None
            self._note_resynced(command, measured, last)
        self._last_command = command

    def _note_resynced(self, command: Any, measured: np.ndarray, last: Any) -> None:
        """Count and warn: an arm joint was measured past max_tracking_error from its last command (the arm
        stopped following: torque off, moved by hand, stalled, or slower than its commands), so its command
        moved toward where it is."""
        cfg = self.cfg
        assert cfg is not None
        self._counts["resynced"] += 1
        before = last.action if last is not None else None
        self._last_resync = ", ".join(
            f"{cfg.joint_names[i]} measured {measured[i]:.4g}"
            + (f", commanded {before[i]:.4g}" if before is not None else "")
            for i in command.resynced
        )
        now = time.monotonic()
        self._last_resync_at = now
        if now - self._last_resync_logged >= RESYNC_LOG_PERIOD_S:
            self._last_resync_logged = now
            self.get_logger().warning(
                f"the arm is not where it was commanded (max_tracking_error {cfg.max_tracking_error:g} rad): "
                f"{self._last_resync}; its commands move toward where it is ({self._counts['resynced']} so far)"
            )

    def _note_clamped(self, command: Any) -> None:
        """Count a command held at a position limit; log it (at most every CLAMP_LOG_PERIOD_S) with what the
        chunk asked for: a policy that keeps asking past the arm's travel is in other units or miscalibrated."""
        cfg, schedule = self.cfg, self._schedule
        assert cfg is not None and schedule is not None
        self._counts["clamped"] += 1
        target = command.chunk.actions[command.row]
        lower, upper = schedule.cfg.lower, schedule.cfg.upper
        beyond = ", ".join(
            f"{cfg.joint_names[i]} {target[i]:.4g} (limits [{lower[i]:.4g}, {upper[i]:.4g}])"
            for i in command.clamped
        )
        self._last_clamp = (
            f"episode {command.chunk.episode_id} chunk {command.chunk.chunk_id} row {command.row}: {beyond}"
        )
        now = time.monotonic()
        if now - self._last_clamp_logged >= CLAMP_LOG_PERIOD_S:
            self._last_clamp_logged = now
            self.get_logger().warning(
                f"commanded at the position limit: {self._last_clamp} ({self._counts['clamped']} commands so far)"
            )

    # -- diagnostics -------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        last = self._last_command
        rows = sorted(self._takeover_rows)
        return {
            # the row at which each of the latest chunks took over: its call's latency in control periods
            "takeover_row.p50": rows[len(rows) // 2] if rows else 0,
            "takeover_row.max": rows[-1] if rows else 0,
            "commands": self._counts["commands"],
            "limited": self._counts["limited"],
            # commands with a joint held at its position limit (arm_joint_limits), and the latest one's detail
            "clamped": self._counts["clamped"],
            "last_clamp": self._last_clamp,
            # commands with an arm joint measured past max_tracking_error from its last command, and the latest
            "resynced": self._counts["resynced"],
            "last_resync": self._last_resync,
            "held": self._counts["held"],
            "waiting_for_joints": self._counts["waiting_for_joints"],
            # ticks a chunk was due but the arms' drivers had not answered, or answered wrong (robot_info_services)
            "waiting_for_drivers": self._counts["waiting_for_drivers"],
            "drivers": self._drivers_state(),
            "chunks_accepted": self._counts["chunks_accepted"],
            # with takeover_delay_s: chunks that arrived after their takeover time and took over on arrival
            "chunks_late": self._counts["chunks_late"],
            "clock_jumps": self._counts["clock_jumps"],  # times the clock went back: each a new run
            # joint states whose names and positions did not pair up (other counts, a name twice): not used
            "bad_joint_states": self._counts["bad_joint_states"],
            "refused": dict(self._refused),
            "last_refusal": self._last_refusal,
            "last": None if last is None else (last.chunk.episode_id, last.chunk.chunk_id, last.row),
        }

    def _missing_joint_states(self) -> list[str]:
        """The joint-state topics of the arms whose positions are not all known, recent and finite now."""
        cfg = self.cfg
        assert cfg is not None
        now = self.get_clock().now().nanoseconds
        missing = []
        for topic, prefix in zip(cfg.joint_state_topics, cfg.joint_name_prefixes, strict=True):
            held = [self._joints.get(n) for n in cfg.joint_names if n.startswith(prefix)]
            if not all(self._usable(h, now) for h in held):
                missing.append(self.resolve_topic_name(topic))
        return missing

    def _status(self, s: dict[str, Any]) -> tuple[bytes, str]:
        """/diagnostics' level and message: ERROR while an arm's driver answered what would make the commands
        wrong, or the remaps are crossed (robot_info_services); WARN while one has not answered for
        ROBOT_INFO_WARN_S since it was asked, while chunks come but no command can go out for want of
        joint states (a wrong remap sends nothing, silently otherwise), and for REFUSAL_WARN_S after a
        chunk is refused for a fault (not for a routine refusal: every episode reset may bring one) or an arm
        joint strayed past max_tracking_error, and while most commands since the last report were held at
        a position limit."""
        level = DiagnosticStatus.OK
        where = "no chunk yet" if s["last"] is None else "episode {} chunk {} row {}".format(*s["last"])
        message = f"{s['commands']} commands ({where})"
        waiting = s["waiting_for_joints"] > self._waiting_reported
        self._waiting_reported = s["waiting_for_joints"]
        if waiting:
            level = DiagnosticStatus.WARN
            topics = ", ".join(self._missing_joint_states()) or "none recent enough"
            message += f"; a chunk is in hand but nothing is sent: no recent, finite joint states on {topics}"
        if time.monotonic() - self._last_fault_at < REFUSAL_WARN_S:
            level = DiagnosticStatus.WARN
            message += f"; last refused: {self._last_fault}"
        drivers = s["drivers"]
        waited = [time.monotonic() - c.asked_since for c in self._checks if not c.passed and not c.problem]
        if drivers.startswith("waiting") and max(waited, default=0.0) >= ROBOT_INFO_WARN_S:
            level = DiagnosticStatus.WARN
            message += f"; nothing is sent: no answer from the arms' drivers ({drivers.removeprefix('waiting for ')})"
        if time.monotonic() - self._last_resync_at < REFUSAL_WARN_S:
            level = DiagnosticStatus.WARN
            message += f"; the arm did not follow its commands: {self._last_resync}"
        commands = s["commands"] - self._commands_reported
        clamped = s["clamped"] - self._clamped_reported
        self._commands_reported, self._clamped_reported = s["commands"], s["clamped"]
        if commands and clamped >= CLAMP_WARN_SHARE * commands:
            level = DiagnosticStatus.WARN
            message += f"; {clamped} of {commands} commands held at a position limit: {s['last_clamp']}"
        if self._drivers_problem():
            level = DiagnosticStatus.ERROR
            message += f"; nothing is sent until the streamer is activated again: {drivers}"
        return level, message

    def _publish_diagnostics(self) -> None:
        if self._diag_pub is None:
            return
        s = self.stats()
        status = DiagnosticStatus(name=f"{self.get_name()}: streaming", hardware_id="")
        status.level, status.message = self._status(s)
        keys = ("commands", "limited", "clamped", "resynced", "held", "waiting_for_joints", "waiting_for_drivers",
                "drivers", "chunks_accepted", "chunks_late", "clock_jumps", "bad_joint_states", "takeover_row.p50",
                "takeover_row.max")  # fmt: skip
        values = {k: s[k] for k in keys}
        values |= {f"refused.{r.value}": s["refused"].get(r.value, 0) for r in RefusalReason}
        values["refused.error"] = s["refused"].get("error", 0)
        if s["last_refusal"]:
            values["last_refusal"] = s["last_refusal"]
        if s["last_clamp"]:
            values["last_clamp"] = s["last_clamp"]
        if s["last_resync"]:
            values["last_resync"] = s["last_resync"]
        status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
        array = DiagnosticArray(status=[status])
        array.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(array)


def main(argv: list[str] | None = None, *, exiting: bool = False) -> int:
    """`action_streamer` executable: the lifecycle node on a single-threaded executor. `exiting`: the process
    ends when it returns (the executables pass True: spin_node)."""
    return spin_node(ActionStreamerNode, argv, exiting=exiting)


def run() -> int:
    """The `action_streamer` executable's entry point (the console script, libexec/, `python -m`): `main` in a
    process that ends when it returns (spin_node's `exiting`)."""
    return main(exiting=True)


if __name__ == "__main__":
    sys.exit(run())
