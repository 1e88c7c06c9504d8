"""`rmuscle_node`: an rclpy LifecycleNode that turns camera + joint topics into π0.5 action chunks.

Lifecycle (what `ros2 lifecycle set` drives):
- configure: validate every parameter (FAILURE names the bad one), load weights, open the rMuscle
  library (cache.enabled), warm up (timed); create the publishers and the reset service.
- activate: sensor-QoS subscriptions, the inference timer, the diagnostics (and cache status) timers,
  the worker thread.
- deactivate / cleanup / shutdown undo exactly that; cleanup records the episode in progress into the
  library (`Policy.close`), then releases the model and GPU memory.

Inference runs on a worker thread: the timer only wakes it, so the executor (single-threaded; see
DESIGN.md §6) never blocks on the model. Each wake-up assembles an observation from the newest
messages; an incomplete, stale or bad one gives no chunk and a counted, logged reason. After publishing
a chunk the same thread refills rMuscle's window (`Policy.rebuild_cache`): that is the motion window,
while the arm executes the chunk.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import faulthandler
import gc
import math
import os
import statistics
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any, NoReturn

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import SetParametersResult
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Empty
from std_srvs.srv import Trigger
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from rmuscle_ros.cache.runtime import MODES, REBUILD_TRIES
from rmuscle_ros.node.job_times import ClockRate, JobTimes, clock_jumped
from rmuscle_ros.node.observation import DropReason, Limits, ObservationBuffer, ObservationUnavailable
from rmuscle_ros.node.params import (
    REMOVED_PARAMETERS,
    CombinationError,
    NodeConfig,
    ParameterError,
    node_config,
    parameter_defaults,
    state_sources,
)
from rmuscle_ros.node.spin import (
    clock_change_refused,
    forward_package_logging,
    integers_taken_as_floats,
    node_full_name,
    parameter_values,
    periodic_timer,
    same_value,
    signals_deferred,
    spin_node,
    undeclared_overrides,
    unresolvable_topic,
)

STALL_AFTER_S_DEFAULT = NodeConfig().stall_after_s  # bounds a callback's wait before configure
# The process's exit status when the node ends it for its supervisor to start it again (sysexits'
# EX_SOFTWARE): a stall past exit_after_stall_s, or a lost GPU. A failure to a supervisor (systemd's
# Restart=on-failure, a container's restart policy), told apart from a crash's 1.
SUPERVISOR_EXIT_STATUS = 70
# How often the stall watchdog looks (wall seconds): an exit comes at most this late.
WATCHDOG_PERIOD_S = 0.25
# A look that came this much later than asked (the process was paused: SIGSTOP, `docker pause`, a debugger,
# or starved) is skipped, and what held the node counts from then: the worker had no time to go on either.
WATCHDOG_LATE_S = 1.0
# If saying why blocks (a full stderr pipe, logging), the process ends this long after all the same,
# status 1, from a thread that needs no GIL (faulthandler's: `arm_exit_backstop`).
EXIT_BACKSTOP_S = 5.0
# With use_sim_time while active: no /clock at all for this long is an ERROR (no tick runs: a simulator or
# player that never started, or use_sim_time set by mistake) ...
CLOCK_SILENT_S = 5.0
# ... and a /clock that stopped for this long a WARN (a player paused or between bags, a simulator stopped).
CLOCK_PAUSED_S = 10.0

LATENCY_WINDOW = 200  # calls kept for the latency percentiles on /diagnostics
# Ticks merged behind a busy worker (`ticks_merged`) within this many wall seconds keep /diagnostics at WARN:
# those ticks got no call of their own (found in review: at 4x a third of the ticks merged, all at OK).
MERGED_WARN_S = 10.0
# An outage (ticks in a row without a chunk) is logged when it starts, naming why (which camera), and when
# chunks come back; at most once in this many seconds, so that a flapping camera does not flood the log.
OUTAGE_LOG_INTERVAL_S = 5.0
SLOWEST_KEPT = 3  # the slowest calls since activation, with where their time went (stats, /diagnostics)
# A call this much slower than the window's median is logged with its breakdown (at most every 5 s).
SLOW_CALL_FACTOR, SLOW_CALL_MARGIN_MS, SLOW_CALL_MIN_CALLS = 3.0, 20.0, 20
# From a tick until the worker runs, Python's thread switch interval (default 5 ms): the worker waits that
# long for the GIL while the executor's thread runs callbacks (camera frames). On the H200 node demo calls
# began 3.8-4.6 ms after their tick with the default and 0.8-0.9 ms with 0.5 ms set for the whole process,
# which made the calls themselves 0.8-1.6 ms slower; so it is short only from the tick to the worker's
# start (0.8 ms after the tick, calls as fast as before: bench/results/node_switch_interval_h200_13c0184).
WAKE_SWITCH_INTERVAL_S = 0.0005
# A sensor that has not delivered yet: a wait, not a drop, for sensor_startup_timeout_s after activation.
STARTUP_REASONS = (DropReason.MISSING_CAMERA, DropReason.MISSING_JOINTS)
# A tick's observation refused for its messages' timing (a frame dropped or late: at 30 Hz one dropped frame
# makes a camera's newest 66 ms old, past the cell profiles' 50 ms max_skew_s) is tried again at each new
# message, for up to LATE_RETRY_SHARE of the inference period after the tick, before it counts as a drop:
# otherwise one late frame cost the whole period's chunk (found in review).
LATE_REASONS = (DropReason.SKEW, DropReason.STALE_IMAGE, DropReason.STALE_JOINTS)
LATE_RETRY_SHARE = 0.5
# What the worker runs for a tick until its chunk is out (`_doing`): an error there is the tick's drop.
TICK_JOBS = ("a call", "a retry on a later message")
# Parameters a configured node applies from its next call on (`ros2 param set`). The others are read at
# configure: the model and its graphs' shapes, the library, topics, publishers and timers.
LIVE_PARAMETERS = {
    "prompt": None,
    "max_image_age_s": None,
    "max_joint_age_s": None,
    "max_skew_s": None,
    "sensor_startup_timeout_s": None,
    "error_after_drops": None,
    "stall_after_s": None,
    "exit_after_stall_s": None,
    "min_episode_s": None,
    "cache.similarity_threshold": "threshold",  # -> RMuscleConfig's name
    "cache.record": "record",
    "cache.rebuilds_per_tick": "rebuilds_per_tick",
    "cache.task": "task",
    "cache.audit_every": "audit_every",
    "cache.audit_max_error": "audit_max_error",
}


# The stall exit's two steps are module functions, not methods, so that tests can stand in for them
# without ending the test's process.

_backstop_sink: Any = None  # faulthandler writes through the file it is given: kept open for the process


def arm_exit_backstop(seconds: float) -> None:
    """End the process `seconds` from now (status 1) unless it has ended by then: faulthandler's own
    thread, which needs no GIL, so whatever blocks Python cannot stop it. It writes its dump to /dev/null:
    the stall exit has already written the stacks to stderr, and a dump into a full stderr pipe would
    block before its exit (found in review)."""
    global _backstop_sink
    if _backstop_sink is None:
        _backstop_sink = open(os.devnull, "w")  # noqa: SIM115 (held for the process's life)
    faulthandler.dump_traceback_later(seconds, exit=True, file=_backstop_sink)


def end_process(status: int) -> NoReturn:
    """End the process now, with `status`, skipping its shutdown (which would wait for a stalled worker,
    as would a deactivation). Kernel locks (the library's) go with the process; nothing is written."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _prompt_too_long(policy: Any, prompt: str) -> str:
    """Why `prompt` cannot run ("" if it can): past the model's token length its tail, the state and
    "Action:", would be cut off, and the actions would not depend on where the arms are."""
    tokens, most = policy.prompt_tokens(prompt)
    if tokens <= most:
        return ""
    return (
        f"prompt: {tokens} tokens with the state, the model takes {most}: the state and 'Action:' at its end "
        "would be cut off; shorten the instruction"
    )


@dataclasses.dataclass(frozen=True)
class _LateTick:
    """A tick whose observation was refused for its messages' timing (LATE_REASONS), tried again at each
    new message of the kind that can end the latest refusal (its `cure`) until `until`; monotonic seconds.
    `first`: the tick's own refusal (what a served tick counts and logs); `latest`: the latest try's (its
    drop, if none serves it)."""

    tick_at: float
    until: float
    first: ObservationUnavailable
    latest: ObservationUnavailable


def prompt_bucket_note(tokens: int, buckets: list[int], opt: int) -> tuple[bool, str]:
    """(whether a prompt of `tokens` runs at the length `opt` the TensorRT engines are tuned for, what to
    say): it runs at the smallest of `buckets` that holds it (`bucket_for`; the node refuses a prompt
    longer than the model takes before it gets here)."""
    from rmuscle_ros.engine.graph import bucket_for

    bucket = bucket_for(buckets, tokens)
    note = f"the prompt takes {tokens} tokens with the state and runs at the {bucket}-token bucket"
    if bucket == opt:
        return True, f"{note}, the length the TensorRT engines are tuned for"
    return False, (
        f"{note}; the TensorRT engines are tuned for {opt} (model.trt_opt_prompt_len): set it to {bucket} and "
        "configure again to build engines for this prompt"
    )


def _limits(cfg: NodeConfig) -> Limits:
    """The observation's age and skew limits, in ns."""
    return Limits(int(cfg.max_image_age_s * 1e9), int(cfg.max_joint_age_s * 1e9), int(cfg.max_skew_s * 1e9))


def _mode_codes(message: Any) -> dict[str, int]:
    """rMuscle mode name -> the CACHE_* constant of ActionChunk / CacheStatus (same values in both)."""
    codes = {"dense": message.CACHE_DENSE, "cached": message.CACHE_CACHED, "fallback": message.CACHE_FALLBACK}
    if set(codes) != set(MODES):  # the runtime grew a mode the messages cannot say: refuse at load time
        raise RuntimeError(f"cache modes {MODES} do not match the message constants {sorted(codes)}")
    return codes


def _call_breakdown(chunk: Any, latency_ms: float, episode: int, chunk_id: int) -> dict[str, Any]:
    """One call for the slowest-calls list: its latency and where the time went (Policy.infer timings)."""
    gpu = chunk.timings_s.get("gpu")
    return {
        "ms": latency_ms,
        "mode": chunk.cache_mode,
        "episode": episode,
        "chunk": chunk_id,
        "preprocess_ms": chunk.timings_s.get("preprocess", 0.0) * 1e3,
        "gpu_ms": None if gpu is None else gpu * 1e3,
    }


def describe_call(call: dict[str, Any]) -> str:
    """One line for a slow call: its latency, mode, episode and chunk, and where its time went."""
    where = f"preprocess {call['preprocess_ms']:.1f} ms"
    if call["gpu_ms"] is not None:
        rest = call["ms"] - call["preprocess_ms"] - call["gpu_ms"]
        where += f", GPU {call['gpu_ms']:.1f} ms, other {rest:.1f} ms"
    return f"{call['ms']:.1f} ms ({call['mode']}, episode {call['episode']} chunk {call['chunk']}: {where})"


def _p50_p99(values: list[float]) -> tuple[float, float]:
    """Median and 99th percentile (0.0 for no values): the node's latency figures."""
    return (statistics.median(values), float(np.percentile(values, 99))) if values else (0.0, 0.0)


def _per_second(times: list[float] | list[int], unit_s: float = 1.0) -> float:
    """Events per second from their times (oldest first, in units of `unit_s` seconds); 0.0 without a span."""
    if len(times) < 2 or times[-1] <= times[0]:
        return 0.0
    return (len(times) - 1) / ((times[-1] - times[0]) * unit_s)


class GcPauses:
    """Garbage-collection pauses while the node is active (a gc.callbacks entry). A collection stops every
    Python thread for its whole length, the inference worker's included, whichever thread triggered it."""

    def __init__(self) -> None:
        self.longest_ms = 0.0
        self.full_collections = 0  # of the oldest generation: the ones that walk every tracked object
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.longest_ms = max(self.longest_ms, (time.perf_counter() - self._started) * 1e3)
            self.full_collections += info["generation"] == 2
            self._started = None


class RMuscleNode(LifecycleNode):
    # What spin_node tells a signal that comes while the node shuts down (it is held, not acted on)
    SHUTDOWN_SAYS = "shutting down, recording the episode in progress into the library"

    def __init__(self, node_name: str = "rmuscle_node", **kwargs: Any) -> None:
        super().__init__(node_name, **kwargs)
        for name, default in parameter_defaults().items():
            self.declare_parameter(name, default)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        integers_taken_as_floats(self)
        # Everything below is created by a transition and released by its inverse.
        self.cfg: NodeConfig | None = None
        self.policy: Any = None
        self._chunk_pub: Any = None
        self._trajectory_pub: Any = None
        self._diag_pub: Any = None
        self._status_pub: Any = None
        self._reset_srv: Any = None
        self._reset_sub: Any = None
        self._discard_srv: Any = None
        self._discard_sub: Any = None
        self._subs: list[Any] = []
        self._timers: list[Any] = []
        self._infer_timer: Any = None  # the first of _timers: it wakes the worker for each observation
        self._buffer: ObservationBuffer | None = None
        self._worker: threading.Thread | None = None
        self._activated_at = 0.0  # time.monotonic() at the latest activation or episode reset
        self._waits_since = "activation"  # which of the two: named in the wait's log and /diagnostics
        self._wake = threading.Event()  # the worker has something to do: one of the three below
        self._tick = threading.Event()  # the inference timer fired: an observation is due
        # when it last fired (monotonic): what a late retry's window counts from
        self._tick_at: float | None = None
        # when the oldest tick the worker took last had fired (monotonic): its wait for the worker counts
        # from there when later ticks merged into it (`ticks_merged`)
        self._tick_taken_since: float | None = None
        # The oldest tick the worker has not taken yet (monotonic; None: none waits), and what the worker is
        # doing: a tick waiting past stall_after_s is a stalled worker (/diagnostics ERROR). Set with the
        # tick under this lock, so that a tick the worker takes never leaves a stale time behind.
        self._tick_lock = threading.Lock()
        self._tick_waiting_since: float | None = None
        self._doing = ""  # what the worker is running ("": waiting for work), for the stall's report
        self._stall_logged = False  # the current stall was logged (once per stall)
        # From activation until the worker has ended: ends the process once a stall outlasts
        # exit_after_stall_s (`_watch_for_stalls`); its own thread, since a stall can hold the executor too
        # (a deactivation or shutdown waits for the worker)
        self._watchdog: threading.Thread | None = None
        self._watchdog_stop = threading.Event()
        # When the reset in progress took the policy (monotonic; None: none): it records the finished
        # episode on the executor's thread, where a disk that hangs holds the executor and no tick falls due
        self._resetting_since: float | None = None
        # When a deactivation or shutdown began waiting for the worker (monotonic; None: none): it holds the
        # executor, so no tick falls due while the worker finishes its job (found in review: a call that hung
        # less than a period before a deactivation was never counted, and the process hung for good)
        self._stopping_since: float | None = None
        # With use_sim_time: the ROS clock's latest reading seen by /diagnostics, and when (monotonic) it
        # last moved; the silence was logged (once per silence)
        self._ros_clock_seen = 0
        self._ros_clock_moved_at = time.monotonic()
        self._clock_silence_logged = False
        self._crowded_logged: set[str] = set()  # input topics whose several publishers were logged
        self._mistyped_logged: set[str] = set()  # input topics whose publishers' other type was logged
        self._input_topics: tuple[str, ...] = ()  # while active: the camera and joint topics, as remapped
        self._switch_interval_s = sys.getswitchinterval()  # restored once the worker runs
        self._refill = threading.Event()  # an episode reset: a motion window for the next episode's start
        # A callback on the executor waits for the policy lock (a reset, a parameter, a discard): the motion
        # window ends at its next part (a lock is not handed to a waiter: the window took it back at once,
        # part after part, and a reset waited out stall_after_s and was refused; found in review)
        self._lock_wanted = threading.Event()
        # A tick found a sensor not yet heard from during start-up: the call is retried when a sensor's
        # first message arrives, so the first chunk follows the last sensor to come up, not a period later.
        self._start_wait = threading.Event()
        # A tick whose observation a later message may still serve (LATE_REASONS): until when (monotonic)
        # it is tried again, and why it was refused last; None: none pending. Worker-owned; the executor
        # only reads whether one is pending, to wake the worker at each message meanwhile.
        self._late: _LateTick | None = None
        # Messages stored so far, by kind ("image", "joints"; written by the executor only): a message stored
        # between a try's buffer read and its decision to wait wakes the retry (`_retry_if_stored`).
        self._stored_counts: Counter[str] = Counter()  # by kind: "image:<slot>", "joints"
        self._stop = threading.Event()
        self._stats_lock = threading.Lock()
        # Serialises every call into the policy: the worker's infer/rebuild and the executor's episode
        # reset (RMuscle is not thread-safe). A reset therefore waits for at most one call in flight.
        self._policy_lock = threading.Lock()
        self._modes: dict[str, int] = {}
        self.last_error = ""  # why the last transition failed (also logged), for operators and tests
        self._default_cpu_threads: int | None = None  # PyTorch's own choice, before cpu_threads set it
        self._gc = GcPauses()  # since the latest activation; registered while active
        self._reset_stats()
        # The library code's Python logging (the reference library, the runtime) on this node's ROS logger
        self._stop_forwarding_logs = forward_package_logging(self)

    def _reset_stats(self) -> None:
        with self._stats_lock:
            self.episode_id = 0
            self.chunk_id = 0
            self.drops: Counter[str] = Counter()
            self.latencies_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)
            # The same calls' preprocessing (images into the model's input) and latencies by cache mode:
            # where a slow call spent its time, and what the cache saves on this cell.
            self._preprocess_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)
            self._latencies_by_mode: dict[str, deque[float]] = {}
            self._chunk_times: deque[float] = deque(maxlen=LATENCY_WINDOW)
            # the same chunks' observation times on the node's clock (with use_sim_time, /clock): the rate
            # a bag played faster or slower than recorded is served at, in its own seconds
            self._chunk_clock_ns: deque[int] = deque(maxlen=LATENCY_WINDOW)
            # wall ms from each tick to its observation being read: the job in flight when it fired,
            # a reset, the worker's wait for the GIL (WAKE_SWITCH_INTERVAL_S)
            self._tick_waits_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)
            self.stalls = 0  # ticks that waited past stall_after_s for the worker, once taken
            # ticks that fell due while an earlier one still waited for the worker: one call served both
            self.ticks_merged = 0
            self._merged_at: deque[float] = deque(maxlen=LATENCY_WINDOW)  # when (monotonic), the latest
            self._slowest: list[dict[str, Any]] = []  # SLOWEST_KEPT calls, slowest first
            self._failing_ticks = 0  # ticks in a row that gave no chunk (a drop); 0 after a publish
            self._last_drop = ""  # the latest drop's reason and detail
            self._outage_logged_at = -math.inf  # when an outage's start was last logged (monotonic s)
            self._outage_logged = False  # whether the outage in progress was (its end is then logged too)
            # ticks whose observation was refused for timing and served by a later message (LATE_REASONS)
            self.late_served: Counter[str] = Counter()
            self._image_sizes: dict[str, str] = {}  # camera slot -> its latest frame's size, "WxH"
            self._image_size_changes: Counter[str] = Counter()  # camera slot -> size changes since then
            self.errors: Counter[str] = Counter()  # failures the node survived: cache_rebuild, worker, ...
            self.rebuilds = 0  # window entries rebuilt in motion windows
            self.rebuilds_deferred = 0  # entries wanted when a motion window ended (an observation was due)
            self.episodes_discarded = 0  # episodes kept out of the library on ~/discard_episode
            self._discarded = -1  # the latest of them
            # episodes not recorded for lasting under min_episode_s (resets sent over and over?)
            self.episodes_too_short = 0
            # the episode's calls' earliest and latest observation stamps (ns, the node's clock), for its
            # length at the reset (min_episode_s); None before its first call
            self._episode_stamps: tuple[int, int] | None = None
            # the latest full Policy.cache_status() (configure, reset, motion window) with the latest call's
            # part merged in; None = no cache
            self.cache_status: dict[str, Any] | None = None
            self.waiting_for = ""  # during start-up: the sensor the node is still waiting for
        # The latest rebuild parts' and audits' wall times: what the motion windows' estimate reads
        self._rebuild_s = JobTimes()
        self._audit_s = JobTimes(backoff=True)  # an audit that never fits is retried ever more rarely
        self._clock_rate = ClockRate()  # with use_sim_time: how fast /clock runs, for the estimate

    # ── lifecycle ────────────────────────────────────────────────────────────────────────────────────────

    def _set_cpu_threads(self, threads: int, device: str) -> None:
        """PyTorch's CPU threads for this process: `threads`, or (0) automatic: with the model on the CPU
        what PyTorch chose before the node first set it (so that a reconfigure to 0 restores it), on a GPU
        at most 4 (`policy.host_threads`). PyTorch applies the number to each thread when that thread
        first runs an operator: the worker, started at activate, gets it."""
        import torch

        from rmuscle_ros.runtime.policy import host_threads

        if self._default_cpu_threads is None:
            self._default_cpu_threads = torch.get_num_threads()
        wanted = threads or host_threads(device, self._default_cpu_threads)
        torch.set_num_threads(wanted)
        self.get_logger().info(f"configure: PyTorch uses {wanted} CPU thread(s)")

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        with self._saying_why("configure"):
            return self._configure()

    def _configure(self) -> TransitionCallbackReturn:
        # A name the params file or -p gives that the node does not declare (a misspelt key) is otherwise
        # dropped by rclpy, and the node would run on that parameter's default (found in review).
        from rmuscle_ros.node.action_streamer import streamer_defaults

        unknown, others = undeclared_overrides(
            self,
            [*parameter_defaults(), *REMOVED_PARAMETERS],
            prefixes=("model.", "cache."),
            # the streamer's, which a profile's `/**` section may carry (aloha_sim's `seed` and `task` are
            # not taken here: importing it needs MuJoCo, which a cell need not have)
            others_names=streamer_defaults(),
        )
        if others:
            self.get_logger().info(f"configure: parameters given that are not this node's, ignored: {others}")
        try:
            cfg = node_config(parameter_values(self, parameter_defaults()) | unknown)
        except ParameterError as e:
            return self._fail(f"configure: invalid parameter {e}")
        bad = unresolvable_topic(self, cfg, ("camera_topics", "joint_state_topics"))  # before the model loads
        if bad:
            return self._fail(f"configure: invalid parameter {bad}")
        from rmuscle_ros.cache.library import LibraryError
        from rmuscle_ros.msg import ActionChunk
        from rmuscle_ros.runtime.policy import Policy  # torch import: seconds, so only when configuring

        policy = None
        try:
            self._set_cpu_threads(cfg.cpu_threads, cfg.model.device)
            modes = _mode_codes(ActionChunk)
            start = time.perf_counter()
            policy = Policy(cfg.model, cache=cfg.cache.to_runtime() if cfg.cache.enabled else None)
            loaded = time.perf_counter() - start
            too_long = _prompt_too_long(policy, cfg.prompt)
            if too_long:
                self._close_quietly(policy)
                return self._fail(f"configure: invalid parameter {too_long}")
            warm = policy.warmup(cfg.prompt) if cfg.warmup else {}
            policy.expect_task(cfg.prompt)  # the first episode's likely first calls, for activation's refill
            status = policy.cache_status()
        except LibraryError as e:  # LibraryMismatch too: other weights/shapes, corrupt index, version
            self._close_quietly(policy, e)
            return self._fail(f"configure: cannot open the rMuscle library (cache.library_path): {e}")
        except (ValueError, RuntimeError, OSError) as e:  # CheckpointError is a ValueError
            self._close_quietly(policy, e)
            return self._fail(f"configure: cannot load the policy: {e}")
        except Exception as e:  # anything else (a malformed library entry, ...): still a clean FAILURE
            self._close_quietly(policy, e)
            return self._fail(f"configure: cannot load the policy: {type(e).__name__}: {e}")
        self.get_logger().info(
            f"configure: {cfg.model.preset} on {cfg.model.device} ({cfg.model.backend}) loaded in {loaded:.2f} s "
            f"({', '.join(f'{k} {v:.2f}' for k, v in policy.load_timings.items())})"
            + (f", warm-up {warm.get('warmup_total', 0.0):.2f} s" if warm else "")
        )
        if cfg.model.backend == "tensorrt":
            self._log_prompt_bucket(policy, cfg)
        if status is not None:
            where = status["library_path"] or "a temporary folder"
            self.get_logger().info(
                f"configure: rMuscle cache on, library {where} with {status['library_episodes']} episode(s)"
            )
            # each of status["library_problems"] is on the log already, from the library's open

        self.cfg, self.policy, self._modes = cfg, policy, modes
        with self._stats_lock:
            self.cache_status = status
            episode = self.episode_id
        self._seed_noise(episode)  # after the warm-up's draws
        try:
            self._set_up(cfg)
        except Exception as e:  # a name rclpy refuses (a topic with a space), ...: a clean FAILURE, not ERROR
            self._release("configure")  # the model and what was made; the node is unconfigured: fixable
            return self._fail(f"configure: {type(e).__name__}: {e}")
        # A full garbage collection walks every object the process holds, and every thread waits for it.
        # With torch, the model and ROS loaded, one took 130-270 ms on a 2-core CPU (gc.callbacks in the
        # demo). What configure loaded lives until cleanup: collect once, then freeze it (gc.freeze) so
        # that later collections walk only what was allocated since. Undone in _release.
        gc.collect()
        gc.freeze()
        return TransitionCallbackReturn.SUCCESS

    def _set_up(self, cfg: NodeConfig) -> None:
        """Configure's publishers, services and observation buffer, once the policy is loaded."""
        from rmuscle_ros.msg import ActionChunk, CacheStatus

        self._chunk_pub = self.create_lifecycle_publisher(ActionChunk, "~/action_chunk", 10)
        if cfg.publish_joint_trajectory:
            self._trajectory_pub = self.create_lifecycle_publisher(JointTrajectory, "~/joint_trajectory", 10)
        self._diag_pub = self.create_lifecycle_publisher(DiagnosticArray, "/diagnostics", 10)
        if cfg.cache.enabled:
            self._status_pub = self.create_lifecycle_publisher(CacheStatus, "~/cache_status", 10)
        self._reset_srv = self.create_service(Trigger, "~/reset_episode", self._on_reset_service)
        self._reset_sub = self.create_subscription(
            Empty, "~/reset_episode", lambda _msg: self.reset_episode(), 10
        )
        self._discard_srv = self.create_service(Trigger, "~/discard_episode", self._on_discard_service)
        self._discard_sub = self.create_subscription(
            Empty, "~/discard_episode", lambda _msg: self.discard_episode(), 10
        )
        limits = _limits(cfg)
        # Reasons name each camera's topic as remapped (the cell's name for it), which an operator can look up.
        topics = [self.resolve_topic_name(t) for t in cfg.camera_inputs]
        self._buffer = ObservationBuffer(
            len(cfg.camera_inputs), cfg.joint_names, cfg.compressed_images, limits, topics, state_sources(cfg)
        )
        self._warm_up_timer_paths()

    def _warm_up_timer_paths(self) -> None:
        """Run once, at configure, what the executor's timers will first run while active. Their first run
        imported modules (np.percentile imports numpy.ma) in the executor thread, holding the GIL while the
        worker's call waited: on the H200 the dense episode's 2nd or 3rd call took 44-102 ms against ~19
        (bench/results/dev_node_calls_h200_23d9f4a)."""
        _p50_p99([1.0, 2.0])  # what stats() computes once calls are in its window
        self._diagnostics()
        self._cache_status_message()

    def _on_set_parameters(self, params: list[Any]) -> SetParametersResult:
        """`ros2 param set`: a value is validated with every other parameter (a bad one is refused, naming
        the problem). Unconfigured, it is read at the next configure; configured, LIVE_PARAMETERS apply from
        the next call, and any other is refused with what to do instead.

        Unconfigured, a value that is valid by itself but does not go with the others as they are now (a
        π0.5 preset before its checkpoint) is taken with a warning: `ros2 param load` sets a file's
        parameters one at a time, each checked against the others, so a profile's coupled parameters would
        otherwise be refused whichever came first. Configure checks the whole set."""
        clock = clock_change_refused(self, params, bool(self._timers), "node")
        if clock:
            return SetParametersResult(successful=False, reason=clock)
        defaults = parameter_defaults()
        current = parameter_values(self, defaults, strict=False)
        changed = {
            p.name: p.value for p in params if p.name in current and not same_value(p.value, current[p.name])
        }
        if not changed:
            return SetParametersResult(successful=True)
        try:
            cfg = node_config(current | changed)
        except CombinationError as e:
            if self.cfg is not None:
                return SetParametersResult(successful=False, reason=str(e))
            for name, value in changed.items():  # each new value alone, among defaults that go together
                try:
                    node_config(defaults | {name: value})
                except CombinationError:
                    pass
                except ParameterError as own:
                    return SetParametersResult(successful=False, reason=str(own))
            self.get_logger().warning(
                f"parameters taken: {', '.join(changed)}; with the others as they are now, configure would "
                f"refuse them: {e}"
            )
            return SetParametersResult(successful=True)
        except ParameterError as e:
            return SetParametersResult(successful=False, reason=str(e))
        if self.cfg is None:
            return SetParametersResult(successful=True)
        fixed = sorted(set(changed) - set(LIVE_PARAMETERS))
        if fixed:
            return SetParametersResult(
                successful=False,
                reason=f"{fixed[0]}: read at configure; deactivate and clean up the node, set it, then configure "
                f"again (live: {', '.join(LIVE_PARAMETERS)})",
            )
        cache = {LIVE_PARAMETERS[k]: v for k, v in changed.items() if LIVE_PARAMETERS[k] is not None}
        limits = _limits(cfg)  # before anything changes: what can fail fails here
        too_long = (
            "prompt" in changed and self.policy is not None and _prompt_too_long(self.policy, cfg.prompt)
        )
        if too_long:
            return SetParametersResult(successful=False, reason=too_long)
        if not self._lock_policy():
            return SetParametersResult(successful=False, reason=f"not applied: {self._busy()}")
        try:
            if self.policy is not None and cfg.cache.enabled:
                if cache or "prompt" in changed:  # may rebuild its GPU retrieval state, freeing the old
                    found = f"found before {', '.join(sorted(changed))} changed"
                    self._end_if_device_lost(self.policy, found)
                if cache:
                    try:
                        self.policy.reconfigure_cache(**cache)
                    except ValueError as e:
                        return SetParametersResult(successful=False, reason=str(e))
            self.cfg = cfg  # the worker reads it at each call
            if self._buffer is not None:
                self._buffer.limits = limits
            # A new task before the episode's first call (the usual "reset, then set the next prompt"): the
            # window wants that task's likely first calls, not those the reset or configure chose (found in
            # review: they were the old task's, and the episode's first calls ran dense).
            new_task = "prompt" in changed or "cache.task" in changed
            if new_task and self.policy is not None and cfg.cache.enabled and not self.policy.episode_started:
                self.policy.expect_task(cfg.prompt)
                self._refill.set()  # seen by the worker while active, else at activation
                self._wake.set()
        finally:
            self._policy_lock.release()
        self.get_logger().info(
            "parameters now in effect: " + ", ".join(f"{k}={v!r}" for k, v in changed.items())
        )
        return SetParametersResult(successful=True)

    def _stall_after_s(self) -> float:
        return self.cfg.stall_after_s if self.cfg is not None else STALL_AFTER_S_DEFAULT

    def _lock_policy(self) -> bool:
        """The policy lock for a callback on the executor's thread (a parameter, a reset, a discard): within
        stall_after_s, or False. A call holds the lock while it runs; waiting on a stalled one would hold
        the executor too, and /diagnostics would go silent instead of reporting the stall."""
        self._lock_wanted.set()  # a motion window yields between two parts (_rebuild_cache)
        try:
            return self._policy_lock.acquire(timeout=self._stall_after_s())
        finally:
            self._lock_wanted.clear()

    def _busy(self) -> str:
        return (
            f"the inference worker has held the policy for over {self._stall_after_s():g} s (stall_after_s), "
            f"running {self._doing or 'a job'}; see /diagnostics"
        )

    def _close_quietly(self, policy: Any, failed: BaseException | None = None) -> None:
        # A configure that failed after the policy was built: free the cache's temporary library now. If it
        # failed on a lost GPU (a fault in the warm-up), letting the model go would abort the process.
        if policy is not None:
            if failed is not None:
                from rmuscle_ros.runtime.policy import first_line

                found = (
                    f"found before the failed configure released the model (it raised {first_line(failed)})"
                )
                self._end_if_device_lost(policy, found)
            try:
                policy.close()
            except Exception as e:  # the configure error is what matters; this one is only logged
                self.get_logger().warning(f"configure: closing the failed policy: {e}")

    def _log_prompt_bucket(self, policy: Any, cfg: NodeConfig) -> None:
        """The TensorRT engines are tuned for one prompt length (model.trt_opt_prompt_len); say which the
        prompt runs at, and warn where the two differ (the call runs, perhaps slower than it could)."""
        from rmuscle_ros.engine.onnx_export import prompt_buckets

        try:  # advice only: nothing here may fail a configure that loaded the policy
            tokens, _ = policy.prompt_tokens(cfg.prompt)
            buckets = prompt_buckets(cfg.model.model)
        except Exception as e:
            self.get_logger().warning(f"configure: the prompt's token count for TensorRT's tuning: {e}")
            return
        tuned, note = prompt_bucket_note(tokens, buckets, cfg.model.trt_opt_prompt_len)
        # one call site per severity: rclpy refuses a call site whose severity changes
        if tuned:
            self.get_logger().info(f"configure: {note}")
        else:
            self.get_logger().warning(f"configure: {note}")

    def _fail(self, message: str) -> TransitionCallbackReturn:
        self.last_error = message
        self.get_logger().error(message)
        return TransitionCallbackReturn.FAILURE

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            self._start_activity()
        except Exception as e:  # a topic name rclpy refuses, ...: a clean FAILURE, the node stays configured
            self._stop_activity()
            return self._fail(f"activate: {type(e).__name__}: {e}")
        with self._saying_why("activate"):
            return super().on_activate(state)

    def _start_activity(self) -> None:
        """Activate's subscriptions, timers and worker thread."""
        cfg, buffer = self.cfg, self._buffer
        assert cfg is not None and buffer is not None
        image_type = CompressedImage if cfg.compressed_images else Image
        # as remapped: the cell's names, in drop reasons and /diagnostics
        self._input_topics = tuple(
            self.resolve_topic_name(t) for t in (*cfg.camera_inputs, *cfg.joint_state_topics)
        )
        joint_topics = self._input_topics[len(cfg.camera_inputs) :]
        for slot, topic in enumerate(cfg.camera_inputs):  # the buffer's slots: the cameras subscribed to
            self._subs.append(
                self.create_subscription(
                    image_type,
                    topic,
                    lambda msg, slot=slot: self._stored(buffer.put_image(slot, msg), f"image:{slot}"),
                    qos_profile_sensor_data,
                )
            )
        for topic, prefix, resolved in zip(
            cfg.joint_state_topics, cfg.joint_name_prefixes, joint_topics, strict=True
        ):
            self._subs.append(
                self.create_subscription(
                    JointState,
                    topic,
                    lambda msg, prefix=prefix, resolved=resolved: self._stored(
                        buffer.put_joint_state(msg, prefix, resolved), "joints"
                    ),
                    qos_profile_sensor_data,
                )
            )
        period = cfg.actions_per_inference * cfg.control_period_s
        self._infer_timer = periodic_timer(self, period, self._on_tick)
        self._ros_clock_seen, self._ros_clock_moved_at = 0, time.monotonic()
        self._crowded_logged, self._mistyped_logged = set(), set()
        self._timers = [
            self._infer_timer,
            # On the steady clock always: with use_sim_time and no /clock (a simulator stopped, a profile
            # meant for one), a timer on the ROS clock never fires, and the node said nothing at all
            # (found in review). Diagnostics then report the silent clock.
            self.create_timer(1.0, self._publish_diagnostics, clock=Clock(clock_type=ClockType.STEADY_TIME)),
        ]
        if self._status_pub is not None:
            self._timers.append(periodic_timer(self, cfg.cache.status_period_s, self._publish_cache_status))
        self._stop.clear()
        self._gc = GcPauses()
        gc.callbacks.append(self._gc)
        self._activated_at, self._waits_since = time.monotonic(), "activation"
        self._start_wait.clear()
        self._late = None
        with self._stats_lock:
            self.waiting_for = ""
            # What /diagnostics reports "since activation" starts over (found in review: an operator who
            # deactivated, fixed a camera and activated again got ERROR at once, with the old reason).
            self.drops.clear()
            self.late_served.clear()
            self._image_sizes.clear()
            self._image_size_changes.clear()
            self._failing_ticks = 0
            self._last_drop = ""
            self._outage_logged_at, self._outage_logged = -math.inf, False
            self._slowest = []
            self._chunk_times.clear()  # rate_hz: the time spent inactive is no gap between chunks
            self._chunk_clock_ns.clear()
        if cfg.cache.enabled:
            # A motion window before the first tick, as at a reset: the episode's next calls (on a first
            # activation, the likely first calls of a library recorded before) are rebuilt while the node
            # waits, so that its first call can be served cached.
            self._refill.set()
            self._wake.set()
        worker = threading.Thread(target=self._inference_loop, name="rmuscle-inference", daemon=True)
        worker.start()  # kept only once started: a thread that never started cannot be joined
        self._worker = worker
        self._watchdog_stop.clear()
        watchdog = threading.Thread(target=self._watch_for_stalls, name="rmuscle-stall-watchdog", daemon=True)
        watchdog.start()
        self._watchdog = watchdog
        self.get_logger().info(f"activate: one chunk every {period * 1e3:.0f} ms")

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        with self._saying_why("deactivate"):
            self._stop_activity()
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        with self._saying_why("cleanup"):
            self._release()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        with self._saying_why("shutdown"):
            try:
                self._stop_activity()  # shutdown may come from any state: undo activate, then configure
            finally:  # whatever stopping raised, the episode in progress is recorded and the model freed
                self._release("shutdown")
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        """A transition raised (logged by `_saying_why`): what the node still holds is released, the episode
        in progress recorded, and the node goes unconfigured, to be configured again. rclpy's own handling
        said nothing and released nothing (found in review)."""
        self.get_logger().error(
            "error processing: stopping the worker, recording the episode in progress and releasing the model; "
            "the node goes unconfigured"
        )
        try:
            self._stop_activity()
        except Exception as e:
            self.get_logger().error(f"error processing: stopping: {type(e).__name__}: {e}")
        try:
            self._release("error processing")
        except Exception as e:
            self.get_logger().error(f"error processing: releasing: {type(e).__name__}: {e}")
        return TransitionCallbackReturn.SUCCESS

    @contextlib.contextmanager
    def _saying_why(self, transition: str) -> Iterator[None]:
        """An exception out of a transition is logged and kept in `last_error`, then raised on: rclpy turns
        it into error processing (on_error) without a word of what it was."""
        try:
            yield
        except Exception as e:
            self.last_error = f"{transition}: {type(e).__name__}: {e}"
            self.get_logger().error(self.last_error)
            raise

    def destroy_node(self) -> None:
        """Destroyed while configured or active (a program's teardown without the shutdown transition): the
        shutdown transition's work first, so the worker thread is stopped and the episode in progress
        recorded. Before, the worker outlived rclpy.shutdown, the process aborted, and the episode was lost."""
        if self.policy is not None or self._worker is not None:
            try:
                self.on_shutdown(None)
            except Exception as e:  # the node goes either way: say why its shutdown failed
                self.get_logger().error(f"destroy_node: shutdown failed: {type(e).__name__}: {e}")
        self._stop_forwarding_logs()
        super().destroy_node()

    def _stop_activity(self) -> None:
        """Undo on_activate: the worker thread, timers and subscriptions; forget buffered messages."""
        self._stop_worker()
        for timer in self._timers:
            self.destroy_timer(timer)
        for sub in self._subs:
            self.destroy_subscription(sub)
        self._timers, self._subs, self._infer_timer = [], [], None
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        if self._buffer is not None:
            self._buffer.clear()

    def _stop_worker(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._worker is not None:
            self._stopping_since = time.monotonic()
            self._worker.join()
            self._worker = None
            self._stopping_since = None
        self._wake.clear()
        with self._tick_lock:  # a tick after the worker's last wake is not taken: nothing to count
            self._tick.clear()
            self._tick_waiting_since = None
        self._watchdog_stop.set()  # only now: the join above waited for the worker, however long
        if self._watchdog is not None:
            self._watchdog.join()
            self._watchdog = None
        self._refill.clear()
        sys.setswitchinterval(self._switch_interval_s)  # a tick may have come after the worker's last wake

    def _release(self, transition: str = "cleanup") -> None:
        """Undo on_configure: the cache (recording the episode in progress), publishers, services, the
        model and its (GPU) memory. The recording goes first: at Ctrl-C the ROS context may be gone
        already (spin_node), and no ROS handle may stand between the cell and its recorded episode. A
        Ctrl-C or SIGTERM meanwhile takes effect once it is done (`signals_deferred`)."""
        with signals_deferred(f"the {transition} has recorded the episode in progress"):
            self._release_now(transition)

    def _release_now(self, transition: str) -> None:
        if self.policy is not None:
            with self._policy_lock:
                self._end_if_device_lost(self.policy, f"found before the {transition} released the model")
                try:
                    recorded = self.policy.close()
                except Exception as e:  # a full disk must not keep the model (and GPU memory) alive
                    self._error("cache_close", f"{transition}: recording into the library failed: {e}")
                else:
                    if recorded is not None:
                        self.get_logger().info(
                            f"{transition}: episode in progress recorded as library episode {recorded}"
                        )
        for pub in (self._chunk_pub, self._trajectory_pub, self._diag_pub, self._status_pub):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        for srv in (self._reset_srv, self._discard_srv):
            if srv is not None:
                self.destroy_service(srv)
        for sub in (self._reset_sub, self._discard_sub):
            if sub is not None:
                self.destroy_subscription(sub)
        self._chunk_pub = self._trajectory_pub = self._diag_pub = self._status_pub = None
        self._reset_srv = self._reset_sub = self._discard_srv = self._discard_sub = None
        device = self.cfg.model.device if self.cfg is not None else "cpu"
        self.policy, self.cfg, self._buffer = None, None, None
        gc.unfreeze()  # configure's objects (the model among them) may be collected again
        gc.collect()
        if device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
        self._reset_stats()

    # ── episodes ─────────────────────────────────────────────────────────────────────────────────────────

    def _seed_noise(self, episode: int) -> None:
        """With noise_seed >= 0, the episode's calls draw their noise from (noise_seed, episode), folded into
        the 64 bits a generator's seed takes (found in review: a seed from a nanosecond clock overflowed it
        and left configure half done)."""
        if self.cfg is not None and self.policy is not None and self.cfg.noise_seed >= 0:
            self.policy.reseed_noise((self.cfg.noise_seed * 1_000_003 + episode) % 2**64)

    def reset_episode(self) -> int:
        """Start the next episode; the cache records the finished one into its library if it ran dense.
        Returns the new episode id (the current one if the worker held the policy past stall_after_s:
        not reset, logged)."""
        return self._start_episode()[0]

    def _start_episode(self) -> tuple[int, str, bool]:
        """-> (new episode id, what happened to the finished episode's recording, True); or the current
        episode id, why not, and False if the worker held the policy past stall_after_s (no reset)."""
        recorded, failed = None, ""
        # Under the policy lock, so a chunk is numbered in the episode the cache counted it in.
        if not self._lock_policy():
            with self._stats_lock:
                episode = self.episode_id
            self._error("reset", f"episode {episode} was not reset: {self._busy()}")
            return episode, f"not reset: {self._busy()}", False
        policy, status = self.policy, None
        self._resetting_since = time.monotonic()  # the stall watchdog's: a reset on the executor's thread
        try:
            if policy is not None:
                self._end_if_device_lost(policy, f"found before the reset of episode {self.episode_id}")
                self._keep_out_if_short(policy)
                try:
                    recorded = policy.reset_episode()
                except Exception as e:  # e.g. the library's disk is full: the cell keeps running
                    failed = f"{type(e).__name__}: {e}"
                try:  # whatever became of the recording
                    if self.cfg is not None:  # a prompt changed during the episode: refill for its task
                        policy.expect_task(self.cfg.prompt)
                except Exception as e:  # costs the next episode's first cached calls, not the reset
                    self._error("cache_refill", f"{type(e).__name__}: {e}")
                # the previous status stays if this read fails, until the next call and window store theirs
                try:
                    status = policy.cache_status()
                except Exception as e:
                    self._error("cache_status", f"{type(e).__name__}: {e}")
        finally:
            # The cache has started the next episode whatever happened (its reset ends the old one in a
            # finally), and so does the node, even when a Ctrl-C cut the reset's write short: found in a
            # loaded test run, the worker then ran one call on the frames from before the reset, counted
            # in the next episode, and shutdown recorded it as a library episode of one call.
            try:
                with self._stats_lock:
                    self.episode_id += 1
                    self.chunk_id = 0
                    episode = self.episode_id
                    self._episode_stamps = None
                    self.cache_status = status if status is not None else self.cache_status
                self._seed_noise(episode)
                if self._buffer is not None:
                    # The new episode sees only messages that come after its reset: a camera's newest frame
                    # may still show the scene before it for a frame period. Waiting for them is the
                    # start-up wait's (no drop), as after an activation.
                    self._buffer.clear()
                    self._activated_at, self._waits_since = time.monotonic(), "episode reset"
                # A tick still waiting for a later message belongs to the finished episode: ended without
                # a drop, as the reset's own wait is none; left pending, its retry took the reset's wake and
                # the refill for the next episode never ran (found in review).
                self._late = None
            finally:
                self._resetting_since = None
                self._policy_lock.release()
        if failed:
            note = f"recording episode {episode - 1} failed: {failed}"
            if status is not None and status["episode_unsaved"] == episode - 1:
                note += "; it is kept in memory and tried again at the next reset"
            self._error("cache_reset", note)
        elif recorded is not None:
            note = f"episode {episode - 1} recorded as library episode {recorded}"
            self.get_logger().info(note)
        elif self._discarded == episode - 1:
            note = f"episode {episode - 1} was discarded, not recorded"
        elif status is not None and status["last_episode_excluded"]:  # e.g. its task changed midway
            note = f"episode {episode - 1} was not recorded: {status['last_episode_excluded']}"
        else:
            note = ""
        self.get_logger().info(f"episode {episode} starts")
        self._publish_cache_status()  # the library grew: say so now, not a status period later
        if self._worker is not None and self.cfg is not None and self.cfg.cache.enabled:
            self._refill.set()  # the worker refills the window for the next episode's first calls
            self._wake.set()
        return episode, note, True

    def _keep_out_if_short(self, policy: Any) -> None:
        """At a reset, under the policy lock: an episode whose calls' observations span less than
        min_episode_s is kept out of the library (a reset sent over and over: `ros2 topic pub` without
        --once; found in review, its 1 s fragments evicted the library's episodes). The reset's reply and
        log say why (the runtime's exclusion); /diagnostics counts them (`cache.episodes_too_short`)."""
        cfg, stamps = self.cfg, self._episode_stamps
        if cfg is None or not cfg.cache.enabled or not cfg.min_episode_s or stamps is None:
            return
        # only an episode that would be recorded (found in review: a cached one's reply lost its own reason)
        if not policy.cache_would_record():
            return
        span = (stamps[1] - stamps[0]) / 1e9
        if span >= cfg.min_episode_s:
            return
        reason = (
            f"its calls' observations span {span:.2f} s, under min_episode_s {cfg.min_episode_s:g} s (a reset "
            "sent over and over? `ros2 topic pub` needs --once)"
        )
        try:
            if policy.discard_episode(reason):
                with self._stats_lock:
                    self.episodes_too_short += 1
        except Exception as e:  # the reset goes on (its recording is then the runtime's to decide)
            self._error("cache_reset", f"{type(e).__name__}: {e}")

    def discard_episode(self) -> tuple[bool, str]:
        """Keep the episode in progress out of the cache's library: an operator's (or a success
        detector's) word that this attempt failed, so that the cell does not learn it. Its calls so far are
        dropped and later ones are not recorded; the next reset starts recording again. Returns whether
        there was a cache to keep it out of, and what happened (the service's reply)."""
        if not self._lock_policy():
            with self._stats_lock:
                episode = self.episode_id
            self._error("discard", f"episode {episode} was not discarded: {self._busy()}")
            return False, f"episode {episode} was not discarded: {self._busy()}"
        try:
            policy = self.policy
            with self._stats_lock:
                episode = self.episode_id
            if policy is not None:
                self._end_if_device_lost(policy, f"found before the discard of episode {episode}")
            if policy is None or not policy.discard_episode("discarded on ~/discard_episode"):
                return False, f"episode {episode}: no cache to keep it out of"
            with self._stats_lock:
                self.episodes_discarded += self._discarded != episode
                self._discarded = episode
        finally:
            self._policy_lock.release()
        # the log has it from the runtime, with the reason (the reply is the caller's word)
        return True, f"episode {episode} will not be recorded into the library"

    def _on_discard_service(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        response.success, response.message = self.discard_episode()
        return response

    def _on_reset_service(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        # The episode did reset even if its recording failed (that is logged and counted on /diagnostics).
        episode, note, response.success = self._start_episode()
        response.message = f"episode {episode}" + (f" ({note})" if note else "")
        return response

    # ── inference worker ─────────────────────────────────────────────────────────────────────────────────

    def _on_tick(self) -> None:
        now = time.monotonic()
        with self._tick_lock:
            self._tick_at = now
            if self._tick_waiting_since is None:
                self._tick_waiting_since = now
            else:  # the worker still runs a job (a call, a rebuild part) past a period
                with self._stats_lock:
                    self.ticks_merged += 1
                    self._merged_at.append(now)
            self._tick.set()
        sys.setswitchinterval(WAKE_SWITCH_INTERVAL_S)  # the worker gets the GIL soon (see the constant)
        self._wake.set()

    def _take_tick(self) -> float | None:
        """The worker takes the due observation's tick: how long the oldest tick waited (s), None if none
        was due."""
        with self._tick_lock:
            since, self._tick_waiting_since = self._tick_waiting_since, None
            self._tick.clear()
        if since is None:
            return None
        self._tick_taken_since = since
        waited = time.monotonic() - since
        cfg = self.cfg
        if cfg is not None and waited >= cfg.stall_after_s:
            with self._stats_lock:
                self.stalls += 1
            self.get_logger().warning(
                f"the inference worker took a tick after {waited:.1f} s (stall_after_s {cfg.stall_after_s:g}); "
                "it runs again"
            )
        self._stall_logged = False
        return waited

    def _watch_for_stalls(self) -> None:
        """The stall watchdog's loop: once the worker has kept a tick waiting, or a reset (which records into
        the library) or a deactivation or shutdown waiting for the worker has run, exit_after_stall_s (> 0),
        say so (fatal log, stderr with every thread's stack, /diagnostics) and end the process for a
        supervisor to start it again. The node cannot end a hung CUDA call or disk write, and everything
        else waits for them: this thread does not."""
        asked = resumed = time.monotonic()
        while not self._watchdog_stop.wait(WATCHDOG_PERIOD_S):
            now = time.monotonic()
            late, asked = now - asked - WATCHDOG_PERIOD_S, now
            if late > WATCHDOG_LATE_S:  # paused, or starved: what held the node counts from now on
                resumed = now
                continue
            cfg = self.cfg
            limit = cfg.exit_after_stall_s if cfg is not None else 0.0
            held = self._stalled_past(limit, now, resumed) if limit else None
            if held is not None:
                self._end_stalled(*held, limit)
                return

    def _stalled_past(self, limit: float, now: float, resumed: float) -> tuple[str, str] | None:
        """What has held the node `limit` seconds or more, counted from `resumed` at the earliest (a pause
        of the process is no stall), and what it was doing; None if nothing. A reset first, since ticks
        then wait for its lock; then a deactivation or shutdown waiting for the worker; then a tick."""
        resetting, stopping, waiting = self._resetting_since, self._stopping_since, self._tick_waiting_since
        worker = f"in {self._doing or 'nothing'}"
        if resetting is not None and now - max(resetting, resumed) >= limit:
            cache = self.cfg is not None and self.cfg.cache.enabled
            doing = (
                "recording the finished episode into the library, refilling the window"
                if cache
                else "starting the next episode"
            )
            return f"an episode reset has run {now - resetting:.1f} s", doing
        if stopping is not None and now - max(stopping, resumed) >= limit:
            return (
                f"a deactivation or shutdown has waited {now - stopping:.1f} s for the inference worker",
                worker,
            )
        if waiting is not None and now - max(waiting, resumed) >= limit:
            return f"a tick has waited {now - waiting:.1f} s for the inference worker", worker
        return None

    def _end_stalled(self, what: str, doing: str, limit: float) -> None:
        """Say what held the node (fatal log; stderr, with every thread's stack; a last /diagnostics), then
        end the process with SUPERVISOR_EXIT_STATUS."""
        self._end_for_supervisor(f"inference stalled: {what} ({doing}; exit_after_stall_s {limit:g})")

    def _lose_device(self, fault: str, found: str, *, drop: bool = False) -> None:
        """The GPU's CUDA context is lost (`fault`, what `device_fault` raised; `found`, how the node came to
        ask): no call can run in this process again, and only a new process gets a working context. With
        `drop` (a tick's call raised) the tick is a `device_lost` drop. The process ends now, whatever
        exit_after_stall_s, saying why as the stall exit does (status 70, for a supervisor to start it
        again): a node kept up could not even be cleaned up or shut down, since
        letting the model go on a lost context aborts the process (PyTorch's allocator raises from a
        destructor: SIGABRT, measured on an H100), nor could the episode in progress be recorded, its
        states being on the GPU."""
        lost = f"the GPU's CUDA context is lost ({fault}; {found})"
        if drop:
            self._drop(DropReason.DEVICE_LOST, lost)
        self._end_for_supervisor(
            f"{lost}: no call can run in this process again, only a new process gets a working GPU"
        )

    def _end_if_device_lost(self, policy: Any, found: str, *, wait_all: bool = False) -> None:
        """End the process as after a call (`_lose_device`) if the policy's GPU context is lost. Asked
        before a reset, a discard, a cleanup or a failed configure lets go of the episode's (or the
        model's) GPU states, and after a motion-window job raised: a context lost since the last call (a
        fault in a rebuild, or outside the node's work: an uncorrectable ECC error, a GPU fallen off the
        bus) shows first there, and letting those states go on it aborts the process
        (`bench/probe_lost_gpu.py`: discard, close) before anything said why. `found` says where, for the
        message. Without `wait_all` the check waits for no stream but its own (`Policy.device_fault`), so
        that a hung stream cannot hang a reset or a cleanup, which no watchdog covers everywhere. Under
        the policy lock; nothing on a CPU."""
        fault = policy.device_fault(wait_all=wait_all)
        if fault is not None:
            self._lose_device(fault, found)

    def _end_for_supervisor(self, why: str) -> None:
        """Say why the node cannot go on (fatal log; stderr, with every thread's stack; a last /diagnostics),
        then end the process with SUPERVISOR_EXIT_STATUS for its supervisor to start it again: the stall exit and
        a lost GPU (`_lose_device`)."""
        arm_exit_backstop(EXIT_BACKSTOP_S)  # first: if saying why blocks, the process still ends
        with self._stats_lock:
            calls = self.chunk_id
            episode = self.episode_id
        said = (
            f"{why}: ending the process with status {SUPERVISOR_EXIT_STATUS} for its supervisor to start it again; "
            f"episode {episode} ({calls} chunk(s) published) is not recorded, and the library on disk stays "
            "as it was"
        )
        try:  # what an operator watching /diagnostics sees last; the exit goes ahead whatever this raises
            array_msg = self._diagnostics()
            status = array_msg.status[0]
            status.level, status.message = DiagnosticStatus.ERROR, f"ending the process: {said}"
            self._diag_pub.publish(array_msg)
        except Exception as e:
            said += f" (its last /diagnostics could not be published: {type(e).__name__}: {e})"
        self.get_logger().fatal(said)
        # also from Python, flushed by end_process: the console logger's stream may be buffered
        # (RCUTILS_LOGGING_BUFFERED_STREAM), and os._exit flushes no C stream. With every thread's stack:
        # where the worker (or the executor) hung.
        print(f"{self.get_name()}: {said}; the threads' stacks follow", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        time.sleep(0.2)  # the log line and /diagnostics leave over DDS
        end_process(SUPERVISOR_EXIT_STATUS)

    def stalled_s(self) -> float:
        """How long the oldest tick not yet taken by the worker has waited (0: none waits)."""
        since = self._tick_waiting_since
        return time.monotonic() - since if since is not None else 0.0

    def _stored(self, first: bool, kind: str) -> None:
        """A sensor message of `kind` ("image:<slot>" or "joints") was stored. One that brought a camera's first
        frame or a joint's first position wakes the worker while a start-up tick waits for the first
        messages (`_start_wait`); one of the kind that can cure a tick's timing refusal, while that tick
        waits for a later message (`_late`: not every message, found in review: at an ALOHA's ~600 messages
        a second each retry copied every joint's history; nor every camera's frame while one camera is
        stale, found in review: ~30 futile reads a tick at 2 × 60 fps)."""
        self._stored_counts[kind] += 1
        late = self._late
        if (first and self._start_wait.is_set()) or (late is not None and late.latest.cure == kind):
            self._wake.set()

    def _retry_if_stored(self, seen: dict[str, int]) -> None:
        """The worker has just set `_late`: a message of its cure's kind stored after the try's buffer read
        (`seen`, the counts then) found no tick waiting and woke nothing, so wake the retry now (found in
        review: it waited for the next such message, or until the window's end)."""
        late = self._late
        if late is not None and self._stored_counts.get(late.latest.cure, 0) != seen.get(late.latest.cure, 0):
            self._wake.set()

    def _inference_loop(self) -> None:
        while True:
            self._doing = ""
            late = self._late
            self._wake.wait(None if late is None else max(0.0, late.until - time.monotonic()))
            self._wake.clear()
            sys.setswitchinterval(self._switch_interval_s)
            if self._stop.is_set():
                return
            try:
                if self._take_tick() is not None:
                    self._refill.clear()  # the call's own motion window follows it
                    self._end_late_tick()  # a tick still waiting for a later message is a drop now
                    self._doing = "a call"
                    self._infer_once()
                elif self._start_wait.is_set():
                    self._doing = "a start-up retry"
                    self._infer_once(kind="startup")
                elif self._late is not None:
                    self._doing = "a retry on a later message"
                    self._infer_once(kind="late")
                elif self._refill.is_set():
                    self._refill.clear()
                    self._doing = "the refill after a reset or an activation"
                    self._refill_for_next_episode()
            except Exception as e:  # nothing may end the worker: the node would look alive and be silent
                self._error("worker", f"{type(e).__name__}: {e}")
                if self._doing in TICK_JOBS:  # the tick gave no chunk: counted toward ERROR (found in review)
                    self._late = None
                    self._drop(DropReason.INFERENCE_ERROR, f"the worker raised {type(e).__name__}: {e}")

    def _refill_for_next_episode(self) -> None:
        """A motion window right after an episode reset, or an activation: the window is refilled with the
        first calls of the episodes the next one will likely repeat (RMuscle._episode_starts; after an
        activation mid-episode, the calls that episode will likely make next), so that its first call
        can be served cached. It stops once the next observation is due, but starts parts without the
        latest part times' estimate: the first call gains from them directly (a cached call instead of a
        dense one, 2-3 ms less at `pi05` on the H200: bench_policy, the node's soaks), and waits at most
        for the part in flight (~2 ms there).
        A replay whose clock stops between episodes (the demo's bags) refills here too: nothing falls
        due while the clock stands still, which the estimate cannot know."""
        cfg, policy = self.cfg, self.policy
        if cfg is not None and policy is not None and cfg.cache.enabled:
            self._rebuild_cache(policy, estimate=False)

    def _end_late_tick(self) -> None:
        """A tick waiting for a later message (`_late`) that none served: its drop, with the latest reason."""
        late, self._late = self._late, None
        if late is not None:
            self._drop(late.latest.reason, late.latest.detail)

    def _infer_once(self, kind: str = "tick") -> None:
        """One call on the latest observation: at a tick; when a sensor a start-up tick waited for has sent
        its first message (`startup`: one that still finds no observation is not a drop, the next tick says
        what is missing, unless it was refused for timing: then it waits as a tick does); or when a message
        came while a tick's observation, refused for its timing, waits for a later one (`late`:
        LATE_REASONS, until LATE_RETRY_SHARE of the period after the tick)."""
        # loaded at configure: a dict lookup
        from rmuscle_ros.runtime.policy import NonFiniteActions, first_line

        cfg, buffer, policy = self.cfg, self._buffer, self.policy
        if cfg is None or buffer is None or policy is None:
            return
        # The buffer is read under the policy lock, as an episode reset clears it: an observation read
        # before a reset never becomes the next episode's first call.
        with self._policy_lock:
            # and the settings too, which a parameter change replaces under it: read before, a call could
            # run the replaced prompt with the new limits (found in review)
            cfg = self.cfg
            if cfg is None:
                return
            now_ns = self.get_clock().now().nanoseconds
            tick_at, oldest = self._tick_at, self._tick_taken_since
            if kind == "tick":
                self._read_clock_rate()
                # What held the call back (motion-window work, a reset), from the oldest tick it serves
                # (found in review: from the latest)
                if oldest is not None:
                    with self._stats_lock:
                        self._tick_waits_ms.append((time.monotonic() - oldest) * 1e3)
            starting = time.monotonic() - self._activated_at < cfg.sensor_startup_timeout_s
            if starting:  # set before the buffer is read: a first message from then on wakes a retry
                self._start_wait.set()
            seen = dict(self._stored_counts)
            try:
                obs = buffer.observation(now_ns, cfg.prompt, cfg.model.cameras)
            except ObservationUnavailable as e:
                # A wait, not a drop: retried when a sensor's first message comes.
                if starting and e.reason in STARTUP_REASONS:
                    self._late = None  # an episode reset emptied the buffer meanwhile
                    self._wait_for_sensor(e.detail)
                    return
                self._start_wait.clear()
                if kind == "startup" and e.reason not in LATE_REASONS:
                    return
                self._wait_for_sensor("")
                # A tick's first refusal for timing, or a start-up retry's once the last sensor came up
                # (its frames may be a frame period apart: the window counts from then)
                since = tick_at if kind == "tick" else time.monotonic() if kind == "startup" else None
                if e.reason in LATE_REASONS and since is not None:
                    period = cfg.actions_per_inference * cfg.control_period_s
                    # in wall seconds, as `since` is: a /clock faster than real time (a bag at --rate 2)
                    # leaves less (found in review: the window outlasted the period at 2x)
                    until = since + self._clock_rate.wall_s(LATE_RETRY_SHARE * period)
                    self._late = _LateTick(since, until, first=e, latest=e)
                    self._retry_if_stored(seen)
                    return
                late = self._late
                if e.reason in LATE_REASONS and late is not None and time.monotonic() < late.until:
                    self._late = dataclasses.replace(late, latest=e)
                    self._retry_if_stored(seen)
                    return
                self._late = None
                self._drop(e.reason, e.detail)
                return
            late, self._late = self._late, None  # counted as served with its chunk, before it goes out
            self._start_wait.clear()
            self._wait_for_sensor("")
            self._note_image_sizes(obs.images)
            try:
                chunk = policy.infer(obs)
            except NonFiniteActions as e:  # never published: a robot must not get NaN or Inf targets
                self._drop(DropReason.BAD_ACTIONS, str(e))
                return
            except Exception as e:  # the hot path logs, counts and keeps the node alive
                fault = policy.device_fault()  # unless the GPU's context went with the call
                if fault is not None:
                    self._lose_device(fault, f"the call raised {first_line(e)}", drop=True)
                else:  # one line: PyTorch's CUDA errors carry lines of advice, no place for them in /diagnostics
                    self._drop(DropReason.INFERENCE_ERROR, first_line(e))
                return
            stamps, t = self._episode_stamps, obs.stamp_ns  # the episode's length so far (min_episode_s)
            self._episode_stamps = (t, t) if stamps is None else (min(stamps[0], t), max(stamps[1], t))
            if chunk.prompt_truncated:  # the model never saw the state: not for a robot (prompt_too_long)
                self._drop(
                    DropReason.PROMPT_TRUNCATED,
                    f"the prompt took {chunk.prompt_tokens} tokens with this state, more than the model takes: "
                    "the state was cut off",
                )
                return
            # The cache's status goes with its chunk (found in review: refreshed only at the motion window's
            # end, a chunk published cached sat beside a status saying dense, its hit rate not counting it):
            # the call's part, read without the disk (not cache_status(), which reads the library's free
            # space: a disk error there dropped every chunk, found in review); the rest at the window's end
            call_status = policy.cache_call_status()
            with self._stats_lock:
                # Stopping (a deactivation or shutdown waits for this call): the chunk is not published, so
                # nothing counts it, nor takes its id (found in review: it was counted, and the episode's
                # next published chunk, after an activation, skipped its id). Decided here, once: a chunk
                # counted below is published, on publishers kept active until the worker has ended.
                if self._stop.is_set():
                    return
                if call_status is not None and self.cache_status is not None:
                    self.cache_status = self.cache_status | call_status
                episode, chunk_id = self.episode_id, self.chunk_id
                self.chunk_id += 1
                outage = (self._failing_ticks, self._last_drop) if self._outage_logged else None
                self._failing_ticks, self._outage_logged = 0, False
                latency_ms = chunk.latency_s * 1e3
                self.latencies_ms.append(latency_ms)
                self._preprocess_ms.append(chunk.timings_s.get("preprocess", 0.0) * 1e3)
                by_mode = self._latencies_by_mode.setdefault(chunk.cache_mode, deque(maxlen=LATENCY_WINDOW))
                by_mode.append(latency_ms)
                wall = time.monotonic()
                # rate_hz_clock counts from a bag played again, or the next bag of a set (found in review:
                # a jump ahead read as 0.0 Hz until 200 chunks had gone by)
                if self._chunk_clock_ns:
                    clock_step_s = (now_ns - self._chunk_clock_ns[-1]) * 1e-9
                    if clock_jumped(clock_step_s, wall - self._chunk_times[-1]):
                        self._chunk_clock_ns.clear()
                self._chunk_times.append(wall)
                self._chunk_clock_ns.append(now_ns)
                call = _call_breakdown(chunk, latency_ms, episode, chunk_id)
                if len(self._slowest) < SLOWEST_KEPT or latency_ms > self._slowest[-1]["ms"]:
                    self._slowest = sorted([*self._slowest, call], key=lambda c: -c["ms"])[:SLOWEST_KEPT]
                recent = list(self.latencies_ms)
                # counted with its chunk, before it is out (found in CI: a reader of the stats that had the
                # chunk could find the tick not yet counted as served)
                late_count = 0
                if late is not None:
                    self.late_served[late.first.reason.value] += 1
                    late_count = self.late_served[late.first.reason.value]
        # The tick has its chunk (counted above): an error from here on is not that tick's drop (TICK_JOBS).
        self._doing = "publishing a chunk"
        self._publish_chunk(cfg, chunk, episode, chunk_id)
        if outage is not None:  # the outage's start was logged: so is its end
            self.get_logger().info(
                f"chunks again after {outage[0]} tick(s) without one (the last: {outage[1]})"
            )
        if late is not None:
            self._log_served_late(late, late_count)
        self._log_if_slow(call, recent)
        if cfg.cache.enabled and not self._stop.is_set():  # stopping: the deactivation waits for no audit
            self._doing = "an audit"
            self._audit_cache(cfg, policy, episode)
            self._doing = "a rebuild part"
            self._rebuild_cache(policy)

    def _log_if_slow(self, call: dict[str, Any], recent: list[float]) -> None:
        """A warning for a call far slower than the latest calls' median, saying where its time went: on
        a GPU, its GPU span against the rest (host work, and waiting to start)."""
        if len(recent) < SLOW_CALL_MIN_CALLS:
            return
        p50 = statistics.median(recent)
        if call["ms"] > max(SLOW_CALL_FACTOR * p50, p50 + SLOW_CALL_MARGIN_MS):
            self.get_logger().warning(
                f"slow call: {describe_call(call)}; the latest {len(recent)} calls' p50 {p50:.1f} ms",
                throttle_duration_sec=5.0,
            )

    def _audit_cache(self, cfg: NodeConfig, policy: Any, episode: int) -> None:
        """The motion window's first job when the chunk just published came from a cached call due for an
        audit (`cache.audit_every`): the same call again dense, and the cached chunk's error against it
        (Policy.audit_cache). It goes before the rebuilds because the next call overwrites the inputs it
        runs on. It is skipped when the next observation is due, when the latest audits' times say it
        would end after that (as for a rebuild part), or when a reset, a parameter set or a discard waits
        for the policy (it goes first, as in a window; checked again once the lock is held, for one that
        came meanwhile); the next cached call is then audited instead, and the cache status counts it
        missed at that call (the node's status shows it after that call's window). An error above
        `cache.audit_max_error` sends the rest of the episode dense, and the node says so."""
        if self._lock_wanted.is_set():
            return
        with self._policy_lock:
            if (
                self._lock_wanted.is_set()
                or not policy.cache_audit_due()
                or self._next_call_too_close(durations=self._audit_s)
            ):
                return
            try:
                audit = policy.audit_cache()
            except Exception as e:  # an audit that fails costs its measurement, not the node
                from rmuscle_ros.runtime.policy import first_line  # loaded since configure

                self._end_if_device_lost(policy, f"found when an audit raised {first_line(e)}", wait_all=True)
                self._error("cache_audit", f"{type(e).__name__}: {e}")
                return
            if audit is not None:
                self._audit_s.record(time.monotonic(), audit.seconds, overran=self._tick.is_set())
        if audit is not None and audit.tripped:
            self.get_logger().warning(
                f"episode {episode}: an audit found a cached chunk {audit.error:.4f} from the same call run "
                f"dense (cache.audit_max_error {cfg.cache.audit_max_error}; served from library "
                f"episode {audit.episode}, call {audit.position}): dense for the rest of the episode"
            )

    def _rebuild_cache(self, policy: Any, estimate: bool = True) -> None:
        """The motion window: refill rMuscle's entries for the next calls while the arm executes.

        One part of an entry at a time (an entry is rebuilt in `cache.rebuild_slices` parts), each waited
        for, until `cache.rebuilds_per_tick` entries are complete; no part once the next observation is
        due (the inference timer has fired), nor one that would not be done before it is (the longest of
        the latest parts' build times against the timer's time left). An entry cut short there goes on in
        the next window. A live call so waits for nothing while the estimate holds, and for at most the
        part in flight when it does not (~2 ms at full size on an H200; a whole entry is ~8), never for a
        queue of them. An entry costs more GPU time than a cached call saves (`pi05` on the H200: 8 ms
        against ~1.8), so rebuilding only pays in time the node would otherwise idle; a node whose
        period is shorter than its calls rebuilds nothing, and the diagnostics'
        `cache.rebuilds_deferred` says so. `estimate=False` (the reset's window) stops only once the
        observation is due."""
        cfg = self.cfg
        if cfg is None:
            return
        entries = 0
        for _ in range(cfg.cache.rebuilds_per_tick * cfg.cache.rebuild_slices):
            if self._lock_wanted.is_set():  # a reset, parameter or discard waits: it goes first
                break
            with self._policy_lock:
                try:
                    if self._next_call_too_close(estimate):  # what is still wanted waits for the next window
                        deferred = policy.cache_entries_missing()
                        with self._stats_lock:
                            self.rebuilds_deferred += deferred
                        break
                    start = time.monotonic()
                    queued, finished = policy.rebuild_cache_slice(wait=True)
                    if queued:
                        now = time.monotonic()
                        self._rebuild_s.record(now, now - start, self._tick.is_set(), estimated=estimate)
                except Exception as e:  # a failed rebuild only costs cache hits; the next call runs dense
                    from rmuscle_ros.runtime.policy import first_line  # loaded since configure

                    found = f"found when a rebuild raised {first_line(e)}"
                    self._end_if_device_lost(policy, found, wait_all=True)
                    self._error("cache_rebuild", f"{type(e).__name__}: {e}")
                    break
            if not queued:
                break
            entries += finished
            with self._stats_lock:
                self.rebuilds += finished
            if entries >= cfg.cache.rebuilds_per_tick:
                break
        # The full status, which reads the library's disk (a disk that hangs holds the worker here, and a
        # reset or parameter set waiting for the lock times out after stall_after_s); stored under the
        # policy lock: released first, a reset could store the next episode's status in between, and
        # this one replaced it (found in review)
        with self._policy_lock:
            try:
                status = policy.cache_status()
            except Exception as e:  # the last one stands; the chunks go on
                self._error("cache_status", f"{type(e).__name__}: {e}")
                return
            with self._stats_lock:
                self.cache_status = status

    def _next_call_too_close(self, estimate: bool = True, durations: JobTimes | None = None) -> bool:
        """Whether the next observation is due (the inference timer has fired, or the node is stopping),
        or, with `estimate`, will be before another job is done (`durations`, rebuild parts' by default:
        the longest of their recent times, see job_times.py). Those times are wall-clock, as is the time
        left (`_time_to_next_call_s`)."""
        if self._tick.is_set() or self._stop.is_set():
            return True
        if not estimate:
            return False
        jobs = self._rebuild_s if durations is None else durations
        return jobs.too_long(time.monotonic(), self._time_to_next_call_s())

    def _time_to_next_call_s(self) -> float | None:
        """Wall seconds until the inference timer next fires, None without one. The timer runs on
        spin.periodic_timer's clock: with use_sim_time that is /clock, whose seconds are turned into wall
        seconds at the rate it has run lately (job_times.ClockRate: a bag played at `--rate 2` leaves half
        the wall time its clock says)."""
        timer = self._infer_timer
        left = timer.time_until_next_call() if timer is not None else None
        if left is None:
            return None
        self._read_clock_rate()
        return self._clock_rate.wall_s(left * 1e-9)

    def _read_clock_rate(self) -> None:
        """With the inference timer on /clock (use_sim_time), a reading for `_clock_rate` (the worker's, at
        each tick and motion window); nothing on the steady clock, whose seconds are wall seconds."""
        timer = self._infer_timer
        if timer is not None and timer.clock.clock_type == ClockType.ROS_TIME:
            self._clock_rate.read(time.monotonic(), timer.clock.now().nanoseconds)

    def _error(self, kind: str, detail: str) -> None:
        with self._stats_lock:
            self.errors[kind] += 1
            count = self.errors[kind]
        # Throttled like the drops (a broken disk must not flood the log), but for a recording's: one an
        # episode at most, each a recording not in the library (found in review: the 2nd to the 49th went
        # unlogged, and a reset sent on the topic has no reply to say it)
        if count == 1 or count % 50 == 0 or kind in ("cache_reset", "cache_close"):
            self.get_logger().error(f"{kind} error ({count}x): {detail}")

    def _note_image_sizes(self, images: Any) -> None:
        """Each camera's frame size (W×H), logged when first seen since activation and when it changes, and
        kept for /diagnostics (`image_size.<slot>`): the policy letterboxes any aspect to its square input
        without a word, so a camera on another profile than the training data's (ALOHA recorded 640×480)
        is seen here (found in review). Changes are counted (`image_size_changes.<slot>`) and logged like the
        drops, the first and every 50th: frames of two sizes in turn (two drivers on one topic) logged one
        warning a tick (found in review)."""
        for slot, rgb in images.items():
            size = f"{rgb.shape[1]}x{rgb.shape[0]}"
            held = self._image_sizes.get(slot)
            if held == size:
                continue
            with self._stats_lock:
                self._image_sizes[slot] = size
                if held is not None:
                    self._image_size_changes[slot] += 1
                changes = self._image_size_changes[slot]
            if held is None:
                self.get_logger().info(f"camera {slot}: {size} frames")
                if _grey(rgb):
                    self.get_logger().warning(
                        f"camera {slot}: its first frame is grey (every pixel's three channels equal: a mono "
                        "camera or encoding, mono8 replicated, or the driver's colour off); a policy trained "
                        "on colour frames gets none from it"
                    )
            elif changes == 1 or changes % 50 == 0:
                self.get_logger().warning(
                    f"camera {slot}: frames changed from {held} to {size}"
                    + (
                        f" ({changes} changes since activation: two publishers on its topic?)"
                        if changes > 1
                        else ""
                    )
                )

    def _log_served_late(self, late: _LateTick, count: int) -> None:
        """A tick refused for its messages' timing that a later message served (counted with its chunk in
        stats `late_served`, /diagnostics): logged, throttled like the drops."""
        waited_ms = (time.monotonic() - late.tick_at) * 1e3
        if count == 1 or count % 50 == 0:
            self.get_logger().info(
                f"a tick's observation was refused ({late.first}); a message {waited_ms:.0f} ms after the tick "
                f"served it ({count}x)"
            )

    def _wait_for_sensor(self, detail: str) -> None:
        """Set what the node is waiting for during start-up ("": nothing). A tick that waits for a sensor's
        first message is not a drop; the wait is logged once per sensor."""
        if detail == self.waiting_for:
            return
        with self._stats_lock:
            self.waiting_for = detail
        if detail:  # after a reset too: a camera out since before it is named here, then as a drop
            self.get_logger().info(f"waiting for the first messages since the {self._waits_since}: {detail}")

    def _drop(self, reason: DropReason, detail: str) -> None:
        now = time.monotonic()
        with self._stats_lock:
            self.drops[reason.value] += 1
            count = self.drops[reason.value]
            said = False
            # an outage starts: said, unless one was just now (a flapping source)
            if self._failing_ticks == 0:
                said = self._outage_logged = now - self._outage_logged_at >= OUTAGE_LOG_INTERVAL_S
                if said:
                    self._outage_logged_at = now
            self._failing_ticks += 1
            self._last_drop = f"{reason.value}: {detail}"
        # Each outage's start at warn level (found in review: only the first drop of a reason since activation
        # was, so a camera that died later went unnamed), the first of a reason, then every 50th.
        if said or count == 1 or count % 50 == 0:
            self.get_logger().warning(f"no chunk ({reason.value}, {count}x): {detail}")

    def _publish_chunk(self, cfg: NodeConfig, chunk: Any, episode: int, chunk_id: int) -> None:
        from rmuscle_ros.msg import ActionChunk

        msg = ActionChunk()
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(chunk.stamp_ns, 1_000_000_000)
        msg.header.frame_id = ""
        msg.episode_id, msg.chunk_id = episode, chunk_id
        msg.joint_names = list(cfg.action_joint_names)
        msg.horizon, msg.action_dim = (int(n) for n in chunk.actions.shape)
        msg.control_period_s = cfg.control_period_s
        flat = array.array("f")  # assigning a numpy array to a sequence field is ~100x slower
        flat.frombytes(np.ascontiguousarray(chunk.actions, dtype=np.float32).tobytes())
        msg.actions = flat
        msg.inference_latency_s = chunk.latency_s
        msg.cache_mode = self._modes[chunk.cache_mode]
        msg.cache_similarity = chunk.cache_similarity
        self._chunk_pub.publish(msg)
        if self._trajectory_pub is not None:
            traj = JointTrajectory()
            traj.header = msg.header
            traj.joint_names = msg.joint_names
            for i, row in enumerate(chunk.actions):
                point = JointTrajectoryPoint()
                point.positions = row.astype(np.float64).tolist()
                # Row i is due i periods after the observation (the header's stamp), as ActionChunk.msg and
                # the streamer execute it; (i + 1) put the trajectory a period behind (found in review).
                point.time_from_start.sec, point.time_from_start.nanosec = divmod(
                    round(i * cfg.control_period_s * 1e9), 1_000_000_000
                )
                traj.points.append(point)
            self._trajectory_pub.publish(traj)

    # ── diagnostics ──────────────────────────────────────────────────────────────────────────────────────

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            lat = list(self.latencies_ms)
            pre = list(self._preprocess_ms)
            waits = list(self._tick_waits_ms)
            by_mode = {mode: statistics.median(v) for mode, v in self._latencies_by_mode.items() if v}
            times = list(self._chunk_times)
            clock_ns = list(self._chunk_clock_ns)
            drops = dict(self.drops)
            late_served = dict(self.late_served)
            image_sizes = dict(self._image_sizes)
            image_size_changes = dict(self._image_size_changes)
            slowest = [dict(c) for c in self._slowest]
            chunks = self.chunk_id
            cache = dict(self.cache_status) if self.cache_status is not None else None
            if cache is not None:
                cache |= {"rebuilds": self.rebuilds, "rebuilds_deferred": self.rebuilds_deferred,
                          "episodes_discarded": self.episodes_discarded,
                          "episodes_too_short": self.episodes_too_short,
                          # motion-window jobs (rebuild parts, audits) that delayed a call: still running
                          # when its observation fell due
                          "window_overruns": self._rebuild_s.overruns + self._audit_s.overruns}  # fmt: skip
            errors = dict(self.errors)
            waiting_for = self.waiting_for
            failing, last_drop = self._failing_ticks, self._last_drop
            stalls, merged = self.stalls, self.ticks_merged
            now = time.monotonic()
            merged_lately = sum(1 for t in self._merged_at if now - t < MERGED_WARN_S)
        rate, rate_clock = _per_second(times), _per_second(clock_ns, unit_s=1e-9)
        p50, p99 = _p50_p99(lat)
        pre_p50, pre_p99 = _p50_p99(pre)
        return {
            "rate_hz": rate,  # chunks per wall second
            "rate_hz_clock": rate_clock,  # per second of the node's clock (use_sim_time: /clock's)
            "latency_p50_ms": p50,
            "latency_p99_ms": p99,
            "latency_p50_ms_by_mode": by_mode,  # dense / cached / fallback, over the latest calls of each
            "preprocess_p50_ms": pre_p50,
            "preprocess_p99_ms": pre_p99,
            # from a tick to its observation being read: a rebuild part or audit in flight, a reset, the GIL
            "tick_wait_p50_ms": statistics.median(waits) if waits else 0.0,
            "tick_wait_max_ms": max(waits, default=0.0),
            # a tick waiting for the worker right now (s; 0: none), and ticks that waited past stall_after_s
            "stalled_s": self.stalled_s(),
            "stalling": self._doing,  # what the worker is running meanwhile
            "stalls": stalls,
            "ticks_merged": merged,  # since activation: ticks served by the call of an earlier one
            "ticks_merged_lately": merged_lately,  # of those, in the latest MERGED_WARN_S
            "gc_pause_max_ms": self._gc.longest_ms,  # since activation: every thread stood still this long
            "gc_full_collections": self._gc.full_collections,
            # since activation, slowest first: ms, mode, episode, chunk, preprocess_ms, gpu_ms (None off a GPU)
            "slowest_calls": slowest,
            "chunks": chunks,
            "drops": drops,
            # since activation, by reason: ticks refused for their messages' timing that a later message
            # served within LATE_RETRY_SHARE of the period (a chunk, later; not a drop)
            "late_served": late_served,
            "image_sizes": image_sizes,  # camera slot -> its latest frame's WxH, since activation
            "image_size_changes": image_size_changes,  # camera slot -> how often its size changed since
            "cache": cache,  # the latest call's part, the rest from the latest window, reset or configure
            "errors": errors,
            "waiting_for": waiting_for,  # a sensor not heard from yet, within sensor_startup_timeout_s
            "failing_ticks": failing,  # ticks in a row without a chunk, up to now
            "last_drop": last_drop,  # the latest drop's reason and detail ("" = none since activation)
        }

    def _publish_diagnostics(self) -> None:
        self._diag_pub.publish(self._diagnostics())

    def _input_publishers(self) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        """While active, from the ROS graph: (each camera or joint-state topic with more than one publisher,
        and their nodes; each one whose publishers all send another type than the node takes, and those
        types).
        - Several publishers: the node takes each message as it comes, so two sources on one topic (a bag
          player left running beside the camera driver, a joint_state_publisher beside the arm's driver)
          mix in its observations (found in review: nothing said so).
        - Another type: nothing arrives, and the ticks only said `missing_camera: no image yet` (found in
          review: `compressed_images` set while a camera's topic carries raw images, or the reverse)."""
        if not self._subs or self.cfg is None:
            return {}, {}
        cameras = len(self.cfg.camera_inputs)
        image_type = "sensor_msgs/msg/" + ("CompressedImage" if self.cfg.compressed_images else "Image")
        crowded, mistyped = {}, {}
        for i, topic in enumerate(self._input_topics):
            publishers = self.get_publishers_info_by_topic(topic)
            if len(publishers) > 1:
                crowded[topic] = sorted(node_full_name(p.node_name, p.node_namespace) for p in publishers)
            wanted = image_type if i < cameras else "sensor_msgs/msg/JointState"
            types = sorted({p.topic_type for p in publishers})
            if types and wanted not in types:
                mistyped[topic] = [*types, wanted]
        return crowded, mistyped

    def _say_per_topic(
        self, status: DiagnosticStatus, said: dict[str, str], why: str, logged: set[str], error: bool
    ) -> None:
        """What is wrong with each input topic (`said`) and what that means (`why`), put before the
        diagnostics' message; each topic logged once while active (`logged`), as an error or a warning."""
        status.message = f"{'; '.join(said.values())}: {why}; " + status.message
        for topic in said.keys() - logged:
            logged.add(topic)
            # one call site per severity: rclpy refuses a call site whose severity changes
            if error:
                self.get_logger().error(f"{said[topic]}: {why}")
            else:
                self.get_logger().warning(f"{said[topic]}: {why}")

    def _clock_silence_s(self) -> float:
        """With use_sim_time while active: seconds since the ROS clock (/clock) last moved; else 0."""
        if not self._timers or not self.get_clock().ros_time_is_active:
            return 0.0
        now = self.get_clock().now().nanoseconds
        if now != self._ros_clock_seen:
            self._ros_clock_seen, self._ros_clock_moved_at = now, time.monotonic()
            self._clock_silence_logged = False
            return 0.0
        return time.monotonic() - self._ros_clock_moved_at

    def _diagnostics(self) -> DiagnosticArray:
        s = self.stats()
        status = DiagnosticStatus()
        status.name = f"{self.get_name()}: inference"
        status.hardware_id = self.cfg.model.device if self.cfg else ""
        cache = s["cache"]
        warn = (
            s["drops"]
            or s["errors"]
            or (
                cache is not None
                and (
                    cache["library_problems"]
                    or cache["library_disk_low"]
                    or cache["library_disk_error"]
                    or cache["audit_trips"]
                    or cache["episode_unsaved"] >= 0
                )
            )
        )
        status.level = DiagnosticStatus.WARN if warn else DiagnosticStatus.OK
        # with use_sim_time both rates: a bag at --rate 4 is served 4x as often per wall second
        on_clock = f" ({s['rate_hz_clock']:.1f} Hz on /clock)" if self.get_clock().ros_time_is_active else ""
        status.message = f"{s['rate_hz']:.1f} Hz{on_clock}, p50 {s['latency_p50_ms']:.1f} ms"
        if s["ticks_merged_lately"]:  # no drop, yet those ticks got no call of their own
            status.level = max(status.level, DiagnosticStatus.WARN)
            status.message += (
                f", {s['ticks_merged_lately']} tick(s) in the last {MERGED_WARN_S:g} s fell due while the "
                "worker was still busy (a call or job longer than the period) and got no call of their own"
            )
        if self.cfg is not None and s["failing_ticks"] >= self.cfg.error_after_drops:
            status.level = DiagnosticStatus.ERROR  # active, but the arm gets nothing
            status.message = (
                f"no chunk for the last {s['failing_ticks']} ticks ({s['last_drop']}); " + status.message
            )
        if self.cfg is not None and s["stalled_s"] >= self.cfg.stall_after_s:
            status.level = DiagnosticStatus.ERROR  # a call or job that does not return: no chunk, no drop
            stalled = (
                f"stalled: a tick has waited {s['stalled_s']:.1f} s for the inference worker (in "
                f"{s['stalling'] or 'nothing'}; stall_after_s {self.cfg.stall_after_s:g})"
            )
            status.message = f"{stalled}; " + status.message
            if not self._stall_logged:
                self._stall_logged = True
                self.get_logger().error(f"inference {stalled}: no chunks until it returns")
        if s["waiting_for"]:
            status.message = (
                f"waiting for the first messages since the {self._waits_since} ({s['waiting_for']}); "
                + status.message
            )
        crowded, mistyped = self._input_publishers()
        if mistyped:  # nothing of its can arrive: the node cannot run
            status.level = DiagnosticStatus.ERROR
            said = {
                t: f"{t} carries {', '.join(types[:-1])}, the node takes {types[-1]}"
                for t, types in mistyped.items()
            }
            why = "nothing it sends arrives (compressed_images, or the remapping?)"
            self._say_per_topic(status, said, why, self._mistyped_logged, error=True)
        if crowded:
            status.level = max(status.level, DiagnosticStatus.WARN)
            said = {t: f"{len(nodes)} publishers on {t} ({', '.join(nodes)})" for t, nodes in crowded.items()}
            why = "their messages mix in the observations"
            self._say_per_topic(status, said, why, self._crowded_logged, error=False)
        silent = self._clock_silence_s()
        never = self._ros_clock_seen == 0
        if silent >= (CLOCK_SILENT_S if never else CLOCK_PAUSED_S):
            # no tick runs meanwhile: no chunk, no drop
            status.level = max(status.level, DiagnosticStatus.ERROR if never else DiagnosticStatus.WARN)
            said = (
                f"use_sim_time is set and no /clock has come in {silent:.0f} s: no inference runs (a simulator "
                "or bag player not started, or use_sim_time set by mistake)"
                if never
                else f"/clock has not moved for {silent:.0f} s (use_sim_time): no inference runs until it does "
                "(a bag player paused or between bags, a simulator stopped)"
            )
            status.message = f"{said}; " + status.message
            if not self._clock_silence_logged:
                self._clock_silence_logged = True
                # (one call site per severity: rclpy refuses a call site whose severity changes)
                if never:
                    self.get_logger().error(said)
                else:
                    self.get_logger().warning(said)
        keys = (
            "rate_hz",
            "rate_hz_clock",
            "latency_p50_ms",
            "latency_p99_ms",
            "preprocess_p50_ms",
            "preprocess_p99_ms",
            "tick_wait_p50_ms",
            "tick_wait_max_ms",
            "stalled_s",
            "stalls",
            "ticks_merged",
            "ticks_merged_lately",
            "gc_pause_max_ms",
            "gc_full_collections",
            "chunks",
            "failing_ticks",
        )
        values = {k: s[k] for k in keys}
        values |= {f"latency_p50_ms.{mode}": v for mode, v in s["latency_p50_ms_by_mode"].items()}
        if s["slowest_calls"]:
            values["slowest_call"] = describe_call(s["slowest_calls"][0])
        values |= {f"drops.{k}": v for k, v in s["drops"].items()}
        values |= {f"late_served.{k}": v for k, v in s["late_served"].items()}
        values |= {f"image_size.{k}": v for k, v in s["image_sizes"].items()}
        values |= {f"image_size_changes.{k}": v for k, v in s["image_size_changes"].items()}
        if s["waiting_for"]:
            values["waiting_for"] = s["waiting_for"]
        if s["last_drop"]:  # why the latest tick without a chunk had none: which camera, since activation
            values["last_drop"] = s["last_drop"]
        if cache is not None:
            status.message += f", cache {cache['mode']} (hit rate {cache['hit_rate']:.2f})"
            values |= {f"cache.{k}": cache[k] for k in ("mode", "hit_rate", "similarity", "library_episodes",
                                                        "task_episodes", "window_entries", "library_bytes",
                                                        "rebuilds", "rebuilds_deferred", "entries_set_aside",
                                                        "window_overruns",
                                                        "episodes_discarded", "episodes_too_short", "audits", "audits_missed",
                                                        "audit_error_median", "audit_error_max",
                                                        "audit_trips")}  # fmt: skip
            values["cache.library_problems"] = len(cache["library_problems"])
            if cache.get("reason"):  # why the latest chunk was not served cached
                values["cache.reason"] = cache["reason"]
            free = cache["library_disk_free_bytes"]
            values["cache.library_disk_free_mib"] = round(free / 2**20, 1) if free is not None else "unknown"
            if cache["library_disk_low"]:
                status.message += ", library disk nearly full: the next recording may fail"
            if cache["library_disk_error"]:  # found in review: a stale mount read as "unknown", at OK
                values["cache.library_disk_error"] = cache["library_disk_error"]
                status.message += (
                    f", library disk unreadable ({cache['library_disk_error']}): the next recording may fail"
                )
            values["cache.episode_unsaved"] = cache["episode_unsaved"]
            if cache["episode_unsaved"] >= 0:
                status.message += (
                    f", episode {cache['episode_unsaved']} not recorded yet: its library write failed or was "
                    "interrupted (the log says why), tried again at the next reset"
                )
            if cache["entries_set_aside"]:
                status.message += (
                    f", {cache['entries_set_aside']} window entr(ies) set aside this episode: their rebuild "
                    f"failed {REBUILD_TRIES} times (errors.cache_rebuild; the log says why)"
                )
            if cache["audit_trips"]:
                status.message += (
                    f", {cache['audit_trips']} episode(s) sent dense by an audit (cached chunks further from "
                    "dense than cache.audit_max_error)"
                )
        values |= {f"errors.{k}": v for k, v in s["errors"].items()}
        status.values = [
            KeyValue(key=k, value=f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in values.items()
        ]
        array = DiagnosticArray()
        array.header.stamp = self.get_clock().now().to_msg()
        array.status = [status]
        return array

    def _publish_cache_status(self) -> None:
        pub = self._status_pub
        if pub is None or not pub.is_activated:
            return
        msg = self._cache_status_message()
        if msg is not None:
            pub.publish(msg)

    def _cache_status_message(self) -> Any:
        """The latest cache status as a CacheStatus message; None without a cache."""
        from rmuscle_ros.msg import CacheStatus

        with self._stats_lock:
            status, episode = self.cache_status, self.episode_id
        if status is None:
            return None
        msg = CacheStatus()
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.episode_id = episode
        msg.mode = self._modes[status["mode"]]
        msg.similarity = float(status["similarity"])
        msg.reason = str(status["reason"])
        msg.hit_rate = float(status["hit_rate"])
        msg.library_episodes = int(status["library_episodes"])
        msg.window_entries = int(status["window_entries"])
        msg.library_bytes = int(status["library_bytes"])
        msg.library_path = str(status["library_path"])
        msg.task = str(status["task"])
        msg.task_episodes = int(status["task_episodes"])
        msg.audits = int(status["audits"])
        msg.audits_missed = int(status["audits_missed"])
        msg.audit_error_last = float(status["audit_error_last"])
        msg.audit_error_median = float(status["audit_error_median"])
        msg.audit_error_max = float(status["audit_error_max"])
        msg.audit_trips = int(status["audit_trips"])
        return msg


def _grey(rgb: np.ndarray) -> bool:
    """Whether an RGB frame (H, W, 3) is grey, every pixel's three channels equal (on every 4th pixel of
    every 4th row: a first frame's check, not a tick's), and not one flat level (a capped lens, a dark
    room): a mono camera, or a mono8 stream the node replicates to three channels without a word (found in
    review)."""
    sample = rgb[::4, ::4]
    return bool(
        (sample[..., 0] == sample[..., 1]).all()
        and (sample[..., 1] == sample[..., 2]).all()
        and sample.max() > sample.min()
    )


def main(argv: list[str] | None = None, *, exiting: bool = False) -> int:
    """`rmuscle_node` executable: the lifecycle node on a single-threaded executor. `exiting`: the process
    ends when it returns (the executables pass True: spin_node)."""
    return spin_node(RMuscleNode, argv, exiting=exiting)


def run() -> int:
    """The `rmuscle_node` executable's entry point (the console script, libexec/, `python -m`): `main` in a
    process that ends when it returns (spin_node's `exiting`)."""
    return main(exiting=True)


if __name__ == "__main__":
    sys.exit(run())
