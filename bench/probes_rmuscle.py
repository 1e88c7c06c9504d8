"""Fidelity probes of rMuscle's two caches, on the CPU (issue #4 item 7).

DESIGN.md §4 quotes four published figures for rMuscle; this script measures the same quantities on our
engine, on a synthetic repetitive factory task, for a model with (a) seeded random weights and (b) the
same model briefly trained by flow matching on that task:

1. Context Cache: the fraction of the visual tokens' FFN-output change (live vs matched reference) that
   the top ρp tokens by FFN-input drift account for, per prefix layer (published ≈ 80 % at ρp = 0.4).
2. Action Cache: the fraction of the contribution score that the top ρn expert neurons keep
   (published 84.4 % at ρn = 0.5).
3. Mask overlap of a live call with its matched reference call (same task) and with a call of another
   task (another scene and prompt) (published ≈ 86 % / ≈ 71 % at ρn = 0.5).
4. Action-chunk relative L2 error, cached vs dense, over a replayed episode (reference episode recorded
   densely, live episode served from it), for a table of (ρp, ρn); (1, 1) must be exactly 0.

The task: three cameras watch a bench on which an object follows a fixed path; the robot's 7 joint
positions are smooth functions of the episode phase τ ∈ [0, 1]. An observation at phase τ is the
rendered scene plus the π0.5 prompt "Task: <text>, State: <bin>;\nAction: " whose state is τ itself
(discretised into 256 bins); its target action chunk is the joint trajectory over the next `horizon`
control steps, zero-padded to the action width. A live episode repeats the task at phases between the
reference's, with a small change of light and sensor noise; each live call is paired with the reference
call nearest in phase (a perfect retrieval; what the runtime's retrieval picks is reported beside it).

Where the numbers come from: the Context Cache entries (per-layer FFN inputs/outputs of the visual
tokens) are the engine's own recording prefill (`rebuild_entry`) of each observation; the expert
activations are copied out of the engine's own dense recording denoise by wrapping its ops module
(nothing is recomputed), and the masks recomputed from them with `cache.sparse_ffn` are checked to equal
the masks the engine recorded. Training (b) is π0's flow-matching loss on both tasks, Adam, all
parameters, a few minutes on one CPU thread (450 steps: a partly trained policy); the report gives its
final loss and how close the trained policy's actions come to the target. `--train-device cuda` trains on
a GPU instead, where 3000 steps (a policy that does the task) took ~3 min on the H200.

Everything runs on the CPU with the `fused` engine (the graph engine's computation, float32, no graphs)
using one intra-op thread: on our shared 2-core machine, two OpenMP threads contending with another
process ran this model's stages 50–60× slower than one thread did. The default run takes ~8 minutes
(training ~5.5 of them):

    .venv/bin/python bench/probes_rmuscle.py --commit $(git rev-parse --short HEAD)
    .venv/bin/python bench/probes_rmuscle.py --no-wide --train-steps 50 --name quick   # ~1.5 min
    python bench/probes_rmuscle.py --no-wide --train-device cuda --train-steps 3000 \
        --name probes_rmuscle_tiny_trained3000_h200   # on the device machine

Writes bench/results/<name>.{md,json}, by default probes_rmuscle_tiny_cpu (date, gpu "cpu", commit,
command, setting, results).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rmuscle_ros.cache.retrieval import RetrievalConfig, Retriever, unit_rows
from rmuscle_ros.cache.sparse_ffn import (
    captured_change,
    contribution_scores,
    dense_ffn,
    kept_contribution,
    mask_overlap,
    top_neurons,
)
from rmuscle_ros.engine import create_engine
from rmuscle_ros.engine.fused import ContextRef, FusedPi05, round_up
from rmuscle_ros.engine.graph import CacheShapes, GraphEngine
from rmuscle_ros.models.checkpoint import init_random_
from rmuscle_ros.models.config import TINY_VOCAB_SIZE, GemmaConfig, Pi05Config, VisionConfig, get_preset
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model, PrefixCache
from rmuscle_ros.models.tokenizer import ByteTokenizer
from rmuscle_ros.runtime.transforms import build_prompt, discretize_state, tokenize_prompt

# The figures DESIGN.md §4 quotes from the published description (not measured here).
PUBLISHED = {
    "context_captured_at_rho_p_0.4": 0.80,
    "action_kept_at_rho_n_0.5": 0.844,
    "mask_overlap_same_task_at_rho_n_0.5": 0.86,
    "mask_overlap_cross_task_at_rho_n_0.5": 0.71,
}

# `tiny` with twice the widths, four times the MLP widths and depth 4 (3 prefix FFN layers instead of 1).
WIDE = Pi05Config(
    vision=VisionConfig(width=128, depth=4, mlp_dim=256, num_heads=4),
    vlm=GemmaConfig(width=256, depth=4, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32),
    expert=GemmaConfig(width=128, depth=4, mlp_dim=512, num_heads=8, num_kv_heads=1, head_dim=32),
    vocab_size=TINY_VOCAB_SIZE,
)

JOINTS = 7  # real action dims; the rest of action_dim is zero padding, as for a 7-DoF arm
CONTROL_STEPS = 200  # control steps per episode: a chunk of 50 spans a quarter of the task

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[probes {time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


# ── 1. A synthetic repetitive task ───────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Task:
    """One factory task: its instruction, its bench, and how the arm and the object move with phase τ."""

    text: str
    background_seed: int
    colour: tuple[float, float, float]  # RGB offset of the object, in [-1, 1] image units
    path: Callable[[float], tuple[float, float]]  # τ -> object centre (x, y) as fractions of the image
    joint_offset: float  # phase offset of the joint trajectories (tasks move the arm differently)


TASKS = {
    "pick": Task(
        "pick up the red block and place it in the bin",
        1234,
        (1.0, 0.4, -0.5),
        lambda tau: (0.25 + 0.5 * tau, 0.6 - 0.3 * math.sin(math.pi * tau)),
        0.0,
    ),
    "wipe": Task(
        "wipe the table with the blue sponge",
        4321,
        (-0.5, 0.2, 1.0),
        lambda tau: (0.5 + 0.25 * math.cos(2 * math.pi * tau), 0.5 + 0.2 * math.sin(2 * math.pi * tau)),
        1.7,
    ),
}

# A planner's subtask of "pick" (the instruction a `cache.task` job may carry at one call): the live
# episode's observations with this prompt instead, served from the reference recorded under the task's own.
SUBTASK_TEXT = "grasp the red block"

JOINT_FREQS = torch.tensor([0.25, 0.5, 0.5, 0.75, 0.25, 0.5, 1.0])  # cycles per episode


def joint_positions(task: Task, tau: Tensor) -> Tensor:
    """tau (...,) -> normalised joint positions (..., JOINTS) in [-0.8, 0.8]: smooth in τ."""
    angle = 2 * math.pi * JOINT_FREQS * tau[..., None] + task.joint_offset + torch.arange(JOINTS)
    return 0.8 * torch.sin(angle)


def target_chunk(cfg: Pi05Config, task: Task, tau: float) -> Tensor:
    """The action chunk at phase τ: joint targets for the next `horizon` control steps,
    zero-padded to action_dim. -> (horizon, action_dim) float32."""
    steps = tau + torch.arange(cfg.horizon, dtype=torch.float32) / CONTROL_STEPS
    chunk = torch.zeros(cfg.horizon, cfg.action_dim)
    chunk[:, :JOINTS] = joint_positions(task, steps)
    return chunk


@cache
def _background(task_seed: int, cameras: int, size: int) -> Tensor:
    """A smooth random texture per (task, camera): the bench. (C, 3, S, S)."""
    coarse = torch.rand(cameras, 3, size // 8, size // 8, generator=torch.Generator().manual_seed(task_seed))
    return F.interpolate(coarse * 1.2 - 0.6, size=(size, size), mode="bilinear", align_corners=False)


def render(cfg: Pi05Config, task: Task, tau: float, light: float, sensor_noise: float, seed: int) -> Tensor:
    """The camera images at phase τ: bench + object, scaled by `light`, plus Gaussian sensor noise.
    -> (C, 3, S, S) in [-1, 1]."""
    c, s = cfg.num_cameras, cfg.vision.image_size
    img = _background(task.background_seed, c, s).clone()
    yy, xx = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    fx, fy = task.path(tau)
    colour = torch.tensor(task.colour)[:, None, None]
    for cam in range(c):  # each camera sees the object from a slightly shifted viewpoint
        cx, cy = s * fx + 10 * cam, s * fy - 8 * cam
        img[cam] += 0.9 * colour * torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * 18.0**2))
    noise = torch.randn(img.shape, generator=torch.Generator().manual_seed(seed))
    return (img * light + sensor_noise * noise).clamp(-1, 1)


def prompt(task: Task, tau: float, max_len: int) -> tuple[Tensor, Tensor]:
    """The π0.5 prompt with the discretised state, byte-tokenised. -> tokens, mask (max_len,).

    The state is the task's phase, normalised to [-1, 1] (a conveyor position, say)."""
    state = np.array([2 * tau - 1])
    tokenized = tokenize_prompt(ByteTokenizer(), build_prompt(task.text, discretize_state(state)), max_len)
    if tokenized.truncated:
        raise ValueError(f"prompt longer than {max_len} tokens")
    return torch.from_numpy(tokenized.tokens), torch.from_numpy(tokenized.mask)


def observation(
    cfg: Pi05Config, task: Task, tau: float, light: float, sensor_noise: float, seed: int
) -> ModelInputs:
    """One observation of `task` at phase τ, batch 1; the prompt is cut to its valid tokens."""
    tokens, mask = prompt(task, tau, cfg.max_token_len)
    valid = int(mask.sum())
    return ModelInputs(
        render(cfg, task, tau, light, sensor_noise, seed)[None],
        torch.ones(1, cfg.num_cameras, dtype=torch.bool),
        tokens[None, :valid],
        mask[None, :valid],
    )


@dataclass
class Episode:
    """A sequence of calls of one task: observation k at phase taus[k], each with its own seeded noise."""

    task: Task
    taus: list[float]
    inputs: list[ModelInputs]  # batch 1 each
    noises: list[Tensor]  # (1, horizon, action_dim) each

    @staticmethod
    def make(
        cfg: Pi05Config, task: Task, taus: list[float], light: float, sensor_noise: float, seed: int
    ) -> Episode:
        inputs = [observation(cfg, task, t, light, sensor_noise, seed + 17 * k) for k, t in enumerate(taus)]
        gen = torch.Generator().manual_seed(seed)
        noises = [torch.randn(1, cfg.horizon, cfg.action_dim, generator=gen) for _ in taus]
        return Episode(task, taus, inputs, noises)


def episodes(cfg: Pi05Config, calls: int) -> dict[str, Episode]:
    """The reference episode (recorded densely), the live repetition of the same task (phases between the
    reference's, light −3 %, twice the sensor noise), that repetition under a subtask's prompt, and a
    reference episode of another task."""
    ref_taus = [k / (calls - 1) for k in range(calls)]
    live_taus = [(k + 0.3) / (calls - 1) for k in range(calls - 1)]
    return {
        "reference": Episode.make(cfg, TASKS["pick"], ref_taus, 1.0, 0.01, seed=100),
        "live": Episode.make(cfg, TASKS["pick"], live_taus, 0.97, 0.02, seed=500),
        # the same images and noise as `live` (same seed), another prompt: a subtask of the same job
        "live_subtask": Episode.make(
            cfg, replace(TASKS["pick"], text=SUBTASK_TEXT), live_taus, 0.97, 0.02, seed=500
        ),
        "other_task": Episode.make(cfg, TASKS["wipe"], ref_taus, 1.0, 0.01, seed=900),
    }


# ── 2. Brief flow-matching training (π0's objective) ─────────────────────────────────────────────────


def prefill_for_training(model: Pi05Model, embs: Tensor, pad_mask: Tensor) -> PrefixCache:
    """`Pi05Model.prefill` with PyTorch's fused attention (differentiable, ~5× faster on the CPU than the
    explicit (B, H, Lp, Lp) logits), stopping at the last layer's K/V like `engine.fused`. Padded keys are
    masked; the rows of padded queries, which nothing reads, may differ from the model's. Checked against
    `Pi05Model.prefill` before training."""
    positions = pad_mask.cumsum(-1) - 1
    group = model.cfg.vlm.num_heads // model.cfg.vlm.num_kv_heads
    key_mask = pad_mask[:, None, None, :]  # (B, 1, 1, Lp): every query sees the valid keys
    keys, values = [], []
    x = embs
    last = len(model.llm.layers) - 1
    for i, layer in enumerate(model.llm.layers):
        q, k, v, gate = layer.attention_inputs(x, positions, None)
        keys.append(k)
        values.append(v)
        if i == last:
            break  # only the last layer's K/V is read (as in engine.fused)
        attn = F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=key_mask
        )  # (B, H, Lp, Dh)
        x = layer.finish(x, attn.transpose(1, 2).flatten(2), gate, None)
    return PrefixCache(keys, values, pad_mask)


def check_training_prefill(model: Pi05Model, inputs: ModelInputs) -> float:
    """Largest difference of the valid prefix K/V between `prefill_for_training` and the model's."""
    with torch.no_grad():
        embs, pad = model.embed_prefix(inputs)
        ours, theirs = prefill_for_training(model, embs, pad), model.prefill(embs, pad)
    valid = pad[:, None, :, None]
    return max(
        float(((a - b) * valid).abs().max())
        for a, b in zip(ours.keys + ours.values, theirs.keys + theirs.values, strict=True)
    )


def training_batch(cfg: Pi05Config, batch: int, gen: torch.Generator) -> tuple[ModelInputs, Tensor]:
    """Random tasks at random phases, light and sensor noise. -> inputs, target chunks (B, H, A)."""
    names = sorted(TASKS)
    parts, targets = [], []
    for _ in range(batch):
        task = TASKS[names[int(torch.randint(len(names), (), generator=gen))]]
        tau, light, noise = torch.rand(3, generator=gen).tolist()
        seed = int(torch.randint(2**31, (), generator=gen))
        parts.append(observation(cfg, task, tau, 0.9 + 0.2 * light, 0.005 + 0.025 * noise, seed))
        targets.append(target_chunk(cfg, task, tau))
    width = max(p.tokens.shape[1] for p in parts)
    pad = lambda t: F.pad(t, (0, width - t.shape[1]))  # noqa: E731
    inputs = ModelInputs(
        torch.cat([p.images for p in parts]),
        torch.cat([p.image_masks for p in parts]),
        torch.cat([pad(p.tokens) for p in parts]),
        torch.cat([pad(p.token_mask) for p in parts]),
    )
    return inputs, torch.stack(targets)


def flow_matching_loss(
    model: Pi05Model, inputs: ModelInputs, actions: Tensor, draws: int, gen: torch.Generator
) -> Tensor:
    """π0's objective: t ~ 0.999·Beta(1.5, 1) + 0.001, x_t = t·noise + (1 − t)·actions, loss =
    ‖v(x_t, t) − (noise − actions)‖². The prefix is computed once per observation and reused for `draws`
    (t, noise) samples: the expert is cheap next to the 768-token prefix, and more draws steady the loss."""
    actions = actions.repeat_interleave(draws, 0)  # (B·draws, H, A)
    b = actions.shape[0]
    t = torch.rand(b, generator=gen) ** (1 / 1.5) * 0.999 + 0.001  # Beta(1.5, 1) by its inverse CDF u^(1/1.5)
    noise = torch.randn(actions.shape, generator=gen)
    t, noise = t.to(actions.device), noise.to(actions.device)
    x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
    prefix = prefill_for_training(model, *model.embed_prefix(inputs))
    prefix = PrefixCache(
        [k.repeat_interleave(draws, 0) for k in prefix.keys],
        [v.repeat_interleave(draws, 0) for v in prefix.values],
        prefix.pad_mask.repeat_interleave(draws, 0),
    )
    return F.mse_loss(model.velocity(x_t, t, prefix), noise - actions)


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, loss: Tensor) -> float:
    """One update from `loss`: gradients clipped to norm 1, then the optimizer's and the schedule's step.
    Returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def train(
    model: Pi05Model, steps: int, batch: int, draws: int, lr: float, seed: int, device: str = "cpu"
) -> dict[str, Any]:
    """Adam on every parameter, linear warm-up over 10 % of the steps, cosine decay, gradient clip 1. On
    `device` (the data and the noise are drawn on the CPU from the same seeded generator, then moved);
    the model is back on the CPU when this returns, where the probes run."""
    gen = torch.Generator().manual_seed(seed)
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    warmup = max(1, steps // 10)
    schedule = lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        inputs, actions = training_batch(model.cfg, batch, gen)
        loss = flow_matching_loss(model, inputs.to(device), actions.to(device), draws, gen)
        losses.append(optimizer_step(model, opt, sched, loss))
        if step % 50 == 0 or step == steps - 1:
            log(f"train step {step}: loss {loss.item():.4f}")
    model.eval()
    model.to("cpu")
    window = max(1, min(20, steps // 5))
    return {
        "steps": steps,
        "batch": batch,
        "noise_draws": draws,
        "lr": lr,
        "device": device,
        "seconds": round(time.perf_counter() - start, 1),
        "first_loss": round(statistics.mean(losses[:window]), 4),
        "final_loss": round(statistics.mean(losses[-window:]), 4),
        "loss_window": window,
    }


# ── 3. Recording a call: its Context Cache entry, its masks and its expert activations ─────────────


class ActivationTap:
    """Stands in for the engine's ops module and keeps a copy of every dense `linear_geglu` output of the
    expert (the prefix FFNs' calls read other weights): in a dense or recording denoise those are exactly
    the expert FFNs' GeGLU activations, in the order (step 0: layers 0..depth−1, step 1: …)."""

    def __init__(self, ops: ModuleType, expert_gate_up: list[Tensor]) -> None:
        self._ops = ops
        self._expert = {w.data_ptr() for w in expert_gate_up}
        self.acts: list[Tensor] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def linear_geglu(self, a: Tensor, gate_up: Tensor, out: Tensor, **kw: Any) -> Tensor:
        result = self._ops.linear_geglu(a, gate_up, out, **kw)
        if not kw and gate_up.data_ptr() in self._expert:
            self.acts.append(result.clone())
        return result


@contextmanager
def tapped(fused: FusedPi05) -> Iterator[ActivationTap]:
    original = fused.ops
    tap = ActivationTap(original, [layer.gate_up_w for layer in fused.expert_layers])
    fused.ops = tap  # type: ignore[assignment]
    try:
        yield tap
    finally:
        fused.ops = original


@dataclass
class CallRecord:
    """One call run densely, with everything the probes read."""

    entry: ContextRef  # per prefix FFN layer: the visual tokens' FFN inputs and outputs
    masks: Tensor  # (steps, expert depth, S): the engine's recorded Action Cache masks at its ρn
    acts: Tensor  # (steps, expert depth, horizon, F): expert GeGLU activations
    actions: Tensor  # (horizon, action_dim)
    descriptor: np.ndarray  # (cameras, W) retrieval descriptor


def run_call(engine: GraphEngine, inputs: ModelInputs, noise: Tensor, prefill: str, denoise: str) -> Tensor:
    bucket = engine.load_inputs(inputs, noise)
    engine.run_stage("vision", bucket)
    engine.run_stage("prefill", bucket, variant=prefill)
    engine.run_stage("denoise", bucket, variant=denoise)
    return engine.actions.clone()


def record_call(engine: GraphEngine, inputs: ModelInputs, noise: Tensor) -> CallRecord:
    """A dense call with mask recording (activations tapped), then its entry rebuilt on the rebuild lane."""
    cfg = engine.cfg
    with tapped(engine.fused) as tap:
        actions = run_call(engine, inputs, noise, "dense", "record")
    if len(tap.acts) != cfg.num_steps * cfg.expert.depth:
        raise RuntimeError(f"tapped {len(tap.acts)} expert activations, expected steps × depth")
    acts = torch.stack(tap.acts).view(cfg.num_steps, cfg.expert.depth, cfg.horizon, cfg.expert.mlp_dim)
    descriptor = engine.descriptor().numpy().copy()
    entry = ContextRef.allocate(cfg, engine.device, engine.dtype)
    engine.rebuild_entry(inputs, entry)
    return CallRecord(entry, engine.recorded_masks.clone(), acts, actions, descriptor)


def expert_down(fused: FusedPi05, layer: int) -> Tensor:
    return fused.expert_layers[layer].down_w


def neuron_scores(fused: FusedPi05, call: CallRecord) -> Tensor:
    """Contribution scores of every (step ≥ 1, expert layer), against step 0 (the anchor). (steps−1, depth, F)."""
    steps, depth = call.acts.shape[:2]
    rows = [
        torch.stack(
            [
                contribution_scores(call.acts[s, i], call.acts[0, i], expert_down(fused, i))
                for i in range(depth)
            ]
        )
        for s in range(1, steps)
    ]
    return torch.stack(rows)


def match(
    live_taus: list[float], ref_taus: list[float], live: list[CallRecord], ref: list[CallRecord]
) -> list[dict[str, Any]]:
    """Each live call's matched reference: the reference call nearest in phase (same task), i.e. a perfect
    retrieval. The runtime's retrieval (cosine of descriptors, aligned window, threshold off) runs alongside
    on the same descriptors; what it picked and the cosine similarity are reported, not used."""
    rows = np.stack([r.descriptor.ravel() for r in ref])
    rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    retriever = Retriever(RetrievalConfig(threshold=-1.0), {0: np.stack([r.descriptor for r in ref])})
    out = []
    for k, (tau, call) in enumerate(zip(live_taus, live, strict=True)):
        position = min(range(len(ref_taus)), key=lambda j: abs(ref_taus[j] - tau))
        q = call.descriptor.ravel() / np.linalg.norm(call.descriptor)
        picked = retriever.query(call.descriptor)[0]
        similarity = float(rows[position] @ q)
        out.append(
            {"call": k, "position": position, "similarity": similarity, "retrieval_position": picked.position}
        )
    return out


# ── 4. The probes ────────────────────────────────────────────────────────────────────────────────────


def context_probe(
    fused: FusedPi05, live: list[CallRecord], ref: list[CallRecord], matches: list[dict], rhos: list[float]
) -> dict[str, Any]:
    """Probe 1, per prefix FFN layer and ρp, averaged over the live calls: the captured change (top ρp by
    input drift, the cache's rule), the best any ρp of the tokens could capture (top ρp by output change)
    and what a random choice captures on average (ρp)."""
    depth = live[0].entry.ffn_in.shape[0]
    captured = {rho: [[] for _ in range(depth)] for rho in rhos}
    oracle = {rho: [[] for _ in range(depth)] for rho in rhos}
    for m in matches:
        now, then = live[m["call"]].entry, ref[m["position"]].entry
        for i in range(depth):
            w = fused.prefix_layers[i]
            w_gate, w_up = w.gate_up_w.chunk(2)  # gate_up rows are [W_gate; W_up]
            recomputed = dense_ffn(now.ffn_in[i], w_gate, w_up, w.down_w)
            if not torch.allclose(recomputed, now.ffn_out[i], rtol=1e-4, atol=1e-4):
                raise RuntimeError("sparse_ffn.dense_ffn does not reproduce the engine's prefix FFN")
            change = (now.ffn_out[i] - then.ffn_out[i]).pow(2).sum(-1)
            for rho in rhos:
                captured[rho][i].append(
                    captured_change(
                        now.ffn_in[i],
                        then.ffn_in[i],
                        then.ffn_out[i],
                        w_gate,
                        w_up,
                        w.down_w,
                        rho,
                        scale=fused.ffn_in_scale[i],  # the engine's rule: the FFN input's own drift
                    )
                )
                k = math.ceil(rho * change.shape[0])
                oracle[rho][i].append(float(change.topk(k).values.sum() / change.sum()))
    mean = statistics.mean
    return {
        f"{rho:g}": {
            "captured_per_layer": [round(mean(c), 4) for c in captured[rho]],
            "captured_mean": round(mean(mean(c) for c in captured[rho]), 4),
            "best_possible_mean": round(mean(mean(c) for c in oracle[rho]), 4),
            "random_choice": rho,
        }
        for rho in rhos
    }


def action_probe(
    fused: FusedPi05,
    live: list[CallRecord],
    ref: list[CallRecord],
    other: list[CallRecord],
    matches: list[dict],
    rhos: list[float],
) -> dict[str, Any]:
    """Probes 2 and 3 at each ρn, averaged over the live calls, denoising steps 1..9 and expert layers.

    kept_own: the published metric — the share of a call's total contribution score its own top ρn neurons
    hold. kept_with_reference_mask: the share held by the matched reference's top ρn, the set the Action
    Cache actually updates. overlap_same_task / overlap_other_task: |S_live ∩ S_ref| / |S_live| against the
    matched reference call and against the other task's call at the same position."""
    live_s, ref_s, other_s = ([neuron_scores(fused, c) for c in calls] for calls in (live, ref, other))
    rows: dict[str, dict[str, list[float]]] = {f"{r:g}": {} for r in rhos}
    for m in matches:
        now, same, cross = live_s[m["call"]], ref_s[m["position"]], other_s[m["position"]]
        for rho in rhos:
            acc = rows[f"{rho:g}"]
            for s in range(now.shape[0]):
                for i in range(now.shape[1]):
                    mine = top_neurons(now[s, i], rho)
                    theirs = top_neurons(same[s, i], rho)
                    acc.setdefault("kept_own", []).append(kept_contribution(now[s, i], rho))
                    acc.setdefault("kept_with_reference_mask", []).append(
                        float(now[s, i][theirs].sum() / now[s, i].sum())
                    )
                    acc.setdefault("overlap_same_task", []).append(mask_overlap(mine, theirs))
                    acc.setdefault("overlap_other_task", []).append(
                        mask_overlap(mine, top_neurons(cross[s, i], rho))
                    )
    return {
        r: {name: round(statistics.mean(v), 4) for name, v in acc.items()} | {"random_choice": float(r)}
        for r, acc in rows.items()
    }


def masks_agree(fused: FusedPi05, call: CallRecord, rho_n: float) -> bool:
    """The masks recomputed with sparse_ffn from the tapped activations are the engine's recorded ones."""
    scores = neuron_scores(fused, call)
    return all(
        torch.equal(top_neurons(scores[s - 1, i], rho_n), call.masks[s, i].long())
        for s in range(1, call.masks.shape[0])
        for i in range(call.masks.shape[1])
    )


def rel_l2(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def episode_error(
    model: Pi05Model,
    bucket: int,
    episodes_: dict[str, Episode],
    ref: list[CallRecord],
    matches: list[dict],
    pairs: list[tuple[float, float]],
) -> dict[str, Any]:
    """Probe 4. Per (ρp, ρn), an engine with those cache shapes records the reference episode's masks
    (dense calls, variant "record"); each live call is then run dense and cached (its matched reference's
    rebuilt entry and masks loaded) on the same inputs and noise. Also, against the task's target chunk
    (joint dims only), the dense and the cached actions' relative L2 error."""
    cfg = model.cfg
    reference, live = episodes_["reference"], episodes_["live"]
    out: dict[str, Any] = {}
    for rho_p, rho_n in pairs:
        engine = create_engine("fused", model, "cpu", buckets=[bucket], cache=CacheShapes(rho_p, rho_n))
        masks = []
        for inputs, noise in zip(reference.inputs, reference.noises, strict=True):
            run_call(engine, inputs, noise, "dense", "record")
            masks.append(engine.recorded_masks.clone())
        errors, dense_task, cached_task, subtask_errors = [], [], [], []
        for m in matches:
            for name in ("live", "live_subtask"):
                inputs, noise = episodes_[name].inputs[m["call"]], episodes_[name].noises[m["call"]]
                dense = run_call(engine, inputs, noise, "dense", "dense")
                engine.load_reference(ref[m["position"]].entry, masks[m["position"]])
                cached = run_call(engine, inputs, noise, "cached", "cached")
                if (rho_p, rho_n) == (1.0, 1.0) and not torch.equal(cached, dense):
                    raise AssertionError("ρp = ρn = 1 must give the dense actions bit for bit")
                if name == "live_subtask":
                    subtask_errors.append(rel_l2(cached, dense))
                    continue
                errors.append(rel_l2(cached, dense))
                target = target_chunk(cfg, live.task, live.taus[m["call"]])[:, :JOINTS]
                dense_task.append(rel_l2(dense[:, :JOINTS], target))
                cached_task.append(rel_l2(cached[:, :JOINTS], target))
        out[f"p{rho_p:g}_n{rho_n:g}"] = {
            "rho_p": rho_p,
            "rho_n": rho_n,
            "rel_l2_median": statistics.median(errors),
            "rel_l2_max": max(errors),
            "vs_target_dense_median": round(statistics.median(dense_task), 4),
            "vs_target_cached_median": round(statistics.median(cached_task), 4),
            # the same calls under the subtask's prompt, served from the reference recorded under the task's
            "rel_l2_median_subtask_prompt": statistics.median(subtask_errors),
        }
        log(f"  episode ρp={rho_p:g} ρn={rho_n:g}: rel L2 median {statistics.median(errors):.3g}")
    return out


def reference_gap(
    model: Pi05Model, bucket: int, episodes_: dict[str, Episode], matches: list[dict]
) -> dict[str, float]:
    """How far each live call is from its matched reference, for scale in probe 4: the dense actions of the
    reference observation vs the live one (same noise: only the observation differs), and the target
    chunks at the two phases (joint dims). A well-trained policy moves about as much as its target."""
    cfg = model.cfg
    reference, live = episodes_["reference"], episodes_["live"]
    engine = create_engine("fused", model, "cpu", buckets=[bucket])
    dense_gap, target_gap = [], []
    for m in matches:
        k, j = m["call"], m["position"]
        dense = run_call(engine, live.inputs[k], live.noises[k], "dense", "dense")
        from_ref = run_call(engine, reference.inputs[j], live.noises[k], "dense", "dense")
        dense_gap.append(rel_l2(from_ref, dense))
        target = target_chunk(cfg, live.task, live.taus[k])[:, :JOINTS]
        target_gap.append(rel_l2(target_chunk(cfg, live.task, reference.taus[j])[:, :JOINTS], target))
    return {
        "dense_median": round(statistics.median(dense_gap), 4),
        "dense_max": round(max(dense_gap), 4),
        "target_median": round(statistics.median(target_gap), 4),
        "target_max": round(max(target_gap), 4),
    }


# ── 5. One model through every probe ─────────────────────────────────────────────────────────────────


def probe_model(
    model: Pi05Model, calls: int, rho_p: list[float], rho_n: list[float], pairs: list[tuple[float, float]]
) -> dict[str, Any]:
    """Record the three episodes densely (engine at ρp = 0.4, ρn = 0.5), pair each live call with its
    reference and run probes 1–3 on those records, then probe 4 with one engine per (ρp, ρn)."""
    cfg = model.cfg
    eps = episodes(cfg, calls)
    longest = max(int(i.token_mask.sum()) for e in eps.values() for i in e.inputs)
    bucket = round_up(longest, 16)
    engine = create_engine("fused", model, "cpu", buckets=[bucket], cache=CacheShapes(0.4, 0.5))
    recorded = {
        name: [record_call(engine, i, n) for i, n in zip(e.inputs, e.noises, strict=True)]
        for name, e in eps.items()
        if name != "live_subtask"  # served in probe 4 only
    }
    ref, live, other = recorded["reference"], recorded["live"], recorded["other_task"]
    matches = match(eps["live"].taus, eps["reference"].taus, live, ref)
    sims = [m["similarity"] for m in matches]
    log(f"  recorded {sum(map(len, recorded.values()))} calls; similarity min {min(sims):.6f}")
    # What the fallback threshold compares against: how similar the other task's scene looks to each live
    # call (its best match among the other task's calls), beside the same task's matched pairs above.
    live_rows, other_rows = (unit_rows(np.stack([c.descriptor for c in calls])) for calls in (live, other))
    other_sims = (live_rows @ other_rows.T).max(axis=1).tolist()
    fused = engine.fused
    return {
        "matching": {
            "similarity_min": round(min(sims), 6),
            "similarity_median": round(statistics.median(sims), 6),
            "below_runtime_threshold_0.8": sum(s < 0.8 for s in sims),
            "retrieval_agrees": sum(m["retrieval_position"] == m["position"] for m in matches),
            "live_calls": len(matches),
            "other_task_similarity_max": round(max(other_sims), 6),
            "other_task_similarity_median": round(statistics.median(other_sims), 6),
        },
        "recorded_masks_equal_sparse_ffn_top_neurons": all(masks_agree(fused, c, 0.5) for c in live),
        "context_cache": context_probe(fused, live, ref, matches, rho_p),
        "action_cache": action_probe(fused, live, ref, other, matches, rho_n),
        "episode": episode_error(model, bucket, eps, ref, matches, pairs),
        "reference_gap": reference_gap(model, bucket, eps, matches),
    }


def build_model(cfg: Pi05Config, seed: int) -> Pi05Model:
    model = Pi05Model(cfg).eval()
    init_random_(model, seed)
    return model


# ── 6. Report ────────────────────────────────────────────────────────────────────────────────────────


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def summary_table(r: dict[str, Any]) -> list[str]:
    """The published figures next to ours, one column per probed model ("—" where a ρ was not run)."""
    runs = r["results"]
    rows: list[tuple[str, str, Callable[[dict[str, Any]], float], Callable[[float], str]]] = [
        ("Context Cache: change captured by top 40 % tokens (ρp = 0.4)", pct(PUBLISHED["context_captured_at_rho_p_0.4"]),
         lambda v: v["context_cache"]["0.4"]["captured_mean"], pct),
        ("Action Cache: contribution score kept (ρn = 0.5)", pct(PUBLISHED["action_kept_at_rho_n_0.5"]),
         lambda v: v["action_cache"]["0.5"]["kept_own"], pct),
        ("Mask overlap, same task (ρn = 0.5)", pct(PUBLISHED["mask_overlap_same_task_at_rho_n_0.5"]),
         lambda v: v["action_cache"]["0.5"]["overlap_same_task"], pct),
        ("Mask overlap, other task (ρn = 0.5)", pct(PUBLISHED["mask_overlap_cross_task_at_rho_n_0.5"]),
         lambda v: v["action_cache"]["0.5"]["overlap_other_task"], pct),
        ("Action chunk rel L2, cached vs dense, (ρp, ρn) = (0.4, 0.5), median", "not published",
         lambda v: v["episode"]["p0.4_n0.5"]["rel_l2_median"], lambda x: f"{x:.3g}"),
        ("The same, each live call under a subtask's prompt (one `cache.task` job), median", "not published",
         lambda v: v["episode"]["p0.4_n0.5"]["rel_l2_median_subtask_prompt"], lambda x: f"{x:.3g}"),
        ("Action chunk rel L2, cached vs dense, (1, 1), max", "0 (by design)",
         lambda v: v["episode"]["p1_n1"]["rel_l2_max"], lambda x: f"{x:.3g}"),
    ]  # fmt: skip
    lines = [
        "## Summary: published vs measured here",
        "",
        "| quantity | published | " + " | ".join(f"ours: {name}" for name in runs) + " |",
        "|---|---|" + "---|" * len(runs),
    ]
    for label, published, get, fmt in rows:
        cells = []
        for run in runs.values():
            try:
                cells.append(fmt(get(run)))
            except KeyError:
                cells.append("—")
        lines.append(f"| {label} | {published} | " + " | ".join(cells) + " |")
    return lines


def to_markdown(r: dict[str, Any]) -> str:
    s = r["setting"]
    lines = [
        f"# rMuscle fidelity probes — CPU, {r['date']}",
        "",
        f"commit `{r['commit']}`, torch {r['torch']}, command `{r['command']}`",
        "",
        f"Task: {s['task']}",
        f"Episodes: {s['episodes']}",
        "Published figures are those DESIGN.md §4 quotes from the published rMuscle description (their "
        "model and tasks, not measured here); *ours are measured here on small models and a synthetic "
        "task*, so they show how the probes behave on this engine, not whether the published figures hold "
        "for a full-size trained π0.5.",
        "",
        *summary_table(r),
    ]
    for name, run in r["results"].items():
        tr = run.get("training")
        lines += ["", f"## {name}", "", run["description"], ""]
        if tr:
            lines += [
                f"Training: {tr['steps']} Adam steps, batch {tr['batch']}, lr {tr['lr']} (warm-up + cosine), "
                f"{tr['seconds']} s on {tr.get('device', 'cpu')}; flow-matching loss {tr['first_loss']} (mean of the first "
                f"{tr['loss_window']} steps) → **{tr['final_loss']}** (mean of the last {tr['loss_window']}). "
                "Dense policy's action error vs the target chunk (joint dims, median over the live episode): "
                f"{next(iter(run['episode'].values()))['vs_target_dense_median']} (relative L2; predicting "
                "zeros gives 1).",
                "",
            ]
        m = run["matching"]
        lines += [
            f"Matching: each live call is paired with the reference call nearest in phase. Descriptor cosine "
            f"similarity of those pairs: min {m['similarity_min']}, median {m['similarity_median']} "
            f"({m['below_runtime_threshold_0.8']} of {m['live_calls']} below the runtime's 0.8 threshold); the "
            f"runtime's retrieval picked the same reference call for {m['retrieval_agrees']} of "
            f"{m['live_calls']}. The other task's scene, for the fallback threshold: each live call's best "
            f"similarity to the other task's calls, median {m.get('other_task_similarity_median', '–')}, max "
            f"{m.get('other_task_similarity_max', '–')}. Engine's recorded masks = sparse_ffn top neurons recomputed from the tapped "
            f"activations: {run['recorded_masks_equal_sparse_ffn_top_neurons']}.",
            "",
            "**Probe 1 — Context Cache**: share of the visual tokens' FFN-output change captured by the top ρp "
            "tokens by FFN-input drift (mean over live calls; per prefix FFN layer).",
            "",
            "| ρp | captured (mean) | per layer | best possible (top ρp by change) | random choice | published |",
            "|---|---|---|---|---|---|",
        ]
        for rho, v in run["context_cache"].items():
            pub = pct(PUBLISHED["context_captured_at_rho_p_0.4"]) if rho == "0.4" else "—"
            per_layer = ", ".join(pct(x) for x in v["captured_per_layer"])
            lines.append(
                f"| {rho} | **{pct(v['captured_mean'])}** | {per_layer} | {pct(v['best_possible_mean'])} | "
                f"{pct(v['random_choice'])} | {pub} |"
            )
        lines += [
            "",
            "**Probes 2 and 3 — Action Cache** (mean over live calls, denoising steps 1–9, expert layers): "
            "contribution score kept by the call's own top ρn neurons (the published metric) and by its "
            "matched reference's mask (what the cache updates); mask overlap with the matched reference "
            "(same task) and with the other task's call.",
            "",
            "| ρn | kept, own mask | kept, reference mask | published kept | overlap same task | overlap other task | published overlap (same / other) | random choice |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for rho, v in run["action_cache"].items():
            at_half = rho == "0.5"
            pub_kept = pct(PUBLISHED["action_kept_at_rho_n_0.5"]) if at_half else "—"
            pub_overlap = (
                f"{pct(PUBLISHED['mask_overlap_same_task_at_rho_n_0.5'])} / "
                f"{pct(PUBLISHED['mask_overlap_cross_task_at_rho_n_0.5'])}"
                if at_half
                else "—"
            )
            lines.append(
                f"| {rho} | **{pct(v['kept_own'])}** | {pct(v['kept_with_reference_mask'])} | {pub_kept} | "
                f"**{pct(v['overlap_same_task'])}** | **{pct(v['overlap_other_task'])}** | {pub_overlap} | "
                f"{pct(v['random_choice'])} |"
            )
        lines += [
            "",
            "**Probe 4 — replayed episode**: action chunk relative L2 error, cached vs dense on the same "
            "inputs and noise (whole chunk, all action dims), over the live episode; each one's error "
            "against the task's target chunk (joint dims); and the cached error of the same calls under a "
            f"subtask's prompt ({SUBTASK_TEXT!r}), served from the reference recorded under the task's prompt "
            "(a job named by `cache.task` whose prompt varies).",
            "",
            "| ρp | ρn | rel L2 median | rel L2 max | vs target: dense | vs target: cached | rel L2 median, subtask prompt |",
            "|---|---|---|---|---|---|---|",
        ]
        for v in run["episode"].values():
            sub = v.get("rel_l2_median_subtask_prompt")
            lines.append(
                f"| {v['rho_p']:g} | {v['rho_n']:g} | {v['rel_l2_median']:.3g} | {v['rel_l2_max']:.3g} | "
                f"{v['vs_target_dense_median']} | {v['vs_target_cached_median']} | "
                f"{'—' if sub is None else f'{sub:.3g}'} |"
            )
        g = run["reference_gap"]
        lines += [
            "",
            "(1, 1) is asserted to be bit-identical to dense on every call (error exactly 0). For scale, how far "
            "each live call is from its matched reference: the dense actions of the reference observation vs "
            f"the live one (same noise) differ by {g['dense_median']} median / {g['dense_max']} max (rel L2); "
            f"the target chunks at the two phases by {g['target_median']} / {g['target_max']}.",
        ]
    return "\n".join(lines) + "\n"


def parse_pairs(values: list[str] | None) -> list[tuple[float, float]]:
    if not values:
        return [(1.0, 1.0), (0.4, 0.5), (0.2, 0.3), (0.6, 0.7), (0.4, 1.0), (1.0, 0.5)]
    return [tuple(map(float, v.split(","))) for v in values]  # type: ignore[misc]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=10, help="calls per reference episode")
    p.add_argument("--train-steps", type=int, default=450)
    p.add_argument(
        "--train-device",
        default="cpu",
        help="where to train (e.g. cuda, for longer training); probes run on the CPU",
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--noise-draws", type=int, default=4, help="(t, noise) samples per observation")
    p.add_argument("--lr", type=float, default=6e-3)
    p.add_argument("--seed", type=int, default=0, help="weights seed (and training data seed)")
    p.add_argument("--rho-p", type=float, nargs="+", default=[0.2, 0.4, 0.6])
    p.add_argument("--rho-n", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    p.add_argument("--pair", action="append", default=None, help="ρp,ρn for probe 4 (default: a table)")
    p.add_argument(
        "--wide", action=argparse.BooleanOptionalAction, default=True, help="also probe WIDE (random)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--name", default="probes_rmuscle_tiny_cpu")
    args = p.parse_args()
    args.pairs = parse_pairs(args.pair)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tiny = get_preset("tiny")
    probe_args = (args.calls, args.rho_p, args.rho_n, args.pairs)
    results: dict[str, Any] = {}
    log("tiny, random weights")
    results["tiny_random"] = {
        "description": f"`tiny` preset, **random weights** (init_random_, seed {args.seed}), untrained.",
    } | probe_model(build_model(tiny, args.seed), *probe_args)

    model = build_model(tiny, args.seed)
    batch, _ = training_batch(tiny, 2, torch.Generator().manual_seed(1))
    gap = check_training_prefill(model, batch)
    if gap > 1e-4:
        raise RuntimeError(f"the training prefill differs from Pi05Model.prefill by {gap}")
    log(f"tiny, training {args.train_steps} steps (training prefill matches the model's to {gap:.1e})")
    training = train(
        model, args.train_steps, args.batch, args.noise_draws, args.lr, args.seed, args.train_device
    )
    results["tiny_trained"] = {
        "description": f"`tiny` preset **trained {args.train_steps} steps** ({args.train_device}) from the same "
        "random weights: flow matching on the two synthetic tasks (random phase, light and sensor noise).",
        "training": training,
    } | probe_model(model, *probe_args)

    if args.wide:
        log("wide, random weights")
        results["wide_random"] = {
            "description": "A wider custom config (vision 128×4, VLM 256×4 with MLP 1024, expert 128×4 with "
            f"MLP 512; 3 prefix FFN layers), **random weights** (seed {args.seed}), untrained.",
            "config": WIDE.to_dict(),
        } | probe_model(build_model(WIDE, args.seed), *probe_args)

    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": "cpu",
        "commit": args.commit,
        "command": " ".join(["python", *sys.argv]),
        "torch": torch.__version__,
        "setting": {
            "preset": "tiny",
            "engine": "fused (CPU, float32, no graphs)",
            "threads": args.threads,
            "cameras": tiny.num_cameras,
            "steps": tiny.num_steps,
            "horizon": tiny.horizon,
            "calls_per_episode": args.calls,
            "task": "three cameras, a textured bench and an object moving along a fixed path with the episode "
            "phase τ; prompt = π0.5 task text + the state τ (discretised, 256 bins); target chunk = "
            f"{JOINTS} joints' smooth trajectories over the next {tiny.horizon} of {CONTROL_STEPS} control "
            f"steps, zero-padded to {tiny.action_dim} action dims.",
            "episodes": f"reference: task 'pick' at τ = k/{args.calls - 1}, light 1.0, sensor noise σ 0.01; "
            f"live: same task at τ = (k + 0.3)/{args.calls - 1} ({args.calls - 1} calls), light 0.97, σ 0.02; "
            "other task: 'wipe' (another bench, object path, colour and prompt) at the reference phases. Every "
            "call draws its own seeded noise; the Action Cache has one dense anchor step.",
            "rho_p": args.rho_p,
            "rho_n": args.rho_n,
            "published": PUBLISHED,
        },
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(to_markdown(record))
    print(to_markdown(record), flush=True)
    log("done")


if __name__ == "__main__":
    main()
