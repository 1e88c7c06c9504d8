"""ROS parameters of `rmuscle_node` <-> a frozen, validated `NodeConfig`.

One function maps the flat parameter dictionary (what `--params-file` / `-p` give the node) onto the
dataclasses and rejects unknown or invalid values with a message that names the parameter. No rclpy
here: the node declares `parameter_defaults()` and passes what it reads to `node_config()`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import yaml

from rmuscle_ros.cache.runtime import RMuscleConfig
from rmuscle_ros.models.config import PRESETS
from rmuscle_ros.node import params_file
from rmuscle_ros.node.params_file import likely_meant, section_keys
from rmuscle_ros.runtime.policy import CACHE_BACKENDS, PI05_CAMERA_SLOTS, PolicyConfig
from rmuscle_ros.runtime.transforms import check_prompt

if TYPE_CHECKING:
    from pathlib import Path

ALOHA_ARM_JOINTS = ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate", "gripper")
ALOHA_JOINTS = tuple(f"{side}_{joint}" for side in ("left", "right") for joint in ALOHA_ARM_JOINTS)


class ParameterError(ValueError):
    """An invalid node parameter; the message starts with the parameter's name."""


class CombinationError(ParameterError):
    """Parameters each valid alone that do not go together (a π0.5 preset without its checkpoint, more
    joint-state topics than name prefixes). `ros2 param load` sets a file's parameters one at a time, so an
    unconfigured node takes a value that only disagrees with the others as they are now; configure checks
    the whole set."""


# PolicyConfig fields whose errors are about the value alone; the others (cameras, dims, the checkpoint
# a π0.5 preset needs, the ALOHA conventions) depend on other parameters.
_POLICY_OWN_CHECKS = ("preset", "backend", "dtype", "device")


MAX_SECONDS = 3600.0  # the node's time limits and periods: at most an hour
# The least stall_after_s: a reset, a discard or a parameter set waits for the policy up to stall_after_s,
# so one below a call's length refused them all, the set that would raise it back included, and with
# exit_after_stall_s just above it the process ended after its first call (found in review: 0.005 s).
MIN_STALL_S = 0.5
# Parameters an earlier version had, with what to do instead: a params file from before an upgrade is
# refused naming the change, not only as unknown (found in review: cache.speculate was refused among a
# list of every known name). Kept in params_file, whose launch-side check refuses them alike.
REMOVED_PARAMETERS = params_file.REMOVED_PARAMETERS["rmuscle_node"]

# CacheParams field -> RMuscleConfig field, where the ROS name says more than the runtime's.
_RUNTIME_NAMES = {"similarity_threshold": "threshold"}
# Node-side settings that RMuscleConfig does not have.
_NODE_ONLY = ("enabled", "status_period_s")


@dataclass(frozen=True)
class CacheParams:
    """The `cache.*` parameters: rMuscle's settings (RMuscleConfig) plus what the node does with them.

    Validated even when disabled, so a profile that would fail once the cache is switched on fails now.
    """

    enabled: bool = False
    rho_p: float = 0.4  # fraction of the configured cameras' visual tokens whose prefill FFN is recomputed
    rho_n: float = 0.5  # fraction of expert MLP neurons updated after the anchor step
    anchors: int = 1  # dense denoising steps per call
    neuron_schedule: str = "ramp"  # how rho_n spreads over the steps: "ramp" or "uniform" (RMuscleConfig)
    top_k: int = 4  # candidate library episodes kept by retrieval
    lookahead: int = 4  # positions past the aligned one kept ready in the window
    similarity_threshold: float = 0.8  # below it: dense for the rest of the episode
    library_path: str = ""  # "" = a temporary folder, lost when the node is cleaned up
    record: bool = True  # add dense episodes to the library at each episode reset
    max_library_mb: int = 4096
    max_episodes: int = 64
    rebuilds_per_tick: int = 2  # at most this many window entries rebuilt after each published chunk
    task: str = ""  # the job episodes are kept under; "" = the prompt's instruction (RMuscleConfig.task)
    concurrent_rebuilds: bool = False  # rebuilds alongside live calls, kernel by kernel (RMuscleConfig)
    match_on_gpu: bool = True  # pick and load the window entry on the GPU, no host round trip
    rebuild_slices: int = 4  # parts of an entry's rebuild: the most a live call can wait for is one
    audit_every: int = 10  # one cached call in this many run again dense in its motion window (0: none)
    audit_max_error: float = 0.0  # an audited error above it: dense for the rest of the episode (0: never)
    status_period_s: float = 1.0  # ~/cache_status period while active

    def __post_init__(self) -> None:
        # at most an hour, as the node's other periods (1e300 overflowed the timer at activation)
        if not 0 < self.status_period_s <= MAX_SECONDS:
            raise ParameterError(
                f"cache.status_period_s: must be > 0 and at most {MAX_SECONDS:g} s, got {self.status_period_s!r}"
            )
        # A negative cosine similarity as the bar for "the same task" would accept any scene.
        if not 0.0 <= self.similarity_threshold <= 1.0:
            raise ParameterError(
                f"cache.similarity_threshold: must be in [0, 1], got {self.similarity_threshold}"
            )
        try:
            self.to_runtime()
        except ValueError as e:
            raise ParameterError(self._name_the_parameter(str(e))) from None

    def runtime_fields(self) -> dict[str, Any]:
        """RMuscleConfig's keyword arguments (its field names)."""
        return {
            _RUNTIME_NAMES.get(f.name, f.name): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _NODE_ONLY
        }

    def to_runtime(self) -> RMuscleConfig:
        """The policy-level cache configuration (RMuscleConfig validates it)."""
        return RMuscleConfig(**self.runtime_fields())

    def _name_the_parameter(self, message: str) -> str:
        """RMuscleConfig's error -> "cache.<parameter>: <what is wrong>"."""
        # Its messages may name several fields at once ("top_k must be >= 1 and lookahead >= 1"): trying
        # each value alone against the defaults finds the one that is wrong.
        for name, value in self.runtime_fields().items():
            try:
                RMuscleConfig(**{name: value})
            except ValueError:
                param = next((k for k, v in _RUNTIME_NAMES.items() if v == name), name)
                head, _, rest = message.partition(" ")
                # "rho_p must be in (0, 1]" -> "cache.rho_p: must be in (0, 1]"
                return f"cache.{param}: {rest if head == name else message}"
        return f"cache: {message}"  # only the combination of values is invalid


@dataclass(frozen=True)
class NodeConfig:
    model: PolicyConfig = field(default_factory=PolicyConfig)
    prompt: str = "do the task"
    # Camera topics in π0.5 slot order (base, left wrist, right wrist); the launch file remaps them onto
    # the cell's topics (ALOHA: /cam_high/camera/color/image_rect_raw, ...). An empty entry leaves its slot
    # empty (a cell without a base camera: ["", "images/left_wrist", "images/right_wrist"]).
    camera_topics: tuple[str, ...] = ("images/base", "images/left_wrist", "images/right_wrist")
    compressed_images: bool = False  # sensor_msgs/CompressedImage instead of sensor_msgs/Image
    joint_state_topics: tuple[str, ...] = ("joint_states/left", "joint_states/right")
    # Prefixed to the joint names in each joint_state_topics entry's messages (same order) before they are
    # matched against joint_names. An Interbotix ALOHA publishes the same names (waist ... gripper) on both
    # arms' topics, so the arm is told apart by its topic. "" for a topic whose names are already unique.
    joint_name_prefixes: tuple[str, ...] = ("left_", "right_")
    # Each arm's gripper slot in joint_names is its prefix + gripper_joint. By default its state is that
    # joint's position as published. An ALOHA's recordings hold the gripper as its fingers' opening, 0
    # closed ... 1 open: gripper_state_joint "left_finger" reads each arm's finger position instead, and
    # gripper_state_range [closed, open] maps it to (position - closed) / (open - closed).
    gripper_joint: str = "gripper"
    gripper_state_joint: str = ""  # "": the gripper joint itself
    gripper_state_range: tuple[float, float] = (0.0, 1.0)  # [closed, open]; [0, 1]: the position as it is
    joint_names: tuple[str, ...] = ALOHA_JOINTS  # state order fed to the policy
    action_joint_names: tuple[str, ...] = ALOHA_JOINTS  # meaning of each action dimension
    # The checkpoint predicts every action joint but the grippers (prefix + gripper_joint) as an offset from
    # that joint's state, added back before publishing: openpi's ALOHA configs (use_delta_joint_actions,
    # with model.aloha_adapt_to_pi), LeRobot's use_relative_actions. Sets model.delta_actions.
    delta_joint_actions: bool = False
    control_period_s: float = 0.02  # the arm consumes one action per period (ALOHA: 50 Hz)
    actions_per_inference: int = 25  # actions executed before the next chunk is requested
    max_image_age_s: float = 0.25  # an observation older than this is stale (no chunk)
    max_joint_age_s: float = 0.1
    max_skew_s: float = 0.1  # largest stamp difference between the observation's messages
    # After activation, how long (wall clock) a sensor may stay silent before a tick without it counts as a
    # drop. Until then the node waits for it quietly: camera drivers start at their own pace. 0: count it.
    sensor_startup_timeout_s: float = 5.0
    # /diagnostics says ERROR once this many ticks in a row gave no chunk (at 2 Hz, 10 is 5 s): the node is
    # active but the arm gets nothing. One chunk brings it back to OK / WARN.
    error_after_drops: int = 10
    # /diagnostics says ERROR once a tick has waited this long (wall clock) for the inference worker: a call
    # or motion-window job that does not return (a hung GPU, a deadlock) sends no chunk and no drop either.
    # Ticks normally wait a few ms, at most one rebuild part or audit; the first tick taken ends it.
    # At least MIN_STALL_S: resets, discards and parameter sets wait for the worker up to this long.
    stall_after_s: float = 2.0
    # 0: never. Above 0, once the node has been held this long (a tick, or a deactivation or shutdown,
    # waiting for the inference worker; while active, an episode reset recording into the library), it
    # ends its process (status 70, logged at fatal level) for a supervisor to start it again: it cannot end
    # a hung CUDA call or disk write itself, and a deactivation or shutdown would wait for it. The episode
    # in progress is not recorded then; the library on disk stays as it was. Must exceed stall_after_s.
    exit_after_stall_s: float = 0.0
    # With the cache on, an episode whose calls' observations span less than this (s, the node's clock) is
    # not recorded into the library at its reset: a reset sent over and over (`ros2 topic pub` without
    # --once, 1 Hz) filled the library with 1 s fragments that evicted its episodes (found in review). 0:
    # every episode is.
    min_episode_s: float = 2.0
    publish_joint_trajectory: bool = False  # also publish trajectory_msgs/JointTrajectory
    warmup: bool = True
    # PyTorch's CPU threads in this process (torch.set_num_threads), set at configure; 0: automatic, PyTorch's
    # default (one per core) with the model on the CPU, at most 4 on a GPU, where 16 stalled preprocessing
    # (runtime.policy.host_threads). The executor and DDS need cores too: on a 2-core machine 1 thread ran
    # the CPU demo's calls faster than 2 (README, Running the node).
    cpu_threads: int = 0
    # >= 0: each episode's calls draw their noise from a generator seeded by (noise_seed, episode id), so
    # two runs of the same scenes get the same noise call for call (benchmarks comparing dense and cached:
    # bench/sim_success.py --node); -1: one stream, seeded by model.seed, for the node's life.
    noise_seed: int = -1
    cache: CacheParams = field(default_factory=CacheParams)

    @property
    def camera_inputs(self) -> tuple[str, ...]:
        """The camera topics the node subscribes to, in slot order: `camera_topics` without its empty
        entries (slots left empty). The i-th feeds `model.cameras[i]`, in image slot `model.slots[i]`."""
        return tuple(topic for topic in self.camera_topics if topic)


def delta_actions(values: Mapping[str, Any]) -> tuple[int, ...]:
    """The action dimensions delta_joint_actions makes offsets: every action joint but the grippers, each
    of which must be the state's joint at the same index (the offset is added to it).

    A gripper is an action joint named `gripper_joint`, alone, after one of `joint_name_prefixes`, or after
    "_": a driver that publishes unique names has prefix "" and names them `left_gripper`, `right_gripper`
    (found in review: there both grippers were made offsets, so an open gripper could not be closed;
    LeRobot keeps every action named for a gripper absolute). With `gripper_joint` set, some action joint
    must be one."""
    gripper = values["gripper_joint"]
    grippers = {prefix + gripper for prefix in values["joint_name_prefixes"]} | {gripper}
    names = values["action_joint_names"]
    is_gripper = [bool(gripper) and (n in grippers or n.endswith("_" + gripper)) for n in names]
    dims = []
    for i, name in enumerate(names):
        if is_gripper[i]:
            continue
        state = values["joint_names"]
        if i >= len(state) or state[i] != name:
            raise CombinationError(
                f"delta_joint_actions: action joint {i} ({name!r}) is an offset from its state, but joint_names "
                f"holds {state[i] if i < len(state) else 'nothing'!r} there; list both in the same order"
            )
        dims.append(i)
    if gripper and not any(is_gripper):
        raise CombinationError(
            f"delta_joint_actions: no action joint is a gripper (gripper_joint {gripper!r}, named alone, after "
            f"a joint_name_prefixes entry or after '_'), so every joint would be an offset; name the grippers "
            f'so, or set gripper_joint: "" for arms without one'
        )
    return tuple(dims)


def check_aloha_order(values: Mapping[str, Any]) -> None:
    """model.aloha_adapt_to_pi converts by index, as openpi does (the shoulder and elbow of each arm flipped,
    slots 6 and 13 converted as grippers): joint_names and action_joint_names must list each arm's joints
    in ALOHA's order, or the conversions would fall on other joints. ParameterError naming the first that
    does not."""
    gripper = values["gripper_joint"] or "gripper"
    order = [*ALOHA_ARM_JOINTS[:-1], gripper] * 2
    for name in ("joint_names", "action_joint_names"):
        names = values[name]
        for i, (joint, suffix) in enumerate(zip(names, order, strict=False)):
            if not joint.endswith(suffix):
                raise CombinationError(
                    f"{name}: model.aloha_adapt_to_pi needs ALOHA's order, each arm {', '.join(order[:7])} "
                    f"(openpi flips the shoulder and elbow and converts the gripper by index); entry {i} is "
                    f"{joint!r}, not a {suffix}"
                )


def state_sources(cfg: NodeConfig) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """(the joint read for each joint_names slot, offset, scale): the state is (position - offset) * scale.

    Every slot reads its own name and passes it on unchanged, except each arm's gripper slot when
    gripper_state_joint / gripper_state_range convert it (an ALOHA's finger opening, 0 closed ... 1 open).
    """
    sources = list(cfg.joint_names)
    offset = np.zeros(len(sources))
    scale = np.ones(len(sources))
    closed, opened = cfg.gripper_state_range
    if converts_gripper(cfg):
        for prefix in cfg.joint_name_prefixes:
            slot = cfg.joint_names.index(prefix + cfg.gripper_joint)
            sources[slot] = prefix + (cfg.gripper_state_joint or cfg.gripper_joint)
            offset[slot], scale[slot] = closed, 1.0 / (opened - closed)
    return tuple(sources), offset, scale


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out |= _flatten(value, f"{name}.")
        else:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


# PolicyConfig fields the node derives from its topics and joint names instead of declaring them.
DERIVED = {
    "model.cameras": "camera_topics",
    "model.camera_slots": "camera_topics",
    "model.state_dim": "joint_names",
    "model.action_dim": "action_joint_names",
    "model.delta_actions": "delta_joint_actions",
}


def load_params_file(path: Path, node_name: str = "rmuscle_node") -> dict[str, Any]:
    """The `ros__parameters` a ROS params file gives `node_name`, flattened to dotted names (what
    --params-file gives). Its section may be keyed `/**/name` (in any namespace: the shipped profiles, so
    that the launch file's `namespace:=` keeps them; keyed `name` alone they match only `/name`, and a
    namespaced node would start on the defaults), `/name` or `name`."""

    def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
        return out

    document = yaml.safe_load(path.read_text())
    for key in section_keys(node_name):  # the keys ROS applies outside a namespace
        if key in document:
            return flatten(document[key]["ros__parameters"])
    raise KeyError(f"{path}: no section for {node_name} (keys: {', '.join(map(str, document))})")


def parameter_defaults() -> dict[str, Any]:
    """Every parameter the node declares, with its default (dotted names: `model.preset`, `cache.rho_p`)."""
    defaults = _flatten(NodeConfig())
    # ROS has no None: optional paths are empty strings.
    return {k: ("" if v is None else v) for k, v in defaults.items() if k not in DERIVED}


def check_closed_open(name: str, value: tuple[float, ...]) -> None:
    """A gripper's [closed, open] pair: two different finite numbers, or ParameterError naming `name`."""
    if len(value) != 2 or not all(map(math.isfinite, value)) or value[0] == value[1]:
        raise ParameterError(f"{name}: needs [closed, open], two different finite values, got {list(value)}")


def converts_gripper(cfg: NodeConfig) -> bool:
    """Whether each arm's gripper slot is read from another joint or rescaled (state_sources)."""
    return bool(cfg.gripper_state_joint) or cfg.gripper_state_range != (0.0, 1.0)


def check_type(name: str, value: Any, default: Any) -> Any:
    float_array = isinstance(default, (list, tuple)) and bool(default) and isinstance(default[0], float)
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif float_array:
        # A ROS double array (rclpy may hand it over as an array.array).
        ok = not isinstance(value, (str, bytes)) and hasattr(value, "__len__")
        ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        value = tuple(float(v) for v in value) if ok else value
    elif isinstance(default, (list, tuple)):
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        if isinstance(default, (list, tuple)):
            kind = "a list of numbers" if float_array else "a list of strings"
        else:
            kind = type(default).__name__
        raise ParameterError(f"{name}: expected {kind}, got {value!r}")
    return value


_C = TypeVar("_C")


def flat_defaults(config_class: type) -> dict[str, Any]:
    """A flat config dataclass's defaults as ROS parameter values (tuples as lists), by field name."""
    return {name: (list(v) if isinstance(v, tuple) else v) for name, v in vars(config_class()).items()}


def unknown_parameter(name: str, known: Iterable[str]) -> str:
    """ "<name>: unknown parameter ...", with the name it likely meant: a dotted parameter it is the last
    part of (a key of a `model:` or `cache:` block that lost its indentation), or a close spelling."""
    known = sorted(known)
    meant = likely_meant(name, known)
    if meant is not None and meant[1]:
        block = meant[0].rpartition(".")[0]
        return (
            f"{name}: unknown parameter; did you mean {meant[0]}? (a key of the params file's `{block}:` "
            "block that lost its indentation is read as a parameter of its own; another node's parameter "
            "of that name belongs in that node's own section, not in one every node reads)"
        )
    hint = f"did you mean {meant[0]}? " if meant is not None else ""
    return f"{name}: unknown parameter ({hint}known: {', '.join(known)})"


def flat_config(config_class: type[_C], params: Mapping[str, Any]) -> _C:
    """Build a flat config dataclass from ROS parameter values: an unknown name, or a value of another type
    than its default's, is a ParameterError naming the parameter (the dataclass checks the values)."""
    defaults = flat_defaults(config_class)
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise ParameterError(unknown_parameter(unknown[0], defaults))
    return config_class(**{name: check_type(name, params.get(name, d), d) for name, d in defaults.items()})


def node_config(params: Mapping[str, Any]) -> NodeConfig:
    """Validate `params` (dotted names, as declared) and build the NodeConfig."""
    defaults = parameter_defaults()
    unknown = sorted(set(params) - set(defaults))
    removed = [name for name in unknown if name in REMOVED_PARAMETERS]
    if removed:
        raise ParameterError(f"{removed[0]}: no longer a parameter: {REMOVED_PARAMETERS[removed[0]]}")
    if unknown:
        raise ParameterError(unknown_parameter(unknown[0], defaults))
    values = {
        name: check_type(name, params.get(name, default), default) for name, default in defaults.items()
    }

    def positive(name: str) -> None:
        # at most an hour: a time limit, never meant to be infinite (a huge one overflowed in nanoseconds)
        if not 0 < values[name] <= MAX_SECONDS:
            raise ParameterError(f"{name}: must be > 0 and at most {MAX_SECONDS:g} s, got {values[name]!r}")

    for name in ("control_period_s", "max_image_age_s", "max_joint_age_s", "max_skew_s"):
        positive(name)
    if not 0 <= values["sensor_startup_timeout_s"] <= MAX_SECONDS:
        raise ParameterError(
            f"sensor_startup_timeout_s: must be >= 0 and at most {MAX_SECONDS:g} s, got "
            f"{values['sensor_startup_timeout_s']!r}"
        )
    for name in ("joint_state_topics", "joint_names", "action_joint_names"):
        if (
            not values[name]
            or any(not v for v in values[name])
            or len(set(values[name])) != len(values[name])
        ):
            raise ParameterError(f"{name}: needs distinct, non-empty entries, got {list(values[name])}")
    fed = [t for t in values["camera_topics"] if t]
    if not fed or len(set(fed)) != len(fed):
        raise ParameterError(
            "camera_topics: needs at least one topic, distinct, one per π0.5 image slot in order (base, left "
            f'wrist, right wrist; "" leaves a slot empty), got {list(values["camera_topics"])}'
        )
    if len(values["joint_name_prefixes"]) != len(values["joint_state_topics"]):
        raise CombinationError(
            f"joint_name_prefixes: needs one entry per joint_state_topics entry ({len(values['joint_state_topics'])}), "
            f"got {list(values['joint_name_prefixes'])}"
        )
    check_closed_open("gripper_state_range", values["gripper_state_range"])
    try:
        check_prompt(values["prompt"])
    except ValueError as e:
        raise ParameterError(f"prompt: {e}") from None
    if values["error_after_drops"] < 1:
        raise ParameterError(f"error_after_drops: must be >= 1, got {values['error_after_drops']}")
    positive("stall_after_s")
    if values["stall_after_s"] < MIN_STALL_S:
        raise ParameterError(
            f"stall_after_s: must be at least {MIN_STALL_S:g} s (a call or motion-window job held that long "
            "is a stall; below a call's length, resets and parameter sets are refused as stalled and "
            f"exit_after_stall_s ends the process in normal running), got {values['stall_after_s']!r}"
        )
    exit_after = values["exit_after_stall_s"]
    if not 0 <= exit_after <= MAX_SECONDS:
        raise ParameterError(
            f"exit_after_stall_s: must be >= 0 (0: never) and at most {MAX_SECONDS:g} s, got {exit_after!r}"
        )
    if exit_after != 0 and exit_after <= values["stall_after_s"]:  # the stall is reported before the exit
        raise CombinationError(
            f"exit_after_stall_s: must be 0 (never) or above stall_after_s, got {exit_after:g} against "
            f"{values['stall_after_s']:g} s (set one at a time, raise exit_after_stall_s first and lower "
            "stall_after_s first)"
        )
    if not 0 <= values["min_episode_s"] <= MAX_SECONDS:
        raise ParameterError(
            f"min_episode_s: must be >= 0 (0: every episode recorded) and at most {MAX_SECONDS:g} s, got "
            f"{values['min_episode_s']!r}"
        )
    if values["noise_seed"] < -1:
        raise ParameterError(f"noise_seed: must be >= 0, or -1 for one stream, got {values['noise_seed']}")
    # What no preset takes, whichever is chosen: wrong by itself (ParameterError); within that, the chosen
    # preset's bounds are a combination (CombinationError, below and in PolicyConfig).
    most_dims = max(preset.action_dim for preset in PRESETS.values())
    for name in ("joint_names", "action_joint_names"):
        if len(values[name]) > most_dims:
            raise ParameterError(
                f"{name}: at most {most_dims} joints (π0.5's action width), got {len(values[name])}"
            )
    longest = max(preset.horizon for preset in PRESETS.values())
    if not 1 <= values["actions_per_inference"] <= longest:
        raise ParameterError(f"actions_per_inference: must be in 1..{longest} (the chunk length)")
    cores = os.cpu_count() or 1
    if not 0 <= values["cpu_threads"] <= cores:  # 2**31 overflowed inside PyTorch at configure
        raise ParameterError(
            f"cpu_threads: must be in 0..{cores} (0: automatic; this machine's cores), got {values['cpu_threads']}"
        )

    model_fields = {k.removeprefix("model."): v for k, v in values.items() if k.startswith("model.")}
    for optional in ("checkpoint", "norm_stats", "tokenizer", "engine_cache_dir"):
        model_fields[optional] = model_fields[optional] or None
    # Observations are keyed by π0.5 slot; topic i feeds slot i, and an empty topic feeds none.
    slots = tuple(i for i, topic in enumerate(values["camera_topics"]) if topic)
    model_fields["cameras"] = tuple(PI05_CAMERA_SLOTS[i] for i in slots if i < len(PI05_CAMERA_SLOTS))
    model_fields["camera_slots"] = slots if slots != tuple(range(len(slots))) else ()
    model_fields["state_dim"] = len(values["joint_names"])
    model_fields["action_dim"] = len(values["action_joint_names"])
    model_fields["delta_actions"] = delta_actions(values) if values["delta_joint_actions"] else ()
    if len(values["camera_topics"]) > len(PI05_CAMERA_SLOTS):
        raise ParameterError(
            f"camera_topics: π0.5 has {len(PI05_CAMERA_SLOTS)} image slots, got {len(values['camera_topics'])}"
        )
    try:
        model = PolicyConfig(**model_fields)
    except ValueError as e:  # PolicyConfig names its field first; report the parameter that sets it
        field_name = str(e).split(":")[0]
        parameter = DERIVED.get(f"model.{field_name}", f"model.{field_name}")
        error = ParameterError if field_name in _POLICY_OWN_CHECKS else CombinationError
        raise error(f"{parameter}:{str(e).split(':', 1)[1]}") from None
    if model.aloha_adapt_to_pi:  # 14-D, checked by PolicyConfig: now the order
        check_aloha_order(values)
    horizon = model.model.horizon
    if not 1 <= values["actions_per_inference"] <= horizon:
        raise CombinationError(f"actions_per_inference: must be in 1..{horizon} (the chunk length)")

    cache = CacheParams(**{k.removeprefix("cache."): v for k, v in values.items() if k.startswith("cache.")})
    if cache.enabled and model.backend not in CACHE_BACKENDS:
        raise CombinationError(
            f"model.backend: cache.enabled needs backend 'fused' (CPU) or 'graph' (CUDA), got {model.backend!r} "
            "(only those two have the Context and Action Caches)"
        )
    top = {k: v for k, v in values.items() if "." not in k}
    cfg = NodeConfig(model=model, cache=cache, **top)
    if converts_gripper(cfg):
        if not cfg.gripper_joint:
            raise CombinationError(
                "gripper_joint: names no gripper, but gripper_state_joint/_range convert one"
            )
        for prefix in cfg.joint_name_prefixes:
            if prefix + cfg.gripper_joint not in cfg.joint_names:
                raise CombinationError(
                    f"gripper_joint: joint_names has no {prefix + cfg.gripper_joint!r} "
                    f"(joint_name_prefixes {prefix!r} + {cfg.gripper_joint!r}) to convert"
                )
    return cfg
