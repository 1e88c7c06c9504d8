"""A stand-in for what an Interbotix X-series driver (xs_sdk) answers on `get_robot_info`, for the tests that
run action_streamer over DDS: an ALOHA follower (ViperX 300 6DOF) by default, or one changed to test the
streamer's refusals. The service type is the tests' stand-in interbotix_xs_msgs (its field layout is the
real one's); the simulated cell (rmuscle_ros/node/aloha_sim.py) answers with its own model's values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rmuscle_ros.node.action_streamer import VX300S_JOINTS, VX300S_LIMITS


@dataclass(frozen=True)
class Driver:
    """What one arm's driver says: its group "arm" and its joint "gripper" (an empty answer for others)."""

    joint_names: tuple[str, ...] = VX300S_JOINTS
    mode: str = "position"
    lower: tuple[float, ...] = VX300S_LIMITS[::2]
    upper: tuple[float, ...] = VX300S_LIMITS[1::2]
    gripper_mode: str = "current_based_position"

    def answer(self, request: Any, response: Any) -> Any:
        if request.cmd_type == "group" and request.name == "arm":
            response.mode = self.mode
            response.joint_names = list(self.joint_names)
            response.joint_lower_limits, response.joint_upper_limits = list(self.lower), list(self.upper)
        elif request.cmd_type == "single" and request.name == "gripper":
            response.mode = self.gripper_mode
            response.joint_names = ["left_finger"]  # the driver speaks of a gripper as its left finger
            response.joint_lower_limits, response.joint_upper_limits = [0.021], [0.057]
        response.num_joints = len(response.joint_names)
        return response


def serve(node: Any, service: str, driver: Driver | None = None) -> Any:
    """`node` answers on `service` as `driver` (default: an ALOHA follower's)."""
    from interbotix_xs_msgs.srv import RobotInfo

    return node.create_service(RobotInfo, service, (driver or Driver()).answer)
