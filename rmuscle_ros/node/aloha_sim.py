"""`aloha_sim`: a simulated ALOHA cell (MuJoCo, rmuscle_ros/sim/aloha.py) on the real cell's ROS topics.

It stands in for the Interbotix ALOHA stack and its cameras, so that `rmuscle_node` and `action_streamer`
run in closed loop, with the launch file's remappings, as they would on the cell:

- publishes `/cam_high`, `/cam_left_wrist`, `/cam_right_wrist` `/camera/color/image_rect_raw`
  (`sensor_msgs/Image`, rgb8, 480×640) at `camera_rate_hz`, and `/follower_{left,right}/joint_states`
  (the Interbotix names, the same on both arms, in the real arms' units) every control period (50 Hz);
- takes `/follower_{left,right}/commands/joint_group` (`interbotix_xs_msgs/JointGroupCommand`, group
  `arm`, six positions) and `.../joint_single` (`JointSingleCommand`, joint `gripper`); each arm holds
  its last command, as a position-controlled arm does. A bad command is refused, counted and logged;
  the simulation goes on;
- answers `/follower_{left,right}/get_robot_info` (`interbotix_xs_msgs/RobotInfo`) as the Interbotix
  driver does, for the group `arm` (position mode, the model's joint ranges) and the joint `gripper`
  (current_based_position mode, as an ALOHA follower's; given as its `left_finger`, as the driver does);
  another name gets an empty answer. action_streamer checks them at each activation;
- is the clock: it publishes `/clock` at every step (run the other nodes with use_sim_time), paced to
  `real_time_factor` of the wall clock (0: as fast as it can). A step that takes longer (one that renders
  the cameras) is not made up by a burst of steps: simulated time runs slower than the wall clock instead,
  and the other nodes see their own latency shrink by as much;
- `~/reset` (`std_srvs/Trigger`) ends the episode and starts the next, with the object placed from
  `seed` + episode × `seed_step` (0: the same scene each time, a repeated task); the response's message is
  the ended episode's result as JSON (reward, best reward, success). `/diagnostics` once a second (wall
  clock): episode, simulated time, reward, the real-time factor achieved, commands taken and refused.

The simulation runs on a thread of its own; the executor's thread only queues commands and resets. That
thread renders one frame per camera before the node is up, so a renderer that cannot be made (no OpenGL
for MUJOCO_GL's backend) stops the node at start-up. If it dies later (an exception other than the
physics diverging, e.g. a lost EGL context), the node says why on its log and `/diagnostics` (level
ERROR), answers `~/reset` at once with that reason and takes no more commands; the `aloha_sim` executable
then exits with status 1, so that a launch file or supervisor sees a cell that is gone.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import rclpy
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import SetParametersResult
from rclpy.clock import Clock, ClockType
from rclpy.duration import Duration
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from rosgraph_msgs.msg import Clock as ClockMsg
from sensor_msgs.msg import Image, JointState
from std_srvs.srv import Trigger

from rmuscle_ros.node.action_streamer import (
    LIMIT_TOLERANCE,
    import_command_messages,
    import_robot_info,
    streamer_defaults,
)
from rmuscle_ros.node.bags import (
    ALOHA_ARM_COMMAND_TOPIC,
    ALOHA_CAMERA_TOPICS,
    ALOHA_GRIPPER_COMMAND_TOPIC,
    ALOHA_JOINT_STATE_TOPIC,
    ALOHA_ROBOT_INFO_SERVICE,
)
from rmuscle_ros.node.params import ParameterError, flat_config, flat_defaults
from rmuscle_ros.node.spin import spin_node, undeclared_overrides
from rmuscle_ros.sim.aloha import (
    ARM_JOINTS,
    CONTROL_PERIOD_S,
    DEFAULT_CAMERAS,
    JOINT_STATE_NAMES,
    SIDES,
    AlohaSim,
    CommandError,
    FrameSchedule,
    SimConfig,
    SimulationDiverged,
)

# The cell's cameras in π0.5 slot order (base, left wrist, right wrist); the sim has no cam_low.
CAMERA_TOPICS = ALOHA_CAMERA_TOPICS[:3]
ARM_GROUP = "arm"  # the Interbotix group of an ALOHA follower's six arm joints
GRIPPER_JOINT = "gripper"
GRIPPER_MODE = "current_based_position"  # an ALOHA follower's gripper's (its setup in Interbotix's aloha)
REFUSAL_LOG_PERIOD_S = 1.0
RESET_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 60.0  # the simulation thread's first frames (making the renderer: ~0.2 s here)
# Slower than this, a step takes over 2 s of wall clock: no use for a cell, and a typo for 0 (unpaced).
MIN_REAL_TIME_FACTOR = 0.01


@dataclass(frozen=True)
class SimNodeConfig:
    """aloha_sim's parameters (validated): the scene's, then the node's."""

    task: str = "transfer_cube"
    seed: int = 0
    seed_step: int = 1  # episode k's scene comes from seed + k × seed_step; 0 repeats one scene
    cameras: tuple[str, ...] = DEFAULT_CAMERAS  # MuJoCo cameras, published in CAMERA_TOPICS' order
    camera_rate_hz: float = 30.0  # simulated time; each frame costs ~20 ms of CPU per camera
    height: int = 480
    width: int = 640
    finger_range: tuple[float, float] = SimConfig.finger_range
    gripper_joint_range: tuple[float, float] = SimConfig.gripper_joint_range
    shadows: bool = False
    placement_spread: float = 1.0  # 1: gym-aloha's placements; 0.25: a fixtured cell's (±2.5 cm)
    real_time_factor: float = 1.0  # 0: unpaced
    # An episode's result (reward, best reward, success) is taken at this much simulated time, the sim
    # stepping on until ~/reset as a cell does; 0: at the reset. A benchmark's episodes then all last the
    # same, however late each reset comes (sim_success --node's last scene ran ~1 s longer, found in review).
    episode_s: float = 0.0
    start_time_s: float = 1_700_000_000.0  # the clock at the first step (it never goes back, resets included)

    def __post_init__(self) -> None:
        if len(self.cameras) > len(CAMERA_TOPICS):
            raise ParameterError(
                f"cameras: at most {len(CAMERA_TOPICS)} (one per ALOHA camera topic), got {list(self.cameras)}"
            )
        # At most one frame per control period: frames are rendered at steps, so a higher rate would be
        # published at 1 / period_s all the same.
        max_rate = 1.0 / CONTROL_PERIOD_S
        if not (0 < self.camera_rate_hz <= max_rate):
            raise ParameterError(
                f"camera_rate_hz: must be in (0, {max_rate:g}] Hz (one frame per control period of "
                f"{CONTROL_PERIOD_S:g} s at most), got {self.camera_rate_hz!r}"
            )
        if not (self.real_time_factor == 0 or MIN_REAL_TIME_FACTOR <= self.real_time_factor < math.inf):
            raise ParameterError(
                f"real_time_factor: must be 0 (unpaced) or at least {MIN_REAL_TIME_FACTOR:g}, got "
                f"{self.real_time_factor!r}"
            )
        if not 0 <= self.episode_s <= 3600:
            raise ParameterError(f"episode_s: must be in [0, 3600] s (0: no limit), got {self.episode_s!r}")
        if not (0 < self.start_time_s < 2**31 and math.isfinite(self.start_time_s)):
            raise ParameterError(
                f"start_time_s: must be a positive time in seconds, got {self.start_time_s!r}"
            )
        # NumPy seeds are 0 ... 2^32 - 1; a million episodes on from the first seed stay in range.
        if self.seed < 0 or self.seed_step < 0 or self.seed + 10**6 * self.seed_step >= 2**32:
            raise ParameterError(
                f"seed, seed_step: both >= 0 and the seeds within 0 ... 2^32 - 1, got {self.seed}, {self.seed_step}"
            )
        try:
            self.sim()
        except ValueError as e:
            raise ParameterError(str(e)) from None

    def sim(self) -> SimConfig:
        fields = (
            "task",
            "cameras",
            "height",
            "width",
            "finger_range",
            "gripper_joint_range",
            "shadows",
            "placement_spread",
        )
        return SimConfig(**{name: getattr(self, name) for name in fields})


def sim_defaults() -> dict[str, Any]:
    return flat_defaults(SimNodeConfig)


def sim_node_config(params: dict[str, Any]) -> SimNodeConfig:
    return flat_config(SimNodeConfig, params)


class AlohaSimNode(Node):
    def __init__(
        self, node_name: str = "aloha_sim", *, shutdown_on_failure: bool = False, **kwargs: Any
    ) -> None:
        """`shutdown_on_failure`: when the simulation thread dies, shut this node's context down too (ending
        its spin: what the executable does, to exit non-zero). Otherwise the node stays up, reporting it."""
        super().__init__(node_name, **kwargs)
        for name, default in sim_defaults().items():
            self.declare_parameter(name, default)
        # Bad parameters or a missing scene stop the node at start-up, saying which: there is no lifecycle
        # to fail, and a simulated cell that is not running is better found at once. A misspelt one too
        # (found in review: `placment_spread` ran gym-aloha's whole placement area without a word).
        from rmuscle_ros.node.params import parameter_defaults

        unknown, others = undeclared_overrides(
            self, sim_defaults(), others_names=[*parameter_defaults(), *streamer_defaults()]
        )
        if unknown:
            raise ParameterError(f"{sorted(unknown)[0]}: not a parameter of aloha_sim")
        if others:
            self.get_logger().info(f"parameters given that are not this node's, ignored: {others}")
        self.cfg = sim_node_config({name: self.get_parameter(name).value for name in sim_defaults()})
        # Read once, here: a later `ros2 param set` is refused (found in review: taken, shown by `get`, and
        # never applied)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        group, single = import_command_messages()
        robot_info = import_robot_info()
        try:  # the scene's own checks (its camera names, the render buffer's size): one line, status 2
            self.sim = AlohaSim(self.cfg.sim())
        except ValueError as e:  # (a traceback and status 1, the dead simulation thread's, before: review)
            raise ParameterError(str(e)) from None
        self._arm_limits = {side: self.sim.arm_joint_limits(side) for side in SIDES}  # get_robot_info's
        self.episode = 0
        self._pending: deque[tuple[str, str, Any]] = (
            deque()
        )  # (side, "arm" | "gripper", values) from callbacks
        self._reset_request: threading.Event = threading.Event()
        self._reset_done: threading.Event = threading.Event()
        self._result: dict[str, Any] = {}
        self._at_limit: dict[str, Any] | None = None  # the episode's result at episode_s, once reached
        self._counts: Counter[str] = Counter()
        self._last_refusal = ""
        self._last_refusal_logged = -math.inf
        self._rtf_window: deque[tuple[float, float]] = deque(maxlen=64)  # (wall s, simulated s)
        self._steps = 0  # since the start: the clock
        self._stop = threading.Event()
        self._shutdown_on_failure = shutdown_on_failure
        self.failure = ""  # why the simulation thread died ("" while it runs)
        self._started = threading.Event()  # the thread rendered its first frames, or could not
        self._startup_error: Exception | None = None

        self._clock_pub = self.create_publisher(ClockMsg, "/clock", 10)
        self._image_pubs = [
            self.create_publisher(Image, t, qos_profile_sensor_data)
            for t in CAMERA_TOPICS[: len(self.cfg.cameras)]
        ]
        # Reliable, depth 10, as Interbotix's xs_sdk publishes them on Jazzy: a reliable subscriber (a
        # robot_state_publisher for RViz) receives them too, best-effort ones (rmuscle_node's) as before.
        self._joint_pubs = [
            self.create_publisher(JointState, ALOHA_JOINT_STATE_TOPIC.format(side=side), 10) for side in SIDES
        ]
        for side in SIDES:
            self.create_subscription(
                group, ALOHA_ARM_COMMAND_TOPIC.format(side=side), lambda m, s=side: self._on_arm(s, m), 10
            )
            self.create_subscription(
                single,
                ALOHA_GRIPPER_COMMAND_TOPIC.format(side=side),
                lambda m, s=side: self._on_gripper(s, m),
                10,
            )
            self.create_service(
                robot_info,
                ALOHA_ROBOT_INFO_SERVICE.format(side=side),
                lambda request, response, s=side: self._on_robot_info(s, request, response),
            )
        self.create_service(Trigger, "~/reset", self._on_reset)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.create_timer(1.0, self._publish_diagnostics, clock=Clock(clock_type=ClockType.STEADY_TIME))

        self.sim.reset(self._seed())
        self._thread = threading.Thread(target=self._run, name="aloha_sim", daemon=True)
        self._thread.start()
        # The renderer is made on the thread that renders (its OpenGL context is that thread's): wait for
        # its first frames, so that a cell that cannot render never comes up.
        if not self._started.wait(STARTUP_TIMEOUT_S) or self._startup_error is not None:
            error = self._startup_error
            self.destroy_node()
            reason = f"{type(error).__name__}: {error}" if error else f"none within {STARTUP_TIMEOUT_S:g} s"
            raise RuntimeError(
                f"cameras: cannot render {list(self.cfg.cameras)} with MuJoCo "
                f"(MUJOCO_GL={os.environ.get('MUJOCO_GL', '')!r}): {reason}"
            ) from error
        self.get_logger().info(
            f"{self.cfg.task}, episode 0 (seed {self.sim.seed}); {len(self.cfg.cameras)} cameras at "
            f"{self.cfg.camera_rate_hz:g} Hz, real-time factor {self.cfg.real_time_factor:g}"
        )

    def _on_set_parameters(self, params: list[Any]) -> SetParametersResult:
        for p in params:
            if p.name in sim_defaults() and p.value != self.get_parameter(p.name).value:
                return SetParametersResult(
                    successful=False, reason=f"{p.name}: read at start-up; start aloha_sim again with it"
                )
        return SetParametersResult(successful=True)

    def _seed(self) -> int:
        return self.cfg.seed + self.episode * self.cfg.seed_step

    # -- the executor's thread: commands and resets are queued for the simulation's thread ---------------
    def _on_arm(self, side: str, msg: Any) -> None:
        if self.failure:  # nothing takes them any more: queued, they would grow without bound
            return
        if msg.name != ARM_GROUP:
            self._refuse(f"{side} arm: group {msg.name!r} is not this arm's ({ARM_GROUP!r})")
            return
        self._pending.append((side, "arm", list(msg.cmd)))

    def _on_gripper(self, side: str, msg: Any) -> None:
        if self.failure:
            return
        if msg.name != GRIPPER_JOINT:
            self._refuse(f"{side} arm: joint {msg.name!r} is not its gripper ({GRIPPER_JOINT!r})")
            return
        self._pending.append((side, "gripper", float(msg.cmd)))

    def _on_robot_info(self, side: str, request: Any, response: Any) -> Any:
        """What an Interbotix driver answers about its arm group or its gripper joint; empty for another name
        (no Dynamixel IDs, velocity limits or sleep positions: the simulated arm has none)."""
        if request.cmd_type == "group" and request.name == ARM_GROUP:
            response.mode, response.profile_type = "position", "time"
            response.joint_names = list(ARM_JOINTS)
            limits = self._arm_limits[side]
            response.joint_lower_limits = [lo for lo, _ in limits]
            response.joint_upper_limits = [hi for _, hi in limits]
            response.joint_state_indices = [JOINT_STATE_NAMES.index(j) for j in ARM_JOINTS]
        elif request.cmd_type == "single" and request.name == GRIPPER_JOINT:
            response.mode, response.profile_type = GRIPPER_MODE, "time"
            response.joint_names = ["left_finger"]
            # its model's joint range, as the driver answers its URDF's (found in review: the fingers'
            # travel in the ALOHA's recordings, finger_range, was answered)
            lo, hi = self.sim.physics.model.ptr.joint(f"vx300s_{side}/left_finger").range
            response.joint_lower_limits, response.joint_upper_limits = [float(lo)], [float(hi)]
            response.joint_state_indices = [JOINT_STATE_NAMES.index("left_finger")]
        else:
            return response
        response.num_joints = len(response.joint_names)
        response.name = [request.name]
        return response

    def _on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        response.success = False
        if self.failure or not self._thread.is_alive():
            response.message = self.failure or "the simulation is not running"
            return response
        self._reset_done.clear()
        self._reset_request.set()
        deadline = time.monotonic() + RESET_TIMEOUT_S
        # In slices: a thread that dies meanwhile never answers, and the caller is told why at once.
        while not self._reset_done.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                break
        if self.failure or not self._reset_done.is_set():
            response.message = self.failure or f"the simulation did not reset within {RESET_TIMEOUT_S:g} s"
            return response
        response.success, response.message = True, json.dumps(self._result)
        return response

    def _within_limits(self, side: str, values: list[float]) -> list[float]:
        """An arm command as the follower's servos take it: a joint whose goal lies past its position limit
        keeps its previous goal (a Dynamixel ignores a goal outside its limits; docs/streamer.md), the others
        take theirs; each such joint is counted (`arm_joints_past_limits`) and reported as a refusal. Found in
        review: the simulated arm drove to the limit instead, so a missing clamp upstream went unseen."""
        limits, held = self._arm_limits[side], self.sim.targets(side)
        out, past = list(values), []
        for i, (value, (lo, hi)) in enumerate(zip(values, limits, strict=False)):
            if math.isfinite(value) and not lo - LIMIT_TOLERANCE <= value <= hi + LIMIT_TOLERANCE:
                out[i] = float(held[i])
                past.append(f"{ARM_JOINTS[i]} {value:.4g} (limits [{lo:.4g}, {hi:.4g}])")
        if past:
            self._counts["arm_joints_past_limits"] += len(past)
            self._refuse(
                f"{side} arm: goal past its limit, not taken (the joint keeps its goal): {', '.join(past)}"
            )
        return out

    def _note_gripper_range(self, side: str, position: float) -> None:
        """A gripper goal past `gripper_joint_range` drives the gripper to its end (open or closed), as the
        real one in current_based_position goes into its end stop: counted (`gripper_commands_past_range`)."""
        closed, opened = self.sim.config.gripper_joint_range
        lo, hi = min(closed, opened), max(closed, opened)
        if math.isfinite(position) and not lo - LIMIT_TOLERANCE <= position <= hi + LIMIT_TOLERANCE:
            self._counts["gripper_commands_past_range"] += 1

    def _refuse(self, message: str) -> None:
        self._counts["refused"] += 1
        self._last_refusal = message
        now = time.monotonic()
        if now - self._last_refusal_logged >= REFUSAL_LOG_PERIOD_S:
            self._last_refusal_logged = now
            self.get_logger().warning(f"command refused: {message}")

    # -- the simulation's thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            try:
                for camera in self.cfg.cameras:  # makes the renderer, on this thread
                    self.sim.render(camera)
            except Exception as e:
                self._startup_error = e
                return
            finally:
                self._started.set()
            self._loop()
        except Exception as e:
            self._fail(e)
        finally:
            try:
                self.sim.close()  # its OpenGL context belongs to this thread
            except Exception as e:  # a context already lost: nothing more to free
                self.get_logger().debug(f"closing the renderer: {e!r}")

    def _fail(self, error: Exception) -> None:
        """The simulation thread died: say so loudly, stop taking commands and resets, and (the executable)
        end the process."""
        if self._stop.is_set() or not self.context.ok():
            return  # shutting down (Ctrl-C, SIGTERM): its publishers went first
        self.failure = f"simulation stopped: {type(error).__name__}: {error}"
        self._counts["crashed"] += 1
        self._last_refusal = self.failure
        self._pending.clear()
        self._reset_done.set()  # a ~/reset waiting on this thread answers now, with the failure
        self.get_logger().error(f"{self.failure}\n{''.join(traceback.format_exception(error)).rstrip()}")
        try:  # telling it is best effort: whatever fails here, the executable still ends (a second review)
            self._publish_diagnostics()
            if self._shutdown_on_failure:
                self._diag_pub.wait_for_all_acked(Duration(seconds=2))  # the reason reaches its subscribers
        except Exception as e:  # an RMW without wait_for_all_acked, a sim whose state cannot be read, ...
            self.get_logger().error(f"could not report the failure on /diagnostics: {type(e).__name__}: {e}")
        finally:
            if self._shutdown_on_failure:
                rclpy.shutdown(context=self.context)

    def _loop(self) -> None:
        period = self.sim.period_s
        frames = FrameSchedule(period, self.cfg.camera_rate_hz)
        last_step = time.perf_counter()
        while not self._stop.is_set():
            if self._reset_request.is_set():
                self._reset_request.clear()
                self._result = self._at_limit or self.result()
                self._at_limit = None
                self.episode += 1
                self.sim.reset(self._seed())
                self._pending.clear()  # commands for the ended episode's arms
                self.get_logger().info(f"episode {self.episode - 1}: {json.dumps(self._result)}")
                self._reset_done.set()
            while self._pending:
                side, kind, values = self._pending.popleft()
                try:
                    if kind == "arm":
                        self.sim.command_arm(side, self._within_limits(side, values))
                    else:
                        self._note_gripper_range(side, values)
                        self.sim.command_gripper(side, values)
                    self._counts[f"{kind}_commands"] += 1
                except CommandError as e:
                    self._refuse(f"{side} {e}")
            before = self.sim.best_reward
            if not self.sim.diverged:
                try:
                    self.sim.step()
                except SimulationDiverged as e:
                    # The episode is over; the cell holds still (clock, joint states and cameras go on, as
                    # on a stopped robot's drivers) until ~/reset starts the next one.
                    self._counts["diverged"] += 1
                    self._last_refusal = f"{e}; the arms hold still until ~/reset"
                    self.get_logger().error(self._last_refusal)
            self._steps += 1
            limit = self.cfg.episode_s
            if limit and self._at_limit is None and self.sim.time_s >= limit - 1e-9:
                self._at_limit = self.result()
            if self.sim.best_reward > before:
                self.get_logger().info(
                    f"episode {self.episode}: reward {self.sim.best_reward}/{self.sim.max_reward} at {self.sim.time_s:.2f} s"
                )
            now_s = self._steps * period
            stamp = self._stamp(now_s)
            self._clock_pub.publish(ClockMsg(clock=stamp))
            for side, pub in zip(SIDES, self._joint_pubs, strict=True):
                position, velocity = self.sim.joint_state(side)
                msg = JointState(name=list(JOINT_STATE_NAMES), position=position, velocity=velocity)
                msg.header.stamp = stamp
                pub.publish(msg)
            if frames.due(self._steps):
                for camera, pub in zip(self.cfg.cameras, self._image_pubs, strict=True):
                    pub.publish(self._image(camera, stamp))
            self._rtf_window.append((time.perf_counter(), now_s))
            if self.cfg.real_time_factor > 0:
                # Each step at least one period of wall clock (over the factor) after the one before. A late
                # step (a frame rendered) is not made up by steps in a burst: the clock runs slower instead,
                # so the other nodes still get a period of wall clock to answer each step.
                due = last_step + period / self.cfg.real_time_factor
                now = time.perf_counter()
                if now < due and self._stop.wait(due - now):  # a shutdown does not wait for the step
                    return
                last_step = max(due, now)

    def _stamp(self, since_start_s: float) -> Time:
        ns = round(self.cfg.start_time_s * 1e9) + round(since_start_s * 1e9)
        return Time(sec=ns // 10**9, nanosec=ns % 10**9)

    def _image(self, camera: str, stamp: Time) -> Image:
        pixels = self.sim.render(camera)
        msg = Image(
            height=pixels.shape[0],
            width=pixels.shape[1],
            encoding="rgb8",
            is_bigendian=0,
            step=pixels.shape[1] * 3,
        )
        msg.header.stamp = stamp
        msg.header.frame_id = camera
        msg.data = pixels.tobytes()  # bytes: assigning an array element by element is slow
        return msg

    # -- reporting -------------------------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        """The current episode's result so far."""
        sim = self.sim
        return {
            "episode": self.episode,
            "task": self.cfg.task,
            "seed": sim.seed,
            "seconds": round(sim.time_s, 3),
            "reward": sim.reward,
            "best_reward": sim.best_reward,
            "max_reward": sim.max_reward,
            "success": sim.success,
            "diverged": sim.diverged,  # why the physics stopped this episode ("" if it did not)
        }

    def real_time_factor(self) -> float:
        """Simulated over wall-clock seconds across the last ~64 steps (0 before two steps)."""
        if len(self._rtf_window) < 2:
            return 0.0
        (w0, s0), (w1, s1) = self._rtf_window[0], self._rtf_window[-1]
        return (s1 - s0) / (w1 - w0) if w1 > w0 else 0.0

    def _publish_diagnostics(self) -> None:
        r = self.result()
        status = DiagnosticStatus(name=f"{self.get_name()}: simulation", hardware_id=self.cfg.task)
        status.level = (
            DiagnosticStatus.ERROR
            if self.failure or self.sim.diverged
            else (DiagnosticStatus.WARN if self._counts["refused"] else DiagnosticStatus.OK)
        )
        status.message = (
            f"episode {r['episode']} at {r['seconds']:.2f} s, reward {r['reward']}/{r['max_reward']}"
        )
        if self.failure:
            status.message = f"{self.failure}; {status.message}"
        elif self._last_refusal:
            status.message += f"; last: {self._last_refusal}"
        values = r | {
            "failure": self.failure,  # why the simulation thread died ("" while it runs)
            "real_time_factor": round(self.real_time_factor(), 3),
            "arm_commands": self._counts["arm_commands"],
            "gripper_commands": self._counts["gripper_commands"],
            "refused": self._counts["refused"],
            "arm_joints_past_limits": self._counts["arm_joints_past_limits"],
            "gripper_commands_past_range": self._counts["gripper_commands_past_range"],
        }
        status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
        array = DiagnosticArray(status=[status])
        array.header.stamp = self._stamp(self._steps * self.sim.period_s)
        self._diag_pub.publish(array)

    def destroy_node(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        super().destroy_node()


def main(argv: list[str] | None = None, *, exiting: bool = False) -> int:
    """`aloha_sim` executable: the simulated cell on a single-threaded executor. Exits 1 when the simulation
    thread died (its reason on stderr and, before the exit, on /diagnostics), 0 on Ctrl-C or SIGTERM."""
    made: list[AlohaSimNode] = []

    def make() -> AlohaSimNode:
        made.append(AlohaSimNode(shutdown_on_failure=True))
        return made[-1]

    rc = spin_node(make, argv, exiting=exiting)
    if rc:  # the node was not made (a parameter of the wrong type)
        return rc
    if made and made[0].failure:
        print(f"aloha_sim: {made[0].failure}", file=sys.stderr)
        return 1
    return 0


def run() -> int:
    """The `aloha_sim` executable's entry point (the console script, libexec/, `python -m`): `main` in a
    process that ends when it returns (spin_node's `exiting`)."""
    return main(exiting=True)


if __name__ == "__main__":
    sys.exit(run())
