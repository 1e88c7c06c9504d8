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

__all__ = ["camera_remappings", "check_params_file", "likely_meant", "node_parameter", "section_keys"]


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
