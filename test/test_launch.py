"""The launch file: valid Python everywhere; where launch_ros exists (a ROS install), it builds."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import ros_domain

LAUNCH = Path(__file__).resolve().parents[1] / "launch" / "rmuscle.launch.py"


def remappings(name: str, launch: Path = LAUNCH) -> list[tuple[str, str]]:
    """A remapping table of a launch file (read from its source: launch_ros is not installable here)."""
    tree = ast.parse(launch.read_text())
    table = next(n for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.targets[0].id == name)
    return ast.literal_eval(table.value)


def start_executable(
    log_dir: Path,
    env: dict[str, str],
    module: str,
    *ros_args: str,
    table: str = "",
    executable: Path | None = None,
    launch: Path = LAUNCH,
) -> Any:
    """`python -m module --ros-args ...` as its own process (or `executable`, an installed node executable,
    in its stead), with the launch file's table `table`'s remappings (if any) first; its output goes to
    log_dir/<module's last part>.log."""
    import subprocess
    import sys

    remaps = [arg for frm, to in remappings(table, launch) for arg in ("-r", f"{frm}:={to}")] if table else []
    log = (log_dir / f"{module.rsplit('.', 1)[1]}.log").open("wb")
    start = [str(executable)] if executable else [sys.executable, "-m", module]
    return subprocess.Popen(
        [*start, "--ros-args", *remaps, *ros_args], env=env, stdout=log, stderr=subprocess.STDOUT
    )


def test_launch_file_is_valid_python_with_the_aloha_remappings() -> None:
    pairs = remappings("ALOHA_REMAPPINGS")
    assert ("images/base", "/cam_high/camera/color/image_rect_raw") in pairs
    assert {to for _, to in pairs} >= {"/follower_left/joint_states", "/follower_right/joint_states"}
    # Every node topic it remaps is one the node subscribes to by default.
    from rmuscle_ros.node.params import NodeConfig

    cfg = NodeConfig()
    assert {frm for frm, _ in pairs} == set(cfg.camera_topics) | set(cfg.joint_state_topics)


def test_the_streamer_is_remapped_onto_the_policys_chunks_and_the_follower_arms() -> None:
    pairs = dict(remappings("STREAMER_REMAPPINGS"))
    from rmuscle_ros.node.action_streamer import StreamerConfig

    cfg = StreamerConfig()
    assert set(pairs) == {
        "action_chunk",
        *cfg.joint_state_topics,
        *cfg.arm_command_topics,
        *cfg.gripper_command_topics,
        *cfg.robot_info_services,
    }
    assert pairs["action_chunk"] == "rmuscle_node/action_chunk"  # the policy node's ~/action_chunk
    for side in ("left", "right"):
        assert pairs[f"joint_states/{side}"] == f"/follower_{side}/joint_states"
        assert pairs[f"commands/{side}/joint_group"] == f"/follower_{side}/commands/joint_group"
        assert pairs[f"commands/{side}/joint_single"] == f"/follower_{side}/commands/joint_single"
        assert pairs[f"get_robot_info/{side}"] == f"/follower_{side}/get_robot_info"


def test_autostart_activates_after_the_first_configure_only() -> None:
    """The handler that activates a node once it is configured matches only the end of its first
    configure, if it succeeded, and once: after a later configure by hand (cleanup, a parameter set,
    configure again, as the nodes tell an operator to do), or one after a failed first, the node stays
    inactive until told; the streamer's arms would otherwise move at once (found in review). Read from
    the source, as launch_ros is not installable here. Run through jazzy's launch 3.4.3 and launch_ros
    0.26.6 sources (a one-off check in scratch): the matcher gave [True, False] for two successful
    configures and [False, False] after a failed first; a launch whose streamer's configure failed, its
    parameter then fixed and configured by hand, left it inactive."""
    text = LAUNCH.read_text()
    tree = ast.parse(text)
    handlers = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "OnStateTransition"
    ]
    assert len(handlers) == 1
    keywords = {k.arg: k.value for k in handlers[0].keywords}
    once, matcher = keywords.get("handle_once"), keywords.get("matcher")
    assert isinstance(once, ast.Constant) and once.value is True
    assert isinstance(matcher, ast.Call) and getattr(matcher.func, "id", "") == "first_configure_succeeded"
    function = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "first_configure_succeeded"
    )

    # The matcher itself, run on stand-in events (found in review: only its text was checked, and a matcher
    # that never matched passed): launch_ros's StateTransition carries action, start_state and goal_state.
    class StateTransition:
        def __init__(self, action: object, start: str, goal: str) -> None:
            self.action, self.start_state, self.goal_state = action, start, goal

    scope: dict = {
        "StateTransition": StateTransition,
        "Callable": object,
        "Event": object,
        "LifecycleNode": object,
    }
    exec(compile(ast.Module([function], type_ignores=[]), str(LAUNCH), "exec"), scope)
    streamer, other = object(), object()

    def run(events: list[tuple[object, str, str]]) -> list[bool]:
        matches = scope["first_configure_succeeded"](streamer)
        return [matches(StateTransition(*e)) for e in events]

    configured = (streamer, "configuring", "inactive")
    assert run([configured, configured]) == [True, False]  # the first configure only
    assert run([(streamer, "configuring", "unconfigured"), configured]) == [
        False,
        False,
    ]  # after a failed one
    assert run([(other, "configuring", "inactive"), (streamer, "activating", "active"), configured]) == [
        False,
        False,
        True,
    ]  # another node's, or another transition, do not count


def test_the_policy_nodes_end_ends_the_launch_only_when_it_is_not_ending_already() -> None:
    """end_with_policy_node:=true: rmuscle_node's exit shuts the launch down, unless the launch is shutting
    down already (a Ctrl-C or systemd's stop signal reaches every process of the group, and the node ends
    after the launch began to). The second Shutdown made launch_ros raise ("Cannot shutdown a ROS adapter
    that is not running") and the launch end with status 1; found running the launch with jazzy's launch
    3.4.3 and launch_ros 0.26.6 sources on 2026-12-05 (a SIGINT to the launch's process group: status 1
    before, 0 after; a SIGKILL of rmuscle_node alone still ends the launch, status 0). The handler is run
    here on stand-ins, read from the source as launch_ros is not installable here."""
    tree = ast.parse(LAUNCH.read_text())
    function = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "end_launch_unless_ending"
    )

    class Shutdown:
        def __init__(self, reason: str) -> None:
            self.reason = reason

    class Context:
        def __init__(self, is_shutdown: bool) -> None:
            self.is_shutdown = is_shutdown

    scope: dict = {"Shutdown": Shutdown, "LaunchContext": object}
    exec(compile(ast.Module([function], type_ignores=[]), str(LAUNCH), "exec"), scope)
    ended = scope["end_launch_unless_ending"](Context(is_shutdown=False))
    assert [type(a) for a in ended] == [Shutdown] and "end_with_policy_node" in ended[0].reason
    assert scope["end_launch_unless_ending"](Context(is_shutdown=True)) is None
    # and it is what the policy node's exit runs when the argument is true
    on_exit = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and getattr(n.func, "id", "") == "OpaqueFunction"
        and any(getattr(k.value, "id", "") == "end_launch_unless_ending" for k in n.keywords)
    ]
    assert len(on_exit) == 1


@pytest.mark.skipif(
    importlib.util.find_spec("launch_ros") is None,
    reason="launch_ros is not on PyPI; this runs in a ROS 2 Jazzy install from apt (a Thor with ROS)",
)
def test_launch_description_builds() -> None:
    spec = importlib.util.spec_from_file_location("rmuscle_launch", LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    description = module.generate_launch_description()
    assert len(description.entities) == 9  # 8 arguments, then the nodes once their params file is checked


def test_the_launch_file_refuses_a_params_file_that_would_start_a_node_on_its_defaults(tmp_path) -> None:
    """ROS only warns about a params file that is not there and starts the node on its defaults: the tiny
    demo model on random weights, whose actions the streamer would send to the arms (found in review, with
    `profile:=rmuscle_thor`, no .yaml). The launch file checks the file first (check_params_file), and
    stops before any node starts; a profile without the streamer's section is refused unless
    stream_actions:=false."""
    from rmuscle_ros.node.params_file import check_params_file

    config = LAUNCH.parents[1] / "config"
    both = ("rmuscle_node", "action_streamer")
    for profile in ("rmuscle_aloha.yaml", "rmuscle_thor.yaml"):
        check_params_file(config / profile, both)
    check_params_file(config / "rmuscle_default.yaml", ("rmuscle_node",))
    with pytest.raises(ValueError, match="rmuscle_thor is not there"):
        check_params_file(config / "rmuscle_thor", both)
    with pytest.raises(ValueError, match="is a folder"):
        check_params_file(config, both)
    with pytest.raises(
        ValueError, match=r"no section that ROS applies to action_streamer .*stream_actions:=false"
    ):
        check_params_file(config / "rmuscle_default.yaml", both)
    # keyed by the bare name, a section ROS applies only outside a namespace (found in the closing review)
    (tmp_path / "plain.yaml").write_text("rmuscle_node:\n  ros__parameters:\n    prompt: pick\n")
    check_params_file(tmp_path / "plain.yaml", ("rmuscle_node",))
    with pytest.raises(ValueError, match="no section that ROS applies to rmuscle_node in namespace 'cell1'"):
        check_params_file(tmp_path / "plain.yaml", ("rmuscle_node",), "cell1")
    check_params_file(config / "rmuscle_aloha.yaml", both, "/cell1/")
    (tmp_path / "notes.yaml").write_text("just: [a list\n")
    with pytest.raises(ValueError, match="not a ROS params file"):
        check_params_file(tmp_path / "notes.yaml", both)
    # A node's own section holds only its parameters: a name that is none of them (`max_joint_step` for
    # max_step, only logged by the streamer, which cannot tell its own section from `/**`) stops the launch,
    # naming it; one close to a parameter, or a `cache:` key that lost its indentation, says which it meant.
    # rclpy's own and QoS overrides pass, and so does anything in `/**` (every node's: other nodes' too).
    ok = (
        "/**:\n  ros__parameters:\n    robot_description: x\n    max_joint_step: 0.1\n"
        "/**/rmuscle_node:\n  ros__parameters:\n    prompt: pick\n    use_sim_time: true\n"
        "    cache:\n      record: false\n    qos_overrides:\n      /action_chunk:\n        publisher:\n"
        "          depth: 5\n"
        "/**/action_streamer:\n  ros__parameters:\n    max_step: 0.05\n"
    )
    (tmp_path / "ok.yaml").write_text(ok)
    check_params_file(tmp_path / "ok.yaml", both)
    for section, key, said in (
        ("action_streamer", "max_joint_step: 0.05", r"max_joint_step is not a parameter of action_streamer \("),
        ("action_streamer", "max_steps: 0.05", r"max_steps is not a parameter .*did you mean max_step\?"),
        ("rmuscle_node", "record: false", r"record is not a parameter of rmuscle_node .*did you mean cache\.record"),
        ("rmuscle_node", "model:\n      presets: tiny", r"model\.presets is not a parameter .*did you mean model\.preset\?"),
    ):  # fmt: skip
        bad = ok.replace(
            f"/**/{section}:\n  ros__parameters:\n", f"/**/{section}:\n  ros__parameters:\n    {key}\n"
        )
        (tmp_path / "bad.yaml").write_text(bad)
        with pytest.raises(ValueError, match=rf"bad\.yaml, section /\*\*/{section}: {said}"):
            check_params_file(tmp_path / "bad.yaml", both)
    # one the node once had: its own reason, as configure gives it, not a look-alike
    (tmp_path / "bad.yaml").write_text(
        ok.replace("      record: false\n", "      record: false\n      speculate: true\n")
    )
    with pytest.raises(
        ValueError, match=r"section /\*\*/rmuscle_node: cache\.speculate: no longer a parameter: removed on "
    ):
        check_params_file(tmp_path / "bad.yaml", both)
    # the streamer's section is not read when the streamer is not started
    (tmp_path / "bad.yaml").write_text(ok.replace("max_step:", "max_joint_step:"))
    check_params_file(tmp_path / "bad.yaml", ("rmuscle_node",))
    # and the launch file calls it, with the streamer's section asked for only when it starts the streamer
    source = LAUNCH.read_text()
    assert "check_params_file(" in source and "OpaqueFunction(function=nodes)" in source


def test_params_files_ros_would_not_apply_or_cannot_read_are_refused_saying_so(tmp_path) -> None:
    """More files that would start a node on its defaults, each refused with a ValueError naming the file
    (the launch prints it and starts nothing) rather than passed or crashing with a traceback (found by a
    mutation review: each was let through with its check removed, no test noticing)."""
    from rmuscle_ros.node.params_file import check_params_file, section_keys

    node = ("rmuscle_node",)
    # `/*/name` matches one namespace level only: ROS does not apply it to /a/b/rmuscle_node
    assert "/*/rmuscle_node" not in section_keys("rmuscle_node", "a/b")
    assert "/*/rmuscle_node" in section_keys("rmuscle_node", "a")
    (tmp_path / "one_level.yaml").write_text("/*/rmuscle_node:\n  ros__parameters:\n    prompt: pick\n")
    check_params_file(tmp_path / "one_level.yaml", node, "cell1")
    with pytest.raises(ValueError, match="no section that ROS applies to rmuscle_node in namespace 'a/b'"):
        check_params_file(tmp_path / "one_level.yaml", node, "/a/b")
    # the parameters without their `ros__parameters:` key: ROS reads none of them
    (tmp_path / "flat.yaml").write_text("/**/rmuscle_node:\n  prompt: pick\n")
    with pytest.raises(ValueError, match="no section that ROS applies to rmuscle_node"):
        check_params_file(tmp_path / "flat.yaml", node)
    # an empty file, a list: no node sections
    for name, text in (("empty.yaml", ""), ("list.yaml", "- rmuscle_node\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"{name}: not a ROS params file")):
            check_params_file(tmp_path / name, node)
    # a binary file given as the profile (a bag's .db3, a model's weights)
    (tmp_path / "weights.yaml").write_bytes(b"\xff\xfe\x00\x81 not text")
    with pytest.raises(ValueError, match=r"weights\.yaml: not a ROS params file"):
        check_params_file(tmp_path / "weights.yaml", node)


def test_a_profile_taking_compressed_images_has_the_cameras_remapped_onto_their_compressed_topics(
    tmp_path,
) -> None:
    """image_transport publishes a camera's JPEG frames on `<topic>/compressed`; the launch file remapped
    the cameras onto the raw topics whatever the profile said, and a node taking CompressedImage there
    received nothing (found in review). It reads the profile's `compressed_images` as ROS applies the file
    (every section that applies, in the file's order) and remaps the cameras, and only them, onto
    `/compressed`."""
    from rmuscle_ros.node.params_file import camera_remappings, node_parameter

    config = LAUNCH.parents[1] / "config"
    assert node_parameter(config / "rmuscle_default.yaml", "rmuscle_node", "compressed_images") is False
    assert node_parameter(config / "rmuscle_aloha.yaml", "rmuscle_node", "compressed_images") is None
    (tmp_path / "cell.yaml").write_text(
        "/**/rmuscle_node:\n  ros__parameters:\n    compressed_images: false\n"
        "/cell1/rmuscle_node:\n  ros__parameters:\n    compressed_images: true\n"
        "/cell2/rmuscle_node:\n  ros__parameters:\n    compressed_images: true\n"
        "/**:\n  ros__parameters:\n    compressed_images: false\n"
    )
    assert node_parameter(tmp_path / "cell.yaml", "rmuscle_node", "compressed_images") is False
    assert node_parameter(tmp_path / "cell.yaml", "rmuscle_node", "compressed_images", "cell1") is False
    (tmp_path / "cell.yaml").write_text(
        "/**:\n  ros__parameters:\n    compressed_images: false\n"
        "/**/rmuscle_node:\n  ros__parameters:\n    prompt: pick\n"
        "/cell1/rmuscle_node:\n  ros__parameters:\n    compressed_images: true\n"
    )
    assert node_parameter(tmp_path / "cell.yaml", "rmuscle_node", "compressed_images", "cell1") is True
    assert node_parameter(tmp_path / "cell.yaml", "rmuscle_node", "compressed_images", "cell2") is False
    # the same answers as rclpy's own reading of the files (rcl's YAML parser), where ROS is installed
    rclpy = pytest.importorskip("rclpy", reason="ROS 2 wheels not installed (make venv installs them)")
    for layout in (
        "/cell1/rmuscle_node:\n  ros__parameters:\n    compressed_images: true\n"
        "/**:\n  ros__parameters:\n    compressed_images: false\n",
        "/**:\n  ros__parameters:\n    compressed_images: false\n"
        "/cell1/rmuscle_node:\n  ros__parameters:\n    compressed_images: true\n",
    ):
        (tmp_path / "order.yaml").write_text(layout)
        context = rclpy.Context()
        rclpy.init(args=["--ros-args", "--params-file", str(tmp_path / "order.yaml")], context=context)
        try:
            node = rclpy.create_node(
                "rmuscle_node", namespace="cell1", context=context,
                automatically_declare_parameters_from_overrides=True,
            )  # fmt: skip
            ros = node.get_parameter("compressed_images").value
            node.destroy_node()
        finally:
            rclpy.shutdown(context=context)
        assert node_parameter(tmp_path / "order.yaml", "rmuscle_node", "compressed_images", "cell1") is ros
    table = remappings("ALOHA_REMAPPINGS")
    assert camera_remappings(table, False) == table
    moved = dict(camera_remappings(table, True))
    assert moved["images/base"] == "/cam_high/camera/color/image_rect_raw/compressed"
    assert moved["joint_states/left"] == "/follower_left/joint_states"
    source = LAUNCH.read_text()
    assert "camera_remappings(ALOHA_REMAPPINGS, compressed)" in source
    assert 'node_parameter(params_file, "rmuscle_node", "compressed_images", namespace)' in source


def test_what_the_launch_file_imports_of_this_package_needs_no_torch() -> None:
    """`ros2 launch` runs the launch file in the `ros2` program's Python (apt's /usr/bin/python3 on a
    Thor), which does not see the venv's torch. The launch file imported params.py, which imports the
    policy and torch: the documented launch stopped before any node started (found in review). Every
    rmuscle_ros module it imports must load with torch, safetensors and numpy absent."""
    import subprocess
    import sys

    tree = ast.parse(LAUNCH.read_text())
    modules = sorted(
        n.module
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("rmuscle_ros")
    )
    assert modules == ["rmuscle_ros.node.params_file"]
    code = (
        "import importlib, sys\n"
        "for m in ('torch', 'safetensors', 'numpy'):\n"
        "    sys.modules[m] = None\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "from rmuscle_ros.node.params_file import check_params_file\n"
        "check_params_file('config/rmuscle_thor.yaml', ('rmuscle_node', 'action_streamer'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=LAUNCH.parents[1], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_the_launch_remappings_connect_both_nodes_to_an_aloha_stack(tmp_path) -> None:
    """What `ros2 launch` would start, without the launch library (not installable here): both executables
    as processes of their own with the launch file's remappings, the policy node on the CPU profile and the
    streamer on the ALOHA profile's section, configured and activated through their lifecycle services. A
    stand-in for the Interbotix stack publishes on the ALOHA's own topics (cameras, both followers' joint
    states, with the names an Interbotix arm uses) and listens on the followers' command topics, which must
    then carry the policy's actions; it answers get_robot_info on each follower's driver service as an ALOHA
    follower's driver does, which the streamer asks before it sends anything."""
    drive_an_aloha_stack(tmp_path, config=LAUNCH.parents[1] / "config", launch=LAUNCH)


def drive_an_aloha_stack(
    log_dir: Path,
    *,
    config: Path,
    launch: Path,
    executables: Path | None = None,
    env: dict[str, str] | None = None,
    domain_offset: int = 50,
) -> None:
    """Both nodes started as `ros2 launch` would (the launch file `launch`'s remappings, the profiles in
    `config`; from `executables`, a folder of installed node executables, with the environment `env`, or
    else with `python -m` in this one), brought up through their lifecycle services, and checked to turn a
    stand-in ALOHA stack's cameras and joint states into both followers' arm and gripper commands."""
    rclpy = pytest.importorskip("rclpy", reason="ROS 2 wheels not installed (make venv installs them)")
    pytest.importorskip(
        "rmuscle_ros.msg", reason="interfaces not built (scripts/setup_ros_venv.sh builds them)"
    )
    interbotix = pytest.importorskip(
        "interbotix_xs_msgs.msg",
        reason="the stand-in Interbotix messages are not built (scripts/setup_ros_venv.sh)",
    )
    import os
    import time

    import numpy as np
    from interbotix_driver import serve
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image, JointState

    from rmuscle_ros.node.bags import ALOHA_JOINT_STATE_NAMES
    from rmuscle_ros.node.replay_demo import call_service, stop_processes
    from rmuscle_ros.node.spin import BackgroundSpin

    domain = ros_domain(domain_offset)  # away from the other tests' nodes
    env = (os.environ if env is None else env) | {"ROS_DOMAIN_ID": str(domain)}

    def start(module: str, *args: str, table: str) -> Any:
        installed = executables / module.rsplit(".", 1)[1] if executables else None
        return start_executable(log_dir, env, module, *args, table=table, executable=installed, launch=launch)

    processes = [
        start("rmuscle_ros.node.rmuscle_node", "--params-file", str(config / "rmuscle_default.yaml"),
              "-p", "warmup:=false", "-p", "cache.enabled:=false", table="ALOHA_REMAPPINGS"),
        start("rmuscle_ros.node.action_streamer", "--params-file", str(config / "rmuscle_aloha.yaml"),
              table="STREAMER_REMAPPINGS"),
    ]  # fmt: skip
    context = rclpy.Context()
    rclpy.init(context=context, domain_id=domain)
    cell = rclpy.create_node("aloha_stand_in", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(cell)
    spinning = BackgroundSpin(executor)
    commands: dict[str, list] = {"left": [], "right": [], "left_gripper": [], "right_gripper": []}
    try:
        for side in ("left", "right"):
            cell.create_subscription(
                interbotix.JointGroupCommand,
                f"/follower_{side}/commands/joint_group",
                commands[side].append,
                100,
            )
            cell.create_subscription(
                interbotix.JointSingleCommand, f"/follower_{side}/commands/joint_single",
                commands[f"{side}_gripper"].append, 100,
            )  # fmt: skip
            serve(cell, f"/follower_{side}/get_robot_info")  # an ALOHA follower's driver's answers
        cameras = [cell.create_publisher(Image, to, qos_profile_sensor_data)
                   for frm, to in remappings("ALOHA_REMAPPINGS", launch) if frm.startswith("images/")]  # fmt: skip
        arms = [cell.create_publisher(JointState, f"/follower_{side}/joint_states", qos_profile_sensor_data)
                for side in ("left", "right")]  # fmt: skip
        for name in ("rmuscle_node", "action_streamer"):
            client = cell.create_client(ChangeState, f"/{name}/change_state")
            for transition in (Transition.TRANSITION_CONFIGURE, Transition.TRANSITION_ACTIVATE):
                request = ChangeState.Request()
                request.transition.id = transition
                assert call_service(client, request, 120.0).success, (log_dir / f"{name}.log").read_text()[
                    -3000:
                ]
        pixels = np.full((48, 64, 3), 90, np.uint8).tobytes()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and min(len(v) for v in commands.values()) < 10:
            stamp = cell.get_clock().now().to_msg()
            for pub in cameras:
                msg = Image(height=48, width=64, encoding="rgb8", step=64 * 3, data=pixels)
                msg.header.stamp = stamp
                pub.publish(msg)
            for pub in arms:  # an Interbotix follower: the same names on both arms, the fingers in metres
                msg = JointState(name=list(ALOHA_JOINT_STATE_NAMES), position=[0.0] * 6 + [0.9, 0.05, -0.05])
                msg.header.stamp = stamp
                pub.publish(msg)
            time.sleep(0.02)
        assert min(len(v) for v in commands.values()) >= 10, {k: len(v) for k, v in commands.items()}
        assert all(m.name == "arm" and len(m.cmd) == 6 for m in commands["left"] + commands["right"])
        assert all(m.name == "gripper" for m in commands["left_gripper"] + commands["right_gripper"])
    finally:
        stop_processes(*processes)
        spinning.stop()
        cell.destroy_node()
        rclpy.shutdown(context=context)
