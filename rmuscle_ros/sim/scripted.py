"""A scripted demonstrator for the simulated ALOHA's transfer-cube task, in joint space. No ROS here.

It plans the grippers' paths in Cartesian space and turns each control period's gripper poses into arm
joint targets by damped least-squares inverse kinematics on the arms' own MuJoCo model, then commands
them through `AlohaSim` as a policy's actions would be (six joints and the gripper per arm, 50 Hz):

1. the right arm opens, moves above the cube, points its fingers down and grasps the cube;
2. it lifts the cube and brings it to the middle of the bench, fingers pointing at the left arm;
3. the left arm, its gripper turned a quarter about its pointing axis (so that its fingers close on the
   faces the right's do not hold), comes in over the cube and closes;
4. the right arm lets go and backs off; the left arm holds the cube off the table (gym-aloha's reward 4).

Like ACT's scripted policies it uses privileged state: the cube's pose at the start, and again just
before the handover, where the right gripper actually holds it. It makes demonstrations (e.g. to record a
cell's episodes or to train a policy), not a policy: it does not look at the cameras.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from rmuscle_ros.sim.aloha import ARM_JOINTS, SIDES, AlohaSim

# The point between a gripper's finger pads, in its gripper_link frame (m): the link's x axis points along
# the fingers. Measured in the scene: with it the top-down grasp closes on the cube's middle.
PAD_OFFSET = np.array([0.14, 0.0, 0.0])
EPISODE_STEPS = 400  # 8 s at 50 Hz, gym-aloha's episode
MEET = np.array([0.0, 0.5, 0.25])  # where the right gripper presents the cube (m, world frame)
HANDOVER_LOOK = 255  # the step at which the left arm's approach is aimed at where the cube is then
FOREARM_ROLL = ARM_JOINTS.index("forearm_roll")


def frame(x_axis: np.ndarray | list[float], y_axis: np.ndarray | list[float]) -> np.ndarray:
    """A rotation matrix whose columns are `x_axis`, `y_axis` (made orthogonal to it) and their cross."""
    x = np.asarray(x_axis, dtype=np.float64)
    x = x / np.linalg.norm(x)
    y = np.asarray(y_axis, dtype=np.float64)
    y = y - x * (x @ y)
    y = y / np.linalg.norm(y)
    return np.column_stack([x, y, np.cross(x, y)])


# Gripper orientations (columns: the fingers' direction, the direction they close along, the third axis).
RIGHT_DOWN = frame([0, 0, -1], [0, -1, 0])  # fingers down, closing along y
RIGHT_TO_LEFT = frame([-1, 0, 0], [0, -1, 0])  # fingers toward the left arm, closing along y
LEFT_TO_RIGHT = frame([1, 0, 0], [0, 0, 1])  # fingers toward the right arm, closing along z


class ArmIK:
    """Inverse kinematics of one arm's gripper pad point and orientation, on a scratch copy of the model's
    data (the simulation's own state is never touched).

    The solution is pulled lightly toward forearm_roll = 0 (`roll_weight`, a seventh least-squares row).
    Without it, where the wrist passes straight (forearm_roll and wrist_rotate on one axis, a singular
    pose) the solver took the forearm_roll = ±π branch in some episodes and not in others: at the same
    step of the 80 successful demonstrations of seeds 0-99, the right arm's forearm_roll target spread by
    2.7 rad (std), targets no policy could learn from the cameras. With it no joint's spreads by more than
    0.25 rad at steps 100, 150 and 300 of seeds 0-29, and all 30 succeed (27 before)."""

    def __init__(
        self, sim: AlohaSim, side: str, iterations: int = 60, damping: float = 1e-4, roll_weight: float = 0.1
    ) -> None:
        import mujoco

        self._mujoco = mujoco
        self.model = sim.physics.model.ptr
        self.data = mujoco.MjData(self.model)
        self.body = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY, f"vx300s_{side}/gripper_link")
        first = SIDES.index(side) * 8  # each arm: 6 joints, then its two fingers (one dof each)
        self.joints = np.arange(first, first + 6)
        self.lower = self.model.jnt_range[self.joints, 0].copy()
        self.upper = self.model.jnt_range[self.joints, 1].copy()
        self.iterations, self.damping = iterations, damping
        self._roll_row = roll_weight * np.eye(6)[FOREARM_ROLL]
        self._jacp = np.zeros((3, self.model.nv))
        self._jacr = np.zeros((3, self.model.nv))

    def forward(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pad point (m), gripper rotation matrix) for the arm's six joint positions `q` (rad)."""
        mj = self._mujoco
        self.data.qpos[self.joints] = q
        mj.mj_kinematics(self.model, self.data)
        mj.mj_comPos(self.model, self.data)
        rotation = self.data.xmat[self.body].reshape(3, 3).copy()
        return self.data.xpos[self.body] + rotation @ PAD_OFFSET, rotation

    def solve(
        self, q: np.ndarray, point: np.ndarray, rotation: np.ndarray, rotation_weight: float = 0.3
    ) -> tuple[np.ndarray, float]:
        """Joint positions that bring the pad point to `point` with the gripper at `rotation`, starting
        from `q` (the last solution: the path is followed in small steps); and the position error left (m)."""
        q = np.array(q, dtype=np.float64)
        error = np.inf
        for _ in range(self.iterations):
            p, r = self.forward(q)
            e_pos = point - p
            # ½ Σ_i r_i × R_i over the columns, written out: three np.cross calls an iteration were half
            # of a demonstration's time (the same products and sums, in the same order)
            cross = r[[1, 2, 0]] * rotation[[2, 0, 1]] - r[[2, 0, 1]] * rotation[[1, 2, 0]]
            e_rot = 0.5 * (cross[:, 0] + cross[:, 1] + cross[:, 2])
            error = float(np.linalg.norm(e_pos))
            if error < 1e-4 and np.linalg.norm(e_rot) < 1e-3:
                break
            self._mujoco.mj_jac(self.model, self.data, self._jacp, self._jacr, p, self.body)
            jac = np.vstack(
                [self._jacp[:, self.joints], rotation_weight * self._jacr[:, self.joints], self._roll_row]
            )
            e = np.concatenate([e_pos, rotation_weight * e_rot, [-self._roll_row @ q]])
            dq = np.linalg.solve(jac.T @ jac + self.damping * np.eye(6), jac.T @ e)
            q = np.clip(q + dq, self.lower, self.upper)
        return q, error


@dataclass(frozen=True)
class Waypoint:
    step: int
    point: np.ndarray  # the pad point (m)
    rotation: np.ndarray  # the gripper's orientation
    opening: float  # 0 closed ... 1 open


def _at(path: list[Waypoint], step: int) -> tuple[np.ndarray, np.ndarray, float]:
    """The pose and opening at `step`, linear between waypoints (the rotation re-orthogonalised)."""
    for a, b in itertools.pairwise(path):
        if a.step <= step <= b.step:
            f = (step - a.step) / (b.step - a.step) if b.step > a.step else 1.0
            rotation = a.rotation + f * (b.rotation - a.rotation)
            return (
                a.point + f * (b.point - a.point),
                frame(rotation[:, 0], rotation[:, 1]),
                a.opening + f * (b.opening - a.opening),
            )
    last = path[-1]
    return last.point, last.rotation, last.opening


class TransferCubeDemonstrator:
    """Drives `sim` (reset, the transfer_cube task) through one demonstration: call `act(step)` before each
    of EPISODE_STEPS `sim.step()`s. `run()` does both and returns gym-aloha's best and final reward."""

    def __init__(self, sim: AlohaSim) -> None:
        if sim.config.task != "transfer_cube":
            raise ValueError(
                f"task: the scripted demonstrator does transfer_cube only, not {sim.config.task!r}"
            )
        self.sim = sim
        self.ik = {side: ArmIK(sim, side) for side in SIDES}
        self.q = {side: self._measured(side) for side in SIDES}
        start = {side: self.ik[side].forward(self.q[side]) for side in SIDES}
        # gym-aloha drops the cube from 5 cm at the reset: plan for where it comes to rest on the table.
        cube = self.cube()
        cube[2] = self.sim.physics.named.model.geom_size["red_box"][2]
        above = cube + np.array([0, 0, 0.10])
        p0, r0 = start["right"]
        present = RIGHT_TO_LEFT  # the cube held out toward the left arm
        self.paths = {
            "right": [
                Waypoint(0, p0, r0, 0.0),
                Waypoint(40, p0, r0, 1.0),
                Waypoint(100, above, RIGHT_DOWN, 1.0),
                Waypoint(140, cube, RIGHT_DOWN, 1.0),
                Waypoint(165, cube, RIGHT_DOWN, 0.0),
                Waypoint(185, cube, RIGHT_DOWN, 0.0),
                Waypoint(200, above, RIGHT_DOWN, 0.0),
                Waypoint(250, MEET, present, 0.0),
                Waypoint(320, MEET, present, 0.0),
                Waypoint(335, MEET, present, 1.0),
                Waypoint(370, MEET + np.array([0.10, 0, 0]), present, 1.0),
                Waypoint(EPISODE_STEPS, MEET + np.array([0.10, 0, 0]), present, 1.0),
            ],
        }
        self._aim_left(MEET, start["left"])

    def _aim_left(self, cube: np.ndarray, start: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """The left arm's path, its grasp aimed at `cube`."""
        p0, r0 = start if start is not None else (self.paths["left"][0].point, self.paths["left"][0].rotation)
        wait = MEET + np.array([-0.15, 0, 0])
        self.paths["left"] = [
            Waypoint(0, p0, r0, 0.0),
            Waypoint(120, wait, LEFT_TO_RIGHT, 1.0),
            Waypoint(260, cube + np.array([-0.12, 0, 0]), LEFT_TO_RIGHT, 1.0),
            Waypoint(290, cube, LEFT_TO_RIGHT, 1.0),
            Waypoint(310, cube, LEFT_TO_RIGHT, 0.0),
            Waypoint(340, cube, LEFT_TO_RIGHT, 0.0),
            Waypoint(380, cube + np.array([-0.08, 0, 0]), LEFT_TO_RIGHT, 0.0),
            Waypoint(EPISODE_STEPS, cube + np.array([-0.08, 0, 0]), LEFT_TO_RIGHT, 0.0),
        ]

    def cube(self) -> np.ndarray:
        """The cube's position (m), privileged state."""
        return self.sim.physics.named.data.qpos["red_box_joint"][:3].copy()

    def act(self, step: int) -> dict[str, np.ndarray]:
        """Command both arms for control period `step`; returns each arm's targets (6 joints, opening)."""
        if step == HANDOVER_LOOK:
            self._aim_left(self.cube())
        closed, opened = self.sim.config.gripper_joint_range
        targets = {}
        for side in SIDES:
            point, rotation, opening = _at(self.paths[side], step)
            self.q[side], _ = self.ik[side].solve(self.q[side], point, rotation)
            self.sim.command_arm(side, self.q[side])
            self.sim.command_gripper(side, closed + opening * (opened - closed))
            targets[side] = np.append(self.q[side], opening)
        return targets

    def run(self) -> tuple[int, int]:
        for step in range(EPISODE_STEPS):
            self.act(step)
            self.sim.step()
        return self.sim.best_reward, self.sim.reward

    def _measured(self, side: str) -> np.ndarray:
        return np.asarray(self.sim.joint_state(side)[0][:6])
