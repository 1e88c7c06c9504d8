"""Launch rmuscle_node on a cell, and action_streamer to execute its chunks on the arms.

    ros2 launch rmuscle_ros rmuscle.launch.py profile:=rmuscle_aloha.yaml
    ros2 launch rmuscle_ros rmuscle.launch.py params_file:=/path/to/cell.yaml autostart:=false
    ros2 launch rmuscle_ros rmuscle.launch.py stream_actions:=false   # chunks only, the arms untouched

Parameters come from a profile (both nodes read their own section of the file); the topics are remapped
onto an Interbotix ALOHA stack. With autostart (default) each node is configured on start and activated
once configuring succeeds, which is what `ros2 lifecycle set ... configure/activate` would do by hand.
The streamer sends the follower arms position commands as soon as it is active and a chunk is due; with
stream_actions:=false it is not started.
"""

from __future__ import annotations

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, RegisterEventHandler
from launch.conditions import IfCondition
from launch.events import matches_action
from launch.substitutions import AndSubstitution, LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from lifecycle_msgs.msg import Transition

# The policy node's topics (π0.5 slot order) -> the Interbotix ALOHA stack's topics.
ALOHA_REMAPPINGS = [
    ("images/base", "/cam_high/camera/color/image_rect_raw"),
    ("images/left_wrist", "/cam_left_wrist/camera/color/image_rect_raw"),
    ("images/right_wrist", "/cam_right_wrist/camera/color/image_rect_raw"),
    ("joint_states/left", "/follower_left/joint_states"),
    ("joint_states/right", "/follower_right/joint_states"),
]
# The streamer's topics -> the policy node's chunks and the follower arms' state and command topics.
STREAMER_REMAPPINGS = [
    ("action_chunk", "rmuscle_node/action_chunk"),
    ("joint_states/left", "/follower_left/joint_states"),
    ("joint_states/right", "/follower_right/joint_states"),
    ("commands/left/joint_group", "/follower_left/commands/joint_group"),
    ("commands/left/joint_single", "/follower_left/commands/joint_single"),
    ("commands/right/joint_group", "/follower_right/commands/joint_group"),
    ("commands/right/joint_single", "/follower_right/commands/joint_single"),
]


def autostarted(node: LifecycleNode, condition: IfCondition) -> list:
    """Configure `node` on start and activate it once configured, under `condition`."""

    def change(transition: int, **kwargs: object) -> EmitEvent:
        return EmitEvent(
            event=ChangeState(lifecycle_node_matcher=matches_action(node), transition_id=transition),
            **kwargs,
        )

    activate_when_configured = RegisterEventHandler(
        OnStateTransition(
            target_lifecycle_node=node,
            start_state="configuring",
            goal_state="inactive",
            entities=[change(Transition.TRANSITION_ACTIVATE)],
        ),
        condition=condition,
    )
    return [activate_when_configured, node, change(Transition.TRANSITION_CONFIGURE, condition=condition)]


def generate_launch_description() -> LaunchDescription:
    config_dir = os.path.join(get_package_share_directory("rmuscle_ros"), "config")
    profile = LaunchConfiguration("profile")
    params_file = LaunchConfiguration("params_file")
    autostart = LaunchConfiguration("autostart")
    stream_actions = LaunchConfiguration("stream_actions")
    namespace = LaunchConfiguration("namespace")

    policy = LifecycleNode(
        package="rmuscle_ros",
        executable="rmuscle_node",
        name="rmuscle_node",
        namespace=namespace,
        output="screen",
        parameters=[params_file],
        remappings=ALOHA_REMAPPINGS,
    )
    streamer = LifecycleNode(
        package="rmuscle_ros",
        executable="action_streamer",
        name="action_streamer",
        namespace=namespace,
        output="screen",
        parameters=[params_file],
        remappings=STREAMER_REMAPPINGS,
        condition=IfCondition(stream_actions),
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
            DeclareLaunchArgument(
                "stream_actions",
                default_value="true",
                description="start action_streamer, which sends the chunks to the follower arms",
            ),
            *autostarted(policy, IfCondition(autostart)),
            *autostarted(streamer, IfCondition(AndSubstitution(autostart, stream_actions))),
        ]
    )
