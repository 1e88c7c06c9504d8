"""Launch rmuscle_node on a cell, and action_streamer to execute its chunks on the arms.

    ros2 launch rmuscle_ros rmuscle.launch.py profile:=rmuscle_aloha.yaml
    ros2 launch rmuscle_ros rmuscle.launch.py params_file:=/path/to/cell.yaml autostart:=false
    ros2 launch rmuscle_ros rmuscle.launch.py stream_actions:=false   # chunks only, the arms untouched
    ros2 launch rmuscle_ros rmuscle.launch.py activate_streamer:=true # the arms move once chunks come
    ros2 launch rmuscle_ros rmuscle.launch.py use_sim_time:=true      # on a bag's or simulator's /clock
    ros2 launch rmuscle_ros rmuscle.launch.py end_with_policy_node:=true  # under a supervisor (systemd)

Parameters come from a profile (both nodes read their own section of the file); the topics are remapped
onto an Interbotix ALOHA stack. With autostart (default) rmuscle_node is configured on start and
activated once its first configure succeeds, which is what `ros2 lifecycle set ... configure/activate` would do
by hand. The streamer sends the follower arms position commands as soon as it is active and a chunk is
due, so autostart only configures it: the operator activates it when the cell is ready
(`ros2 lifecycle set /action_streamer activate`, `/<namespace>/action_streamer` under namespace:=), or
activate_streamer:=true does it at start (a bare launch otherwise moved the arms as soon as the first
chunk came, tens of seconds after the command while the kernels compiled; found in review). With
stream_actions:=false it is not started. A params file that is not there, or that has no section for a
node it would start, stops the launch before any node starts (ROS would start that node on its defaults).
A profile with `compressed_images: true` has the cameras remapped onto their `/compressed` subtopics.
With end_with_policy_node:=true the launch ends when rmuscle_node's process does (a crash, a lost
GPU, or `exit_after_stall_s` after a call that hung), so that a supervisor restarting the launch brings the cell
back as at start: rmuscle_node configured and active, the streamer configured and waiting for the
operator (unless activate_streamer:=true). Without it the other nodes go on, and nothing restarts the node.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ament_index_python.packages import get_package_share_directory
from launch import Event, LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, OpaqueFunction, RegisterEventHandler, Shutdown
from launch.events import matches_action
from launch.launch_context import LaunchContext
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch.utilities import perform_substitutions
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState, StateTransition
from lifecycle_msgs.msg import Transition

from rmuscle_ros.node.params_file import (  # no torch: see its docstring
    camera_remappings,
    check_params_file,
    node_parameter,
)

# The policy node's topics (π0.5 slot order) -> the Interbotix ALOHA stack's topics. With the profile's
# `compressed_images: true` the cameras' go to each topic's `/compressed` (image_transport's JPEG frames).
ALOHA_REMAPPINGS = [
    ("images/base", "/cam_high/camera/color/image_rect_raw"),
    ("images/left_wrist", "/cam_left_wrist/camera/color/image_rect_raw"),
    ("images/right_wrist", "/cam_right_wrist/camera/color/image_rect_raw"),
    ("joint_states/left", "/follower_left/joint_states"),
    ("joint_states/right", "/follower_right/joint_states"),
]
# The streamer's topics -> the policy node's chunks and the follower arms' state and command topics, and
# its services -> the follower arms' drivers' (xs_sdk's) get_robot_info.
STREAMER_REMAPPINGS = [
    ("action_chunk", "rmuscle_node/action_chunk"),
    ("joint_states/left", "/follower_left/joint_states"),
    ("joint_states/right", "/follower_right/joint_states"),
    ("commands/left/joint_group", "/follower_left/commands/joint_group"),
    ("commands/left/joint_single", "/follower_left/commands/joint_single"),
    ("commands/right/joint_group", "/follower_right/commands/joint_group"),
    ("commands/right/joint_single", "/follower_right/commands/joint_single"),
    ("get_robot_info/left", "/follower_left/get_robot_info"),
    ("get_robot_info/right", "/follower_right/get_robot_info"),
]


def first_configure_succeeded(node: LifecycleNode) -> Callable[[Event], bool]:
    """A matcher for the end of `node`'s first configure, if it succeeded. Only that one activates it: after
    a later configure by hand (cleanup, a parameter set, configure again), or one after a failed first
    (an operator fixing a parameter), the node stays inactive until told. Found in review: the streamer's
    arms moved as soon as such a configure ended."""
    ends: list[str] = []

    def matches(event: Event) -> bool:
        if not (
            isinstance(event, StateTransition) and event.action == node and event.start_state == "configuring"
        ):
            return False
        ends.append(event.goal_state)
        return ends == ["inactive"]

    return matches


def autostarted(node: LifecycleNode, autostart: bool, activate: bool = True) -> list:
    """`node`, configured on start if `autostart`, and activated when that first configure succeeds if also
    `activate` (first_configure_succeeded)."""
    if not autostart:
        return [node]

    def change(transition: int) -> EmitEvent:
        return EmitEvent(
            event=ChangeState(lifecycle_node_matcher=matches_action(node), transition_id=transition)
        )

    activate_when_configured = RegisterEventHandler(
        OnStateTransition(
            matcher=first_configure_succeeded(node),
            entities=[change(Transition.TRANSITION_ACTIVATE)],
            handle_once=True,
        )
    )
    if not activate:
        return [node, change(Transition.TRANSITION_CONFIGURE)]
    return [activate_when_configured, node, change(Transition.TRANSITION_CONFIGURE)]


def true(context: LaunchContext, name: str) -> bool:
    """A boolean launch argument, read as launch's IfCondition reads one (true/false, 1/0)."""
    value = perform_substitutions(context, [LaunchConfiguration(name)]).strip().lower()
    if value not in ("true", "1", "false", "0"):
        raise ValueError(f"{name}:={value!r}: expected true or false")
    return value in ("true", "1")


def end_launch_unless_ending(context: LaunchContext) -> list | None:
    """rmuscle_node's process has ended (end_with_policy_node:=true): the launch ends too, unless it is
    ending already (a Ctrl-C, or systemd stopping it, ends the node first). A second Shutdown then made
    launch_ros raise "Cannot shutdown a ROS adapter that is not running" and the launch end with status 1
    (found running the launch with its sources: systemd would have marked each stop a failure)."""
    if context.is_shutdown:
        return None
    return [Shutdown(reason="rmuscle_node ended (end_with_policy_node:=true)")]


def nodes(context: LaunchContext) -> list:
    """The nodes, once the params file is known to give each of them its section (else the launch stops
    here, before anything starts)."""
    params_file = perform_substitutions(context, [LaunchConfiguration("params_file")])
    stream_actions, autostart = true(context, "stream_actions"), true(context, "autostart")
    activate_streamer = true(context, "activate_streamer")
    end_with_policy_node = true(context, "end_with_policy_node")
    # Only when true: false leaves the profile's own use_sim_time as it is.
    overrides = [{"use_sim_time": True}] if true(context, "use_sim_time") else []
    namespace = perform_substitutions(context, [LaunchConfiguration("namespace")])
    names = ("rmuscle_node", "action_streamer") if stream_actions else ("rmuscle_node",)
    check_params_file(params_file, names, namespace)
    compressed = node_parameter(params_file, "rmuscle_node", "compressed_images", namespace) is True

    def lifecycle_node(
        executable: str, remappings: list[tuple[str, str]], on_exit: list | None = None
    ) -> LifecycleNode:
        return LifecycleNode(
            package="rmuscle_ros",
            executable=executable,
            name=executable,
            namespace=LaunchConfiguration("namespace"),
            output="screen",
            parameters=[params_file, *overrides],
            remappings=remappings,
            on_exit=on_exit,
        )

    ended = [OpaqueFunction(function=end_launch_unless_ending)] if end_with_policy_node else None
    policy_node = lifecycle_node("rmuscle_node", camera_remappings(ALOHA_REMAPPINGS, compressed), ended)
    entities = autostarted(policy_node, autostart)
    if stream_actions:
        streamer = lifecycle_node("action_streamer", STREAMER_REMAPPINGS)
        entities += autostarted(streamer, autostart, activate=activate_streamer)
    return entities


def generate_launch_description() -> LaunchDescription:
    config_dir = os.path.join(get_package_share_directory("rmuscle_ros"), "config")
    return LaunchDescription(
        [
            DeclareLaunchArgument(
                "profile", default_value="rmuscle_aloha.yaml", description="file in config/"
            ),
            DeclareLaunchArgument(
                "params_file",
                default_value=PathJoinSubstitution([config_dir, LaunchConfiguration("profile")]),
                description="parameter file (overrides profile)",
            ),
            DeclareLaunchArgument("namespace", default_value="", description="node namespace"),
            DeclareLaunchArgument(
                "autostart",
                default_value="true",
                description="configure + activate rmuscle_node on start; configure action_streamer "
                "(activated too with activate_streamer:=true)",
            ),
            DeclareLaunchArgument(
                "stream_actions",
                default_value="true",
                description="start action_streamer, which sends the chunks to the follower arms",
            ),
            DeclareLaunchArgument(
                "activate_streamer",
                default_value="false",
                description="with autostart, also activate action_streamer (the arms then move once chunks "
                "come); otherwise it waits, configured, for `ros2 lifecycle set /action_streamer activate` "
                "(/<namespace>/action_streamer with namespace:=)",
            ),
            DeclareLaunchArgument(
                "end_with_policy_node",
                default_value="false",
                description="true: the launch ends when rmuscle_node's process does (a crash, a lost GPU, "
                "or its exit_after_stall_s), with status 0, for a supervisor (systemd Restart=always, a container's "
                "--restart unless-stopped) to start it again as at start; false: the other nodes go on",
            ),
            DeclareLaunchArgument(
                "use_sim_time",
                default_value="false",
                description="true: both nodes on the /clock of a bag played with `ros2 bag play --clock 100` "
                "(a bare --clock is 40 Hz, below the 50 Hz control rate) or "
                "a simulator (false leaves the profile's setting)",
            ),
            OpaqueFunction(function=nodes),
        ]
    )
