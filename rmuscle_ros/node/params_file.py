"""Checking a ROS params file before anything starts: the launch file's part of the parameters.

Apart from rmuscle_node's parameters (params.py) because the launch file imports it: `ros2 launch` runs
the launch file in the `ros2` program's Python (on a Thor, apt's /usr/bin/python3), which does not see the
venv's torch; params.py imports the policy, and with it torch, so the launch stopped with "No module named
'torch'" before any node started (found in review). This module needs only PyYAML, which ROS brings.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from pathlib import Path

import yaml

__all__ = [
    "NODE_PARAMETERS",
    "REMOVED_PARAMETERS",
    "camera_remappings",
    "check_params_file",
    "likely_meant",
    "node_parameter",
    "section_keys",
]

# Each node's parameter names, as declared (dotted: a `cache:` block's `record` is cache.record): the launch
# file refuses a name in a node's own section that is none of them (`max_joint_step` for max_step left the
# streamer's rate limit at its default, only logged by the node, which cannot tell its own section from
# `/**`). Kept here, not read from params.py, which imports torch; test_node_params checks both lists
# against the nodes' declarations.
# fmt: off
NODE_PARAMETERS: dict[str, frozenset[str]] = {
    "rmuscle_node": frozenset((
        "action_joint_names", "actions_per_inference", "camera_topics", "compressed_images",
        "control_period_s", "cpu_threads", "delta_joint_actions", "error_after_drops", "exit_after_stall_s",
        "gripper_joint", "gripper_state_joint", "gripper_state_range", "joint_name_prefixes", "joint_names",
        "joint_state_topics", "max_image_age_s", "max_joint_age_s", "max_skew_s", "min_episode_s",
        "noise_seed", "prompt", "publish_joint_trajectory", "sensor_startup_timeout_s", "stall_after_s",
        "warmup", "cache.anchors", "cache.audit_every", "cache.audit_max_error", "cache.concurrent_rebuilds",
        "cache.enabled", "cache.library_path", "cache.lookahead", "cache.match_on_gpu", "cache.max_episodes",
        "cache.max_library_mb", "cache.neuron_schedule", "cache.rebuild_slices", "cache.rebuilds_per_tick",
        "cache.record", "cache.rho_n", "cache.rho_p", "cache.similarity_threshold", "cache.status_period_s",
        "cache.task", "cache.top_k", "model.aloha_adapt_to_pi", "model.backend", "model.checkpoint",
        "model.device", "model.dtype", "model.engine_cache_dir", "model.image_antialias", "model.norm_stats",
        "model.preset", "model.random_weights", "model.seed", "model.tokenizer", "model.trt_opt_prompt_len",
    )),
    "action_streamer": frozenset((
        "arm_command_topics", "arm_group_name", "arm_joint_limits", "arm_joints", "control_period_s",
        "gripper_command_range", "gripper_command_topics", "gripper_joint", "joint_name_prefixes",
        "joint_names", "joint_state_topics", "max_future_s", "max_joint_age_s", "max_rows", "max_step",
        "max_tracking_error", "robot_info_services", "takeover_delay_s",
    )),
}
# fmt: on
# Parameters a node once had, with what to do instead: refused by name and reason, at configure
# (params.node_config) and by the launch file alike (the launch's check had called them unknown).
REMOVED_PARAMETERS: dict[str, dict[str, str]] = {
    "rmuscle_node": {
        "cache.speculate": "removed on 2026-11-30 (c68d7c1): cache.match_on_gpu (default true) replaced it; "
        "delete the line",
    },
}
# rclpy's own, every node's; and publishers' QoS overrides (qos_overrides.<topic>.publisher.<policy>)
ROS_PARAMETERS = frozenset({"use_sim_time", "start_type_description_service"})


def section_keys(node_name: str, namespace: str = "") -> tuple[str, ...]:
    """The keys of a params file's sections that ROS applies to `node_name` in `namespace`: `/**/name` in
    any namespace, `/*/name` in a one-level one, the fully qualified name; `name` alone is `/name`, so it
    (and `/name`) only outside a namespace."""
    ns = namespace.strip("/")
    if not ns:
        return (f"/**/{node_name}", f"/{node_name}", node_name)
    keys = [f"/**/{node_name}", f"/{ns}/{node_name}"]
    if "/" not in ns:
        keys.append(f"/*/{node_name}")
    return tuple(keys)


def likely_meant(name: str, known: Iterable[str]) -> tuple[str, bool] | None:
    """The parameter among `known` that an unknown `name` likely meant, and whether `name` is its last part:
    first a dotted parameter it is the last part of (`record` for cache.record: a key of a `cache:` block
    that lost its indentation), else a close spelling (max_image_age for max_image_age_s); None if neither.
    Shared by the node's configure (params.unknown_parameter) and its override check (spin), which must
    not import params (it pulls torch)."""
    known = sorted(known)
    nested = [k for k in known if k.endswith(f".{name}")]
    if nested:
        return nested[0], True
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return (close[0], False) if close else None


def _document(path: str | os.PathLike[str]) -> dict:
    """The params file's YAML, or ValueError saying why it is not one."""
    file = Path(path)
    if not file.is_file():
        what = "a folder" if file.is_dir() else "not there"
        raise ValueError(
            f"params file {file} is {what}: give an existing profile (profile:=<file in config/>)"
        )
    try:
        document = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"params file {file}: not a ROS params file ({e})") from None
    if not isinstance(document, dict):
        raise ValueError(f"params file {file}: not a ROS params file (no node sections)")
    return document


def node_parameter(path: str | os.PathLike[str], node_name: str, name: str, namespace: str = "") -> object:
    """The value a params file gives `node_name`'s top-level parameter `name` (None: not set): as ROS
    applies the file, every section that applies to the node (`section_keys`, and `/**` for every node) in
    the file's order, the last to set it winning."""
    keys = {*section_keys(node_name, namespace), "/**"}
    value = None
    for key, section in _document(path).items():
        params = section.get("ros__parameters") if key in keys and isinstance(section, dict) else None
        if isinstance(params, dict) and name in params:
            value = params[name]
    return value


def camera_remappings(remappings: list[tuple[str, str]], compressed: bool) -> list[tuple[str, str]]:
    """`remappings` with each camera's (`images/...`) target moved to its `/compressed` subtopic when
    `compressed`: image_transport publishes a camera's JPEG frames there, beside the raw topic, and a node
    taking CompressedImage on the raw topic's name receives nothing (found in review)."""
    return [
        (frm, f"{to}/compressed" if compressed and frm.startswith("images/") else to)
        for frm, to in remappings
    ]


def check_params_file(path: str | os.PathLike[str], node_names: tuple[str, ...], namespace: str = "") -> None:
    """ValueError unless `path` is a params file with a section that ROS applies to each of `node_names`
    in `namespace` (`section_keys`). The launch file calls it before it starts anything: ROS only warns
    about a params file that is not there and starts the node on its defaults (the tiny demo model, random
    weights), and a node whose section it does not apply (none, or `rmuscle_node:` under a namespace) would
    too; the streamer would then send that model's actions to the arms (found in review)."""
    file = Path(path)
    document = _document(file)
    missing = []
    for name in node_names:
        keys = section_keys(name, namespace)
        section = next((document[k] for k in keys if k in document), None)
        if not isinstance(section, dict) or not isinstance(section.get("ros__parameters"), dict):
            missing.append(name)
    if missing:
        where = f" in namespace {namespace.strip('/')!r}" if namespace.strip("/") else ""
        raise ValueError(
            f"params file {file} has no section that ROS applies to {', '.join(missing)}{where} (a "
            f"`/**/{missing[0]}: ros__parameters:` key): it would start on its defaults. Add the section, or "
            "leave that node out (stream_actions:=false for action_streamer)"
        )
    for name in node_names:
        known = NODE_PARAMETERS.get(name)
        if known is None:
            continue
        for key in section_keys(name, namespace):  # the node's own sections: every key is its parameter
            section = document.get(key)
            if not isinstance(section, dict) or not isinstance(section.get("ros__parameters"), dict):
                continue
            for parameter in _flat_names(section["ros__parameters"]):
                if (
                    parameter in known
                    or parameter in ROS_PARAMETERS
                    or parameter.startswith("qos_overrides.")
                ):
                    continue
                removed = REMOVED_PARAMETERS.get(name, {}).get(parameter)
                if removed is not None:
                    raise ValueError(
                        f"params file {file}, section {key}: {parameter}: no longer a parameter: {removed}"
                    )
                meant = likely_meant(parameter, known)
                hint = f"did you mean {meant[0]}? " if meant is not None else ""
                raise ValueError(
                    f"params file {file}, section {key}: {parameter} is not a parameter of {name} ({hint}a "
                    "misspelt name would leave its default in force; the node's parameters are listed in "
                    "docs/node.md)"
                )


def _flat_names(params: dict, prefix: str = "") -> list[str]:
    """The parameter names of a section's ros__parameters, as ROS flattens them (a nested mapping's keys
    joined with dots: `cache: {record: ...}` is cache.record)."""
    names = []
    for key, value in params.items():
        name = f"{prefix}{key}"
        names += _flat_names(value, f"{name}.") if isinstance(value, dict) else [name]
    return names
