"""Success rate in closed loop on the simulated ALOHA: the same trained policy dense and with rMuscle.

The product's claim is "faster, with unchanged success rates". The speed benchmarks measure the first
half; this measures the second on a task that can fail: gym-aloha's transfer-cube, simulated in MuJoCo
(rmuscle_ros.sim), with a `tiny` (or `small`, `--preset`) π0.5 trained here from scripted demonstrations.
Three stages:

  collect   scripted demonstrations (rmuscle_ros.sim.scripted, privileged cube pose) of the seeds asked
            for; the successful ones are kept: the top camera at 10 Hz, 168×224 (what Policy.preprocess
            makes of a 480×640 ALOHA frame before padding), each frame zlib-compressed, the 14-D state
            at those frames, the 14-D commanded targets at every 50 Hz step, in one safetensors file
            (~0.4 MiB and ~4 s per episode on the 2-core CPU). `--placement-spread` as in SimConfig.
  train     flow matching (π0's objective, bench/probes_rmuscle.py's loss) on those, every parameter
            of the preset from its seeded random start, on a GPU. The inputs are made by Policy.preprocess
            itself, so training sees what the deployed policy sees. Writes model.safetensors (LeRobot
            key names, what the node's `checkpoint` parameter loads) and norm_stats.json (openpi
            layout: q01/q99 of the demonstrations' state and actions). `--state-noise` perturbs the
            prompt's state: without it the policy ignored the camera (see `train`).
  evaluate  closed loop on the CPU, with no ROS: per episode the sim is reset to a seed, the policy is
            called every `--replan` steps on the rendered top frame and the measured state, and the
            sim takes the chunk's rows in between. Two policies from the same files, the same seeds
            and the same noise per call: `dense` (fused engine, no cache) and `rmuscle` (fused engine,
            Context + Action Cache at ρp/ρn). rMuscle's library is warmed up first by dense episodes of
            other seeds; failed episodes are kept out of it (`discard_episode`), as a cell would; its
            window is refilled after every call (the motion window), as the node does. During
            the rMuscle episodes a third, dense policy is called on the same inputs, so every call's
            action error (relative L2, cached vs dense on the same observation) is measured too.
            `--latency-steps N`: each chunk takes over N steps after its observation, the previous one
            going on meanwhile, as a call's latency costs through the node (whose streamer reports the
            row its chunks took over at). With `--node`, the streamer's fixed execution delay
            (`takeover_delay_s`, N control periods): every chunk then takes over at row N whatever its
            call's latency (a later one on arrival, counted), so dense and cached calls that differ in
            speed hand the arms the same rows.
            `--node`: instead, the same files through the deployed stack (rmuscle_node, action_streamer
            and aloha_sim on DDS: `through_node`), dense and per ρ; no action error there, but the run's
            timing (latency, takeover rows, the calls' wait after their tick). `--keep DIR` keeps each
            run's recorded chunks and logs; `--dense-only` runs no rMuscle variant.

Results go to bench/results/<name>.{md,json}. Commands (the data and the checkpoint in an ignored
folder, bench/_dev_sim/; the device tool carries them there and back):

    .venv/bin/python bench/sim_success.py collect --seeds 0-99 --placement-spread 0.25 \\
        --out bench/_dev_sim/demos_fixtured.safetensors                                  # ~7 min
    python bench/sim_success.py train --data bench/_dev_sim/demos_fixtured.safetensors --preset small \\
        --out /tmp/policy_fixtured --minutes 6.3 --lr 5e-4 --state-noise 0.3             # H200, ~6.5 min
    # `small`'s model.safetensors (41.7 MB) is over the device's 16 MiB a file that comes back from $OUT:
    # `split -b 15M` it into $OUT with the folder's sha256 (and copy its two JSON files), then here `cat`
    # the parts into bench/_dev_sim/policy_fixtured/ and `sha256sum -c` (2026-12-04: a 394 s device call).
    .venv/bin/python bench/sim_success.py evaluate --policy bench/_dev_sim/policy_fixtured \\
        --seeds 1000-1049 --warmup-seeds 2000-2007 --rho 0.4,0.5 0.2,0.3 --commit $(git rev-parse --short HEAD)

evaluate takes the preset and the placement spread the policy was trained on (training.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rmuscle_ros.cache.runtime import (  # the audits' measure, so the shadow's is the same
    LEARNING_REASON,
    relative_l2,
)
from rmuscle_ros.engine.fused import NEURON_SCHEDULES
from rmuscle_ros.models.config import PRESETS
from rmuscle_ros.sim.aloha import SIDES, AlohaSim, SimConfig, SimulationDiverged
from rmuscle_ros.sim.scripted import EPISODE_STEPS, TransferCubeDemonstrator

PROMPT = "transfer the cube to the other arm"
CAMERA = "top"  # ACT's simulated tasks see through this one camera as well
FRAME_HEIGHT, FRAME_WIDTH = 168, 224  # a 480×640 frame fitted into the model's 224×224, before padding
FRAME_EVERY = 5  # steps between recorded frames: 10 Hz at the sim's 50 Hz
STATE_DIM = ACTION_DIM = 14
PROBE_STEPS = 40  # training steps (the second half of them) timed to fit the rest into the time given


def log(msg: str) -> None:
    print(f"[sim_success] {msg}", file=sys.stderr, flush=True)


def parse_seeds(text: str) -> list[int]:
    """'0-9,20,30-31' -> [0, ..., 9, 20, 30, 31]."""
    seeds: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        seeds.extend(range(int(first), int(last or first) + 1))
    return seeds


def make_sim(placement_spread: float) -> AlohaSim:
    return AlohaSim(
        SimConfig(
            task="transfer_cube",
            cameras=(CAMERA,),
            height=FRAME_HEIGHT,
            width=FRAME_WIDTH,
            placement_spread=placement_spread,
        )
    )


def measured_state(sim: AlohaSim) -> np.ndarray:
    """Per arm six joints (rad) and the gripper as the finger's opening, 0 closed ... 1 open: what the
    ALOHA profile (config/rmuscle_aloha.yaml) makes of a follower's joint_states."""
    closed, opened = sim.config.finger_range
    parts = []
    for side in SIDES:
        positions, _ = sim.joint_state(side)
        parts += [*positions[:6], (positions[7] - closed) / (opened - closed)]
    return np.asarray(parts, dtype=np.float32)


def command(sim: AlohaSim, action: np.ndarray) -> None:
    """One 14-D action (per arm six joints, then the gripper opening) as the arms' commands."""
    closed, opened = sim.config.gripper_joint_range
    for i, side in enumerate(SIDES):
        row = action[7 * i : 7 * i + 7]
        sim.command_arm(side, row[:6])
        sim.command_gripper(side, closed + float(row[6]) * (opened - closed))


# ── collect ──────────────────────────────────────────────────────────────────────────────────────────


def collect(seeds: list[int], out: Path, placement_spread: float) -> None:
    from safetensors.numpy import save_file

    sim = make_sim(placement_spread)
    blobs: list[bytes] = []
    states, actions, frame_step, kept, failed = [], [], [], [], []
    start = time.perf_counter()
    for seed in seeds:
        sim.reset(seed)
        demo = TransferCubeDemonstrator(sim)
        ep_blobs, ep_states, ep_actions, ep_steps = [], [], [], []
        for step in range(EPISODE_STEPS):
            if step % FRAME_EVERY == 0:
                ep_blobs.append(zlib.compress(sim.render(CAMERA).tobytes(), 6))
                ep_states.append(measured_state(sim))
                ep_steps.append(step)
            targets = demo.act(step)
            ep_actions.append(np.concatenate([targets[side] for side in SIDES]).astype(np.float32))
            sim.step()
        if sim.reward < sim.max_reward:  # the demonstrator's failures (~1 in 10) are not demonstrations
            failed.append(seed)
            continue
        base = len(actions) * EPISODE_STEPS
        kept.append(seed)
        blobs += ep_blobs
        states += ep_states
        actions.append(np.stack(ep_actions))
        frame_step += [base + s for s in ep_steps]
    sim.close()
    if not kept:
        raise SystemExit(f"no seed of {seeds} gave a successful demonstration")
    offsets = np.cumsum([0] + [len(b) for b in blobs]).astype(np.int64)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "frames_zlib": np.frombuffer(b"".join(blobs), dtype=np.uint8).copy(),
            "frame_offsets": offsets,
            "state": np.stack(states),
            "frame_step": np.asarray(frame_step, dtype=np.int64),
            "actions": np.concatenate(actions),
        },
        str(out),
        metadata={
            "what": "scripted transfer_cube demonstrations (bench/sim_success.py collect)",
            "seeds": json.dumps(kept),
            "failed_seeds": json.dumps(failed),
            "camera": CAMERA,
            "frame_shape": json.dumps([FRAME_HEIGHT, FRAME_WIDTH, 3]),
            "frame_every_steps": str(FRAME_EVERY),
            "episode_steps": str(EPISODE_STEPS),
            "prompt": PROMPT,
            "placement_spread": str(placement_spread),
        },
    )
    log(
        f"{len(kept)} demonstrations ({len(failed)} failed: {failed}), {len(blobs)} frames, "
        f"{out.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - start:.0f} s -> {out}"
    )


def load_demos(path: Path) -> dict[str, Any]:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    shape = tuple(json.loads(meta["frame_shape"]))
    blob, offsets = tensors["frames_zlib"].tobytes(), tensors["frame_offsets"]
    frames = [
        np.frombuffer(bytearray(zlib.decompress(blob[offsets[i] : offsets[i + 1]])), dtype=np.uint8).reshape(
            shape
        )
        for i in range(len(offsets) - 1)
    ]
    return {"frames": frames, **{k: tensors[k] for k in ("state", "frame_step", "actions")}, "meta": meta}


# ── train ────────────────────────────────────────────────────────────────────────────────────────────


def write_norm_stats(state: np.ndarray, actions: np.ndarray, path: Path) -> None:
    """openpi's norm_stats.json layout, which `load_norm_stats` reads: q01/q99 per dimension."""

    def entry(x: np.ndarray) -> dict[str, list[float]]:
        return {
            "mean": x.mean(0).tolist(),
            "std": x.std(0).tolist(),
            "q01": np.quantile(x, 0.01, axis=0).tolist(),
            "q99": np.quantile(x, 0.99, axis=0).tolist(),
        }

    path.write_text(json.dumps({"norm_stats": {"state": entry(state), "actions": entry(actions)}}, indent=1))


def chunk_targets(demos: dict[str, Any], horizon: int) -> np.ndarray:
    """(frames, horizon, 14): each frame's next `horizon` commanded targets, from its own step on; past the
    episode's end the last target repeats (the arm holds it)."""
    actions, steps = demos["actions"], demos["frame_step"]
    out = np.empty((len(steps), horizon, ACTION_DIM), dtype=np.float32)
    for i, g in enumerate(steps):
        end = (g // EPISODE_STEPS + 1) * EPISODE_STEPS
        idx = np.minimum(np.arange(g, g + horizon), end - 1)
        out[i] = actions[idx]
    return out


def train(
    data: Path,
    out: Path,
    steps: int,
    batch: int,
    draws: int,
    lr: float,
    seed: int,
    minutes: float,
    state_noise: float,
    state_dropout: float,
    preset: str = "tiny",
) -> None:
    """`preset` from its seeded random start; `steps` at most; fewer if the first PROBE_STEPS say they
    would take longer than `minutes` (the cosine schedule then spans the steps that fit).

    `state_noise` (std, in normalised units) and `state_dropout` (the probability that a sample's state is
    replaced by the middle of its range) act on the state in the prompt. Without them the first policy
    ignored the camera: its chunks were the same for every cube position (the right waist's target at
    step 49, where the image alone can tell, did not follow the scene), since once the arm moves its
    joint angles give the cube's place away, and a policy that copies them fails in closed loop."""
    from bench.probes_rmuscle import check_training_prefill, flow_matching_loss, optimizer_step
    from rmuscle_ros.models.checkpoint import load_model, save_checkpoint
    from rmuscle_ros.runtime.policy import Observation, Policy, PolicyConfig
    from rmuscle_ros.runtime.transforms import build_prompt, discretize_state, pad_to_dim, tokenize_prompt

    device = "cuda" if torch.cuda.is_available() else "cpu"
    demos = load_demos(data)
    out.mkdir(parents=True, exist_ok=True)
    # training.json, written last, marks a finished policy: a retrain cut short (a timeout, Ctrl-C) must
    # not leave the new stats beside the old model looking like one (found in review: evaluate ran the pair).
    (out / "training.json").unlink(missing_ok=True)
    norm_path = out / "norm_stats.json"
    write_norm_stats(demos["state"], demos["actions"], norm_path)
    # A policy only to preprocess: its images, prompt and tokens are what the deployed policy makes.
    pre = Policy(
        PolicyConfig(preset=preset, norm_stats=str(norm_path), cameras=(CAMERA,), device=device, seed=seed)
    )
    cfg = pre.model_cfg
    n = len(demos["frames"])
    images = torch.empty(n, 3, cfg.vision.image_size, cfg.vision.image_size, device=device)
    tokens = torch.empty(n, cfg.max_token_len, dtype=torch.int64)
    token_mask = torch.empty(n, cfg.max_token_len, dtype=torch.bool)
    for i, (frame, state) in enumerate(zip(demos["frames"], demos["state"], strict=True)):
        inputs, _, truncated = pre.preprocess(Observation({CAMERA: frame}, state, PROMPT))
        assert not truncated, "the prompt must fit the model's token budget"
        images[i] = inputs.images[0, 0]
        tokens[i], token_mask[i] = inputs.tokens[0], inputs.token_mask[0]
    assert bool(inputs.image_masks[0, 0]) and not bool(inputs.image_masks[0, 1:].any())
    targets = torch.from_numpy(
        pad_to_dim(pre.stats.actions.normalize(chunk_targets(demos, cfg.horizon)), cfg.action_dim)
    ).float()
    states = pre.stats.state.normalize(demos["state"])  # what the prompt's state bins are made from
    tokenizer = pre.tokenizer
    del pre

    def prompt(picked: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts of samples `picked`, their states perturbed (as Policy.preprocess builds them)."""
        x = states[picked] + state_noise * torch.randn(len(picked), STATE_DIM, generator=gen).numpy()
        x[(torch.rand(len(picked), generator=gen) < state_dropout).numpy()] = 0.0
        toks = [
            tokenize_prompt(tokenizer, build_prompt(PROMPT, discretize_state(v)), cfg.max_token_len)
            for v in x
        ]
        return torch.from_numpy(np.stack([t.tokens for t in toks])), torch.from_numpy(
            np.stack([t.mask for t in toks])
        )

    log(f"{n} samples from {len(json.loads(demos['meta']['seeds']))} demonstrations, on {device}")

    from rmuscle_ros.models.pi05 import ModelInputs

    model = load_model(cfg, None, seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    planned = {"steps": steps}  # the schedule reads it at every step; fitted to `minutes` below
    warmup = max(PROBE_STEPS, steps // 20)

    def schedule(s: int) -> float:
        return min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / planned["steps"]))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    masks = torch.zeros(batch, cfg.num_cameras, dtype=torch.bool, device=device)
    masks[:, 0] = True
    filler = torch.full((batch, cfg.num_cameras - 1, *images.shape[1:]), -1.0, device=device)
    first = ModelInputs(torch.cat([images[:1, None], filler[:1]], 1), masks[:1], tokens[:1], token_mask[:1])
    gap = check_training_prefill(model, first.to(device))
    if gap > 1e-4:  # the loss's prefill must be the model's (as bench/probes_rmuscle.py checks too)
        raise RuntimeError(f"the training prefill differs from Pi05Model.prefill by {gap}")
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    step = 0
    while step < planned["steps"]:
        if step == PROBE_STEPS // 2:
            probe_start = time.perf_counter()  # the first steps include the GPU's warm-up
        if step == PROBE_STEPS:
            per_step = (time.perf_counter() - probe_start) / (PROBE_STEPS - PROBE_STEPS // 2)
            left = minutes * 60 - (time.perf_counter() - start)
            planned["steps"] = min(steps, PROBE_STEPS + int(left / per_step))
            log(f"{per_step * 1e3:.0f} ms per step: {planned['steps']} steps")
        pick = torch.randint(n, (batch,), generator=gen)
        picked_tokens, picked_mask = (
            prompt(pick.tolist()) if state_noise or state_dropout else (tokens[pick], token_mask[pick])
        )
        inputs = ModelInputs(
            torch.cat([images[pick.to(device)][:, None], filler], 1),
            masks,
            picked_tokens.to(device),
            picked_mask.to(device),
        )
        loss = flow_matching_loss(model, inputs, targets[pick].to(device), draws, gen)
        losses.append(optimizer_step(model, opt, sched, loss))
        if step % 250 == 0 or step == planned["steps"] - 1:
            elapsed = time.perf_counter() - start
            log(f"step {step}: loss {statistics.mean(losses[-50:]):.4f} ({elapsed:.0f} s)")
        step += 1
    model.eval()
    save_checkpoint(model.to("cpu"), out / "model.safetensors")
    steps = planned["steps"]
    window = max(1, min(100, steps // 10))
    summary = {
        "data": str(data),
        "preset": preset,
        "samples": n,
        "demonstrations": len(json.loads(demos["meta"]["seeds"])),
        "demonstration_seeds": json.loads(demos["meta"]["seeds"]),  # evaluate refuses them as scenes
        "placement_spread": float(demos["meta"].get("placement_spread", 1.0)),
        "steps": steps,
        "batch": batch,
        "noise_draws": draws,
        "lr": lr,
        "seed": seed,
        "state_noise": state_noise,
        "state_dropout": state_dropout,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "seconds": round(time.perf_counter() - start, 1),
        "first_loss": round(statistics.mean(losses[:window]), 4),
        "final_loss": round(statistics.mean(losses[-window:]), 4),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=1))
    log(f"trained: {summary}")


# ── evaluate ─────────────────────────────────────────────────────────────────────────────────────────


def episode(
    sim: AlohaSim,
    policy: Any,
    seed: int,
    replan: int,
    shadow: Any | None = None,
    latency: int = 0,
    noise_offset: int = 0,
) -> dict[str, Any]:
    """One closed-loop episode from `seed`. `shadow`: a dense policy called on the same inputs, for the
    action error of every call: over its whole chunk (`rel_l2`) and over the rows the arms execute of it
    (`rel_l2_executed`: rows `latency` .. `latency + replan - 1`; the rest is replanned before its turn).
    `latency`: control periods between a call's observation and its chunk taking over, as a call's
    latency costs through the node (action_streamer): meanwhile the previous chunk goes on past its
    `replan` rows (the arms hold before the episode's first chunk), and the new one starts at its row
    `latency`. `noise_offset`: the calls' noise drawn from seed + it (the dense
    control: the same policy on the same scene with other noise)."""
    from rmuscle_ros.runtime.policy import Observation

    sim.reset(seed)
    noise_gen = torch.Generator().manual_seed(seed + noise_offset)
    cfg = policy.model_cfg
    modes: list[str] = []
    errors: list[float] = []
    executed: list[float] = []
    # per call: the library episode and call a cached call was served from (RMuscle.call_status), else None
    references: list[tuple[int, int] | None] = []
    # calls run dense to be recorded (the episode before was served, then fell back): mode fallback
    learning_calls = 0
    rows = slice(latency, latency + replan)
    audits: list[float | None] = []  # per call: the audit's error, None where none ran
    # Chunks not yet executing, oldest first: rows and their observation's step. A chunk takes over
    # `latency` steps after its observation; with latency >= replan the next chunk arrives before that
    # (found in review: one pending slot, each chunk replaced before its turn, and the arms never moved).
    pending: deque[tuple[np.ndarray, int]] = deque()
    current: tuple[np.ndarray, int] | None = None  # the chunk the arms execute, likewise
    policy.rebuild_cache(wait=True)  # the node's refill at a reset: the likely first entries (no-op: dense)
    for step in range(EPISODE_STEPS):
        if step % replan == 0:
            obs = Observation({CAMERA: sim.render(CAMERA)}, measured_state(sim), PROMPT)
            noise = torch.randn(1, cfg.horizon, cfg.action_dim, generator=noise_gen)
            chunk = policy.infer(obs, noise=noise)
            status = policy.cache_call_status()  # this call's: read before the motion window's work
            learning_calls += int(status is not None and status["reason"] == LEARNING_REASON)
            pending.append((chunk.actions, step))
            # The motion window, as the node runs it: the audit if one is due, then the window's refill.
            audit = policy.audit_cache()
            audits.append(None if audit is None else audit.error)
            policy.rebuild_cache(wait=True)
            modes.append(chunk.cache_mode)
            references.append(
                (int(status["reference_episode"]), int(status["reference_position"]))
                if status is not None and chunk.cache_mode == "cached"
                else None
            )
            if shadow is not None:
                got, ref = (
                    torch.from_numpy(chunk.actions),
                    torch.from_numpy(shadow.infer(obs, noise=noise).actions),
                )
                errors.append(relative_l2(got, ref))
                executed.append(relative_l2(got[rows], ref[rows]))
        while pending and step >= pending[0][1] + latency:
            current = pending.popleft()
        if current is not None:
            command(sim, current[0][step - current[1]])
        try:
            sim.step()
        except SimulationDiverged:
            break  # a failed episode (the policy's commands were violent enough to break the physics)
    return {
        "seed": seed,
        "success": sim.success,
        "final_reward": sim.reward,
        "best_reward": sim.best_reward,
        "diverged": bool(sim.diverged),
        "modes": modes,
        "learning": learning_calls > 0,
        "learning_calls": learning_calls,
        "rel_l2": errors,
        "rel_l2_executed": executed,
        "references": references,
        "audits": audits,
    }


def cell_episode(
    sim: AlohaSim, policy: Any, seed: int, replan: int, shadow: Any | None = None, latency: int = 0
) -> dict[str, Any]:
    """`episode`, then what a cell does at its end: a failed one is kept out of the library, and the next
    one begins (`reset_episode` records a successful dense one: its library id is the run's `library_id`,
    None if not recorded)."""
    run = episode(sim, policy, seed, replan, shadow, latency)
    if not run["success"]:
        policy.discard_episode("the episode failed")
    return run | {"library_id": policy.reset_episode()}


def served_from(runs: list[dict[str, Any]], recorded: list[dict[str, Any]]) -> None:
    """Per run, per call: the scene (seed) and call of the library episode a cached call was served from
    (`served_from`, [seed, call]; None for other calls), from the ids `cell_episode` noted in `recorded`."""
    seed_of = {r["library_id"]: r["seed"] for r in recorded if r.get("library_id") is not None}
    for r in runs:
        r["served_from"] = [None if ref is None else [seed_of.get(ref[0]), ref[1]] for ref in r["references"]]


def scene_overlap(seeds: list[int], warm: list[int], taught: list[int]) -> str:
    """Why the evaluation's scenes are not apart ("" if they are): an evaluation scene the library was warmed
    up on, or that the policy was taught (its demonstrations' seeds, recorded in training.json since
    2026-12-05), measures recall, not what the cache does on an unseen scene (found in review: not
    checked; the published runs were apart)."""
    for name, other in (("--warmup-seeds", warm), ("the policy's demonstrations", taught)):
        shared = sorted(set(seeds) & set(other))
        if shared:
            return f"--seeds: {len(shared)} scene(s) also in {name} ({shared[:5]}…): evaluate on other seeds"
    return ""


def policy_config(folder: str, preset: str) -> Any:
    """The trained files as the deployed policy loads them: fused engine on the CPU, one thread (see
    bench/probes_rmuscle.py: one thread on a shared 2-core machine)."""
    from rmuscle_ros.runtime.policy import PolicyConfig

    torch.set_num_threads(1)
    return PolicyConfig(
        preset=preset,
        checkpoint=str(Path(folder) / "model.safetensors"),
        norm_stats=str(Path(folder) / "norm_stats.json"),
        backend="fused",
        cameras=(CAMERA,),
    )


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    from rmuscle_ros.cache.runtime import RMuscleConfig
    from rmuscle_ros.runtime.policy import Policy

    pcfg = policy_config(args.policy, args.preset)
    seeds, warm = parse_seeds(args.seeds), parse_seeds(args.warmup_seeds)
    sim = make_sim(args.placement_spread)
    results: dict[str, Any] = {}
    start = time.perf_counter()
    scripted = []
    for s in seeds:  # the demonstrator on the same scenes: what the policy was taught to do
        sim.reset(s)
        TransferCubeDemonstrator(sim).run()
        scripted.append(
            {"seed": s, "success": sim.success, "final_reward": sim.reward, "best_reward": sim.best_reward}
            | {"diverged": False, "modes": [], "rel_l2": [], "audits": []}
        )
    results["scripted"] = summarise(scripted, time.perf_counter() - start)
    dense = Policy(pcfg)
    start = time.perf_counter()
    runs = [episode(sim, dense, s, args.replan, latency=args.latency_steps) for s in seeds]
    results["dense"] = summarise(runs, time.perf_counter() - start)
    log(f"dense: {results['dense']['success_rate']:.2f} ({results['dense']['successes']}/{len(seeds)})")
    if args.dense_control:
        # How much the same dense policy's scenes change by themselves, with other noise per call: the
        # spread a cached variant's difference from dense is to be read against (found in review: "within
        # the runs' spread" had no spread measured in this loop).
        start = time.perf_counter()
        control = [
            episode(sim, dense, s, args.replan, latency=args.latency_steps, noise_offset=CONTROL_NOISE_OFFSET)
            for s in seeds
        ]
        results["dense_control"] = summarise(control, time.perf_counter() - start) | {
            "noise_offset": CONTROL_NOISE_OFFSET,
            **discordant(runs, control, sim.max_reward),
        }
        log(f"dense control (other noise): {results['dense_control']}")
    for rho_p, rho_n, schedule, name in variants(args):
        # The whole window after every call, as config/rmuscle_default.yaml has the node do on a CPU.
        cache = RMuscleConfig(
            rho_p=rho_p,
            rho_n=rho_n,
            neuron_schedule=schedule,
            rebuilds_per_tick=20,
            audit_every=args.audit_every or 0,
            audit_max_error=args.audit_max_error,
        )
        policy = Policy(pcfg, cache=cache)
        lat = args.latency_steps
        # the library's warm-up
        warm_runs = [cell_episode(sim, policy, s, args.replan, latency=lat) for s in warm]
        start = time.perf_counter()
        runs = [cell_episode(sim, policy, s, args.replan, shadow=dense, latency=lat) for s in seeds]
        served_from(runs, warm_runs + runs)
        library = policy.cache_status()["library_episodes"]  # type: ignore[index]
        results[name] = cached_summary(
            runs, time.perf_counter() - start, (rho_p, rho_n, schedule), warm_runs, library
        )
        policy.close()
        log(f"{name}: {results[name]['success_rate']:.2f}, cached share {results[name]['cached_share']:.2f}")
    sim.close()
    return results


CONTROL_NOISE_OFFSET = 10**6  # the dense control's noise: seed + this, never another scene's seed


def discordant(base: list[dict[str, Any]], other: list[dict[str, Any]], top: int = 4) -> dict[str, Any]:
    """Scenes (paired by order) that only `other` or only `base` succeeded in, by the highest reward and by
    the final one (`top`: the task's top reward, transfer-cube's 4), with a two-sided sign test on each
    (exact binomial)."""
    out: dict[str, Any] = {}
    for count, won in (
        ("highest", lambda r: bool(r["success"])),
        ("final", lambda r: r["final_reward"] >= top),
    ):
        only_other = sum(1 for a, b in zip(base, other, strict=True) if won(b) and not won(a))
        only_base = sum(1 for a, b in zip(base, other, strict=True) if won(a) and not won(b))
        n, k = only_other + only_base, min(only_other, only_base)
        p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
        out[f"only_other_{count}"], out[f"only_base_{count}"] = only_other, only_base
        out[f"sign_test_p_{count}"] = round(p, 3)
    return out


def variants(args: argparse.Namespace) -> list[tuple[float, float, str, str]]:
    """(ρp, ρn, neuron schedule, result name) of every rMuscle variant asked for."""
    # audits run (--audit-every unset: none in the synchronous loop, the profile's through the node) and trip
    audits_run = args.audit_every != 0 if args.node else bool(args.audit_every)
    audited = f"_audit{args.audit_max_error:g}" if audits_run and args.audit_max_error else ""
    return [
        (
            rho_p,
            rho_n,
            schedule,
            f"rmuscle_{rho_p:g}_{rho_n:g}" + ("" if schedule == "uniform" else f"_{schedule}") + audited,
        )
        for rho_p, rho_n in args.rho
        for schedule in args.neuron_schedule
    ]


def repeat_probe(args: argparse.Namespace, pcfg: Any) -> dict[str, Any]:
    """An exact repeat: per setting, one dense episode of `--seed` recorded into an empty library, then the
    same scene again served from it. Its first call sees the very observation its reference did, so that
    call's error against the dense policy is the caches' own approximation, with no retrieval or scene
    difference in it (the Context Cache's is then 0: no token drifted)."""
    from rmuscle_ros.cache.runtime import RMuscleConfig
    from rmuscle_ros.runtime.policy import Policy

    sim = make_sim(args.placement_spread)
    dense = Policy(pcfg)
    out: dict[str, Any] = {}
    for rho_p, rho_n, schedule, name in variants(args):
        for anchors in args.anchors:
            cache = RMuscleConfig(
                rho_p=rho_p, rho_n=rho_n, anchors=anchors, neuron_schedule=schedule, rebuilds_per_tick=20
            )
            policy = Policy(pcfg, cache=cache)
            first = episode(sim, policy, args.seed, args.replan)
            policy.reset_episode()
            again = episode(sim, policy, args.seed, args.replan, shadow=dense)
            policy.close()
            errors = again["rel_l2"]
            out[f"{name}_anchors{anchors}"] = {
                "rho_p": rho_p,
                "rho_n": rho_n,
                "neuron_schedule": schedule,
                "anchors": anchors,
                "reference_success": first["success"],
                "repeat_success": again["success"],
                "modes": {m: again["modes"].count(m) for m in sorted(set(again["modes"]))},
                "first_call_rel_l2": round(errors[0], 4),
                "rel_l2_median": round(statistics.median(errors), 4),
            }
            log(f"{rho_p:g}/{rho_n:g}, {anchors} anchor(s): {out[next(reversed(out))]}")
    sim.close()
    return out


def through_node(args: argparse.Namespace) -> dict[str, Any]:
    """The same trained files through the deployed stack: rmuscle_node, action_streamer and aloha_sim,
    each on DDS, on the sim's clock (`replay_demo.run`, what `demo --sim` runs), one process per node
    but the policy's. Per variant one run of all the scenes, each episode `EPISODE_STEPS` of sim time;
    failed episodes are kept out of the library (`discard_failed`). rMuscle's library is warmed up by a
    run on the warm-up seeds first and kept on disk for the evaluation run, as a cell's is. No dense
    shadow here: the action error is the synchronous loop's to measure."""
    import tempfile

    from rmuscle_ros.node.replay_demo import run

    seeds, warm = parse_seeds(args.seeds), parse_seeds(args.warmup_seeds)
    for name, group in (("--seeds", seeds), ("--warmup-seeds", warm)):
        if group != list(range(group[0], group[0] + len(group))):
            raise SystemExit(f"{name}: one range of consecutive seeds (aloha_sim steps through them)")
        if group[0] < 1:  # found in review: seed -1, refused by aloha_sim once the run had started
            raise SystemExit(f"{name}: from 1 with --node (aloha_sim's episode 0, the wait for the nodes, "
                             f"takes the seed before the first), got {group[0]}")  # fmt: skip
    folder = Path(args.policy)
    base = {
        "model.checkpoint": str(folder / "model.safetensors"),
        "model.norm_stats": str(folder / "norm_stats.json"),
        "camera_topics": ["images/base"],  # the top camera, in π0.5's base slot as in training
        "prompt": PROMPT,
        "model.preset": args.preset,
        "actions_per_inference": args.replan,
        # each episode's calls draw the same noise in every variant, call for call (before, one stream per
        # run: after the first call count that differed, dense and cached drew different noise)
        "noise_seed": 0,
    }

    def cell(
        first: int, count: int, out: Path, overrides: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
        """The episodes' results, the node's last cache status (empty without the cache), and the run's
        timing: the node's call latency (wall clock, p50 per cache mode), the rows of each chunk that
        latency cost on the sim's clock (the streamer's takeover rows), the commands the sim took, and how
        long calls waited for the node's worker after their tick."""
        sim = {
            "cameras": [CAMERA], "height": FRAME_HEIGHT, "width": FRAME_WIDTH,
            "placement_spread": args.placement_spread, "camera_rate_hz": args.camera_rate_hz,
            # The sim's episode 0 is the wait for the nodes; the demo's first reset starts episode 1.
            "seed": first - 1, "seed_step": 1,
            # every scene judged at EPISODE_STEPS (the demo's default, its `seconds`), however late its
            # reset: the last one's came ~1 s later
            "episode_s": EPISODE_STEPS * 0.02,
        }  # fmt: skip
        # With --latency-steps every chunk takes over at that row (a fixed execution delay), not on arrival.
        streamer = {"takeover_delay_s": args.latency_steps * 0.02} if args.latency_steps else {}
        summary = run(out, seconds=EPISODE_STEPS * 0.02, overrides=base | overrides, episodes=count,
                      sim=True, sim_params=sim, domain_id=args.domain_id, discard_failed=True,
                      streamer_overrides=streamer)  # fmt: skip
        modes = {e["episode"]: e["modes"] for e in summary["episodes"]}
        runs = []
        for k, e in enumerate(summary["sim"]["episodes"]):
            calls = modes.get(k, {})
            runs.append(
                {"seed": e["seed"], "success": e["success"], "final_reward": e["reward"],
                 "best_reward": e["best_reward"], "diverged": bool(e["diverged"]),
                 "modes": [m for m, n in sorted(calls.items()) for _ in range(n)], "rel_l2": []}
            )  # fmt: skip
        log(f"{out.name}: {sum(r['success'] for r in runs)}/{len(runs)}, drops {summary['drops']}")
        timing = {
            "latency_p50_ms": round(summary["latency_p50_ms"], 1),
            "latency_p50_by_mode_ms": {m: round(v, 1) for m, v in summary["latency_p50_by_mode_ms"].items()},
            # wall ms from the node's ticks to their calls' start (its latest 200): work in flight delays them
            "tick_wait_p50_ms": round(summary["tick_wait_p50_ms"], 1),
            "tick_wait_max_ms": round(summary["tick_wait_max_ms"], 1),
            # the row at which the latest 100 chunks took over (action_streamer): latency in control periods
            "takeover_row_p50": summary["streaming"]["streamer"].get("takeover_row.p50"),
            "takeover_row_max": summary["streaming"]["streamer"].get("takeover_row.max"),
            # commands the sim took per arm and second of its clock (the streamer sends 50 a second while a
            # chunk is due): fewer where the streamer fell behind the sim's clock
            "sim_arm_commands_per_s": round(
                summary["sim"]["arm_commands"] / 2 / (len(runs) * EPISODE_STEPS * 0.02), 1
            ),
        }
        if args.latency_steps:  # chunks whose call took longer than the delay (they took over on arrival)
            timing["chunks_late"] = summary["streaming"]["streamer"].get("chunks_late")
        return runs, summary["cache_status"] or {}, timing

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sim_success_node_") as scratch:
        tmp = str(args.keep) if args.keep is not None else scratch
        # A --keep folder reused would carry an earlier run's library (its recordings) over: refused first.
        kept = [] if args.dense_only else [Path(tmp) / f"library_{v[-1]}" for v in variants(args)]
        if any(library.exists() for library in kept):
            raise SystemExit(f"sim_success: {tmp} holds an earlier run's library; give another --keep folder")
        start = time.perf_counter()
        runs, _, timing = cell(seeds[0], len(seeds), Path(tmp) / "dense", {"cache.enabled": False})
        results["dense"] = summarise(runs, time.perf_counter() - start) | timing
        for rho_p, rho_n, schedule, name in [] if args.dense_only else variants(args):
            library = Path(tmp) / f"library_{name}"
            cache = {"cache.enabled": True, "cache.rho_p": rho_p, "cache.rho_n": rho_n,
                     "cache.neuron_schedule": schedule, "cache.audit_max_error": args.audit_max_error,
                     "cache.library_path": str(library)}  # fmt: skip
            if args.audit_every is not None:
                cache["cache.audit_every"] = args.audit_every
            warm_runs, _, _ = cell(warm[0], len(warm), Path(tmp) / f"{name}_warmup", cache)
            start = time.perf_counter()
            runs, status, timing = cell(seeds[0], len(seeds), Path(tmp) / name, cache)
            results[name] = cached_summary(
                runs, time.perf_counter() - start, (rho_p, rho_n, schedule), warm_runs,
                status.get("library_episodes", 0),
            ) | timing  # fmt: skip
            if status.get("audits"):  # the node's audits over the evaluation run (its cache status)
                results[name] |= {
                    "audits": status["audits"],
                    "audits_missed": status["audits_missed"],
                    "audit_error_median": round(status["audit_error_median"], 4),
                    "audit_error_max": round(status["audit_error_max"], 4),
                    "episodes_fallen_back": fallen_back(runs),
                }
    return results


def cached_summary(
    runs: list[dict[str, Any]],
    seconds: float,
    setting: tuple[float, float, str],
    warm_runs: list[dict[str, Any]],
    library_episodes: int,
) -> dict[str, Any]:
    """`summarise` of an rMuscle variant, with its setting (ρp, ρn, neuron schedule) and how its library was
    warmed up."""
    return summarise(runs, seconds) | {
        "rho_p": setting[0],
        "rho_n": setting[1],
        "neuron_schedule": setting[2],
        "warmup_successes": sum(r["success"] for r in warm_runs),
        "warmup_episodes": len(warm_runs),
        "library_episodes": library_episodes,
    }


def fallen_back(runs: list[dict[str, Any]]) -> int:
    """Episodes with a call that fell back for its scene, not counting the calls of a learning episode (run
    dense to be recorded, their mode fallback too: found in review, they were counted as fallen back). A
    node run's episodes carry no reasons (an ActionChunk has the mode alone): there a learning episode
    still counts as fallen back."""
    return sum(1 for r in runs if r["modes"].count("fallback") > r.get("learning_calls", 0))


def summarise(runs: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    modes = [m for r in runs for m in r["modes"]]
    errors = [e for r in runs for e in r["rel_l2"]]
    cached, executed = (
        [e for r in runs if r.get(key) for e, m in zip(r[key], r["modes"], strict=True) if m == "cached"]
        for key in ("rel_l2", "rel_l2_executed")
    )
    summary: dict[str, Any] = {
        "episodes": len(runs),
        "successes": sum(r["success"] for r in runs),
        "success_rate": round(sum(r["success"] for r in runs) / len(runs), 3),
        "calls": len(modes),
        "modes": {m: modes.count(m) for m in sorted(set(modes))},
        "cached_share": round(modes.count("cached") / len(modes), 3) if modes else 0.0,
        "diverged": sum(r["diverged"] for r in runs),
        "seconds": round(seconds, 1),
        "per_episode": [
            {k: r[k] for k in ("seed", "success", "final_reward", "best_reward", "diverged")}
            | {"cached_calls": r["modes"].count("cached")}
            # per call: the shadow's error (0 for a dense call) and the audit's (None: not audited)
            | ({"rel_l2": [round(e, 5) for e in r["rel_l2"]]} if r["rel_l2"] else {})
            | (
                {"rel_l2_executed": [round(e, 5) for e in r["rel_l2_executed"]]}
                if r.get("rel_l2_executed")
                else {}
            )
            | ({"served_from": r["served_from"]} if any(r.get("served_from", [])) else {})
            | ({"learning": True} if r.get("learning") else {})
            | (
                {"audits": [None if a is None else round(a, 5) for a in r["audits"]]}
                if any(a is not None for a in r.get("audits", []))
                else {}
            )
            for r in runs
        ],
    }
    audited = [a for r in runs for a in r.get("audits", []) if a is not None]
    if audited:
        summary["audits"] = len(audited)
        summary["audit_error_median"] = round(statistics.median(audited), 4)
        summary["episodes_fallen_back"] = fallen_back(runs)
    # episodes run dense to be recorded after one served then fallen back (their calls' mode is fallback)
    summary["episodes_learning"] = sum(1 for r in runs if r.get("learning"))
    summary["learning_calls"] = sum(r.get("learning_calls", 0) for r in runs)
    if errors:  # every call against the dense policy on the same inputs (0 for the dense ones)
        summary["rel_l2_median"] = round(statistics.median(errors), 4)
    if cached:
        summary["rel_l2_cached_median"] = round(statistics.median(cached), 4)
        summary["rel_l2_cached_p90"] = round(float(np.quantile(cached, 0.9)), 4)
    if executed:  # the rows the arms execute of each cached chunk
        summary["rel_l2_executed_cached_median"] = round(statistics.median(executed), 4)
        summary["rel_l2_executed_cached_p90"] = round(float(np.quantile(executed, 0.9)), 4)
    return summary


def _header(title: str, report: dict[str, Any]) -> list[str]:
    return [f"# {title} — {report['date']}", "", f"Commit `{report['commit']}`, `{report['command']}`.", "",
            report["setting"], ""]  # fmt: skip


def to_markdown(report: dict[str, Any]) -> str:
    lines = [
        *_header("Closed-loop success, dense vs rMuscle", report),
        "| variant | success | physics diverged | calls: cached / dense / fallback | cached calls' action "
        "error vs dense, median (p90): whole chunk; executed rows | audits (median error), episodes fallen back | library episodes "
        "(warm-up successes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        m = r["modes"]
        err = (
            f"{r['rel_l2_cached_median']} ({r['rel_l2_cached_p90']}); "
            f"{r.get('rel_l2_executed_cached_median', '–')} ({r.get('rel_l2_executed_cached_p90', '–')})"
            if "rel_l2_cached_median" in r
            else "–"
        )
        fallback = f"{m.get('fallback', 0)}" + (
            f" ({r['learning_calls']} learning)" if r.get("learning_calls") else ""
        )
        calls = f"{m.get('cached', 0)} / {m.get('dense', 0)} / {fallback}" if r["calls"] else "–"
        library = (
            f"{r['library_episodes']} ({r['warmup_successes']}/{r['warmup_episodes']})"
            if calls != "–" and "library_episodes" in r
            else "–"
        )
        audits = (
            f"{r['audits']} ({r['audit_error_median']}), {r['episodes_fallen_back']}"
            if "audits" in r
            else "–"
        )
        lines.append(
            f"| {name} | {r['successes']}/{r['episodes']} ({r['success_rate']:.0%}) | {r['diverged']} | "
            f"{calls} | {err} | {audits} | {library} |"
        )
    learning = {n: r["episodes_learning"] for n, r in report["results"].items() if r.get("episodes_learning")}
    if learning:
        lines += [
            "",
            "Episodes run dense to be recorded, after one served from the cache that then fell back (their "
            "calls are the fallback column's `learning`; not counted as fallen back): "
            + ", ".join(f"{n} {k}" for n, k in learning.items())
            + ".",
        ]
    control = report["results"].get("dense_control")
    if control is not None:
        lines += [
            "",
            f"dense_control: the dense policy again, the same scenes, other noise per call (seed + "
            f"{control['noise_offset']}): scenes only it won / only dense won, {control['only_other_highest']} / "
            f"{control['only_base_highest']} by the highest reward (sign test p {control['sign_test_p_highest']}), "
            f"{control['only_other_final']} / {control['only_base_final']} by the final one (p "
            f"{control['sign_test_p_final']}): how much scenes change by themselves, the spread a cached "
            "variant's differences from dense are read against.",
        ]
    if "scripted" not in report["results"]:  # through the node: no demonstrator, no shadow
        timed = [(n, r) for n, r in report["results"].items() if "takeover_row_p50" in r]
        if timed:
            lines += [
                "",
                "Timing (the node's call latency is wall clock, the takeover rows on the sim's clock):",
            ]
            for name, r in timed:
                by_mode = ", ".join(f"{m} {v} ms" for m, v in r["latency_p50_by_mode_ms"].items())
                lines.append(f"- {name}: latency p50 {r['latency_p50_ms']} ms ({by_mode}); the latest 100 chunks took over at row "
                             f"{r['takeover_row_p50']} (median; max {r['takeover_row_max']}); the sim took "
                             f"{r['sim_arm_commands_per_s']} commands per arm and second of its clock; "
                             f"calls began {r['tick_wait_p50_ms']} ms after their tick (median; max "
                             f"{r['tick_wait_max_ms']})"
                             + (f"; {r['chunks_late']} chunks came after the fixed delay"
                                if r.get("chunks_late") is not None else ""))  # fmt: skip
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "scripted: the demonstrator the policy learnt from, on the same scenes (it reads the cube's pose). "
        "The library holds the successful dense episodes (warm-up and evaluation); a cached episode is "
        "not recorded.",
        "Action error: relative L2 of a cached call's chunk against the dense policy's on the same "
        "observation and noise, in robot units; over the whole chunk, and over the rows the arms execute "
        "(rows latency .. latency + replan - 1, the rest replanned first). Per call in the JSON: "
        "`served_from`, the scene (seed) and call a cached call's reference was recorded in.",
    ]
    return "\n".join(lines) + "\n"


def repeat_markdown(report: dict[str, Any]) -> str:
    lines = [
        *_header("rMuscle on an exact repeat of one scene", report),
        "Per setting: a dense episode recorded into an empty library, then the same scene (same seed and "
        "noise) served from it. The repeat's first call sees exactly its reference's observation.",
        "",
        "| ρp | ρn | anchors | reference (dense) success | repeat success | calls cached | first call's action "
        "error vs dense | median over the repeat |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"].values():
        lines.append(
            f"| {r['rho_p']:g} | {r['rho_n']:g}{'' if r.get('neuron_schedule', 'uniform') == 'uniform' else ' ' + r['neuron_schedule']} | {r['anchors']} | {r['reference_success']} | "
            f"{r['repeat_success']} | {r['modes'].get('cached', 0)} | {r['first_call_rel_l2']} | "
            f"{r['rel_l2_median']} |"
        )
    return "\n".join(lines) + "\n"


def main_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--seeds", default="0-99")
    c.add_argument("--out", type=Path, default=Path("bench/_dev_sim/demos.safetensors"))
    c.add_argument("--placement-spread", type=float, default=1.0, help="SimConfig.placement_spread")
    t = sub.add_parser("train")
    t.add_argument("--data", type=Path, default=Path("bench/_dev_sim/demos.safetensors"))
    t.add_argument("--out", type=Path, default=Path("bench/_dev_sim/sim_policy"))
    t.add_argument("--steps", type=int, default=6000)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--draws", type=int, default=4)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--minutes", type=float, default=6.0, help="fewer steps if they would take longer")
    t.add_argument(
        "--state-noise", type=float, default=0.0, help="std of the prompt state's noise (normalised)"
    )
    t.add_argument("--state-dropout", type=float, default=0.0, help="share of samples with a blank state")
    t.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="the model's size")
    e = sub.add_parser("evaluate")
    e.add_argument("--policy", default="bench/_dev_sim/sim_policy")
    e.add_argument("--seeds", default="1000-1029")
    e.add_argument("--warmup-seeds", default="2000-2007")
    e.add_argument("--replan", type=int, default=25, help="steps executed per chunk (the node's default)")
    e.add_argument(
        "--latency-steps", type=int, default=0,
        help="control periods from a call's observation to its chunk taking over (the previous chunk goes "
        "on meanwhile): the synchronous loop's model of a call's latency; with --node, the streamer's fixed "
        "takeover_delay_s (a call slower than it takes over on arrival)",
    )  # fmt: skip
    e.add_argument(
        "--rho", type=lambda s: tuple(float(v) for v in s.split(",")), nargs="+", default=[(0.4, 0.5)]
    )
    e.add_argument("--anchors", type=int, nargs="+", default=[1], help="--repeat-seed: dense anchor steps")
    e.add_argument(
        "--neuron-schedule", nargs="+", default=["ramp"], choices=NEURON_SCHEDULES,
        help="how ρn spreads over the denoising steps (RMuscleConfig.neuron_schedule; default ramp, as the "
        "node's; the runs before 2026-12-03 defaulted to uniform); each with each --rho",
    )  # fmt: skip
    e.add_argument(
        "--repeat-seed", type=int, default=None,
        help="instead: the exact-repeat probe on this seed (repeat_probe), for each --rho and --anchors",
    )  # fmt: skip
    e.add_argument(
        "--node", action="store_true",
        help="instead: through rmuscle_node, action_streamer and aloha_sim on DDS (through_node)",
    )  # fmt: skip
    e.add_argument(
        "--audit-every", type=int, default=None,
        help="RMuscleConfig.audit_every: audit one cached call in this many, in the motion window (0: none; "
        "default: none in the synchronous loop, the node's profile's with --node)",
    )  # fmt: skip
    e.add_argument(
        "--audit-max-error", type=float, default=0.0,
        help="RMuscleConfig.audit_max_error: an audited error above it sends the episode dense (0: never)",
    )  # fmt: skip
    e.add_argument("--camera-rate-hz", type=float, default=50.0, help="--node: aloha_sim's camera rate")
    e.add_argument("--domain-id", type=int, default=93, help="--node: the DDS domain")
    e.add_argument("--dense-only", action="store_true", help="--node: the dense run only, no rMuscle variant")
    e.add_argument(
        "--dense-control",
        action="store_true",
        help="also run the dense policy again with other noise per call: how much scenes change by themselves",
    )
    e.add_argument(
        "--keep", type=Path, default=None,
        help="--node: keep each run's output here (recorded chunks, logs, the library) instead of discarding it",
    )  # fmt: skip
    e.add_argument("--commit", default="unknown")
    e.add_argument("--name", default="sim_success_tiny_cpu")
    e.add_argument("--results", type=Path, default=Path("bench/results"))
    return ap


def main(argv: list[str] | None = None) -> None:
    args = main_parser().parse_args(argv)
    if args.stage == "collect":
        collect(parse_seeds(args.seeds), args.out, args.placement_spread)
    elif args.stage == "train":
        train(
            args.data,
            args.out,
            args.steps,
            args.batch,
            args.draws,
            args.lr,
            args.seed,
            args.minutes,
            args.state_noise,
            args.state_dropout,
            args.preset,
        )
    else:
        finished = Path(args.policy) / "training.json"
        if not finished.is_file():
            raise SystemExit(
                f"--policy: {finished} is missing: not a policy `sim_success train` finished (one cut short?)"
            )
        training = json.loads(finished.read_text())
        # The model and the scenes it was trained on.
        args.preset = training.get("preset", "tiny")
        args.placement_spread = training.get("placement_spread", 1.0)
        horizon = PRESETS[args.preset].horizon
        if not 1 <= args.replan <= horizon:
            raise SystemExit(f"--replan: 1 ... {horizon} (a chunk's rows), got {args.replan}")
        if not 0 <= args.latency_steps <= horizon - args.replan:
            raise SystemExit(
                f"--latency-steps: 0 ... {horizon - args.replan} (a chunk's rows beyond --replan), got "
                f"{args.latency_steps}"
            )
        if args.dense_only and not args.node:
            raise SystemExit("--dense-only: through the node (--node)")
        overlap = scene_overlap(
            parse_seeds(args.seeds), parse_seeds(args.warmup_seeds), training.get("demonstration_seeds", [])
        )
        if overlap:
            raise SystemExit(overlap)
        if args.latency_steps and args.repeat_seed is not None:
            raise SystemExit("--latency-steps: not with --repeat-seed")
        if args.node:
            results = through_node(args)
        elif args.repeat_seed is None:
            results = evaluate(args)
        else:
            args.seed = args.repeat_seed
            results = repeat_probe(args, policy_config(args.policy, args.preset))
        report = {
            "date": dt.date.today().isoformat(),
            "gpu": "cpu",
            "commit": args.commit,
            "command": "python bench/sim_success.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "setting": (
                f"gym-aloha transfer_cube (MuJoCo), cube placement spread {args.placement_spread:g} of "
                f"gym-aloha's 20 × 20 cm, top camera {FRAME_HEIGHT}×{FRAME_WIDTH}, a call every "
                f"{args.replan} steps (50 Hz), {EPISODE_STEPS} steps per episode; "
                + (
                    f"each chunk takes over {args.latency_steps} steps after its observation (the previous "
                    + (
                        "one going on meanwhile: the streamer's fixed takeover_delay_s; a chunk whose call "
                        "took longer takes over on arrival); "
                        if args.node
                        else "one going on meanwhile: a call's latency as through the node); "
                    )
                    if args.latency_steps
                    else ""
                )
                + f"`{args.preset}` trained on "
                f"{training['demonstrations']} scripted demonstrations ({training['steps']} steps, loss "
                f"{training['first_loss']} -> {training['final_loss']}); fused engine on the CPU, one thread"
                + (
                    f"; rMuscle's library warmed up by dense episodes of seeds {args.warmup_seeds}."
                    if args.repeat_seed is None
                    else f"; scene seed {args.repeat_seed}."
                )
                + (
                    " **Through the node**: rmuscle_node (CPU profile, the node's own noise), "
                    "action_streamer (max_step 0.1 rad) and aloha_sim in their own processes on DDS, on the "
                    f"sim's clock; camera at {args.camera_rate_hz:g} Hz; the node's timer calls every "
                    f"{args.replan} control periods (its first call falls where its timer does, not on the episode's "
                    "first step). The node's first episode also holds the calls made before the sim's "
                    "first reset (0-2). No dense shadow: the action error here is the node's own audits' (one cached call in "
                    "cache.audit_every run again dense; the median and maximum of the run's latest 100)."
                    if args.node
                    else ""
                )
            ),
            "training": training,
            "results": results,
        }
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / f"{args.name}.json").write_text(json.dumps(report, indent=1))
        markdown = to_markdown(report) if args.repeat_seed is None else repeat_markdown(report)
        (args.results / f"{args.name}.md").write_text(markdown)
        print(markdown)


if __name__ == "__main__":
    main()
