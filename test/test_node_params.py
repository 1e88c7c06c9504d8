"""ROS parameters -> NodeConfig: defaults, profiles, and errors that name the parameter."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rmuscle_ros.cache.runtime import RMuscleConfig
from rmuscle_ros.node.params import (
    ALOHA_JOINTS,
    CacheParams,
    ParameterError,
    load_params_file,
    node_config,
    parameter_defaults,
)
from rmuscle_ros.runtime.action_space import ALOHA_DELTA_ACTIONS

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"


def test_defaults_build_a_valid_config() -> None:
    cfg = node_config({})
    assert cfg.model.preset == "tiny" and cfg.model.state_dim == 14 == len(ALOHA_JOINTS)
    assert cfg.model.cameras == ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    assert cfg.model.checkpoint is None  # "" in ROS means "none"
    assert "model.cameras" not in parameter_defaults()  # derived from camera_topics


def test_an_empty_camera_topic_leaves_its_image_slot_empty() -> None:
    """A cell without a base camera: its wrists feed π0.5's wrist slots, slot 0 stays empty (found in
    review: camera_topics[i] fed slot i, so two wrist cameras went into the base and left wrist slots)."""
    cfg = node_config({"camera_topics": ["", "images/left_wrist", "images/right_wrist"]})
    assert cfg.camera_inputs == ("images/left_wrist", "images/right_wrist")
    assert cfg.model.cameras == ("left_wrist_0_rgb", "right_wrist_0_rgb") and cfg.model.slots == (1, 2)
    base_and_right = node_config({"camera_topics": ["images/base", "", "images/right_wrist"]})
    assert base_and_right.model.cameras == ("base_0_rgb", "right_wrist_0_rgb")
    assert base_and_right.model.slots == (0, 2)
    first_two = node_config({"camera_topics": ["images/base", "images/left_wrist", ""]})
    assert first_two.model.camera_slots == () and first_two.model.slots == (0, 1), (
        "the first slots: as before"
    )
    assert "model.camera_slots" not in parameter_defaults()  # derived from camera_topics


@pytest.mark.parametrize("profile", sorted(p.name for p in CONFIG_DIR.glob("rmuscle_*.yaml")))
def test_shipped_profiles_are_valid(profile: str) -> None:
    node_config(load_params_file(CONFIG_DIR / profile))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"model.preset": "pi0"}, r"^model\.preset: unknown 'pi0'"),
        ({"model.backend": "openvino"}, r"^model\.backend: unknown 'openvino'"),
        ({"control_period_s": 0.0}, r"^control_period_s: must be > 0"),
        ({"max_skew_s": float("nan")}, r"^max_skew_s"),
        ({"sensor_startup_timeout_s": -1.0}, r"^sensor_startup_timeout_s: must be >= 0"),
        ({"sensor_startup_timeout_s": float("inf")}, r"^sensor_startup_timeout_s: must be >= 0"),
        ({"cache.rho_p": 1.5}, r"^cache\.rho_p: must be in \(0, 1\]"),
        ({"cache.similarity_threshold": -0.1}, r"^cache\.similarity_threshold"),
        ({"cache.rho_n": 0.0}, r"^cache\.rho_n: must be in \(0, 1\]"),
        ({"cache.anchors": 0}, r"^cache\.anchors: must be >= 1"),
        (
            {"cache.neuron_schedule": "cosine"},
            r"^cache\.neuron_schedule: must be one of \('uniform', 'ramp'\)",
        ),
        ({"cache.top_k": 0}, r"^cache\.top_k"),
        ({"cache.lookahead": -1}, r"^cache\.lookahead"),
        # found in review: accepted, then the window's allocation failed (4 TB) at configure
        (
            {"cache.top_k": 100000},
            r"^cache\.top_k: a window of top_k × \(lookahead \+ 1\) = 500000 entries is more than 256",
        ),
        ({"cache.max_library_mb": 0}, r"^cache\.max_library_mb: must be >= 1"),
        # found in review: a blank task overrode every prompt with one (empty) task
        ({"cache.task": " _ "}, r"^cache\.task: ' _ ' is blank once cleaned"),
        ({"cache.max_episodes": 0}, r"^cache\.max_episodes: must be >= 1"),
        ({"cache.rebuilds_per_tick": 0}, r"^cache\.rebuilds_per_tick: must be >= 1"),
        ({"cache.rebuild_slices": 0}, r"^cache\.rebuild_slices: must be >= 1"),
        ({"cache.audit_every": -1}, r"^cache\.audit_every: must be an int >= 0 \(0: no audits\)"),
        ({"cache.audit_max_error": -0.5}, r"^cache\.audit_max_error: must be a finite number >= 0"),
        ({"cache.status_period_s": 0.0}, r"^cache\.status_period_s: must be > 0"),
        ({"cache.record": 1}, r"^cache\.record: expected bool"),
        (
            {"cache.enabled": True},
            r"^model\.backend: cache\.enabled needs backend 'fused' \(CPU\) or 'graph'",
        ),
        (
            {"cache.enabled": True, "model.backend": "tensorrt"},
            r"^model\.backend: cache\.enabled needs .* got 'tensorrt'",
        ),
        ({"actions_per_inference": 51}, r"^actions_per_inference: must be in 1\.\.50"),
        ({"camera_topics": ["a", "a"]}, r"^camera_topics: needs at least one topic, distinct"),
        (
            {"camera_topics": ["", "", ""]},
            r"^camera_topics: needs at least one topic, .* leaves a slot empty",
        ),
        ({"camera_topics": ["", "a", "a"]}, r"^camera_topics: needs at least one topic, distinct"),
        ({"camera_topics": ["a", "b", "c", "d"]}, r"^camera_topics: π0\.5 has 3 image slots"),
        ({"joint_names": [f"j{i}" for i in range(40)]}, r"^joint_names: at most 32 joints"),
        (
            {"joint_name_prefixes": ["left_"]},
            r"^joint_name_prefixes: needs one entry per joint_state_topics entry \(2\)",
        ),
        (
            {"joint_state_topics": ["arm"], "joint_name_prefixes": ["a_", "b_"]},
            r"^joint_name_prefixes: needs one entry per joint_state_topics entry \(1\)",
        ),
        (
            {"gripper_state_range": [0.04, 0.04]},
            r"^gripper_state_range: needs \[closed, open\], two different",
        ),
        ({"gripper_state_range": [0.0, 0.5, 1.0]}, r"^gripper_state_range: needs \[closed, open\]"),
        ({"gripper_state_range": ["a", "b"]}, r"^gripper_state_range: expected a list of numbers"),
        (
            {"gripper_state_joint": "left_finger", "gripper_joint": "claw"},
            r"^gripper_joint: joint_names has no 'left_claw'",
        ),
        ({"gripper_state_joint": "left_finger", "gripper_joint": ""}, r"^gripper_joint: names no gripper"),
        ({"prompt": "  "}, r"^prompt: prompt '  ' is blank once cleaned"),
        ({"prompt": "_"}, r"^prompt: prompt '_' is blank once cleaned for the model \('_' and newlines"),
        ({"cpu_threads": -1}, r"^cpu_threads: must be in 0\.\.\d+ \(0: automatic"),
        ({"noise_seed": -2}, r"^noise_seed: must be >= 0, or -1 for one stream"),
        ({"error_after_drops": 0}, r"^error_after_drops: must be >= 1"),
        ({"stall_after_s": 0.0}, r"^stall_after_s: must be > 0"),
        ({"min_episode_s": -1.0}, r"^min_episode_s: must be >= 0 \(0: every episode recorded\)"),
        # found in review: 0.005 s refused every reset and parameter set (the one raising it back included)
        ({"stall_after_s": 0.01}, r"^stall_after_s: must be at least 0\.5 s \(a call or motion-window job"),
        ({"max_skew_s": 1e300}, r"^max_skew_s: must be > 0 and at most 3600 s"),
        ({"sensor_startup_timeout_s": 1e300}, r"^sensor_startup_timeout_s: must be >= 0 and at most 3600 s"),
        ({"stall_after_s": float("inf")}, r"^stall_after_s: must be > 0"),
        ({"exit_after_stall_s": -1.0}, r"^exit_after_stall_s: must be >= 0 \(0: never\) and at most 3600 s"),
        ({"exit_after_stall_s": float("nan")}, r"^exit_after_stall_s: must be >= 0 \(0: never\)"),
        (
            {"exit_after_stall_s": 1.5},
            r"^exit_after_stall_s: must be 0 \(never\) or above stall_after_s, got 1\.5 against 2 s",
        ),
        ({"warmup": "yes"}, r"^warmup: expected bool"),
        ({"model.seed": 1.5}, r"^model\.seed: expected int"),
        ({"model.presett": "tiny"}, r"^model\.presett: unknown parameter \(did you mean model\.preset\?"),
        # found in review: a `cache:` key that lost its indentation was ignored, its default in force
        (
            {"record": False},
            r"^record: unknown parameter; did you mean cache\.record\? \(a key of the params file's `cache:` block",
        ),
        # a params file from before an upgrade: what replaced it (found in review)
        ({"cache.speculate": False}, r"^cache\.speculate: no longer a parameter: .*cache\.match_on_gpu"),
        ({"model.preset": "pi05"}, r"^model\.checkpoint: preset 'pi05' needs a trained checkpoint"),
        (
            {"model.preset": "pi05", "model.checkpoint": "m", "model.norm_stats": "n.json"},
            r"^model\.tokenizer: preset 'pi05' needs",
        ),
        ({"model.random_weights": True, "model.checkpoint": "m"}, r"^model\.random_weights: set, but so is"),
        (
            {"model.aloha_adapt_to_pi": True, "joint_names": ["a"]},
            r"^model\.aloha_adapt_to_pi: needs ALOHA's 14-D",
        ),
        ({"model.delta_actions": [0]}, r"^model\.delta_actions: unknown parameter"),
        (
            {
                "model.aloha_adapt_to_pi": True,
                "joint_names": [ALOHA_JOINTS[6], *ALOHA_JOINTS[:6], *ALOHA_JOINTS[7:]],
            },
            r"^joint_names: model\.aloha_adapt_to_pi needs ALOHA's order, .* entry 0 is 'left_gripper', not a waist",
        ),
        (
            {"delta_joint_actions": True, "action_joint_names": ["left_shoulder", "left_waist"]},
            r"^delta_joint_actions: action joint 0 \('left_shoulder'\) is an offset from its state, but "
            r"joint_names holds 'left_waist' there",
        ),
    ],
)
def test_invalid_parameters_are_named(params: dict, message: str) -> None:
    with pytest.raises(ParameterError, match=message):
        node_config(params)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        # every scene falls below a bar over 1 (cosine similarity): the cache would never serve
        ({"cache.similarity_threshold": 1.5}, r"^cache\.similarity_threshold: must be in \[0, 1\]"),
        # every frame would be stale: the node would drop every tick
        ({"max_image_age_s": 0.0}, r"^max_image_age_s: must be > 0"),
        ({"max_image_age_s": -0.25}, r"^max_image_age_s: must be > 0"),
        ({"max_joint_age_s": 0.0}, r"^max_joint_age_s: must be > 0"),
        # one joint listed twice: its state would be fed to the policy twice, another joint not at all
        ({"joint_names": [*ALOHA_JOINTS[:13], ALOHA_JOINTS[0]]}, r"^joint_names: needs distinct, non-empty"),
        ({"joint_state_topics": ["arm", "arm"]}, r"^joint_state_topics: needs distinct, non-empty"),
        # the chunk's joint names say which joint each action drives (the streamer maps by them)
        ({"action_joint_names": []}, r"^action_joint_names: needs distinct, non-empty"),
        ({"action_joint_names": ["a", ""]}, r"^action_joint_names: needs distinct, non-empty"),
        ({"action_joint_names": ["a", "a"]}, r"^action_joint_names: needs distinct, non-empty"),
        # the exit must come after the stall is reported: equal is refused as below
        ({"exit_after_stall_s": 2.0}, r"^exit_after_stall_s: must be 0 \(never\) or above stall_after_s"),
        ({"min_episode_s": 1e300}, r"^min_episode_s: must be >= 0 .* and at most 3600 s"),
        # below MIN_STALL_S (0.5 s), not only far below it
        ({"stall_after_s": 0.4}, r"^stall_after_s: must be at least 0\.5 s"),
        # YAML's true/false for a number: not taken as 1 or 0
        ({"cache.top_k": True}, r"^cache\.top_k: expected int, got True"),
        ({"error_after_drops": False}, r"^error_after_drops: expected int"),
        ({"max_skew_s": True}, r"^max_skew_s: expected float, got True"),
        # an infinite end would scale the gripper's state to 0 (or NaN) for every position
        ({"gripper_state_range": [0.0, float("inf")]}, r"^gripper_state_range: needs \[closed, open\]"),
        ({"gripper_state_range": [float("nan"), 1.0]}, r"^gripper_state_range: needs \[closed, open\]"),
    ],
)
def test_more_invalid_parameters_are_named(params: dict, message: str) -> None:
    """What a params file can get wrong that configure must refuse, naming the parameter, instead of
    running a cell that drops every tick, feeds one joint twice or never serves from its cache (found by a
    mutation review: each of these was accepted with its check weakened, and no test noticed)."""
    with pytest.raises(ParameterError, match=message):
        node_config(params)


def test_values_wrong_by_themselves_are_no_combination_and_the_bounds_take_their_ends() -> None:
    """`ros2 param set` on an unconfigured node takes a CombinationError with a warning (a profile loaded one
    parameter at a time) but refuses a value wrong by itself: actions_per_inference 0 is the latter. The
    documented ends are valid: sensor_startup_timeout_s 0 (count a silent sensor at once), exit_after_stall_s
    just above stall_after_s, stall_after_s 0.5. Found by a mutation review."""
    from rmuscle_ros.node.params import CombinationError

    with pytest.raises(ParameterError, match=r"^actions_per_inference: must be in 1\.\.50") as e:
        node_config({"actions_per_inference": 0})
    assert not isinstance(e.value, CombinationError)
    assert node_config({"sensor_startup_timeout_s": 0.0}).sensor_startup_timeout_s == 0.0
    assert node_config({"stall_after_s": 0.5, "exit_after_stall_s": 0.6}).exit_after_stall_s == 0.6
    assert node_config({"cache.similarity_threshold": 1.0}).cache.similarity_threshold == 1.0


def test_delta_joint_actions_are_every_arm_joint_but_the_grippers() -> None:
    """openpi's ALOHA mask (6 joints offset, gripper absolute, per arm), from the node's joint names."""
    cfg = node_config({"delta_joint_actions": True, "model.aloha_adapt_to_pi": True})
    assert cfg.model.delta_actions == (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12)
    assert cfg.model.aloha_adapt_to_pi
    assert node_config({}).model.delta_actions == ()
    assert node_config({"delta_joint_actions": True, "gripper_joint": ""}).model.delta_actions == tuple(
        range(14)
    )


def test_a_driver_with_unique_joint_names_keeps_its_grippers_absolute_under_delta_joint_actions() -> None:
    """One joint_states topic that names the joints itself (prefix ""): `left_gripper` and `right_gripper`
    are the grippers all the same, kept absolute (found in review: they were made offsets, so an open
    gripper told to close stayed open); and with gripper_joint set, an action list without any is refused."""
    one_topic = {
        "joint_state_topics": ["joint_states"],
        "joint_name_prefixes": [""],
        "delta_joint_actions": True,
    }
    assert node_config(one_topic).model.delta_actions == ALOHA_DELTA_ACTIONS
    assert (
        node_config({**one_topic, "model.aloha_adapt_to_pi": True}).model.delta_actions == ALOHA_DELTA_ACTIONS
    )
    arms_only = [n for n in ALOHA_JOINTS if not n.endswith("gripper")]
    with pytest.raises(ParameterError, match=r"^delta_joint_actions: no action joint is a gripper"):
        node_config({**one_topic, "joint_names": arms_only, "action_joint_names": arms_only})


def test_cache_parameters_cover_the_runtime_config() -> None:
    """Every RMuscleConfig field is set by a cache.* parameter, with the same default."""
    runtime = {f.name for f in dataclasses.fields(RMuscleConfig)}
    assert set(CacheParams().runtime_fields()) == runtime
    assert CacheParams().to_runtime() == RMuscleConfig()
    assert {f"cache.{f.name}" for f in dataclasses.fields(CacheParams)} <= set(parameter_defaults())


def test_cache_parameters_map_onto_the_runtime_config() -> None:
    cfg = node_config(
        {
            "model.backend": "fused",
            "cache.enabled": True,
            "cache.similarity_threshold": 0.9,
            "cache.lookahead": 2,
            "cache.rebuilds_per_tick": 20,
            "cache.concurrent_rebuilds": True,
            "cache.match_on_gpu": False,
            "cache.library_path": "/var/lib/rmuscle/library",
            "cache.status_period_s": 0.5,
        }
    )
    runtime = cfg.cache.to_runtime()
    assert (runtime.threshold, runtime.lookahead, runtime.rebuilds_per_tick) == (0.9, 2, 20)
    assert runtime.concurrent_rebuilds is True and runtime.match_on_gpu is False
    assert runtime.library_path == "/var/lib/rmuscle/library" and runtime.window_size == 4 * 3
    assert cfg.cache.status_period_s == 0.5
    # Switched off, the eager reference is fine, and the cache settings are still checked.
    assert not node_config({"cache.enabled": False}).cache.enabled
    with pytest.raises(ParameterError, match=r"^cache\.anchors"):
        node_config({"cache.enabled": False, "cache.anchors": 0})


def test_the_default_profile_runs_the_cache_on_the_cpu() -> None:
    """`make demo` shows rMuscle on config/rmuscle_default.yaml."""
    cfg = node_config(load_params_file(CONFIG_DIR / "rmuscle_default.yaml"))
    assert cfg.cache.enabled and (cfg.model.backend, cfg.model.device) == ("fused", "cpu")
    assert cfg.cache.library_path == "", "a temporary library: the demo leaves nothing behind"


def test_the_aloha_profile_reads_the_gripper_as_the_fingers_opening() -> None:
    # An ALOHA's recordings hold each gripper as (left_finger - closed) / (open - closed): the profile reads
    # the arm's left_finger (prefixed per arm) for its gripper slot; every other slot reads itself, unscaled.
    from rmuscle_ros.node.params import load_params_file, state_sources

    cfg = node_config(load_params_file(CONFIG_DIR / "rmuscle_aloha.yaml"))
    sources, offset, scale = state_sources(cfg)
    grippers = [cfg.joint_names.index(n) for n in ("left_gripper", "right_gripper")]
    assert [sources[i] for i in grippers] == ["left_left_finger", "right_left_finger"]
    assert offset[grippers].tolist() == [0.044, 0.044] and scale[grippers] == pytest.approx([1 / 0.0139] * 2)
    others = [i for i in range(len(sources)) if i not in grippers]
    assert [sources[i] for i in others] == [cfg.joint_names[i] for i in others]
    assert (offset[others] == 0).all() and (scale[others] == 1).all()
    # The default reads every slot as published.
    default = node_config({})
    assert state_sources(default)[0] == default.joint_names and (state_sources(default)[2] == 1).all()


@pytest.mark.parametrize("profile", ["rmuscle_aloha.yaml", "rmuscle_thor.yaml"])
def test_shipped_profiles_configure_the_action_streamer(profile: str) -> None:
    pytest.importorskip("rclpy", reason="ROS 2 wheels not installed (make venv installs them)")
    from rmuscle_ros.node.action_streamer import streamer_config
    from rmuscle_ros.node.params import load_params_file

    cfg = streamer_config(load_params_file(CONFIG_DIR / profile, "action_streamer"))
    assert cfg.gripper_command_range == (0.6197, 1.6214) and cfg.control_period_s == 0.02


@pytest.mark.parametrize("profile", sorted(p.name for p in CONFIG_DIR.glob("rmuscle_*.yaml")))
def test_a_namespaced_node_takes_its_profile(profile: str) -> None:
    """`ros2 launch ... namespace:=cell1` passes the profile to /cell1/rmuscle_node: each value reaches it
    (before, found in review, sections keyed `rmuscle_node:` matched only /rmuscle_node, and a namespaced
    cell configured and activated on the defaults, random weights on the CPU, without a word)."""
    rclpy = pytest.importorskip("rclpy", reason="ROS 2 wheels not installed (make venv installs them)")
    from rmuscle_ros.node.action_streamer import ActionStreamerNode
    from rmuscle_ros.node.rmuscle_node import RMuscleNode

    path = CONFIG_DIR / profile
    context = rclpy.Context()
    rclpy.init(context=context, args=["--ros-args", "--params-file", str(path)])
    try:
        nodes = {"rmuscle_node": RMuscleNode(context=context, namespace="cell1")}
        if "action_streamer:" in path.read_text():
            nodes["action_streamer"] = ActionStreamerNode(context=context, namespace="cell1")
        for name, node in nodes.items():
            assert node.get_fully_qualified_name() == f"/cell1/{name}"
            for key, value in load_params_file(path, name).items():
                got = node.get_parameter(key).value
                assert (
                    list(got) if isinstance(got, (list, tuple)) or hasattr(got, "tolist") else got
                ) == value, key
            node.destroy_node()
    finally:
        rclpy.shutdown(context=context)


def test_demo_params_are_read_as_their_parameters_type() -> None:
    """`--param prompt=...` is taken as written (YAML cut a prompt at '#' and made 'a: b' a mapping); an
    int for a float parameter is that float; a value no parameter takes is refused by name."""
    from rmuscle_ros.demo import parse_param

    defaults = parameter_defaults()
    assert parse_param("prompt", "fold the towel #2", defaults) == "fold the towel #2"
    assert parse_param("prompt", "pick: grasp the handle", defaults) == "pick: grasp the handle"
    assert parse_param("cache.task", "no", defaults) == "no"
    assert parse_param("cache.rho_p", "1", defaults) == 1.0 and isinstance(
        parse_param("cache.rho_p", "1", defaults), float
    )
    assert parse_param("cache.enabled", "true", defaults) is True
    assert parse_param("camera_topics", "[a, b]", defaults) == ["a", "b"]
    assert parse_param("gripper_state_range", "[0, 1]", defaults) == [0.0, 1.0]
    for text in ("", "{a: 1}"):
        with pytest.raises(ValueError, match=r"^cache\.rho_p: .* is no parameter value"):
            parse_param("cache.rho_p", text, defaults)


def test_time_limits_and_threads_are_bounded() -> None:
    with pytest.raises(ParameterError, match=r"^cache\.status_period_s: must be > 0 and at most 3600 s"):
        node_config({"cache.status_period_s": 1e300})
    with pytest.raises(ParameterError, match=r"^cpu_threads: must be in 0\.\.\d+ \(0: automatic"):
        node_config({"cpu_threads": 2**31})


def test_the_launch_files_parameter_lists_are_the_nodes_declarations() -> None:
    """The launch file refuses a name in a node's own section that is none of its parameters, from lists it
    keeps without torch (params_file.NODE_PARAMETERS): a parameter added to a node and not there would stop
    every launch whose profile sets it."""
    from rmuscle_ros.node.action_streamer import streamer_defaults
    from rmuscle_ros.node.params_file import NODE_PARAMETERS

    assert NODE_PARAMETERS["rmuscle_node"] == set(parameter_defaults())
    assert NODE_PARAMETERS["action_streamer"] == set(streamer_defaults())
