"""A simulated ALOHA cell (MuJoCo) that speaks the real Interbotix follower arms' units. No ROS here.

The scenes, the arms' model and the tasks' rewards are gym-aloha's (ACT's bimanual ViperX: transfer the
cube, insert the peg), stepped through dm_control at its 50 Hz control period. gym-aloha's own Gym
environment renders three 480×640 cameras at every step (~0.3 s per step on a 2-core CPU); this class
steps the physics alone and renders only when a caller asks for a frame, with MuJoCo's renderer and no
shadows or reflections (~20 ms per frame on those cores).

Units are the real arms', so that a stack configured for a real ALOHA (config/rmuscle_aloha.yaml) runs
on the simulation unchanged:
- arm joints in rad, as both take them;
- the gripper is commanded as the Interbotix `gripper` joint's position, between `gripper_joint_range`
  [closed, open], and reported as that joint and the two finger positions, the fingers between
  `finger_range` (m). The simulated fingers (gym-aloha's own range) are driven to, and report, the same
  opening fraction, 0 closed ... 1 open: the unit ALOHA recordings and policies use.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

TASKS = ("transfer_cube", "insertion")
ARM_JOINTS = ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate")
SIDES = ("left", "right")
# The names an Interbotix follower publishes on its joint_states, the same on both arms (node/bags.py's
# ALOHA_JOINT_STATE_NAMES, which the tests check against).
JOINT_STATE_NAMES = (*ARM_JOINTS, "gripper", "left_finger", "right_finger")
# MuJoCo cameras of gym-aloha's scene in π0.5 slot order (base, left wrist, right wrist); "angle",
# "front_close", "left_pillar" and "right_pillar" also exist.
DEFAULT_CAMERAS = ("top", "left_wrist", "right_wrist")
# gym-aloha's control period (its constants.DT; AlohaSim checks it): settings that depend on the step,
# such as a camera rate, are validated against it without importing gym-aloha.
CONTROL_PERIOD_S = 0.02
# The middle (x, y in m) of each object's placement range in gym_aloha.utils' samplers: the cube; the peg,
# then the socket.
PLACEMENT_MIDDLES = {"transfer_cube": [(0.1, 0.5)], "insertion": [(0.15, 0.5), (-0.15, 0.5)]}


class FrameSchedule:
    """Which control steps publish the cameras' frames: the first step does, and frame k is due k /
    camera_rate_hz s of simulated time after it, going out at the first step at or after that time.

    Exact rational arithmetic: a float schedule, advanced frame by frame, drifted by a step after an hour
    or two (a 50 Hz camera skipped a frame, a 25 Hz one sent two on consecutive steps)."""

    def __init__(self, period_s: float, camera_rate_hz: float) -> None:
        rate = Fraction(camera_rate_hz).limit_denominator(10**6)
        per_step = rate * Fraction(period_s).limit_denominator(10**6)  # at most 1 (SimNodeConfig)
        self._num, self._den = per_step.numerator, per_step.denominator

    def due(self, step: int) -> bool:
        """Whether step `step` (1, 2, ...) publishes a frame: a frame time in (step - 2, step - 1] periods
        after the first step (floor(-x) is -1 for the first step: it always does)."""
        n = step - 1
        return (n * self._num) // self._den > ((n - 1) * self._num) // self._den


@dataclass(frozen=True)
class SimConfig:
    task: str = "transfer_cube"
    cameras: tuple[str, ...] = DEFAULT_CAMERAS
    height: int = 480  # the frames' size: an ALOHA RealSense's
    width: int = 640
    # The real follower's units (Interbotix aloha constants.py, as in config/rmuscle_aloha.yaml):
    finger_range: tuple[float, float] = (0.0440, 0.0579)  # left_finger position (m), [closed, open]
    gripper_joint_range: tuple[float, float] = (0.6197, 1.6214)  # gripper joint (rad), [closed, open]
    shadows: bool = False  # shadows and reflections: ~4× the rendering time on a CPU
    # How far from the middle of gym-aloha's placement ranges the objects are put, as a fraction of those
    # ranges: 1 = gym-aloha's (the cube anywhere in a 20 × 20 cm square), 0.25 = a fixtured cell whose
    # parts arrive within ±2.5 cm, 0 = always the middle.
    placement_spread: float = 1.0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task: one of {list(TASKS)}, got {self.task!r}")
        if not self.cameras or len(set(self.cameras)) != len(self.cameras):
            raise ValueError(f"cameras: needs distinct camera names, got {list(self.cameras)}")
        if not (self.height >= 16 and self.width >= 16):
            raise ValueError(f"height, width: at least 16 pixels, got {self.height} × {self.width}")
        if not 0.0 <= self.placement_spread <= 1.0:
            raise ValueError(f"placement_spread: must be in [0, 1], got {self.placement_spread!r}")
        for name in ("finger_range", "gripper_joint_range"):
            value = getattr(self, name)
            try:  # a list of three, or of one, is refused here by name, not by a bare unpacking error
                closed, opened = (float(v) for v in value)
            except (TypeError, ValueError):
                raise ValueError(f"{name}: needs two values [closed, open], got {value!r}") from None
            if not (math.isfinite(closed) and math.isfinite(opened) and closed != opened):
                raise ValueError(
                    f"{name}: needs two distinct finite values [closed, open], got {[closed, opened]}"
                )


class CommandError(ValueError):
    """A command the simulated arm refuses (the message says why); the arm keeps its last target."""


class SimulationDiverged(RuntimeError):
    """The physics reached an invalid state (MuJoCo's bad-acceleration/velocity/position warnings, e.g.
    after violent commands): the episode is over, and the sim does not step again until a `reset`."""


class AlohaSim:
    """One simulated ALOHA cell: `reset(seed)`, then `step()` every `period_s` with the latest targets.

    Targets persist between steps (a position-controlled arm holds its last command): `command_arm`
    and `command_gripper` change them, in the real arm's units."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        # MuJoCo picks its OpenGL backend at import; a headless cell has no display, EGL renders without one.
        os.environ.setdefault("MUJOCO_GL", "egl")
        from dm_control import mujoco as dm_mujoco
        from gym_aloha import constants
        from gym_aloha.tasks import sim as tasks

        self._constants = constants
        self._tasks = tasks
        scene = (
            "bimanual_viperx_transfer_cube.xml"
            if self.config.task == "transfer_cube"
            else "bimanual_viperx_insertion.xml"
        )
        self.physics = dm_mujoco.Physics.from_xml_path(str(constants.ASSETS_DIR / scene))
        self.task = tasks.TransferCubeTask() if self.config.task == "transfer_cube" else tasks.InsertionTask()
        self.period_s = float(constants.DT)
        if not math.isclose(self.period_s, CONTROL_PERIOD_S):
            raise RuntimeError(
                f"gym-aloha's control period is {self.period_s} s, not the {CONTROL_PERIOD_S} s this package "
                "validates its settings against (rmuscle_ros/sim/aloha.py CONTROL_PERIOD_S)"
            )
        self._substeps = round(self.period_s / self.physics.timestep())
        model = self.physics.model.ptr
        known = {model.camera(i).name for i in range(model.ncam)}
        missing = [c for c in self.config.cameras if c not in known]
        if missing:
            raise ValueError(
                f"cameras: {missing} not in the {self.config.task} scene, which has {sorted(known)}"
            )
        buffer = self.physics.model.ptr.vis.global_
        if self.config.height > buffer.offheight or self.config.width > buffer.offwidth:
            raise ValueError(
                f"height, width: at most the scene's offscreen buffer, {buffer.offheight} × {buffer.offwidth}, "
                f"got {self.config.height} × {self.config.width}"
            )
        self._renderer: Any = None  # created at the first frame: tests of the arms need no OpenGL
        self._targets = np.zeros(14)  # gym-aloha's action: per arm 6 joints (rad), then the gripper opening
        self.seed: int | None = None
        self.diverged = ""  # why the physics became invalid in this episode ("" while it is valid)
        self.steps = 0
        self.reward = 0
        self.best_reward = 0

    @property
    def max_reward(self) -> int:
        return int(self.task.max_reward)

    @property
    def success(self) -> bool:
        """The task was done at some step of the episode (gym-aloha's success: the top reward)."""
        return self.best_reward >= self.max_reward

    def reset(self, seed: int) -> None:
        """A new episode: the arms at their start pose, holding it, the object(s) placed from `seed`."""
        from gym_aloha.utils import sample_box_pose, sample_insertion_pose

        # gym-aloha's tasks read the object pose from this module global when they initialise.
        if self.config.task == "transfer_cube":
            poses = [sample_box_pose(seed)]
        else:
            poses = list(sample_insertion_pose(seed))
        for pose, middle in zip(poses, PLACEMENT_MIDDLES[self.config.task], strict=True):
            pose[:2] = middle + self.config.placement_spread * (pose[:2] - middle)
        self._tasks.BOX_POSE[0] = np.concatenate(poses)
        self.task.initialize_episode(self.physics)
        self.seed, self.steps, self.reward, self.best_reward = seed, 0, 0, 0
        self.diverged = ""
        self._targets = self._qpos()

    def step(self) -> int:
        """Advance one control period toward the current targets; returns the task's reward (0 ... max).

        Raises SimulationDiverged when the physics becomes invalid, and again at every later step until a
        `reset`. The scene is then put back as it was before this step (MuJoCo's own recovery puts it in
        the model's default pose, a jump of arms and objects that no real cell makes), at rest, so the
        arms and cameras hold still where the episode ended. The episode's best reward so far stands; the current
        one becomes 0."""
        from dm_control.rl.control import PhysicsError

        if self.diverged:
            raise SimulationDiverged(self.diverged)
        before = self.physics.get_state()
        self.task.before_step(self._targets, self.physics)
        try:
            self.physics.step(self._substeps)
        except PhysicsError as e:
            with self.physics.reset_context():
                self.physics.set_state(before)
                self.physics.data.qvel[:] = 0.0  # held still; and finite, whatever the last state held
            self.reward = 0
            self.diverged = f"the physics diverged at {self.time_s:.2f} s of episode seed {self.seed}: {e}"
            raise SimulationDiverged(self.diverged) from None
        self.steps += 1
        self.reward = int(self.task.get_reward(self.physics))
        self.best_reward = max(self.best_reward, self.reward)
        return self.reward

    @property
    def time_s(self) -> float:
        """Simulated seconds since the reset."""
        return self.steps * self.period_s

    def command_arm(self, side: str, positions: Any) -> None:
        """Set one arm's six joint targets (rad, ARM_JOINTS order). CommandError for a bad command."""
        values = np.asarray(positions, dtype=np.float64).reshape(-1)
        if values.shape != (len(ARM_JOINTS),):
            raise CommandError(f"arm command: needs {len(ARM_JOINTS)} joint positions, got {values.size}")
        if not np.isfinite(values).all():
            raise CommandError(f"arm command: non-finite joint positions {values.tolist()}")
        start = self._side(side) * 7
        self._targets[start : start + 6] = values

    def command_gripper(self, side: str, position: float) -> None:
        """Set one gripper's target as the Interbotix gripper joint's position (rad, gripper_joint_range);
        beyond the range it goes fully open or closed, as far as the fingers go."""
        if not math.isfinite(position):
            raise CommandError(f"gripper command: non-finite position {position!r}")
        closed, opened = self.config.gripper_joint_range
        opening = min(max((position - closed) / (opened - closed), 0.0), 1.0)
        self._targets[self._side(side) * 7 + 6] = opening

    def joint_state(self, side: str) -> tuple[list[float], list[float]]:
        """One follower's joint_states as the real arm reports them (JOINT_STATE_NAMES order): positions
        (rad; the gripper joint in gripper_joint_range; the fingers in m, the right one negated as on the
        arm) and velocities (rad/s; the gripper's and the fingers' as the opening's rate in those units)."""
        start = self._side(side) * 7
        qpos = self._qpos()[start : start + 7]
        qvel = self.task.get_qvel(self.physics)[start : start + 7]
        closed, opened = self.config.gripper_joint_range
        f_closed, f_opened = self.config.finger_range
        opening, rate = qpos[6], qvel[6]
        finger = f_closed + opening * (f_opened - f_closed)
        finger_rate = rate * (f_opened - f_closed)
        positions = [*qpos[:6], closed + opening * (opened - closed), finger, -finger]
        velocities = [*qvel[:6], rate * (opened - closed), finger_rate, -finger_rate]
        return [float(v) for v in positions], [float(v) for v in velocities]

    def arm_joint_limits(self, side: str) -> list[tuple[float, float]]:
        """One arm's six joints' [lower, upper] (rad, ARM_JOINTS order): the MuJoCo model's joint ranges."""
        model = self.physics.model.ptr
        self._side(side)
        return [
            (float(lo), float(hi)) for lo, hi in (model.joint(f"vx300s_{side}/{j}").range for j in ARM_JOINTS)
        ]

    def targets(self, side: str) -> np.ndarray:
        """One arm's current targets: six joints (rad), then the gripper opening (0 closed ... 1 open)."""
        start = self._side(side) * 7
        return self._targets[start : start + 7].copy()

    def render(self, camera: str) -> np.ndarray:
        """One camera's frame now: (height, width, 3) uint8 RGB."""
        if camera not in self.config.cameras:
            raise ValueError(f"camera {camera!r}: not one of this sim's cameras {list(self.config.cameras)}")
        import mujoco

        if self._renderer is None:
            self._renderer = mujoco.Renderer(self.physics.model.ptr, self.config.height, self.config.width)
        self._renderer.update_scene(self.physics.data.ptr, camera=camera)
        if not self.config.shadows:  # update_scene resets the scene's flags from the model's
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        return self._renderer.render()

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    def _qpos(self) -> np.ndarray:
        """Per arm: six joints (rad), then the gripper opening (0 closed ... 1 open), gym-aloha's order."""
        return np.asarray(self.task.get_qpos(self.physics), dtype=np.float64)

    @staticmethod
    def _side(side: str) -> int:
        if side not in SIDES:
            raise ValueError(f"side: one of {list(SIDES)}, got {side!r}")
        return SIDES.index(side)
