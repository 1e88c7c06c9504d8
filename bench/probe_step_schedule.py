"""Where in the denoising loop does the Action Cache's error come from, and how should ρn spread over the
steps? A probe on a trained policy, with the engine's own code (`FusedPi05.denoise` with per-step neuron
counts, `ActionCache.counts`), on the CPU.

A neuron the Action Cache leaves out keeps its value from the anchor step (step 0). Per call pair (a
reference call of one scene, the live call at the same position of another scene, each with its own
noise, as a cell's repeats are), the reference's dense denoise records masks with each schedule's
counts, and the live call's cached denoise uses them (the prefill dense: the Action Cache alone). The
error is the relative L2 of the chunk against the live call's dense chunk, in robot units, as
`bench/sim_success.py` measures it. Observations: the dense policy's own closed-loop episodes of the two
scenes (gym-aloha transfer-cube in MuJoCo, as sim_success evaluates).

    python bench/probe_step_schedule.py --policy bench/_dev_sim/policy_small --commit $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import sim_success
from bench.bench_pi05 import record_header, save_results
from rmuscle_ros.cache.runtime import relative_l2
from rmuscle_ros.engine.fused import ActionCache, CallLayout, KVBuffers, step_neuron_counts
from rmuscle_ros.runtime.policy import Observation, Policy


def explicit(shares: list[float], mlp_dim: int) -> tuple[int, ...]:
    """Per later step, a share of the neurons (1: the step runs dense) -> counts, the anchor step first."""
    return (mlp_dim, *(min(mlp_dim, round(s * mlp_dim)) for s in shares))


def schedules(mlp_dim: int, steps: int) -> dict[str, tuple[int, ...]]:
    later = steps - 1
    half = later // 2 + 1  # steps 1..half-1 early, half.. late (1-4 and 5-9 at 10 steps)
    early = [0.5] * (half - 1) + [1.0] * (later - half + 1)
    out = {f"{name} {rho:g}": step_neuron_counts(rho, mlp_dim, steps, 1, name)
           for name, rho in (("uniform", 0.5), ("ramp", 0.5), ("ramp", 0.4), ("ramp", 0.3), ("uniform", 0.8))}  # fmt: skip
    out[f"0.5 in steps 1-{half - 1} only"] = explicit(early, mlp_dim)
    out[f"0.5 in steps {half}-{later} only"] = explicit(early[::-1], mlp_dim)
    return out


def observations(policy: Policy, seed: int, replan: int, spread: float) -> list[Observation]:
    """The observations of the dense policy's closed-loop episode of scene `seed`."""
    sim = sim_success.make_sim(spread)
    sim.reset(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg, out, chunk = policy.model_cfg, [], None
    for step in range(sim_success.EPISODE_STEPS):
        if step % replan == 0:
            obs = Observation(
                {sim_success.CAMERA: sim.render(sim_success.CAMERA)},
                sim_success.measured_state(sim),
                sim_success.PROMPT,
            )
            out.append(obs)
            chunk = policy.infer(obs, noise=torch.randn(1, cfg.horizon, cfg.action_dim, generator=gen))
        assert chunk is not None
        sim_success.command(sim, chunk.actions[step % replan])
        sim.step()
    sim.close()
    return out


class Probe:
    """The trained policy's fused engine, stage by stage."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self.engine = policy, policy.engine
        self.fused = self.engine.fused
        self.fused.prepare_action_cache()
        self.cfg = policy.model_cfg

    def prefix(self, obs: Observation) -> tuple[CallLayout, KVBuffers]:
        """Vision and the dense prefill of one observation: its layout and K/V."""
        inputs, _, _ = self.policy.preprocess(obs)
        return self.fused.run_prefix(inputs, self.engine._bucket(inputs.token_mask[0].cpu().numpy()))

    def denoise(self, noise: torch.Tensor, prefix: tuple[CallLayout, KVBuffers], **kw) -> np.ndarray:
        out = torch.empty(self.cfg.horizon, self.cfg.action_dim)
        self.fused.denoise(noise, *prefix, out, **kw)
        return self.policy.postprocess(out[None])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="bench/_dev_sim/policy_small")
    p.add_argument("--reference-seed", type=int, default=1000)
    p.add_argument("--live-seed", type=int, default=1001)
    p.add_argument("--replan", type=int, default=25)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--name", default=None)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    training = json.loads((Path(args.policy) / "training.json").read_text())
    preset, spread = training.get("preset", "tiny"), training.get("placement_spread", 1.0)
    policy = Policy(sim_success.policy_config(args.policy, preset))
    probe = Probe(policy)
    cfg = probe.cfg
    f = cfg.expert.mlp_dim
    plans = schedules(f, cfg.num_steps)
    refs = observations(policy, args.reference_seed, args.replan, spread)
    lives = observations(policy, args.live_seed, args.replan, spread)
    gen = torch.Generator().manual_seed(7)
    masks = torch.zeros(cfg.num_steps, cfg.expert.depth, f, dtype=torch.int32)
    errors: dict[str, list[float]] = {name: [] for name in plans}
    for ref_obs, live_obs in zip(refs, lives, strict=True):
        noise_ref, noise_live = (torch.randn(cfg.horizon, cfg.action_dim, generator=gen) for _ in range(2))
        ref, live = probe.prefix(ref_obs), probe.prefix(live_obs)
        dense = probe.denoise(noise_live, live)
        for name, counts in plans.items():
            probe.denoise(noise_ref, ref, record_masks=masks, record_counts=counts)
            cached = probe.denoise(noise_live, live, action=ActionCache(masks, 1, counts))
            errors[name].append(relative_l2(torch.from_numpy(cached), torch.from_numpy(dense)))
        print(
            f"call {len(errors[name])}: " + ", ".join(f"{n} {e[-1]:.4f}" for n, e in errors.items()),
            flush=True,
        )
    results = {
        name: {
            "counts": list(plans[name]),
            "mean_share": round(sum(plans[name][1:]) / ((cfg.num_steps - 1) * f), 3),
            "rel_l2_median": round(statistics.median(e), 4),
            "rel_l2_max": round(max(e), 4),
        }
        for name, e in errors.items()
    }
    record = {
        **record_header("cpu", args.commit),
        "setting": {
            "policy": args.policy,
            "preset": preset,
            "training_steps": training.get("steps"),
            "reference_seed": args.reference_seed,
            "live_seed": args.live_seed,
            "calls": len(refs),
            "prefill": "dense (the Action Cache alone)",
        },
        "results": results,
    }
    lines = [
        f"# The Action Cache's step schedule, trained `{preset}` — {record['date']}",
        "",
        f"commit `{args.commit}`, command `{record['command']}`",
        "",
        f"Per call of scene {args.live_seed}'s dense closed-loop episode ({len(refs)} calls), masks recorded "
        f"from the same call of scene {args.reference_seed} with other noise; the prefill dense; error: the "
        "chunk's relative L2 against the live call's dense chunk, robot units.",
        "",
        f"| schedule | neurons per step after the anchor (of {f}) | mean share | rel L2 median | max |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {', '.join(map(str, r['counts'][1:]))} | {r['mean_share']} | {r['rel_l2_median']} | "
            f"{r['rel_l2_max']} |"
        )
    stem = args.name or f"probe_step_schedule_{preset}_cpu_{args.commit}"
    save_results(args.out, stem, record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
