"""rMuscle at run time: which calls run cached, what is recorded, and the sliding window of entries.

Per call (`RMuscle.infer`):
  1. the vision stage runs; its retrieval descriptor (mean visual token per camera) comes to the host;
  2. retrieval against the library (top-k episodes, aligned positions with lookahead, sticky fallback);
  3. if the best match's entry is in the window: the cached prefill and denoise (mode "cached");
     otherwise dense — mode "fallback" once similarity fell below the threshold (sticky until the
     episode resets), else "dense" (empty library, or the entry not rebuilt yet);
  4. a dense call of a dense episode is recorded (descriptor, 224² uint8 images, prompt tokens, the
     Action Cache masks of its own denoising run); at `reset_episode` an episode with no cached call is
     added to the library;
  5. one cached call in `audit_every` is audited (`RMuscle.audit`, called by the node in the motion
     window after it): the same call again dense, on the inputs and noise still in the live buffers, and
     the cached chunk's error against it. Above `audit_max_error` the episode falls back to dense.
Muscle memory is per task (`set_task`: the instruction as the prompt carries it, or the job named by
`RMuscleConfig.task`): retrieval serves a call only from episodes recorded under its task, since the
descriptor sees the scene, not the instruction, and a bench set up the same way may be doing another job.
Between calls (`RMuscle.rebuild`, called by the node right after publishing a chunk, while the arm
executes it) the window is refilled with the entries retrieval asked for: each candidate's positions
after its aligned one, then that one, best candidate first. Rebuilds run on the engine's rebuild lane (a
low-priority stream); an entry becomes usable when its rebuild has finished on the GPU (a live call
starts after the rebuilds queued before it, unless `concurrent_rebuilds`). An entry is rebuilt in
`rebuild_slices` parts (`RMuscle.rebuild_slice` queues one), so that the node can stop between any two
and a live call waits for at most one part.

The window holds `top_k × (lookahead + 1)` entries (20 by default), allocated once.

With `match_on_gpu` (the default), steps 2-3 of a call whose candidates are already in the window run on
the GPU without waiting for the host: the match stage picks the usable window entry whose descriptor is
most similar and loads it, and the cached prefill and denoise follow at once. The host runs retrieval
meanwhile, for the alignment, the fallback and the next window. If the picked entry is below the threshold,
or the scene left the repertoire (fallback), the call's prefill and denoise run again dense. The flags
saying which entries are usable are copied to the engine where they change (after a call's retrieval,
after a rebuild), so that a call finds them in place.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from rmuscle_ros.cache.library import (
    Episode,
    EpisodeUnreadable,
    LibraryKey,
    LibraryMismatch,
    RecordingFailed,
    ReferenceLibrary,
)
from rmuscle_ros.cache.lock import remove_if_abandoned
from rmuscle_ros.cache.retrieval import Match, RetrievalConfig, Retriever, reaches, unit_rows
from rmuscle_ros.engine.fused import ContextRef
from rmuscle_ros.engine.graph import CacheShapes, GraphEngine
from rmuscle_ros.models.pi05 import ModelInputs
from rmuscle_ros.runtime.transforms import clean_task

log = logging.getLogger(__name__)

MODES = ("dense", "cached", "fallback")  # ActionChunk.msg CACHE_DENSE=0, CACHE_CACHED=1, CACHE_FALLBACK=2
AUDITS_KEPT = 100  # the latest audits' errors, for the median and maximum reported in `status`
# What an episode's file holds beyond the tensors a recording counts (the safetensors header, ~0.5 KB), with
# room to spare: a recording counted just under the library's bound would pass `_record` and then be
# refused at its reset (EpisodeTooLarge, found in review).
FILE_OVERHEAD = 64 << 10
# A window entry whose rebuild raised this many times in one episode is set aside until the next: a fault
# that persists (one entry's inputs the engine refuses, memory too short for it) would otherwise have every
# motion window try it first and stop there, and no other entry would be rebuilt (found in review).
REBUILD_TRIES = 3
# A temporary library's folder (no library_path) starts with this; one whose lock nobody has held for
# ABANDONED_AFTER_S since its lock file was written is a leftover of a process that ended unclean.
TEMPORARY_LIBRARY_PREFIX = "rmuscle-library-"
TEMPORARY_MARKER = ".temporary"  # in a temporary library's folder only, written before the library opens
ABANDONED_AFTER_S = 60.0


# RMuscleConfig's integer fields, and the most window entries it may ask for (the default is 20).
COUNTS = (
    "anchors",
    "top_k",
    "lookahead",
    "max_library_mb",
    "max_episodes",
    "rebuilds_per_tick",
    "rebuild_slices",
)
MAX_WINDOW = 256


@dataclass(frozen=True)
class RMuscleConfig:
    """rMuscle settings of a deployment (validated)."""

    rho_p: float = 0.4  # Context Cache: fraction of the cameras' visual tokens recomputed per prefill layer
    rho_n: float = 0.5  # Action Cache: fraction of expert neurons updated after the anchor step, on average
    anchors: int = 1  # dense denoising steps per call
    # How ρn spreads over the denoising steps after the anchor: "ramp" (a share rising linearly, 0 → all at
    # ρn = 0.5, ρn on average) or "uniform" (ρn in each, the published method). The same weights are read per
    # call; in closed loop on the simulated cell at 0.4 / 0.5 the trained `small` succeeded on 33 of 50
    # scenes with the ramp and 14 uniform (dense 27), the trained `tiny` on 9 and 0 (dense 20). Through the
    # node on a 2-core CPU `small` lost successes with the ramp (25, 26 against 34, 33) and as many with the
    # exact cache (26, 27 against 35, 36), not through the schedule; later runs lost none (ramp 36 against
    # 31). README, "Choosing ρ" (engine.fused.step_neuron_counts).
    neuron_schedule: str = "ramp"
    top_k: int = 4  # candidate episodes kept by retrieval
    lookahead: int = 4  # positions past the aligned one that are kept ready
    threshold: float = 0.8  # best similarity below this: dense for the rest of the episode
    library_path: str = ""  # folder of the reference library; "" = a temporary folder, lost at exit
    record: bool = True  # add dense episodes to the library
    max_library_mb: int = 4096
    max_episodes: int = 64
    rebuilds_per_tick: int = 2  # entries rebuilt per motion window (each is one vision + prefill)
    # The job the calls' episodes are recorded and served under. "" = each call's prompt instruction, so
    # another job on the same bench is never served from this one's episodes. Name the job when the prompt
    # varies within it (a planner's subtask instructions, a prompt with a counter): otherwise every change
    # is a new task, and such an episode is neither served nor recorded.
    task: str = ""
    # False: rebuilds replay their CUDA graph, and a live call starts after the rebuilds queued before
    # it. True: rebuilds launch their kernels one by one and run alongside live calls. On the H200 a live
    # call concurrent with rebuild *graphs* hung the GPU in earlier builds (4 runs, cause not found; not
    # at 758f373, where it took 24.8 ms against 12.1 alone); concurrent with kernel-by-kernel rebuilds it
    # ran undelayed (13.26 vs 13.36 ms alone, 20 rebuilds, one run).
    concurrent_rebuilds: bool = False
    # Match on the GPU (see the module docstring): the cached graphs start right after vision instead of
    # after the descriptor's round trip to the host and retrieval. On by default since the pick became one
    # kernel (a20adb2): on the H200 cached calls took 11.09/11.04 ms against 11.18/11.08 matched on the host
    # (bench_rmuscle, two runs), and it was already ahead by 0.01-0.09 ms in the five runs before. It should
    # pay more where the host is slow (a Jetson's CPU); not measured there. A pick below the threshold (the
    # call where an episode falls back) costs one more prefill + denoise.
    match_on_gpu: bool = True
    # Parts an entry's rebuild is split into (vision, then the prefill's layers in groups): the most a live
    # call can wait for is one part, not a whole entry (pi05 on an H200: ~2 ms instead of ~8).
    rebuild_slices: int = 4
    # Audit one cached call in `audit_every` (0: none; a call the node had no time to audit passes the turn
    # to the next cached one): in the motion window after it, the same call runs again dense, on the inputs
    # and noise it had, and the cached chunk's relative L2 error against that dense chunk (in the units the
    # caller measures: robot units through Policy) is reported (CacheStatus, /diagnostics). It is the one
    # measure of the caches' error a cell has on its own weights and scenes. It costs one dense prefill +
    # denoise in a motion window.
    audit_every: int = 10
    # An audited error above this (0: none trips) sends the rest of the episode dense, as a similarity
    # below `threshold` does. Report only by default: on the simulated cell's trained policies a bound of
    # 0.1 caught the settings that failed grossly but restored no dense successes, and cost the ramp on
    # `small` 3 of its 33 (the error peaks at the same moments of every episode, failed or not; README,
    # "Auditing the cache"). A guard against gross faults, not a way to choose ρ.
    audit_max_error: float = 0.0

    def __post_init__(self) -> None:
        # Counts are integers (found in review: top_k 2.5 or max_library_mb 1.5 passed and failed at the
        # first call or recording with a TypeError; NaN rebuilds_per_tick never rebuilt, so nothing was
        # ever served cached)
        for name in COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.window_size > MAX_WINDOW:  # 100000 × 101 entries passed, then failed allocating 4 TB
            raise ValueError(
                f"a window of top_k × (lookahead + 1) = {self.window_size} entries is more than {MAX_WINDOW}: each "
                "holds a reference's expanded states on the device (~100 MB at pi05)"
            )
        self.shapes()  # validates rho_p, rho_n, anchors, neuron_schedule, rebuild_slices
        RetrievalConfig(self.top_k, self.lookahead, self.threshold)  # validates those three
        for name in ("max_library_mb", "max_episodes", "rebuilds_per_tick"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.task, str):
            raise ValueError(f"task must be a string (the job's name, or empty), got {self.task!r}")
        if self.task and not clean_task(self.task).strip():  # found in review: every prompt one task
            raise ValueError(
                f"task {self.task!r} is blank once cleaned ('_' and newlines read as spaces): it would put "
                "every job's episodes under one task; give the job's name, or \"\" for the prompt's instruction"
            )
        if (
            isinstance(self.audit_every, bool)
            or not isinstance(self.audit_every, int)
            or self.audit_every < 0
        ):
            raise ValueError(f"audit_every must be an int >= 0 (0: no audits), got {self.audit_every!r}")
        bound = self.audit_max_error
        if (
            isinstance(bound, bool)
            or not isinstance(bound, (int, float))
            or not (math.isfinite(bound) and bound >= 0)
        ):
            raise ValueError(f"audit_max_error must be a finite number >= 0 (0: never trips), got {bound!r}")

    def shapes(self, cameras: int = 0) -> CacheShapes:
        """The engine's cache shapes; `cameras`: the image slots the cell fills (0: all the model's), what
        ρp counts (the policy's cameras)."""
        return CacheShapes(
            self.rho_p,
            self.rho_n,
            self.anchors,
            self.neuron_schedule,
            window=self.window_size,
            match=self.match_on_gpu,
            rebuild_slices=self.rebuild_slices,
            cameras=cameras,
        )

    @property
    def window_size(self) -> int:
        return self.top_k * (self.lookahead + 1)


@dataclass(frozen=True)
class CallInfo:
    """How one chunk was produced."""

    mode: str  # one of MODES
    similarity: float  # best library match's cosine similarity; 0.0 with an empty library
    episode: int | None = None  # matched library episode (cached calls)
    position: int | None = None  # matched call within it
    reason: str = ""  # why a call was not cached


NO_CALL_YET = CallInfo("dense", 0.0, reason="no call yet")  # the status before an episode's first call
# Why an episode runs dense from its start: the one before was served from the cache, then fell back, so
# the library lacks this scene (RMuscle.reset_episode)
LEARNING_REASON = (
    "the episode before was served from the cache, then fell back: this one runs dense, to be recorded"
)


@dataclass(frozen=True)
class Audit:
    """One cached call checked against the same call run dense (`RMuscle.audit`)."""

    error: float  # the cached chunk's relative L2 error against the dense one (inf: not finite)
    tripped: bool  # the error was above `audit_max_error`: the rest of the episode runs dense
    episode: int | None  # the library episode and call the audited call was served from
    position: int | None
    seconds: float  # wall time of the audit (the dense prefill + denoise and the comparison)


def relative_l2(cached: torch.Tensor, dense: torch.Tensor) -> float:
    """||cached - dense|| / ||dense||, in float32 over every element, in the units given (the audits' measure:
    the model's units by default, robot units through Policy)."""
    a, b = cached.float(), dense.float()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-12))


@dataclass
class _AuditDue:
    """A cached call to audit: its prompt bucket, its chunk, and what it was served from."""

    bucket: int
    actions: torch.Tensor
    episode: int | None
    position: int | None


@dataclass
class _Slot:
    index: int  # in the engine's ReferenceWindow
    ref: ContextRef
    neurons: torch.Tensor  # (steps, depth, S) int32
    key: tuple[int, int] | None = None  # (library episode, call) held here
    ready: torch.cuda.Event | None = None  # recorded after the rebuild (GPU); None = ready

    def is_ready(self) -> bool:
        """Whether the rebuild written here has run. A finished event is dropped: a call checks every
        wanted slot before its GPU work starts, and each event query costs host time there."""
        if self.ready is not None and self.ready.query():
            self.ready = None
        return self.ready is None


@dataclass
class _Building:
    """The entry whose rebuild is in progress: its slot (key None until done) and what it will hold."""

    slot: _Slot
    key: tuple[int, int]
    masks: torch.Tensor  # its Action Cache masks
    unit: torch.Tensor  # its unit retrieval descriptor, the row the match stage compares with


@dataclass
class _Recording:
    descriptors: list[np.ndarray] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    token_mask: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    image_masks: list[np.ndarray] = field(default_factory=list)
    # The latest call's images and masks on their way to the host (a GPU engine): per list, a pinned copy,
    # the event after it and the dtype it is kept in. Converted by the next call's recording, while that
    # call's GPU work runs, or when the episode ends.
    pending: list[tuple[list[np.ndarray], torch.Tensor, torch.cuda.Event, type]] = field(default_factory=list)
    nbytes: int = 0  # what the recorded calls hold on the host (the pending ones included)

    # Each list's length and the byte count before the latest call's recording began (`begin_call`).
    last_call: tuple[tuple[int, ...], int] | None = None

    def _lists(self) -> tuple[list[np.ndarray], ...]:
        return (self.descriptors, self.images, self.tokens, self.token_mask, self.masks, self.image_masks)

    def begin_call(self) -> None:
        self.last_call = (tuple(len(a) for a in self._lists()), self.nbytes)

    def drop_last_call(self) -> None:
        """Undo the latest call's recording, whatever part of it was appended or is pending: the lists
        stay the same length, call for call (an episode is refused otherwise, losing its good calls)."""
        if self.last_call is not None:
            lengths, self.nbytes = self.last_call
            for into, n in zip(self._lists(), lengths, strict=True):
                del into[n:]
        self.pending, self.last_call = [], None

    def take_pending(self) -> None:
        """The latest call's images and masks onto the host: both appended, or (raising) neither."""
        taken = []
        for into, host, copied, dtype in self.pending:
            copied.synchronize()
            taken.append((into, host.numpy().astype(dtype)))
        for into, array in taken:
            into.append(array)
        self.pending = []

    def send_to_host(self, into: list[np.ndarray], tensor: torch.Tensor, dtype: type) -> None:
        """Append `tensor` to `into` as a `dtype` array: at once from the CPU; from a GPU, through a pinned
        copy queued on the current stream, taken by `take_pending` (reading it now would wait for the
        call's GPU work and convert on its latency path)."""
        self.nbytes += tensor.numel() * np.dtype(dtype).itemsize
        if tensor.device.type != "cuda":
            into.append(tensor.numpy().astype(dtype))
            return
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.pending.append((into, host, copied, dtype))


# The settings behind each field of a library's key: what a cell changed when its library is refused.
MASK_SETTINGS = (
    "neuron schedule or rho_n (cache.neuron_schedule, cache.rho_n; a library without mask_steps in its key was "
    "recorded under 'uniform', the default before 'ramp')"
)
KEY_SETTINGS = {
    "weights": "weights (model.checkpoint)",
    "cameras": "cameras (model.cameras; the node's camera_topics)",
    "cameras_filled": "the cameras a cell has (model.cameras; the node's camera_topics; a library recorded with "
    "fewer cameras than the model's slots before 2026-12-04 counted the empty slots in its descriptors)",
    "camera_slots": "the image slots the cameras fill (model.camera_slots; the node's camera_topics, an empty "
    "entry leaving its slot empty)",
    "descriptor_dim": "model (model.preset)",
    "image_size": "model (model.preset)",
    "max_tokens": "model (model.preset)",
    "steps": "model (model.preset)",
    "expert_depth": "model (model.preset)",
    # the masks' counts follow both: ρn·F under 'uniform'; under 'ramp' each step's share of ρn·F (mask_steps)
    "mask_neurons": MASK_SETTINGS,
    "mask_steps": MASK_SETTINGS,
    "anchors": "dense anchor steps (cache.anchors)",
    "anchor_ranked": "dense anchor steps (cache.anchors; a library recorded before masks were ranked against "
    "the last anchor)",
    "image_antialias": "image resizing (model.image_antialias)",
    "aloha_adapt_to_pi": "the state's convention in the prompt (model.aloha_adapt_to_pi)",
}


def _episode_of(rec: _Recording) -> Episode:
    """A finished episode's recorded calls stacked into its arrays (the library's `Episode`)."""
    return Episode(
        np.stack(rec.descriptors),
        np.stack(rec.images),
        np.stack(rec.tokens),
        np.stack(rec.token_mask),
        np.stack(rec.masks),
        np.stack(rec.image_masks),
    )


def library_key(
    weights: str,
    engine: GraphEngine,
    inputs: Mapping[str, bool] | None = None,
    camera_slots: Sequence[int] | None = None,
) -> LibraryKey:
    """What a library must match to be used with this engine: weights, every recorded shape, and `inputs`:
    the preprocessing settings that change what is recorded (the images' resize, the state's convention in
    the prompt), each only where it is on, so that libraries recorded before they existed keep their key;
    `camera_slots`, the image slots the cameras fill where they are not the first ones (PolicyConfig)."""
    cfg = engine.cfg
    return LibraryKey(
        weights,
        {
            "cameras": cfg.num_cameras,
            # a cell filling fewer slots records descriptors without the empty slots' rows (found in review:
            # they were counted, and a library of all slots was served after a camera was taken out of
            # camera_topics); a cell filling them all keeps the key it had
            **(
                {"cameras_filled": engine.cache.cameras} if 0 < engine.cache.cameras < cfg.num_cameras else {}
            ),
            "descriptor_dim": cfg.vlm.width,
            "image_size": cfg.vision.image_size,
            "max_tokens": cfg.max_token_len,
            "steps": cfg.num_steps,
            "expert_depth": cfg.expert.depth,
            "mask_neurons": engine.keep_neurons,
            # masks recorded for another step schedule rank other counts; uniform libraries keep their key
            **(
                {"mask_steps": list(engine.step_neurons)} if engine.cache.neuron_schedule != "uniform" else {}
            ),
            # masks are recorded for the steps after the anchors only (the others stay zero): another
            # anchors would read zero masks as neuron 0 (found in review); 1, the default, keeps old keys
            # since masks are ranked against the last anchor step (before, against step 0 whatever the anchors)
            **(
                {"anchors": engine.cache.anchors, "anchor_ranked": "last"}
                if engine.cache.anchors != 1
                else {}
            ),
            **{name: True for name, on in (inputs or {}).items() if on},
            **({"camera_slots": list(camera_slots)} if camera_slots is not None else {}),
        },
    )


def images_to_u8(images: torch.Tensor) -> torch.Tensor:
    """Model images (C, 3, S, S) in [-1, 1] (x/255·2−1 of uint8 pixels) -> (C, S, S, 3) uint8, exactly,
    on the images' device."""
    u8 = torch.round((images.float() + 1.0) * 127.5).clamp(0, 255).to(torch.uint8)
    return u8.permute(0, 2, 3, 1).contiguous()


def images_from_u8(u8: np.ndarray) -> torch.Tensor:
    """Inverse of `images_to_u8`, with the preprocessing's own arithmetic (bit-identical inputs)."""
    chw = torch.from_numpy(np.ascontiguousarray(u8)).permute(0, 3, 1, 2).to(torch.float32)
    return chw / 255.0 * 2.0 - 1.0


def _remove_abandoned_temporary_libraries() -> None:
    """Remove the temporary libraries (no library_path) that processes which ended without a clean close
    left behind: `TemporaryDirectory` removes its folder only at cleanup, so each SIGKILL, OOM kill or power
    cut left one of up to max_library_mb in the temporary folder, and nothing removed them (found in review;
    two such folders were there). A folder is removed only if it holds TEMPORARY_MARKER (a library_path
    that happens to share the prefix does not: found in review, a cell's `/tmp/rmuscle-library-cell1` was
    removed) and once no process holds its lock (`remove_if_abandoned`)."""
    parent = Path(tempfile.gettempdir())
    for root in sorted(parent.glob(f"{TEMPORARY_LIBRARY_PREFIX}*")):
        try:
            if root.is_symlink() or not (root / TEMPORARY_MARKER).is_file():
                continue
            size = sum(f.stat().st_size for f in root.iterdir() if f.is_file())
            if remove_if_abandoned(root, ABANDONED_AFTER_S):
                log.info(
                    "rMuscle: removed %s, a temporary library left by a process that ended (%.1f MiB)",
                    root,
                    size / 2**20,
                )
        except OSError:  # another user's, or gone meanwhile: not ours to clean
            continue


class _LiveStream:
    """A call's GPU work on the engine's live stream (the highest priority), ordered after the work the
    caller queued before it (and, `after_rebuilds`, after the rebuilds queued on the rebuild stream), and
    the caller's stream ordered after it. The events are allocated once (STYLE rule 2): `wait_stream`
    records a new event each time, and the context manager `torch.cuda.stream` costs more host time than
    setting the stream; together, 0.09 ms of host time before a call's first launch on the H200
    (bench/results/probe_call_timeline_pi05_h200_35d0631). `begun` and `done` time the call (the caller
    records them); they are recorded again by the next call. Shared by calls and audits, which the
    caller serialises (the node's policy lock): two at once would record each other's events."""

    def __init__(
        self, device: torch.device, stream: torch.cuda.Stream, rebuild_stream: torch.cuda.Stream
    ) -> None:
        self.device, self.stream, self.rebuild_stream = device, stream, rebuild_stream
        self._caller_done, self._rebuilds_done, self._result = (torch.cuda.Event() for _ in range(3))
        self.begun, self.done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._caller_device = 0

    def enter(self, *, after_rebuilds: bool) -> torch.cuda.Stream:
        """Make the live stream current, after the caller's queued work; returns the caller's stream."""
        caller = torch.cuda.current_stream(self.device)
        self._caller_done.record(caller)
        self.stream.wait_event(self._caller_done)
        if after_rebuilds:
            self._rebuilds_done.record(self.rebuild_stream)
            self.stream.wait_event(self._rebuilds_done)
        self._caller_device = torch.cuda.current_device()  # set_stream also makes the stream's device current
        torch.cuda.set_stream(self.stream)
        return caller

    def leave(self, caller: torch.cuda.Stream) -> None:
        """The caller's stream current again (and its device), ordered after the work queued since `enter`."""
        torch.cuda.set_stream(caller)
        if self._caller_device != caller.device_index:
            torch.cuda.set_device(self._caller_device)
        self._result.record(self.stream)
        caller.wait_event(self._result)


class RMuscle:
    """Library, retrieval, window and recording around a GraphEngine built with cache shapes."""

    def __init__(
        self,
        engine: GraphEngine,
        cfg: RMuscleConfig,
        weights: str,
        inputs: Mapping[str, bool] | None = None,
        camera_slots: Sequence[int] | None = None,
    ) -> None:
        """`inputs`, `camera_slots`: the preprocessing settings and the cameras' image slots (where they are
        not the first ones) in the library's key (library_key)."""
        want = cfg.shapes(engine.cache.cameras if engine.cache is not None else 0)
        if engine.cache != want:
            raise ValueError(f"the engine must be built with cache={want}, got {engine.cache}")
        self.engine, self.cfg = engine, cfg
        self._tmp = None
        if cfg.library_path:
            root = Path(cfg.library_path)
        else:
            _remove_abandoned_temporary_libraries()
            self._tmp = tempfile.TemporaryDirectory(prefix=TEMPORARY_LIBRARY_PREFIX)
            root = Path(self._tmp.name)
            (root / TEMPORARY_MARKER).touch()  # what the cleanup above looks for: never a library_path's
        try:
            self.library = ReferenceLibrary.open(
                root,
                library_key(weights, engine, inputs, camera_slots),
                max_bytes=cfg.max_library_mb << 20,
                max_episodes=cfg.max_episodes,
                # Recording off: lowered bounds delete nothing at open (the next recording evicts)
                evict_at_open=cfg.record,
            )
        except LibraryMismatch as e:
            settings = list(dict.fromkeys(KEY_SETTINGS[f] for f in e.fields if f in KEY_SETTINGS))
            if not settings:
                raise
            raise e.with_settings("; ".join(settings)) from None
        self._descriptors: dict[int, np.ndarray] = {}  # every library episode's descriptors, for retrieval
        self.task = ""  # what the calls run under (`set_task`); retrieval serves only this task's episodes
        untasked = sorted(i for i in self.library.entries if self._task_of(i) is None)
        if untasked:
            log.warning(
                "rMuscle: library episode(s) %s in %s were recorded without their task and are never served "
                "(take them out with `python -m rmuscle_ros.cache.library remove`, or let eviction drop them)",
                untasked,
                root,
            )
        try:
            self._refresh_retriever()  # reads every episode's descriptors: a file damaged since open fails
        except BaseException:  # the library goes back to whoever opens it next (this process, too)
            self.library.close()
            if self._tmp is not None:
                self._tmp.cleanup()
            raise
        window = engine.window
        assert window is not None  # the engine's cache shapes equal cfg.shapes(), checked above
        self.window = [_Slot(i, window.ref(i), window.neurons[i]) for i in range(len(window))]
        self.episode_id = 0
        self._first_id = self.library.next_id  # library ids from here on are this runtime's recordings
        self._recording = _Recording()
        # A finished episode whose library write was interrupted (Ctrl-C) or failed (a full disk): (episode,
        # its id here, its task), written before the next one (`_add`)
        # (an episode, or its calls not yet stacked when an interrupt came then: `_Recording`)
        self.unsaved: tuple[Episode | _Recording, int, str] | None = None
        self._episode_cached = False
        self._episode_excluded = ""  # why this episode may not be recorded (exclude_episode); "" = it may
        self._tasks_changed = False  # this episode's task changed after its first call (set_task)
        self._learning_task = ""  # the task a learning episode (LEARNING_REASON) runs dense for
        # Dense calls of this episode that ran unrecorded with `record` off (it may change live): recorded
        # without them, its positions would not follow its calls, so it is not recorded at all.
        self._unrecorded_calls = 0
        self.last_excluded = ""  # why the latest finished episode was kept out of the library, if it was
        self._wanted: list[tuple[int, int]] = []
        self._building: _Building | None = None  # the entry whose rebuild is in progress
        # This episode's failed rebuilds, by entry: one that failed REBUILD_TRIES times is set aside
        self._rebuild_failures: Counter[tuple[int, int]] = Counter()
        self._usable_on_device: list[bool] | None = None  # the usable flags last copied to the engine
        self._usable_writes = -1  # the engine's usable_writes right after that copy (another writer: stale)
        self.calls = self.cached_calls = 0
        self.match_reruns = 0  # on-GPU picks below the threshold, whose call ran again dense
        # The latest call's GPU work on the live stream, from its start (after the waits) to its end: timing
        # events, read once the call's result has been synchronised and before the next call, which
        # records them again. None on a CPU.
        self.last_gpu_span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        cuda = engine.device.type == "cuda"
        if cuda:  # an engine built with cache shapes on a GPU has them (graph.py)
            assert engine.live_stream is not None and engine.rebuild_stream is not None
        self._live = _LiveStream(engine.device, engine.live_stream, engine.rebuild_stream) if cuda else None
        # Each call's order events, allocated here (STYLE rule 2): the descriptor's read-back, the GPU's pick
        self._descriptor_ready = torch.cuda.Event() if cuda else None
        self._matched = torch.cuda.Event() if cuda else None
        self.last = NO_CALL_YET
        self._fallback_reason = ""  # why this episode fell back, when not its similarity (fall_back)
        # Audits (`audit`): the call due for one, cached calls until the next, and what they found.
        self._bucket = 0  # the latest call's prompt bucket
        self._audit_due: _AuditDue | None = None
        self._until_audit = 0  # cached calls to pass before the next audit (0: the next one)
        self.audits = self.audits_missed = self.audit_trips = 0
        self.audit_errors: deque[float] = deque(maxlen=AUDITS_KEPT)
        self.last_audit: Audit | None = None

    # ── library and retrieval ────────────────────────────────────────────────────────────────────────────

    def _task_of(self, episode_id: int) -> str | None:
        """The task an episode was recorded under; None for one recorded before the library kept tasks."""
        return self.library.entries[episode_id].meta.get("task")

    def _refresh_retriever(self) -> None:
        """Retrieval over the library as it is now, searching the current task's episodes (alignment and
        fallback start over)."""
        self._descriptors = {
            i: self._descriptors[i] if i in self._descriptors else self.library.load_field(i, "descriptors")
            for i in sorted(self.library.entries)
        }
        retrieval = RetrievalConfig(self.cfg.top_k, self.cfg.lookahead, self.cfg.threshold)
        # On a GPU the library's descriptors live there too: a call's similarities are one matrix-vector
        # product queued after its descriptor, not a host scan (see Retriever).
        self.retriever = Retriever(retrieval, self._descriptors, self.engine.device)
        self.retriever.restrict(self._task_episodes())

    def _leave_out(self, episode_id: int, problem: str) -> None:
        """An episode whose file can no longer be read: the library reports it and keeps it out, retrieval
        stops searching it (a mask: the other episodes keep their alignments, a fallback stays) and no entry
        of it is wanted."""
        self.library.leave_out(episode_id, problem)
        del self._descriptors[episode_id]
        self._wanted = [key for key in self._wanted if key[0] != episode_id]
        self.retriever.restrict(self._task_episodes(), keep_alignment=True)

    def _task_episodes(self) -> list[int]:
        return [i for i in self._descriptors if self._task_of(i) == self.task]

    def set_task(self, task: str) -> None:
        """The task the next calls run under: the instruction as the prompt carries it
        (`transforms.clean_task`; `Policy.infer` sets it from each observation's prompt, or from
        `RMuscleConfig.task` when that names the job). Retrieval serves only episodes recorded under the
        same task, and an episode is recorded under its own. A change
        after the episode's first call keeps that episode out of the library (its calls ran under two
        tasks) and searches the new task's episodes from their starts (alignments in the episode are kept:
        back on the old task, its alignment goes on); entries of the old task in the window are no longer
        served. A fallback stays for the rest of the episode, whatever the task
        (an audit's trip promises that; before, found in review, a task change served the episode cached
        again)."""
        if task == self.task:
            return
        previous, self.task = self.task, task
        if self.calls:
            self.exclude_episode(f"its task changed from {previous!r} to {task!r} after {self.calls} call(s)")
            self._tasks_changed = True
        fallback = self.retriever.fallback
        # A mask: a prompt that changes every call stays cheap. Mid-episode the alignments are kept (the new
        # task's episodes, never aligned in this episode, search their starts all the same): found in
        # review, a one-call change and back sent retrieval to the references' starts, and usually the
        # rest of the episode into fallback.
        self.retriever.restrict(self._task_episodes(), keep_alignment=bool(self.calls))
        self.retriever.fallback = fallback
        # A learning episode (reset_episode) is for the task whose scene the library lacked: before the
        # episode's first call, another task is served as usual, and that task again runs dense
        self._start_learning_if_pending()
        self._wanted = self._episode_starts([])
        log.debug("rMuscle: task %r: %d library episode(s) of it", task, self.retriever.episodes)

    def warm_up_retrieval(self) -> None:
        """Run retrieval's GPU path once, as calls run it, on a stand-in library of one call: on the live
        stream, and on the side stream where calls matched on the GPU queue it. Otherwise its first run is
        in the first call after the library gains its first episode (see the README's warm-up notes)."""
        e = self.engine
        if e.device.type != "cuda" or e.live_stream is None:
            return
        descriptor = e.descriptor()
        stand_in = Retriever(RetrievalConfig(), {0: np.ones((1, *descriptor.shape), np.float32)}, e.device)
        for stream in (e.live_stream, e.side_stream):
            if stream is None:
                continue
            stream.wait_stream(torch.cuda.current_stream(e.device))
            with torch.cuda.stream(stream):
                stand_in.queue(descriptor)
                stand_in.query()
        torch.cuda.synchronize(e.device)

    # Settings that shape neither the engine's graphs nor how the library is opened: they may change
    # between calls.
    LIVE_SETTINGS = ("threshold", "record", "rebuilds_per_tick", "task", "audit_every", "audit_max_error")

    def reconfigure(self, **changes: object) -> None:
        """Change settings among LIVE_SETTINGS from the next call on (validated first: a bad value raises
        ValueError and changes nothing). A fallback episode stays in fallback until it resets."""
        fixed = sorted(set(changes) - set(self.LIVE_SETTINGS))
        if fixed:
            raise ValueError(f"{fixed[0]} is fixed when the engine is built; it cannot change between calls")
        cfg = replace(self.cfg, **changes)  # RMuscleConfig validates
        if cfg.audit_every != self.cfg.audit_every:
            self._until_audit = 0
        self.cfg = cfg
        self.retriever.cfg = RetrievalConfig(cfg.top_k, cfg.lookahead, cfg.threshold)

    # ── episodes ─────────────────────────────────────────────────────────────────────────────────────────

    def reset_episode(self) -> int | None:
        """End the current episode (recording it if it ran dense) and start the next. Returns the id the
        finished episode got in the library, or None if it was not recorded.

        An episode served from the cache that then fell back (its scene left the reference's, an audit
        tripped) is no reference, and ran dense without being recorded: the next episode then runs dense
        from its start (mode fallback, LEARNING_REASON) and is recorded, so that the library learns the
        scene. Before (found in review), such a cell started every episode cached from the same reference,
        fell back, and recorded nothing, forever, with no reason given."""
        served_from = list(dict.fromkeys(episode for episode, _ in self._wanted))  # best candidate first
        diverged = self._diverged()
        # (an episode of two tasks: which one's scene the library lacks is not known)
        learn = bool(diverged) and self.cfg.record and not self._read_only() and not self._tasks_changed
        learning = self._fallback_reason == LEARNING_REASON  # this episode was the one to be recorded
        recorded = None
        try:
            recorded = self.finish_episode()
            if diverged and not self.last_excluded:
                self.last_excluded = diverged + (
                    "; the next episode runs dense, to be recorded in its place" if learn else ""
                )
            return recorded
        finally:  # a library that cannot be written must not carry this episode's state into the next
            self.retriever.reset()
            self._fallback_reason = ""
            self._tasks_changed = False
            if learn:
                self._learning_task = self.task
                log.warning(
                    "rMuscle: episode %d runs dense to be recorded: %s", self.episode_id + 1, diverged
                )
            elif learning and recorded is not None:
                self._learning_task = ""  # learnt
            if self._audit_due is not None:  # not run: its trip would land on the next episode
                self._audit_due = None
                self.audits_missed += 1
            self.episode_id += 1
            self.calls = self.cached_calls = 0
            # Pending until an episode of that task is recorded: one without calls, too short, discarded
            # or of another task leaves it pending (found in review: a second reset dropped it)
            self._start_learning_if_pending()
            self._rebuild_failures.clear()  # a fault that has gone (memory freed) is tried again
            # The status until the new episode's first call (the finished one's mode before: a FALLBACK
            # shown through the whole scene reset, found in review)
            self.last = NO_CALL_YET
            self._wanted = self._episode_starts(served_from)
            # Last: the episodes served from are kept for eviction even if the process dies before close
            self.library.save_use()

    def _start_learning_if_pending(self) -> None:
        """Run this episode dense to be recorded (mode fallback, LEARNING_REASON) if a learning episode of
        its task is pending (`reset_episode`) and it can be recorded; else not (another task, before the
        episode's first call: `set_task`)."""
        if self.calls:
            return
        pending = bool(self._learning_task) and self._learning_task == self.task
        if pending and self.cfg.record and not self._read_only():
            self.retriever.fallback, self._fallback_reason = True, LEARNING_REASON
        elif self._fallback_reason == LEARNING_REASON:
            self.retriever.fallback, self._fallback_reason = False, ""

    def would_record(self) -> bool:
        """Whether the episode so far would be recorded at its reset: calls, recording on, none served from
        the cache, not excluded, a writable library (the node's min_episode_s applies to these only)."""
        return bool(
            self.cfg.record
            and self._recording.descriptors
            and not self._episode_cached
            and not self._episode_excluded
            and not self._read_only()
        )

    def _diverged(self) -> str:
        """Why this episode is no reference though it ran dense after some point ("" if it is not so): it was
        served from the cache, then fell back for the rest of the episode."""
        if not (self._episode_cached and self.retriever.fallback) or self._fallback_reason == LEARNING_REASON:
            return ""
        return (
            f"{self.cached_calls} of its calls were served from the cache before it fell back "
            f"({self._fallback_why()})"
        )

    def _fallback_why(self) -> str:
        """Why the episode fell back: the reason given (`fall_back`), else the threshold its similarity fell
        below, kept from the first time it is asked: a later change of the threshold does not rewrite it."""
        self._fallback_reason = self._fallback_reason or f"similarity below {self.cfg.threshold}"
        return self._fallback_reason

    def _episode_starts(self, served_from: list[int]) -> list[tuple[int, int]]:
        """What the next episode's first call will likely match, before it has a descriptor: the first
        `lookahead` + 1 calls of `top_k` library episodes, those the finished episode was served from
        first (best candidate first), then the most recently used or recorded. A motion window at the
        reset can rebuild them, so that a repeat's first call is served cached (`_infer_matched_on_gpu`)."""
        entries = self.library.entries
        recent = sorted(entries, key=lambda i: (entries[i].last_used, i), reverse=True)
        episodes = [
            i
            for i in dict.fromkeys([*served_from, *recent])
            if i in self._descriptors and self._task_of(i) == self.task
        ]
        return [
            (episode, position)
            for episode in episodes[: self.cfg.top_k]
            for position in range(min(self.cfg.lookahead + 1, len(self._descriptors[episode])))
        ]

    def want_episode_starts(self) -> None:
        """Ask the window for the next episode's likely first calls (`_episode_starts`), as a reset does,
        unless it already wants some (a reset's choice, the finished episode's candidates first, stands).
        `Policy.expect_task`: a node started on a library it recorded before serves its first episode's
        first call cached once the motion window it runs at activation has rebuilt them."""
        if not self._wanted:
            self._wanted = self._episode_starts([])

    def discard_recording(self) -> None:
        """Forget this episode's calls so far: warm-up calls are not part of any episode (nothing they
        did may be recorded, counted, or steer retrieval's alignment or fallback)."""
        self._recording = _Recording()
        self._episode_cached = False
        self._episode_excluded = ""
        self._tasks_changed = False
        self._unrecorded_calls = 0
        self.calls = self.cached_calls = 0
        self._wanted = []
        self.retriever.reset()
        self._fallback_reason = ""
        self._audit_due = None
        self.last = NO_CALL_YET

    def fall_back(self, reason: str) -> bool:
        """Dense for the rest of the episode (sticky until the reset, as a similarity fallback); returns
        whether it was not already. E.g. an audit's trip, or a cached call with non-finite actions."""
        if self.retriever.fallback:
            return False
        self.retriever.fallback = True
        self._fallback_reason = reason
        log.warning("rMuscle: episode %d runs dense from now on: %s", self.episode_id, reason)
        return True

    def exclude_episode(self, reason: str) -> None:
        """Keep the current episode out of the library (its calls so far are dropped, later ones are not
        recorded): e.g. a call produced non-finite actions, and its recorded calls may hold the fault."""
        if not self._episode_excluded:
            log.warning(f"episode {self.episode_id} will not be recorded into the library: {reason}")
        self._episode_excluded = reason
        self._recording = _Recording()

    def finish_episode(self) -> int | None:
        """Add the current episode to the library if it is recordable: recording on, at least one call,
        every call dense (an episode served from the cache is not a reference), and not excluded. An earlier
        episode whose write was interrupted or failed is written first.

        This episode's recording and flags are taken over first, so that an interrupt during the write never
        merges the next episode's calls into it (found in review); the episode is kept (`unsaved`) until it
        is on disk, also when the interrupt comes during the earlier episode's write (found in review: it
        was lost without a word)."""
        rec, self._recording = self._recording, _Recording()
        cached, self._episode_cached = self._episode_cached, False
        excluded, self._episode_excluded = self._episode_excluded, ""
        unrecorded, self._unrecorded_calls = self._unrecorded_calls, 0
        try:
            rec.take_pending()
        except Exception as e:  # the last call's copy off the GPU failed: the others are still recorded
            log.warning(
                "rMuscle: episode %d's last call is left out of its recording: %s", self.episode_id, e
            )
            rec.drop_last_call()
        if self.cfg.record and unrecorded and not excluded:
            excluded = f"recording (cache.record) was off for {unrecorded} of its calls"
        excluded = excluded or self._read_only()
        self.last_excluded = excluded
        episode = None
        if self.cfg.record and rec.descriptors and not cached and not excluded:
            try:
                episode = _episode_of(rec)
            except BaseException:  # interrupted (Ctrl-C) while its calls were stacked: kept as they are, and
                # stacked at the next try (found in review: the episode was lost)
                self._keep_unsaved(rec, self.episode_id, self.task, "its stacking was interrupted")
                raise
        try:
            self._add_unsaved()
        except BaseException:  # interrupted: this episode, not yet tried, is kept in the earlier one's place
            if episode is not None:
                self._keep_unsaved(episode, self.episode_id, self.task, "its write was interrupted")
            raise
        return self._add(episode, self.episode_id, self.task) if episode is not None else None

    def _keep_unsaved(self, episode: Episode | _Recording, session_episode: int, task: str, why: str) -> None:
        """Keep an episode not yet written (`unsaved`) for the next try. One is kept, the latest: an earlier
        one still held is dropped, with an error naming it (logged once this one is held: an interrupt in
        the log call then loses the earlier, not this one; found in review)."""
        earlier, self.unsaved = self.unsaved, (episode, session_episode, task)
        self._say_dropped(earlier, session_episode, why)

    @staticmethod
    def _say_dropped(
        earlier: tuple[Episode | _Recording, int, str] | None, session_episode: int, why: str
    ) -> None:
        if earlier is not None and earlier[1] != session_episode:
            log.error(
                "rMuscle: episode %d, not yet written to the library, is dropped: episode %d is not written "
                "either (%s), and only the latest such episode is kept",
                earlier[1],
                session_episode,
                why,
            )

    def _add(self, episode: Episode, session_episode: int, task: str) -> int:
        """Write a finished episode into the library. Until it is on disk the episode is kept as `unsaved`:
        a write that an interrupt (Ctrl-C) cut short, or that failed (a full disk: raised, and reported by
        the caller), is tried again before the next episode's (close() at the end of the node's life), so a
        disk that fills for a while loses no recording (found in review: a failed one was dropped). One
        episode is kept, the latest whose write failed; one kept earlier stays kept while a later one is
        written."""
        earlier = self.unsaved if self.unsaved is not None and self.unsaved[1] != session_episode else None
        # Held as unsaved while it is written, and after unless it is written or refused: an interrupt
        # anywhere below, in a handler too, leaves it kept
        self.unsaved = (episode, session_episode, task)
        expected = self.library.next_id  # the id add gives it
        try:
            added = self.library.add(episode, meta={"session_episode": str(session_episode), "task": task})
        except RecordingFailed as e:  # the library is as it was: kept for the next try
            self._say_dropped(earlier, session_episode, f"its write failed: {type(e.__cause__).__name__}")
            raise
        except Exception:  # refused (too large, a read-only library, another writer): not tried again
            self.unsaved = earlier
            raise
        except BaseException:
            if expected in self.library.entries:  # interrupted after its index was written: it is in
                self.unsaved = earlier  # (written again, it would be in twice; found in review)
                # and retrieval follows the library as it now is (it went on searching an episode the add
                # evicted and never saw this one; found in review)
                self._descriptors[expected] = episode.descriptors
                self._refresh_retriever()
            else:
                self._say_dropped(earlier, session_episode, "its write was interrupted")
            raise
        self.unsaved = earlier
        self._descriptors[added] = episode.descriptors
        self._refresh_retriever()
        log.info(
            "rMuscle: recorded episode %d (%d calls) as library episode %d",
            session_episode,
            episode.calls,
            added,
        )
        return added

    def _add_unsaved(self) -> None:
        """Write the episode whose write was interrupted or failed, if any (logged; an error is logged, not
        raised: the episode that ends now is still recorded)."""
        if self.unsaved is None:
            return
        episode, session_episode, task = self.unsaved
        if any(  # its write landed after all (an interrupt right after it): not written twice (review)
            entry.id >= self._first_id and entry.meta.get("session_episode") == str(session_episode)
            for entry in self.library.entries.values()
        ):
            self.unsaved = None
            return
        if isinstance(episode, _Recording):  # an interrupt came while its calls were stacked: stacked now
            try:
                episode = _episode_of(episode)
            except Exception as e:  # as it will be at any later try: dropped, saying why
                self.unsaved = None
                log.error(
                    "rMuscle: episode %d, whose recording was interrupted, is dropped: its calls could not be "
                    "stacked (%s: %s)",
                    session_episode,
                    type(e).__name__,
                    e,
                )
                return
            self.unsaved = (episode, session_episode, task)
        try:
            added = self._add(episode, session_episode, task)
        except Exception as e:
            log.error(
                "rMuscle: episode %d, whose write was interrupted or failed, could not be written again (%s): "
                "%s: %s",
                session_episode,
                "kept in memory" if self.unsaved is not None else "dropped: it was refused, not tried again",
                type(e).__name__,
                e,
            )
            return
        log.warning(  # a late write is news to an operator, at a level any handler shows
            "rMuscle: episode %d, whose write was interrupted or failed, written as library episode %d",
            session_episode,
            added,
        )

    # ── calls ────────────────────────────────────────────────────────────────────────────────────────────

    def _ready_slot(self, key: tuple[int, int]) -> _Slot | None:
        for slot in self.window:
            if slot.key == key and slot.is_ready():
                return slot
        return None

    @torch.no_grad()
    def infer(self, inputs: ModelInputs, noise: torch.Tensor) -> tuple[torch.Tensor, CallInfo]:
        """One observation (batch 1) -> (actions (1, horizon, action_dim), how they were produced).

        On a GPU the call runs on the engine's highest-priority stream and starts after any rebuild still
        queued on the rebuild stream: on the H200 a live call running concurrently with rebuild graphs
        hung the GPU in earlier builds (with and without PDL; cause not found; not reproduced at 758f373 by
        bench_rmuscle --concurrent-rebuild-graphs, where overlap slowed the live call about as much).
        The node rebuilds right after a publish, one part of an entry (~2 ms at full size) at a time, and
        starts none that its latest part times say would end after the next observation is due, nor any
        once it is due: a live call waits for at most one part. With
        `concurrent_rebuilds` the rebuilds launch kernel by kernel and the call does not wait for them
        (see RMuscleConfig). The result is ordered back onto the caller's stream."""
        if self._audit_due is not None:  # not audited in its motion window: the next cached call is
            self._audit_due = None
            self.audits_missed += 1
        self.last_gpu_span = None
        live = self._live
        if live is None:
            return self._infer(inputs, noise)
        caller = live.enter(after_rebuilds=not self.cfg.concurrent_rebuilds)
        try:
            live.begun.record(live.stream)  # passed once the waits are over
            actions, info = self._infer(inputs, noise)
            live.done.record(live.stream)
        finally:
            live.leave(caller)
        self.last_gpu_span = (live.begun, live.done)
        actions.record_stream(caller)
        return actions, info

    def _descriptor_to_host(self) -> torch.cuda.Event | None:
        """Queue the read-back of the retrieval descriptor into the engine's pinned `descriptor_host` (the
        buffer the match graph writes too); returns the event to wait on (None on a CPU, where the copy is
        done on return)."""
        d = self.engine.descriptor()
        self.engine.descriptor_host.copy_(d, non_blocking=True)
        if not d.is_cuda:
            return None
        ready = self._descriptor_ready
        assert ready is not None  # allocated with the runtime on a GPU
        ready.record()
        return ready

    def _usable(self) -> list[bool]:
        """Window entries the next call may pick on the device: wanted (by the last call's retrieval, or at
        a reset the likely episodes' starts, `_episode_starts`), and rebuilt. All False after a fallback. Unless
        `concurrent_rebuilds`, a live call starts after the rebuilds queued before it, so an entry counts
        as rebuilt once its last part is queued; with it, once that part has run (its event)."""
        if self.retriever.fallback:
            return [False] * len(self.window)
        wanted = set(self._wanted)
        queued_is_ready = not self.cfg.concurrent_rebuilds
        return [
            s.key is not None and s.key in wanted and (queued_is_ready or s.is_ready()) for s in self.window
        ]

    def _push_usable(self) -> list[bool]:
        """The usable flags; the device's copy brought up to date (queued on the current stream) if they
        changed and the match stage may read them (any set). Called where they change, after a call's
        retrieval and when a rebuild completes, so that a call normally finds them in place: their copy
        was host time before the call's first graph."""
        usable = self._usable()
        e = self.engine
        if any(usable) and (usable != self._usable_on_device or e.usable_writes != self._usable_writes):
            e.set_usable(usable)
            self._usable_on_device, self._usable_writes = usable, e.usable_writes
        return usable

    def _infer(self, inputs: ModelInputs, noise: torch.Tensor) -> tuple[torch.Tensor, CallInfo]:
        if self.cfg.match_on_gpu:
            usable = self._push_usable()  # normally in place already
            if any(usable):
                return self._infer_matched_on_gpu(inputs, noise, usable)
        e = self.engine
        bucket = self._bucket = e.begin_load(inputs, noise)
        e.run_stage("vision", bucket)
        ready = self._descriptor_to_host()
        self._queue_similarities()
        e.finish_load()  # the prompt is packed on the host while vision runs
        unaligned = self.retriever.fallback or not self.retriever.positions
        # (found in review: an episode's first call on this path said "entry not rebuilt yet" with its
        # entry in the window)
        first = not self.retriever.fallback and not self.retriever.positions
        if unaligned or all(slot.key is None for slot in self.window):
            # Nothing can serve this call cached (an empty window), or finding out would scan the whole
            # library (an episode that fell back: 2.1 ms at 64 episodes on a 2-core CPU's host path,
            # bench/bench_retrieval.py), or it is an episode's first call, not aligned yet (it searches
            # the episodes' starts only, but runs dense on the host path as before). The dense stages go first,
            # and retrieval (the similarity reported, the alignment, the entries wanted next) finishes on
            # the host while they run. (Matched on the GPU, an episode's first call is served cached when
            # a motion window since the reset rebuilt the likely episodes' starts: `_episode_starts`.)
            record = self._dense_stages(bucket)
            descriptor = self._read_descriptor(ready)
            matches = self._query(descriptor)
            info = self._dense_done(inputs, record, descriptor, self.retriever.last_similarity, first)
            return self._finish_call(matches, info)
        descriptor = self._read_descriptor(ready)
        matches = self._query(descriptor)
        similarity = self.retriever.last_similarity
        slot = self._ready_slot((matches[0].episode, matches[0].position)) if matches else None
        if slot is not None:
            e.load_window_entry(slot.index)
            e.run_stage("tail", bucket, variant="cached")
            info = self._served_cached(matches[0].episode, matches[0].position, similarity)
        else:
            info = self._serve_dense(inputs, bucket, descriptor, similarity)
        return self._finish_call(matches, info)

    def _infer_matched_on_gpu(
        self, inputs: ModelInputs, noise: torch.Tensor, usable: list[bool]
    ) -> tuple[torch.Tensor, CallInfo]:
        e = self.engine
        # An episode's first call (nothing aligned yet: the window holds the likely episodes' starts, see
        # `_episode_starts`) waits for the pick before queuing the cached stages: a scene that is not a
        # repeat then costs no cached run for nothing. Later calls queue them at once.
        first = self.calls == 0
        bucket = self._bucket = e.begin_load(inputs, noise)
        e.run_stage("match", bucket, variant="cached")
        matched = self._matched  # None on a CPU
        if matched is not None:
            matched.record()
        self._queue_similarities(after=matched)
        e.finish_load()  # the prompt is packed on the host while the match graph runs
        if first and matched is not None:
            matched.synchronize()
        queued = not first or self._pick(usable)[2]
        if queued:
            e.run_stage("tail", bucket, variant="cached")  # queued now: it runs while the host does retrieval
        descriptor = self._read_descriptor(matched)  # also waits for the match graph's pick
        index, similarity, serves = self._pick(usable)
        matches = self._query(descriptor)
        slot = self.window[index]
        if self.retriever.fallback or not serves:
            if queued:
                self.match_reruns += 1  # the cached result is not used: the same call again, dense
            info = self._serve_dense(inputs, bucket, descriptor, self.retriever.last_similarity)
        else:
            assert slot.key is not None  # usable
            info = self._served_cached(*slot.key, similarity)
        return self._finish_call(matches, info)

    def _pick(self, usable: list[bool]) -> tuple[int, float, bool]:
        """The match graph's pick, once it has arrived: (window index, similarity, whether it may serve
        the call: at or above the threshold, and usable)."""
        index, similarity = int(self.engine.match_host[0]), float(self.engine.match_host[1])
        return index, similarity, reaches(similarity, self.cfg.threshold) and usable[index]

    def _queue_similarities(self, after: torch.cuda.Event | None = None) -> None:
        """With the library on the GPU: queue this call's similarities right after the stage that computed
        its descriptor, so that no later stage delays them. `after` (the GPU picked the entry, and the
        cached stages do not wait for retrieval): on the engine's side stream once that event has passed,
        beside the cached stages rather than before them. `_query` waits for them before the call returns,
        so the next call's vision cannot overwrite the descriptor while they read it."""
        if not self.retriever.on_device:
            return
        side = self.engine.side_stream
        if after is None or side is None:
            self.retriever.queue(self.engine.descriptor())
            return
        side.wait_event(after)
        with torch.cuda.stream(side):
            self.retriever.queue(self.engine.descriptor())

    def _query(self, descriptor: np.ndarray) -> list[Match]:
        """Retrieval for this call: from the similarities queued on the GPU, or on the host."""
        return self.retriever.query(None if self.retriever.on_device else descriptor)

    def _served_cached(self, episode: int, position: int, similarity: float) -> CallInfo:
        self.library.touch(episode)  # used: eviction keeps the episodes a cell is being served from
        self._episode_cached = True
        self.cached_calls += 1
        return CallInfo("cached", similarity, episode, position)

    def _serve_dense(
        self, inputs: ModelInputs, bucket: int, descriptor: np.ndarray, similarity: float
    ) -> CallInfo:
        """The prefill and denoise of a dense call (vision has run), recorded if this episode qualifies."""
        return self._dense_done(inputs, self._dense_stages(bucket), descriptor, similarity)

    def _dense_done(
        self,
        inputs: ModelInputs,
        record: bool,
        descriptor: np.ndarray,
        similarity: float,
        first: bool = False,
    ) -> CallInfo:
        """After a dense call's stages are queued: record the call if they record, and say how it ran
        (`first`: an episode's first call matched on the host, which runs dense)."""
        if record:
            self._record(inputs, descriptor)
        return self._dense_info(similarity, first)

    def _read_only(self) -> str:
        """Why no episode is recorded, if the library was opened read-only (its lock file could not be
        created: `LibraryLock.take`, which logs it): no call is kept, and each reset says why."""
        why = self.library.read_only
        return f"the library was opened read-only ({why}): no episode is recorded" if why else ""

    def _dense_stages(self, bucket: int) -> bool:
        """Queue a dense call's prefill and denoise (vision has run): recording ones if this episode
        qualifies for the library. Returns whether they record."""
        qualifies = not self._episode_cached and not self._episode_excluded and not self._read_only()
        record = self.cfg.record and qualifies
        self._unrecorded_calls += qualifies and not record
        self.engine.run_stage("tail", bucket, variant="record" if record else "dense")
        return record

    def _dense_info(self, similarity: float, first: bool = False) -> CallInfo:
        if self.retriever.fallback:
            return CallInfo("fallback", similarity, reason=self._fallback_why())
        if not self.library.entries:
            return CallInfo("dense", similarity, reason="empty library")
        if not self.retriever.episodes:
            return CallInfo("dense", similarity, reason="no library episode of this task")
        if first and not self.cfg.match_on_gpu:
            return CallInfo("dense", similarity, reason="an episode's first call, matched on the host: dense")
        return CallInfo("dense", similarity, reason="entry not rebuilt yet")

    def _read_descriptor(self, ready: torch.cuda.Event | None) -> np.ndarray:
        """The retrieval descriptor queued by `_descriptor_to_host`, once it has arrived."""
        if ready is not None:
            ready.synchronize()
        return self.engine.descriptor_host.numpy().copy()

    def _finish_call(self, matches: list[Match], info: CallInfo) -> tuple[torch.Tensor, CallInfo]:
        # What the next calls may match: each candidate's aligned position and the `lookahead` after it,
        # in the order the window refills them (best candidate first). The position this call matched comes
        # last: the next call is most likely one chunk on, and a refill slower than one entry per motion
        # window that started with it would always be building the entry just passed.
        self._wanted = []
        for m in matches:
            end = min(m.position + self.cfg.lookahead + 1, len(self._descriptors[m.episode]))
            self._wanted += [(m.episode, p) for p in (*range(m.position + 1, end), m.position)]
        if self.cfg.match_on_gpu:
            self._push_usable()  # for the next call, while this one's GPU work runs
        self.calls += 1
        self.last = info
        actions = self.engine.actions.clone()[None]
        if info.mode == "cached" and self.cfg.audit_every:
            if self._until_audit == 0:
                self._audit_due = _AuditDue(self._bucket, actions, info.episode, info.position)
            else:
                self._until_audit -= 1
        return actions, info

    # ── audits ───────────────────────────────────────────────────────────────────────────────────────────

    @property
    def audit_due(self) -> bool:
        """Whether the latest call is a cached one due for an audit (`audit`) before the next call."""
        return self._audit_due is not None

    @torch.no_grad()
    def audit(self, measure: Callable[[torch.Tensor, torch.Tensor], float] = relative_l2) -> Audit | None:
        """Audit the latest call if it is due for one (else None): its prefill and denoise run again dense,
        on the inputs, vision output and noise the live buffers still hold (nothing runs on them between a
        call and the next), and `measure(cached, dense)` (both (1, horizon, action_dim) on the engine's
        device) gives the cached chunk's error. The dense chunk is exactly what a dense call would have
        produced (the same stages, the same inputs). An error above `audit_max_error` (if set), or one
        that is not finite, sends the rest of the episode dense (mode "fallback", sticky until the reset).
        Run where a rebuild would run, in the motion window: on the live stream, after the rebuilds queued
        before it (unless `concurrent_rebuilds`), waited for."""
        due, self._audit_due = self._audit_due, None
        if due is None:
            return None
        start = time.perf_counter()
        e = self.engine
        live = self._live
        if live is None:
            e.run_stage("tail", due.bucket)
        else:
            caller = live.enter(after_rebuilds=not self.cfg.concurrent_rebuilds)
            try:
                e.run_stage("tail", due.bucket)
            finally:
                live.leave(caller)
        error = float(measure(due.actions, e.actions[None]))
        bound = self.cfg.audit_max_error
        tripped = not math.isfinite(error) or (bound > 0 and error > bound)
        error = error if math.isfinite(error) else math.inf  # a NaN would vanish from the maximum
        if tripped and self.fall_back(
            f"an audit found a cached chunk {error:.4f} from dense (audit_max_error {bound}; served from "
            f"library episode {due.episode}, call {due.position})"
        ):
            self.audit_trips += 1
        self.audits += 1
        self._until_audit = self.cfg.audit_every - 1
        self.audit_errors.append(error)
        self.last_audit = Audit(error, tripped, due.episode, due.position, time.perf_counter() - start)
        return self.last_audit

    def _record(self, inputs: ModelInputs, descriptor: np.ndarray) -> None:
        """Keep this dense call for the library. An episode whose recording outgrows what the whole library
        may hold is dropped (`exclude_episode`) and runs on unrecorded: the library would refuse it, and
        a cell that never resets would fill the host's memory (~1.1 MB a call at `pi05`, 2 calls a second)."""
        rec = self._recording
        try:
            rec.take_pending()  # the previous call's images and masks
        except BaseException:  # that call cannot be completed: left out, the episode keeps its other calls
            rec.drop_last_call()
            raise
        rec.begin_call()
        try:
            rec.descriptors.append(descriptor.astype(np.float32))
            rec.send_to_host(rec.images, images_to_u8(inputs.images[0]), np.uint8)
            rec.tokens.append(inputs.tokens[0].cpu().numpy().astype(np.int64))
            rec.token_mask.append(inputs.token_mask[0].cpu().numpy().astype(np.bool_))
            rec.image_masks.append(inputs.image_masks[0].cpu().numpy().astype(np.bool_))
            rec.send_to_host(rec.masks, self.engine.recorded_masks, np.int16)
        except BaseException:  # a failed copy off the GPU, a Ctrl-C: this call is left out, not half recorded
            rec.drop_last_call()
            raise
        rec.nbytes += sum(
            a[-1].nbytes for a in (rec.descriptors, rec.tokens, rec.token_mask, rec.image_masks)
        )
        if rec.nbytes + FILE_OVERHEAD > self.library.max_bytes:
            self.exclude_episode(
                f"its recording reached {rec.nbytes / 2**20:.1f} MiB in {len(rec.descriptors)} calls, more than "
                f"the whole library may hold (cache.max_library_mb {self.library.max_bytes >> 20}); an episode "
                "is one attempt at the task: call ~/reset_episode at each"
            )

    # ── the sliding window ───────────────────────────────────────────────────────────────────────────────

    def missing_entries(self) -> int:
        """How many entries the latest call's retrieval wants that the window does not hold (and that are
        not set aside, `REBUILD_TRIES`)."""
        held = {slot.key for slot in self.window}
        return sum(1 for key in self._wanted if key not in held and not self._set_aside(key))

    def _set_aside(self, key: tuple[int, int]) -> bool:
        return self._rebuild_failures[key] >= REBUILD_TRIES

    def _rebuild_failed(self, key: tuple[int, int]) -> None:
        self._rebuild_failures[key] += 1
        if self._set_aside(key):
            log.warning(
                "rMuscle: rebuilding library episode %d, call %d failed %d times: set aside until the "
                "episode resets",
                *key,
                REBUILD_TRIES,
            )

    @torch.no_grad()
    def rebuild(self, max_entries: int | None = None, wait: bool = False) -> int:
        """Rebuild up to `max_entries` (default rebuilds_per_tick) wanted entries missing from the window,
        best first, into slots holding entries nobody wants: every part of each is queued. Returns how
        many were queued, an entry already in progress included. `wait`: return only once they are built
        (on a GPU the rebuilds are otherwise queued and run on their own)."""
        budget = self.cfg.rebuilds_per_tick if max_entries is None else max_entries
        finished = 0
        while finished < budget:
            queued, done = self.rebuild_slice()
            if not queued:
                break
            finished += done
        if wait and finished and self.engine.rebuild_stream is not None:
            self.engine.rebuild_stream.synchronize()
        return finished

    @torch.no_grad()
    def rebuild_slice(self, wait: bool = False) -> tuple[bool, bool]:
        """Queue one part of the window's refill: the next part of the entry in progress, or the first of
        the best wanted entry the window lacks. An entry in progress that retrieval no longer wants is
        dropped. Returns (whether a part was queued, whether it completed an entry); `wait`: once it ran."""
        building = self._building
        if building is not None and building.key not in self._wanted:
            building = self._building = None  # its slot stays free
        if building is None:
            building = self._building = self._start_rebuild()
            if building is None:
                return False, False
        try:
            done = (
                self.engine.rebuild_step(use_graphs=not self.cfg.concurrent_rebuilds)
                if self.engine.context_cache
                else True  # ρp = 1: the masks and key, copied below, are the whole entry
            )
        except BaseException as e:  # the part ran partway: the entry starts over, its slot stays unusable
            self._building = None
            self.engine.abandon_rebuild()
            if isinstance(e, Exception):  # a fault, not a Ctrl-C
                self._rebuild_failed(building.key)
            raise
        if done:
            self._building = None
            slot, stream = building.slot, self.engine.rebuild_stream
            key_row = self.engine.window.keys[slot.index]  # what the match stage compares with
            if stream is not None:
                with torch.cuda.stream(stream):
                    slot.neurons.copy_(building.masks, non_blocking=True)
                    key_row.copy_(building.unit, non_blocking=True)
                    slot.ready = torch.cuda.Event()
                    slot.ready.record(stream)
            else:
                slot.neurons.copy_(building.masks)
                key_row.copy_(building.unit)
                slot.ready = None
            slot.key = building.key
            if self.cfg.match_on_gpu:  # after the rebuild, on its stream, which the next call waits for
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    self._push_usable()
        if wait and self.engine.rebuild_stream is not None:
            self.engine.rebuild_stream.synchronize()
        return True, done

    def _start_rebuild(self) -> _Building | None:
        """Begin the rebuild of the best wanted entry the window lacks, into a slot nobody wants (None if
        there is no such entry or slot). Nothing runs yet: `rebuild_slice` queues the parts."""
        held = {slot.key for slot in self.window}
        wanted = set(self._wanted)
        key = next((k for k in self._wanted if k not in held and not self._set_aside(k)), None)
        free = next((s for s in self.window if s.key is None or s.key not in wanted), None)
        if key is None or free is None:
            return None
        try:
            row = self.library.load_call(*key)  # that call's rows only: an episode's file is ~116 MiB at pi05
            building = _Building(
                free,
                key,
                torch.from_numpy(row.action_masks[0].astype(np.int32)),
                torch.from_numpy(unit_rows(self._descriptors[key[0]][key[1]][None])[0]),  # retrieval's row
            )
            free.key = None  # not usable while it is being rewritten
            if self.engine.context_cache:  # else (ρp = 1) the entry is its masks and key alone: nothing runs
                present = (
                    row.image_masks[0]
                    if row.image_masks is not None
                    else np.ones(row.images.shape[1], dtype=np.bool_)
                )
                inputs = ModelInputs(
                    images_from_u8(row.images[0])[None],
                    torch.from_numpy(np.ascontiguousarray(present))[None],
                    torch.from_numpy(row.tokens[0])[None],
                    torch.from_numpy(row.token_mask[0])[None],
                )
                self.engine.begin_rebuild(inputs, free.ref)
        except EpisodeUnreadable as e:
            # Damaged since open: out of service, and the next wanted entry instead.
            self._leave_out(key[0], str(e))
            return self._start_rebuild()
        except Exception:  # this entry's inputs, or the engine's start: counted toward setting it aside
            self.engine.abandon_rebuild()
            self._rebuild_failed(key)
            raise
        return building

    # ── status ───────────────────────────────────────────────────────────────────────────────────────────

    def call_status(self) -> dict[str, object]:
        """The latest call's mode, similarity, reference and hit rate, and the episode they count in, read
        without the disk: what a caller stores with each call's result (the node, before it publishes the
        chunk). What else a call may change (audits missed, match reruns, the task) waits for `status`."""
        return {
            "episode_id": self.episode_id,
            "mode": self.last.mode,
            "similarity": self.last.similarity,
            "hit_rate": self.cached_calls / self.calls if self.calls else 0.0,
            "reason": self.last.reason,  # why it was not served cached ("" if it was)
            # what a cached call was served from: the library episode and its call; -1 for other calls
            "reference_episode": -1 if self.last.episode is None else self.last.episode,
            "reference_position": -1 if self.last.position is None else self.last.position,
        }

    def status(self) -> dict[str, object]:
        """What CacheStatus reports. Reads the library's disk (its free space), which `call_status` does not."""
        free = self.library.disk_free_bytes()
        return self.call_status() | {
            "library_episodes": len(self.library.entries),
            "task": self.task,
            "last_episode_excluded": self.last_excluded,
            # a finished episode whose write failed (a full disk) or was interrupted, kept to be tried again at
            # the next reset; -1: none
            "episode_unsaved": self.unsaved[1] if self.unsaved is not None else -1,
            "task_episodes": self.retriever.episodes,
            "window_entries": sum(1 for s in self.window if s.key is not None),
            "entries_set_aside": sum(1 for key in self._rebuild_failures if self._set_aside(key)),
            "library_bytes": self.library.total_bytes,
            "library_disk_free_bytes": free,
            "library_disk_low": self.library.disk_low(free),
            "library_disk_error": self.library.disk_error,  # "" unless the free space could not be read
            "library_path": str(self.library.root) if self.cfg.library_path else "",
            "library_problems": list(self.library.problems),
            "match_reruns": self.match_reruns,
            "audits": self.audits,
            "audits_missed": self.audits_missed,
            "audit_trips": self.audit_trips,
            # nan until the first audit (CacheStatus carries nan too: "not measured", not "no error")
            "audit_error_last": self.last_audit.error if self.last_audit is not None else math.nan,
            "audit_error_median": statistics.median(self.audit_errors) if self.audit_errors else math.nan,
            "audit_error_max": max(self.audit_errors) if self.audit_errors else math.nan,
        }

    def close(self) -> int | None:
        """Record the current episode if it qualifies (the library is already on disk otherwise)."""
        episode = self.episode_id
        try:
            try:
                recorded = self.finish_episode()
            except RecordingFailed as e:  # the caller's message names the episode (found in a soak)
                raise RecordingFailed(f"episode {episode}, in progress: {e}") from e.__cause__
        finally:  # a recording that fails (a full disk) still gives the library up
            lost, self.unsaved = self.unsaved, None
            if lost is not None:
                log.error(
                    "rMuscle: episode %d is not recorded: its write failed or was interrupted, and the library "
                    "closes now",
                    lost[1],
                )
            self.library.close()
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None
        if lost is not None:  # the caller counts it (the node's errors.cache_close) as any failed recording
            written = (
                ""
                if recorded is None
                else f" (the episode in progress was recorded as library episode {recorded})"
            )
            raise RecordingFailed(
                f"reference library {self.library.root}: episode {lost[1]}, kept since its write failed or was "
                f"interrupted, is not recorded: the library is closed{written}"
            )
        return recorded
