"""How a checkpoint's state and actions relate to the robot's, as it was trained.

Two conventions change what the same numbers mean, and a checkpoint run under the wrong one sends its
arms to the wrong place without any error:

- **openpi's ALOHA adaptation** (`AlohaInputs` / `AlohaOutputs` with `adapt_to_pi`, on in openpi's
  `pi05_aloha` configs): π0's base model was trained on another runtime's joint conventions, so the
  state is converted before normalisation and the actions back after it. Two joints per arm (shoulder,
  elbow) change sign, and the gripper, held by ALOHA recordings as its finger opening (0 closed ... 1 open),
  becomes the gripper motor's angle normalised to its encoder range; the predicted gripper comes back
  as the gripper joint's position normalised to the follower's [closed, open] joint range (what
  ALOHA's recordings hold as the gripper action).
- **Delta actions** (openpi `DeltaActions` / `AbsoluteActions`, `use_delta_joint_actions`, on in its ALOHA
  configs; LeRobot `use_relative_actions`): the model predicts some action dimensions as offsets from the
  state's same dimension (ALOHA: the 12 arm joints, the grippers absolute), which are added back after
  un-normalising. Without this a "stay where you are" (offset 0) is commanded as joint position 0.

Order, as openpi applies them: state -> ALOHA adaptation -> normalise; actions -> un-normalise -> add the
(adapted) state -> ALOHA adaptation undone. The constants are the ones openpi's `aloha_policy.py` takes
from the ALOHA and Interbotix code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ALOHA_DIM = 14  # 2 arms x (6 joints + gripper)
ALOHA_GRIPPERS = (6, 13)
# openpi's delta mask for ALOHA (make_bool_mask(6, -1, 6, -1)): each arm's 6 joints, the grippers absolute.
ALOHA_DELTA_ACTIONS = tuple(d for d in range(ALOHA_DIM) if d not in ALOHA_GRIPPERS)
# +1 / -1 per ALOHA dimension: the shoulder and elbow turn the other way in π's runtime.
ALOHA_JOINT_FLIP = np.array([1, -1, -1, 1, 1, 1, 1] * 2, dtype=np.float64)

# The finger opening 0 ... 1 spans these linear positions (m) of the follower's gripper (ALOHA's
# PUPPET_GRIPPER_POSITION_CLOSE / _OPEN as openpi uses them).
_FINGER_CLOSED_M, _FINGER_OPEN_M = 0.01844, 0.05800
# The Interbotix gripper linkage: linear finger position <-> horn angle.
_LINK_ARM_M, _HORN_RADIUS_M = 0.036, 0.022
# π's gripper: the horn angle (rad) normalised over encoder counts 2405 ... 3110 (zero at 2048 of 4096).
_PI_GRIPPER_MIN_RAD, _PI_GRIPPER_MAX_RAD = 0.5476, 1.6296
# The follower gripper joint's range (rad) the predicted gripper is normalised to (ALOHA's
# PUPPET_GRIPPER_JOINT_CLOSE / _OPEN as openpi uses them).
_JOINT_CLOSED_RAD, _JOINT_OPEN_RAD = -0.6213, 1.4910


def gripper_to_pi(opening: np.ndarray) -> np.ndarray:
    """ALOHA gripper state (finger opening, 0 closed ... 1 open) -> π's normalised gripper angle."""
    # A finger position at or below 0 (an opening under -0.47: a miscalibrated range) is held just above
    # 0, where openpi's formula would turn the sign and read a shut gripper as wide open.
    linear = np.maximum(opening * (_FINGER_OPEN_M - _FINGER_CLOSED_M) + _FINGER_CLOSED_M, 1e-9)
    # The linkage's law of cosines solved for the horn angle; a position the linkage cannot reach
    # saturates at ±π/2, as openpi's clip does.
    cosine = (_HORN_RADIUS_M**2 + linear**2 - _LINK_ARM_M**2) / (2 * _HORN_RADIUS_M * linear)
    angle = np.arcsin(np.clip(cosine, -1.0, 1.0))
    return (angle - _PI_GRIPPER_MIN_RAD) / (_PI_GRIPPER_MAX_RAD - _PI_GRIPPER_MIN_RAD)


def gripper_from_pi(value: np.ndarray) -> np.ndarray:
    """π's predicted gripper -> the ALOHA gripper action (its joint, normalised 0 closed ... 1 open)."""
    return (value + _PI_GRIPPER_MIN_RAD - _JOINT_CLOSED_RAD) / (_JOINT_OPEN_RAD - _JOINT_CLOSED_RAD)


@dataclass(frozen=True)
class ActionSpace:
    """The conventions a checkpoint was trained under (module docstring), for a robot of `state_dim`
    state and `action_dim` action dimensions. The default is the identity: state and actions in robot
    units, actions absolute (LeRobot's pi05 default)."""

    state_dim: int
    action_dim: int
    aloha_adapt_to_pi: bool = False
    # Action dimensions predicted as offsets from the state's same dimension (sorted, distinct).
    delta_actions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.aloha_adapt_to_pi and (self.state_dim, self.action_dim) != (ALOHA_DIM, ALOHA_DIM):
            raise ValueError(
                f"aloha_adapt_to_pi: needs ALOHA's {ALOHA_DIM}-D state and actions (2 x 6 joints + gripper), "
                f"got state_dim {self.state_dim}, action_dim {self.action_dim}"
            )
        dims = self.delta_actions
        bound = min(self.state_dim, self.action_dim)
        if (
            any(isinstance(d, bool) or not isinstance(d, int) for d in dims)
            or list(dims) != sorted(set(dims))
            or any(not 0 <= d < bound for d in dims)
        ):
            raise ValueError(
                f"delta_actions: needs distinct action dimensions in increasing order, each with a state "
                f"dimension of the same index (0..{bound - 1}), got {list(dims)}"
            )

    @property
    def identity(self) -> bool:
        return not self.aloha_adapt_to_pi and not self.delta_actions

    def state_to_model(self, state: np.ndarray) -> np.ndarray:
        """(state_dim,) robot state -> the state the model was trained on (before normalisation), float32
        (computed in float64, as openpi does)."""
        out = np.array(state, dtype=np.float64)
        if self.aloha_adapt_to_pi:
            out *= ALOHA_JOINT_FLIP
            out[list(ALOHA_GRIPPERS)] = gripper_to_pi(out[list(ALOHA_GRIPPERS)])
        return out.astype(np.float32)

    def actions_to_robot(self, actions: np.ndarray, model_state: np.ndarray) -> np.ndarray:
        """(horizon, action_dim) un-normalised model actions -> robot actions (absolute, robot units),
        float32. `model_state`: the call's state_to_model(state)."""
        out = np.array(actions, dtype=np.float64)
        if self.delta_actions:
            dims = list(self.delta_actions)
            out[:, dims] += model_state[dims]
        if self.aloha_adapt_to_pi:
            out *= ALOHA_JOINT_FLIP
            out[:, list(ALOHA_GRIPPERS)] = gripper_from_pi(out[:, list(ALOHA_GRIPPERS)])
        return out.astype(np.float32)
