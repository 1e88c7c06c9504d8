"""Launch rmuscle_node on a cell: parameters from a profile, ALOHA topic remappings, autostart.

    ros2 launch rmuscle_ros rmuscle.launch.py profile:=rmuscle_aloha.yaml
    ros2 launch rmuscle_ros rmuscle.launch.py params_file:=/path/to/cell.yaml autostart:=false

With autostart (default) the node is configured on start and activated once configuring succeeds,
which is what `ros2 lifecycle set ... configure/activate` would do by hand.
"""

from __future__ import annotations

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, RegisterEventHandler
from launch.conditions import IfCondition
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from lifecycle_msgs.msg import Transition

# The node's topics (π0.5 slot order) -> the Interbotix ALOHA stack's topics.
ALOHA_REMAPPINGS = [
    ("images/base", "/cam_high/camera/color/image_rect_raw"),
    ("images/left_wrist", "/cam_left_wrist/camera/color/image_rect_raw"),
    ("images/right_wrist", "/cam_right_wrist/camera/color/image_rect_raw"),
    ("joint_states/left", "/follower_left/joint_states"),
    ("joint_states/right", "/follower_right/joint_states"),
]


def generate_launch_description() -> LaunchDescription:
    config_dir = os.path.join(get_package_share_directory("rmuscle_ros"), "config")
    profile = LaunchConfiguration("profile")
    params_file = LaunchConfiguration("params_file")
    autostart = LaunchConfiguration("autostart")

    node = LifecycleNode(
        package="rmuscle_ros",
        executable="rmuscle_node",
        name="rmuscle_node",
        namespace=LaunchConfiguration("namespace"),
        output="screen",
        parameters=[params_file],
        remappings=ALOHA_REMAPPINGS,
    )
    configure = EmitEvent(
        event=ChangeState(
            lifecycle_node_matcher=matches_action(node), transition_id=Transition.TRANSITION_CONFIGURE
        ),
        condition=IfCondition(autostart),
    )
    activate_when_configured = RegisterEventHandler(
        OnStateTransition(
            target_lifecycle_node=node,
            start_state="configuring",
            goal_state="inactive",
            entities=[
                EmitEvent(
                    event=ChangeState(
                        lifecycle_node_matcher=matches_action(node),
                        transition_id=Transition.TRANSITION_ACTIVATE,
                    )
                )
            ],
        ),
        condition=IfCondition(autostart),
    )
    return LaunchDescription(
        [
            DeclareLaunchArgument(
                "profile", default_value="rmuscle_aloha.yaml", description="file in config/"
            ),
            DeclareLaunchArgument(
                "params_file",
                default_value=PathJoinSubstitution([config_dir, profile]),
                description="parameter file (overrides profile)",
            ),
            DeclareLaunchArgument("namespace", default_value="", description="node namespace"),
            DeclareLaunchArgument(
                "autostart", default_value="true", description="configure + activate on start"
            ),
            activate_when_configured,
            node,
            configure,
        ]
    )
