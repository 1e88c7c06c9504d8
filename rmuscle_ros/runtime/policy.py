"""Policy = preprocess -> engine -> postprocess, for one robot observation at a time.

    Observation (camera images, joint state, task prompt)
      -> resize-with-pad to 224², map to [-1, 1]; missing camera -> masked slot
      -> the state in the checkpoint's convention (action_space: openpi's ALOHA adaptation), quantile-
         normalise it, discretise it into the prompt, tokenise
      -> engine.sample_actions (eager, fused or graph backend), or rMuscle when a cache is configured
         (retrieval, Context/Action Cache, recording of dense episodes; cache.runtime)
      -> drop the padded action dims, un-normalise, add the state to delta actions, undo the ALOHA
         adaptation -> ActionChunk in robot units

Nothing here imports rclpy: the ROS node (next layer up) only converts messages to an Observation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rmuscle_ros.cache.runtime import Audit, CallInfo, RMuscle, RMuscleConfig, relative_l2
from rmuscle_ros.engine import BACKENDS, EXPORTED, Engine, create_engine
from rmuscle_ros.engine.eager import check_noise
from rmuscle_ros.models.checkpoint import (
    check_relative_actions,
    load_model,
    trained_prompt_len,
    weights_fingerprint,
)
from rmuscle_ros.models.config import PALIGEMMA_VOCAB_SIZE, PRESETS, Pi05Config, get_preset
from rmuscle_ros.models.pi05 import ModelInputs
from rmuscle_ros.models.tokenizer import Tokenizer, load_tokenizer
from rmuscle_ros.runtime.action_space import ActionSpace
from rmuscle_ros.runtime.normalize import NormStats, identity_stats, load_norm_stats
from rmuscle_ros.runtime.transforms import (
    ImageUploads,
    build_prompt,
    check_prompt,
    check_rgb_u8,
    clean_task,
    discretize_state,
    images_to_model_padded,
    tokenize_prompt,
)

PI05_CAMERA_SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")

# With the model on a GPU the host's PyTorch work was preprocessing (three 480×640 images resized), until
# that moved to the GPU too. On the H200's 16-core host, 4 threads did it as fast as 8 or 16 (median
# 3.4 ms), and 16, PyTorch's default of one per core, took 12-49 ms in 3 of 12 calls, the calling thread
# busy all along (its CPU time equalled the wall time; bench/results/dev_preprocess_threads_h200_c4736f1).
GPU_HOST_THREADS = 4
# Backends with rMuscle's cached stages (the others run dense only).
CACHE_BACKENDS = ("fused", "graph")


def host_threads(device: str, default: int) -> int:
    """PyTorch CPU threads for a policy on `device` when none are asked for: on a GPU at most
    GPU_HOST_THREADS, on the CPU (where the model runs there too) `default`, PyTorch's own choice."""
    return min(GPU_HOST_THREADS, default) if device.startswith("cuda") else default


@dataclass(frozen=True)
class PolicyConfig:
    """What a deployment chooses: model, weights, hardware, and the robot's dimensions."""

    preset: str = "tiny"
    # LeRobot/openpi model.safetensors. None: seeded random weights, which a π0.5-size preset runs only
    # with random_weights set (benchmarks): a cell whose checkpoint setting came out empty must not move
    # its arms on them. The test presets (tiny, small) have no published weights and run random without it.
    checkpoint: str | None = None
    norm_stats: str | None = None  # LeRobot normalizer .safetensors or openpi norm_stats.json
    tokenizer: str | None = None  # SentencePiece tokenizer.model; None = built-in byte tokenizer
    random_weights: bool = False  # a π0.5-size preset without checkpoint, stats or tokenizer (benchmarks)
    device: str = "cpu"
    backend: str = "eager"
    dtype: str = "float32"  # eager backend only; the graph backend is bf16
    # onnxruntime / tensorrt backends: where exports and engines are kept; None = $XDG_CACHE_HOME/rmuscle_ros.
    # graph backend: its compiled Triton kernels go to <engine_cache_dir>/triton (unless TRITON_CACHE_DIR is
    # set); None = Triton's default, ~/.triton/cache
    engine_cache_dir: str | None = None
    # tensorrt backend: the prompt length (tokens, with the state) its engines are tuned for; prompts of
    # 1..max_token_len all run. Set it to the bucket the node logs at configure when that differs.
    trt_opt_prompt_len: int = 64
    cameras: tuple[str, ...] = PI05_CAMERA_SLOTS  # observation keys, in π0.5 slot order
    # The π0.5 image slot each of `cameras` fills, in the same order; () = the first slots, in order. A cell
    # without a base camera fills the wrists' slots only: cameras (left, right), camera_slots (1, 2), and
    # slot 0 stays empty (masked, as a missing camera is).
    camera_slots: tuple[int, ...] = ()
    # Shrink the images as the checkpoint's training did: openpi resizes with PIL's bilinear filter, which
    # smooths while shrinking (True: within 1 of 255 of PIL's pixels); LeRobot with PyTorch's plain
    # bilinear (False). On textures the two differ by up to half the range.
    image_antialias: bool = False
    state_dim: int = 14  # ALOHA: 2 × (6 joints + gripper)
    action_dim: int = 14
    # The state and action conventions the checkpoint was trained under (runtime.action_space): openpi's
    # pi05_aloha configs set both (adapt_to_pi; use_delta_joint_actions: delta_actions = the 12 arm joints,
    # action_space.ALOHA_DELTA_ACTIONS); LeRobot's pi05 neither, unless trained with use_relative_actions.
    aloha_adapt_to_pi: bool = False
    delta_actions: tuple[int, ...] = ()  # action dims predicted as offsets from the state's same dim
    seed: int = 0

    @property
    def slots(self) -> tuple[int, ...]:
        """The image slot each camera fills (`camera_slots`, or the first slots in order)."""
        return self.camera_slots or tuple(range(len(self.cameras)))

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset: unknown {self.preset!r}; choose one of {sorted(PRESETS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: unknown {self.backend!r}; choose one of {sorted(BACKENDS)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: must be 'float32' or 'bfloat16', got {self.dtype!r}")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device: {e}") from None
        # Types first (found in review: cameras="top" ran as cameras t, o, p until the first call; a
        # checkpoint of 123 raised a bare TypeError from pathlib)
        for name in ("checkpoint", "norm_stats", "tokenizer", "engine_cache_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{name}: a path or None, got {value!r}")
            # "" read as ".": the working directory's model.safetensors was loaded, past the checks that
            # test `if cfg.checkpoint` (found in review)
            if value is not None and not os.fspath(value):
                raise ValueError(f"{name}: an empty path; None for none")
        if isinstance(self.cameras, str) or not all(isinstance(c, str) and c for c in self.cameras):
            raise ValueError(f"cameras: a list of camera names (π0.5 slots), got {self.cameras!r}")
        if isinstance(self.trt_opt_prompt_len, bool) or not isinstance(self.trt_opt_prompt_len, int):
            raise ValueError(f"trt_opt_prompt_len: an int, got {self.trt_opt_prompt_len!r}")
        model = get_preset(self.preset)
        if not 1 <= self.trt_opt_prompt_len <= model.max_token_len:
            raise ValueError(
                f"trt_opt_prompt_len: must be in 1..{model.max_token_len} (preset {self.preset!r}'s prompt "
                f"length), got {self.trt_opt_prompt_len}"
            )
        if not 1 <= len(self.cameras) <= model.num_cameras or len(set(self.cameras)) != len(self.cameras):
            raise ValueError(
                f"cameras: need 1..{model.num_cameras} distinct names (π0.5 slots), got {list(self.cameras)}"
            )
        if not isinstance(self.camera_slots, tuple):  # a list would key a library apart from the tuple
            raise ValueError(f"camera_slots: a tuple of image slots, got {self.camera_slots!r}")
        if self.camera_slots and (
            len(self.camera_slots) != len(self.cameras)
            or not all(type(i) is int and 0 <= i < model.num_cameras for i in self.camera_slots)
            or len(set(self.camera_slots)) != len(self.camera_slots)
        ):
            raise ValueError(
                f"camera_slots: one distinct image slot in 0..{model.num_cameras - 1} per camera "
                f"({len(self.cameras)}), or () for the first slots; got {list(self.camera_slots)}"
            )
        for name in ("state_dim", "action_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= model.action_dim:
                raise ValueError(f"{name}: must be an int in 1..{model.action_dim}, got {value!r}")
        self.action_space  # noqa: B018 (validates aloha_adapt_to_pi and delta_actions)
        if self.random_weights and self.checkpoint:
            raise ValueError("random_weights: set, but so is checkpoint; choose one")
        if model.vocab_size == PALIGEMMA_VOCAB_SIZE and not self.random_weights:
            self._check_deployable()

    def _check_deployable(self) -> None:
        """A π0.5-size preset runs a trained checkpoint with its own stats and tokenizer (or, with
        random_weights, none of them): a setting left empty by mistake is refused, not replaced by a
        stand-in the checkpoint was not trained with."""
        given = {"checkpoint": self.checkpoint, "norm_stats": self.norm_stats, "tokenizer": self.tokenizer}
        missing = [name for name, value in given.items() if not value]
        if missing:
            raise ValueError(
                f"{missing[0]}: preset {self.preset!r} needs a trained checkpoint with its norm_stats and "
                f"tokenizer (the PaliGemma SentencePiece model); {', '.join(missing)} not given. "
                "Seeded random weights (benchmarks) need random_weights set"
            )

    @property
    def action_space(self) -> ActionSpace:
        return ActionSpace(self.state_dim, self.action_dim, self.aloha_adapt_to_pi, self.delta_actions)

    @property
    def model(self) -> Pi05Config:
        # Camera slots the robot does not have stay in the model, always masked (openpi's convention).
        return get_preset(self.preset)


@dataclass(frozen=True)
class Observation:
    """One synchronised observation. images: camera name -> (H, W, 3) uint8 RGB; state: (state_dim,)."""

    images: Mapping[str, np.ndarray]
    state: np.ndarray
    prompt: str
    stamp_ns: int = 0


@dataclass(frozen=True)
class ActionChunk:
    actions: np.ndarray  # (horizon, action_dim) float32, robot units
    stamp_ns: int  # the observation's stamp
    latency_s: float  # preprocess + inference + postprocess, wall clock
    prompt_tokens: int
    prompt_truncated: bool
    # preprocess, model_and_postprocess (wall clock), and on a GPU gpu: from the start of the model's first
    # GPU work to the end of its last (CUDA events), so that latency - preprocess - gpu is the rest: host
    # time, waits, and the images' upload and resampling on the GPU (queued by preprocess, run before)
    timings_s: dict[str, float] = field(default_factory=dict)
    cache_mode: str = "dense"  # rMuscle path: dense, cached or fallback (cache.runtime.MODES)
    cache_similarity: float = 0.0  # best library match's cosine similarity (0.0 without a library)


class NonFiniteActions(ValueError):
    """The model produced NaN or Inf actions: the chunk must not reach a robot."""


class Policy:
    def __init__(self, cfg: PolicyConfig, cache: RMuscleConfig | None = None) -> None:
        """cache: run with rMuscle (backends 'graph' or 'fused'); None = always dense."""
        self.cfg = cfg
        self._closed = False
        self.model_cfg = cfg.model
        self.device = torch.device(cfg.device)
        if cache is not None and cfg.backend not in CACHE_BACKENDS:
            raise ValueError(
                f"cache: rMuscle needs backend 'graph' (GPU) or 'fused' (CPU), not {cfg.backend!r}"
            )
        # What can be refused without the model goes first: nothing to undo yet (a library opened by RMuscle
        # below holds its marker until closed; found in review: a bad norm_stats after it left it open).
        self.space = cfg.action_space
        self.stats: NormStats = (
            load_norm_stats(cfg.norm_stats).for_robot(
                cfg.state_dim, cfg.action_dim, self.model_cfg.action_dim
            )
            if cfg.norm_stats
            else identity_stats(cfg.state_dim, cfg.action_dim)
        )
        self.tokenizer: Tokenizer = load_tokenizer(cfg.tokenizer)
        vocab, model_vocab = self.tokenizer.vocab_size, self.model_cfg.vocab_size
        if vocab > model_vocab:
            raise ValueError(f"tokenizer: vocabulary {vocab} exceeds the model's {model_vocab}")
        if model_vocab == PALIGEMMA_VOCAB_SIZE and not cfg.random_weights and vocab != model_vocab:
            # Another SentencePiece model's ids would all mean other words to the checkpoint.
            raise ValueError(
                f"tokenizer: {cfg.tokenizer} has {vocab} pieces; a π0.5 checkpoint reads PaliGemma's "
                f"{model_vocab} (its tokenizer.model)"
            )
        if cfg.checkpoint:
            check_relative_actions(cfg.checkpoint, bool(cfg.delta_actions))
        start = time.perf_counter()
        model = load_model(self.model_cfg, cfg.checkpoint, seed=cfg.seed, device=cfg.device)
        # Prompts are cut where the checkpoint's training cut them (its config.json), else at the preset's
        self.prompt_len = (
            trained_prompt_len(cfg.checkpoint, self.model_cfg)
            if cfg.checkpoint
            else self.model_cfg.max_token_len
        )
        # Seconds each part of loading took (the node logs them at configure): weights, engine, fingerprint.
        self.load_timings: dict[str, float] = {"weights": time.perf_counter() - start}
        options: dict[str, object] = {"dtype": cfg.dtype} if cfg.backend == "eager" else {}
        if cfg.backend in EXPORTED:
            options["cache_dir"] = cfg.engine_cache_dir
        if cfg.backend == "tensorrt":
            options["opt_prompt_len"] = cfg.trt_opt_prompt_len
        if cfg.backend == "graph" and cfg.engine_cache_dir:
            options["kernel_cache_dir"] = str(Path(cfg.engine_cache_dir) / "triton")
        if cache is not None:
            # ρp counts the configured cameras' rows: a slot no camera fills never takes the budget
            options["cache"] = cache.shapes(cameras=len(cfg.cameras))
        start = time.perf_counter()
        self.engine: Engine = create_engine(cfg.backend, model, self.device, **options)
        self.load_timings["engine"] = time.perf_counter() - start
        # A library recorded under other preprocessing holds other images or state tokens: refused, named.
        inputs = {"image_antialias": cfg.image_antialias, "aloha_adapt_to_pi": cfg.aloha_adapt_to_pi}
        # and one recorded with the cameras in other slots holds other images (the first slots keep old keys)
        slots = list(cfg.slots) if cfg.slots != tuple(range(len(cfg.slots))) else None
        self.rmuscle: RMuscle | None = None
        if cache is not None:
            start = time.perf_counter()
            weights = weights_fingerprint(model)  # every byte hashed: what the library is keyed on
            self.load_timings["fingerprint"] = time.perf_counter() - start
            self.rmuscle = RMuscle(self.engine, cache, weights, inputs, camera_slots=slots)
        del model  # the engines hold what they need (folded copies for graph/fused)
        self._noise = torch.Generator().manual_seed(cfg.seed)
        self._model_state: np.ndarray | None = None  # the latest call's (infer)
        # The images of the latest preprocess. With the engine on a GPU they are made there: the frames go
        # up as uint8 through pinned buffers (a DMA the host does not wait on) and are resampled on the GPU,
        # which takes the host's ~2-3 ms of PyTorch work per call off the call (bench/bench_preprocess.py).
        s, slots = self.model_cfg.vision.image_size, self.model_cfg.num_cameras
        on_gpu = self.device.type == "cuda"
        try:
            self._images = torch.empty(1, slots, 3, s, s, device=self.device if on_gpu else "cpu")
            self._uploads = ImageUploads(self.device) if on_gpu else None
            # A dense call's GPU span (with rMuscle, its runtime times the call): recorded again each call
            self._dense_span = (
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                if on_gpu
                else None
            )
            # `device_fault`'s kernel writes here: a check that allocated could fail on a full GPU, whose
            # context works (found in review)
            self._device_probe = torch.zeros(1, device=self.device) if on_gpu else None
        except BaseException:  # out of memory, ...: the library goes back to whoever opens it next
            if self.rmuscle is not None:
                self.rmuscle.close()
            raise

    def reseed_noise(self, seed: int) -> None:
        """Draw the next calls' flow-matching noise from a generator seeded with `seed` (infer without
        `noise`): a benchmark that reseeds per episode gives two runs the same noise call for call."""
        self._noise = torch.Generator().manual_seed(seed)

    def warmup(self, prompt: str = "warm up") -> dict[str, float]:
        """Backend warm-up (graph capture) plus one full inference on a synthetic observation (seconds)."""
        start = time.perf_counter()
        timings = dict(self.engine.warmup())
        # Its own noise: drawn from the policy's stream, the warm-up moved every later call's noise, and
        # a seed no longer fixed the chunks with warm-up on (found in review).
        cfg = self.model_cfg
        noise = torch.randn(1, cfg.horizon, cfg.action_dim, generator=torch.Generator().manual_seed(0))
        observation = synthetic_observation(self.cfg, prompt)
        self.infer(observation, noise=noise)
        if self._uploads is not None:  # the images' resampling, captured by that call, replayed once
            self.preprocess(observation)
        if self.rmuscle is not None:
            self.rmuscle.discard_recording()
            self.rmuscle.warm_up_retrieval()
        timings["warmup_total"] = time.perf_counter() - start
        return timings

    @property
    def episode_started(self) -> bool:
        """Whether the cache's episode in progress has had a call (False without a cache): until then
        `expect_task` may still change what the episode's first calls are prepared for."""
        return self.rmuscle is not None and self.rmuscle.calls > 0

    def expect_task(self, prompt: str) -> None:
        """Say what the next episode will run before its first call: the cache takes its task from `prompt`
        (or `RMuscleConfig.task`), as `infer` would, and wants the first calls of that task's likely
        episodes, as after a reset, so that a motion window before the first call (`rebuild_cache`) can
        serve it cached. Without it only the episodes after the first reset can start cached. No-op
        without a cache; call it between episodes (a task change after an episode's first call keeps that
        episode out of the library, as in `infer`)."""
        self._check_open()
        check_prompt(prompt)
        if self.rmuscle is not None:
            self._set_task(prompt)
            self.rmuscle.want_episode_starts()

    def _set_task(self, prompt: str) -> None:
        """Muscle memory is per task: the job named in the settings, else the prompt's instruction."""
        assert self.rmuscle is not None
        self.rmuscle.set_task(clean_task(self.rmuscle.cfg.task or prompt))

    def preprocess(self, obs: Observation) -> tuple[ModelInputs, int, bool]:
        """-> model inputs (batch 1), prompt token count, whether the prompt was truncated.

        The images are the policy's own buffer, overwritten by the next preprocess: clone them to keep them."""
        inputs, num_tokens, truncated, _ = self._prepare(obs)
        return inputs, num_tokens, truncated

    def _prepare(self, obs: Observation) -> tuple[ModelInputs, int, bool, np.ndarray]:
        """preprocess, and the state in the checkpoint's convention (what postprocess adds delta actions to)."""
        self._check_open()
        check_prompt(obs.prompt)
        raw_state = np.asarray(obs.state)
        if raw_state.dtype.kind not in "iuf":  # bool, complex, text, objects: no joint positions
            raise ValueError(
                f"state must be real numbers (an int or float array), got dtype {raw_state.dtype}"
            )
        unknown = set(obs.images) - set(self.cfg.cameras)
        if unknown:
            raise ValueError(f"unknown camera(s) {sorted(unknown)}; configured: {list(self.cfg.cameras)}")
        present: dict[int, np.ndarray] = {}
        for slot, name in zip(self.cfg.slots, self.cfg.cameras, strict=True):
            if name in obs.images:
                try:
                    check_rgb_u8(obs.images[name])
                except ValueError as e:
                    raise ValueError(f"camera {name!r}: {e}") from None
                present[slot] = obs.images[name]
        if not present:
            raise ValueError("observation has no camera image")
        images = self._images
        # the cameras of one size as one batch
        images_to_model_padded(present, images[0], self._uploads, self.cfg.image_antialias)
        for slot in range(self.model_cfg.num_cameras):
            if slot not in present:
                images[0, slot].fill_(-1.0)  # missing slot = black, masked out
        masks = torch.from_numpy(np.isin(np.arange(self.model_cfg.num_cameras), list(present)))[None]
        if raw_state.shape != (self.cfg.state_dim,):
            raise ValueError(f"state must have shape ({self.cfg.state_dim},), got {raw_state.shape}")
        if not np.isfinite(raw_state).all():
            raise ValueError(f"state contains NaN or Inf: {raw_state.tolist()}")
        with np.errstate(over="ignore"):
            state = raw_state.astype(np.float32)
        if not np.isfinite(state).all():  # found in review: reported as NaN or Inf, with numpy's warning
            raise ValueError(f"state has values beyond float32's range (±3.4e38): {raw_state.tolist()}")
        model_state = self.space.state_to_model(state)
        with np.errstate(over="ignore", invalid="ignore"):  # checked just below, naming the dimensions
            normalized = self.stats.state.normalize(model_state)
        if not np.isfinite(normalized).all():  # a finite value far past the stats' range (or stats' tiny one)
            stats, bad = self.stats.state, np.flatnonzero(~np.isfinite(normalized))
            raise ValueError(
                f"state dimension(s) {bad.tolist()} (in the model's convention) "
                f"{model_state[bad].tolist()} normalise past float32's range with the norm stats' q01 "
                f"{stats.q01[bad].tolist()}, q99 {stats.q99[bad].tolist()}: check the joint units and model.norm_stats"
            )
        prompt = build_prompt(obs.prompt, discretize_state(normalized))
        tok = tokenize_prompt(self.tokenizer, prompt, self.model_cfg.max_token_len, keep=self.prompt_len)
        # The images where the engine runs, the rest as host tensors: each engine places them (the graph
        # engine packs the prompt on the host, so a device copy here would only be read back).
        inputs = ModelInputs(
            images, masks, torch.from_numpy(tok.tokens)[None], torch.from_numpy(tok.mask)[None]
        )
        return inputs, tok.num_tokens, tok.truncated, model_state

    def prompt_tokens(self, task: str) -> tuple[int, int]:
        """(tokens the prompt of `task` takes with the state, tokens the model takes). The state's bins take
        1-2 tokens each: the longest of a few states is counted. Past the model's length the prompt's tail
        (the state and "Action:") would be cut off, as the reference does (`tokenize_prompt`)."""
        dim = self.cfg.state_dim
        count = max(
            tokenize_prompt(self.tokenizer, build_prompt(task, np.full(dim, b)), self.prompt_len).num_tokens
            for b in (-1, 0, 128, 255)
        )
        return count, self.prompt_len

    def postprocess(self, actions: torch.Tensor, model_state: np.ndarray | None = None) -> np.ndarray:
        """(1, horizon, padded action dim) normalised -> (horizon, action_dim) robot units, float32.
        model_state: the call's state in the checkpoint's convention (ActionSpace.state_to_model), which
        delta actions are offsets from; needed unless the action space is the identity."""
        raw = actions[0, :, : self.cfg.action_dim].float().cpu().numpy()
        unnormalized = self.stats.actions.unnormalize(raw)
        if self.space.identity:
            return unnormalized.astype(np.float32)
        if model_state is None:
            raise ValueError("postprocess: this checkpoint's actions need the call's state (model_state)")
        return self.space.actions_to_robot(unnormalized, model_state)

    @torch.no_grad()
    def infer(self, obs: Observation, noise: torch.Tensor | None = None) -> ActionChunk:
        start = time.perf_counter()
        if noise is not None:
            self._check_noise(noise)
        inputs, num_tokens, truncated, model_state = self._prepare(obs)
        self._model_state = model_state  # for an audit of this call (_robot_error)
        if noise is None:
            noise = torch.randn(1, self.model_cfg.horizon, self.model_cfg.action_dim, generator=self._noise)
        t_model = time.perf_counter()
        if self.rmuscle is not None:
            self._set_task(obs.prompt)
            raw, info = self.rmuscle.infer(inputs, noise)
            span = self.rmuscle.last_gpu_span
        else:
            span = self._dense_span
            if span is not None:
                span[0].record(torch.cuda.current_stream(self.device))
            raw, info = self.engine.sample_actions(inputs, noise), CallInfo("dense", 0.0, reason="no cache")
            if span is not None:
                span[1].record(torch.cuda.current_stream(self.device))
        actions = self.postprocess(raw, model_state)  # .cpu() synchronises the device
        if not np.isfinite(actions).all():
            self._refuse(actions, info)
        t_end = time.perf_counter()
        timings = {"preprocess": t_model - start, "model_and_postprocess": t_end - t_model}
        if span is not None:  # the call's GPU work, from its first kernel's start to its last one's end
            span[1].synchronize()
            timings["gpu"] = span[0].elapsed_time(span[1]) / 1e3
        return ActionChunk(
            actions=actions,
            stamp_ns=obs.stamp_ns,
            latency_s=t_end - start,
            prompt_tokens=num_tokens,
            prompt_truncated=truncated,
            timings_s=timings,
            cache_mode=info.mode,
            cache_similarity=info.similarity,
        )

    def _check_noise(self, noise: object) -> None:
        """A caller's noise: one observation's, as floats (found in review: integer noise ran truncated, and
        the fused engine named a batch where the shape lacked its batch axis)."""
        horizon, action_dim = self.model_cfg.horizon, self.model_cfg.action_dim
        if not isinstance(noise, torch.Tensor) or not noise.is_floating_point():
            kind = noise.dtype if isinstance(noise, torch.Tensor) else type(noise).__name__
            raise ValueError(
                f"noise must be a floating-point torch.Tensor of shape {(1, horizon, action_dim)}, got {kind}"
            )
        check_noise(noise, 1, horizon, action_dim)

    def _refuse(self, actions: np.ndarray, info: CallInfo) -> None:
        """A chunk with NaN or Inf: raise NonFiniteActions naming where, and (with the cache) keep the
        episode out of the library, since its recorded calls may hold the same fault."""
        bad = ~np.isfinite(actions)
        step, joint = (int(i) for i in np.argwhere(bad)[0])
        excluded = ""
        if self.rmuscle is not None:
            self.rmuscle.exclude_episode("a call produced non-finite actions")
            excluded = "; this episode will not be recorded into the library"
            if info.mode == "cached":  # its references may hold the fault: not served from again (review)
                self.rmuscle.fall_back("a cached call produced non-finite actions")
                excluded += " and runs dense from now on"
        raise NonFiniteActions(
            f"the model produced non-finite actions ({int(bad.sum())} of {bad.size} values, the first at step "
            f"{step}, action {joint}; {info.mode} call){excluded}"
        )

    # ── rMuscle hooks (no-ops without a cache) ───────────────────────────────────────────────────────────

    def reset_episode(self) -> int | None:
        """A new episode on the cell; returns the library id the finished episode was recorded as."""
        self._check_open()
        return self.rmuscle.reset_episode() if self.rmuscle is not None else None

    def rebuild_cache(self, max_entries: int | None = None, wait: bool = False) -> int:
        """Refill the sliding window (call while the arm executes a chunk). Returns entries started;
        `wait`: once they are built."""
        return self.rmuscle.rebuild(max_entries, wait) if self.rmuscle is not None else 0

    def rebuild_cache_slice(self, wait: bool = False) -> tuple[bool, bool]:
        """One part of the window's refill (an entry is rebuilt in `rebuild_slices` parts): (whether a part
        was queued, whether it completed an entry); `wait`: once it ran. (False, False) without a cache."""
        return self.rmuscle.rebuild_slice(wait) if self.rmuscle is not None else (False, False)

    def cache_audit_due(self) -> bool:
        """Whether the latest chunk was a cached one due for an audit (`audit_cache`) before the next call."""
        return self.rmuscle is not None and self.rmuscle.audit_due

    def audit_cache(self) -> Audit | None:
        """Audit the latest call if it is due for one (RMuscle.audit): the same call again dense, and the
        cached chunk's relative L2 error against it in robot units (the chunks as published). None if no
        audit was due."""
        return self.rmuscle.audit(self._robot_error) if self.rmuscle is not None else None

    def _robot_error(self, cached: torch.Tensor, dense: torch.Tensor) -> float:
        return relative_l2(
            torch.from_numpy(self.postprocess(cached, self._model_state)),
            torch.from_numpy(self.postprocess(dense, self._model_state)),
        )

    def reconfigure_cache(self, **changes: object) -> None:
        """Change rMuscle settings that may change between calls (RMuscle.LIVE_SETTINGS)."""
        if self.rmuscle is None:
            raise RuntimeError("this policy runs without the rMuscle cache")
        self.rmuscle.reconfigure(**changes)

    def cache_entries_missing(self) -> int:
        """Entries the cache wants rebuilt before the next call (0 without a cache)."""
        return self.rmuscle.missing_entries() if self.rmuscle is not None else 0

    def cache_status(self) -> dict[str, object] | None:
        return self.rmuscle.status() if self.rmuscle is not None else None

    def cache_call_status(self) -> dict[str, object] | None:
        """The latest call's mode, similarity, reference (library episode and call; -1 unless cached) and hit
        rate, and the episode they count in (RMuscle.call_status), read without touching the disk: cheap
        and safe for every call."""
        return self.rmuscle.call_status() if self.rmuscle is not None else None

    def cache_would_record(self) -> bool:
        """Whether the episode so far would be recorded into the library at its reset (RMuscle.would_record);
        False without a cache."""
        return self.rmuscle is not None and self.rmuscle.would_record()

    def discard_episode(self, reason: str) -> bool:
        """Keep the episode in progress out of the library (e.g. the attempt failed: the cache must not
        learn it). Its calls so far are dropped and later ones are not recorded, until the next
        `reset_episode`. Returns whether there is a cache to keep it out of."""
        if self.rmuscle is None:
            return False
        self.rmuscle.exclude_episode(reason)
        return True

    def device_fault(self, *, wait_all: bool = True) -> str | None:
        """None if the policy's GPU still runs work (or the policy runs on the CPU), else what checking it
        raised. After an asynchronous CUDA fault (an illegal address, an uncorrectable ECC error, a GPU
        fallen off the bus) the process's CUDA context is lost for good: every later call raises, and only
        a new process gets a working one. A call that raised for another reason (out of memory, a bad
        input) leaves the context working, and this says None, also with the GPU's memory full.

        The check runs two tiny kernels on a tensor allocated at construction and reads the result back on
        the calling thread's stream; with `wait_all` it first waits for the GPU's queued work on every
        stream (after a call raised: a fault still pending in its work then shows). Without it, a stream
        that hangs (the next call's match work, say) cannot hang the check; a fault that has already
        happened shows all the same, the lost context failing every later CUDA call. An error that
        does not lose the context (left over from other work) is raised once and then cleared, so the
        check runs twice and only an error in both counts. What it says is one line: PyTorch's CUDA
        errors carry several lines of advice after the error itself."""
        probe = self._device_probe
        if probe is None:
            return None
        fault = None
        for _ in range(2):
            try:
                if wait_all:
                    torch.cuda.synchronize(self.device)
                got = float(probe.fill_(1.0).add_(1.0).item())
            except torch.OutOfMemoryError:  # nothing here allocates on the GPU; were it to, a full GPU works
                return None
            except Exception as e:
                fault = fault or first_line(e)  # the first names the fault best
                continue
            return None if got == 2.0 else f"a probe kernel on {self.device} computed {got}, not 2.0"
        return fault

    def close(self) -> int | None:
        """Record the current episode if it qualifies and release the cache's temporary files. Later calls
        raise (before, found in review, they ran dense and unrecorded without a word)."""
        self._closed = True
        rm, self.rmuscle = self.rmuscle, None
        return rm.close() if rm is not None else None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the policy is closed (Policy.close): make a new one to run it again")


def first_line(e: BaseException) -> str:
    """An exception as "Type: its message's first line" (a CUDA error's advice lines dropped)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def synthetic_observation(
    cfg: PolicyConfig,
    prompt: str,
    *,
    seed: int = 0,
    size: tuple[int, int] = (480, 640),
    cameras: Sequence[str] | None = None,
) -> Observation:
    """A random ALOHA-like observation (480×640 RGB per camera, a state in the stats' range)."""
    rng = np.random.default_rng(seed)
    names = cfg.cameras if cameras is None else cameras
    images = {name: rng.integers(0, 256, (*size, 3), dtype=np.uint8) for name in names}
    state = rng.uniform(-1.0, 1.0, cfg.state_dim).astype(np.float32)
    return Observation(images=images, state=state, prompt=prompt)
