"""rMuscle vs the dense graph engine on a GPU, in one process, on the same observations (issue #4).

Scenario: a *reference* episode of `--calls` observations (three cameras watching a scene in which an
object moves smoothly; random-weight π0.5 at full size) runs through the shipped rMuscle runtime
(`RMuscle.infer`, as the node calls it) with an empty library, so it runs dense and is recorded. A *live*
episode then repeats the task: the same motion with a small change of light and sensor noise. Each live
call goes through the runtime (retrieval with alignment, the window refilled after each call as in the
arm's motion window) and is compared with the dense graph on the same inputs and noise.

Reported (Markdown + JSON in --out): per (ρp, ρn), median end-to-end ms of a dense call and a cached
call through the runtime (wall clock; matched as RMuscleConfig.match_on_gpu's default, and the other way),
per-stage replay ms (each stage's graph alone, and the tail graph a call replays after vision), speedup,
action relative L2 error and similarity; the cost of rebuilding an entry, the window's memory, each row's
GPU memory peak, the latency of a live call while rebuilds run on the low-priority stream; FLOPs and
bytes per call with roofline projections (labelled as such) to an RTX 4090 and a Jetson Thor. With
`--library-episodes`, what a library's size costs the calls whose retrieval scans it (an episode's first
call, a fallback call) and a cached call (`Bench.library_scaling`).
Weights are random: the error figures are *not* those of a trained policy.

    python bench/bench_rmuscle.py --out bench/results --commit $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_tag
from bench.bench_pi05 import (
    cuda_time_ms,
    measure_ceilings,
    random_model,
    record_header,
    rel_l2,
    save_results,
)
from bench.trace_graphs import idle_gaps, traced_events
from rmuscle_ros.cache.retrieval import Retriever
from rmuscle_ros.cache.runtime import CallInfo, RMuscle, RMuscleConfig
from rmuscle_ros.engine import create_engine
from rmuscle_ros.engine.cost import call_cost, rmuscle_cost, total
from rmuscle_ros.engine.fused import NEURON_SCHEDULES, ContextRef
from rmuscle_ros.engine.graph import GraphEngine
from rmuscle_ros.models.config import get_preset
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model

# Projection targets, assumed (not measured): bandwidths from the issue, compute peaks dense bf16 tensor
# throughput with float32 accumulation. On a GPU the projection adds a row with the ceilings measured in
# the run.
TARGETS = {"rtx4090": {"tb_s": 1.0, "tflops": 165.0}, "thor": {"tb_s": 0.273, "tflops": 250.0}}


def scene(cfg, t: float, light: float, noise: float, gen: torch.Generator) -> torch.Tensor:
    """(1, C, 3, S, S) images in [-1, 1]: a textured bench and a bright object at phase t of its path."""
    c, s = cfg.num_cameras, cfg.vision.image_size
    base = torch.Generator().manual_seed(1234)
    bench = torch.rand(c, 3, s // 8, s // 8, generator=base) * 1.2 - 0.6
    img = torch.nn.functional.interpolate(bench, size=(s, s), mode="bilinear", align_corners=False)
    yy, xx = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    for cam in range(c):
        cx = s * (0.25 + 0.5 * t) + 10 * cam
        cy = s * (0.6 - 0.3 * np.sin(np.pi * t)) - 8 * cam
        blob = torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * 18.0**2))
        img[cam] += 0.9 * blob * torch.tensor([1.0, 0.4, -0.5])[:, None, None]
    img = img * light + noise * torch.randn(img.shape, generator=gen)
    return img.clamp(-1, 1)[None]


def observation(
    cfg, t: float, light: float, noise: float, seed: int, prompt: int, device: torch.device | None = None
) -> ModelInputs:
    """The scene at phase t as model inputs: the images on `device` (a GPU: where the policy resamples
    them and hands them over, since d42afb2), the prompt on the host (the engine packs it there)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(7))
    tokens[0, -14:] = cfg.vocab_size - 30 + int(20 * t)  # the discretised state moves with the task
    images = scene(cfg, t, light, noise, gen)
    return ModelInputs(
        images if device is None else images.to(device),
        torch.ones(1, cfg.num_cameras, dtype=torch.bool),
        tokens,
        torch.ones(1, prompt, dtype=torch.bool),
    )


T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[rmuscle {time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


WARMUP = 3  # untimed calls before each timing loop


def wall_ms(fn, iters: int, warmup: int = WARMUP) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def device_ms(fn, iters: int, device: torch.device) -> float:
    """Median device time: CUDA events on a GPU, wall clock on the CPU (smoke runs)."""
    samples = cuda_time_ms(fn, iters) if device.type == "cuda" else wall_ms(fn, iters)
    return statistics.median(samples)


def wait(stream: torch.cuda.Stream | None) -> None:
    if stream is not None:
        stream.synchronize()


class Bench:
    """One engine with fixed (ρp, ρn) and the shipped rMuscle runtime on it: reference episode, live
    episode, timings. Cached calls are `RMuscle.infer`, exactly as the node runs them; dense calls replay
    the engine's three stage graphs."""

    def __init__(
        self, model: Pi05Model, rho_p: float, rho_n: float, args, device, schedule: str = "uniform"
    ) -> None:
        backend = "graph" if device.type == "cuda" else "fused"
        pdl = {} if args.pdl else {"pdl": False}
        # Built to match either way (both kinds of graphs captured); calls match as the runtime's default
        # does unless a timing says otherwise.
        self.rm_cfg = RMuscleConfig(
            rho_p=rho_p,
            rho_n=rho_n,
            neuron_schedule=schedule,
            rebuilds_per_tick=20,
            concurrent_rebuilds=args.concurrent_rebuilds or args.concurrent_rebuild_graphs,
            match_on_gpu=True,
            audit_every=0,  # audits are timed on their own (`timings`)
        )
        self.default_match = RMuscleConfig().match_on_gpu
        self.engine: GraphEngine = create_engine(
            backend, model, device, buckets=[64], cache=self.rm_cfg.shapes(), **pdl
        )
        log(f"engine built for {self.rm_cfg.shapes()}; capturing graphs")
        self.engine.warmup()
        log("graphs captured")
        self.runtime = RMuscle(self.engine, self.rm_cfg, weights="random weights, seed 0")
        self.match_on(self.default_match)
        self.args, self.cfg, self.device = args, model.cfg, device
        self.noise = torch.randn(
            1, self.cfg.horizon, self.cfg.action_dim, generator=torch.Generator().manual_seed(3)
        )

    def dense_call(self, inputs: ModelInputs, variant: str = "dense") -> torch.Tensor:
        """The dense engine's call as `GraphEngine.sample_actions` runs it (vision, then the tail, the prompt
        packed while vision runs); variant "record" runs the recording denoise instead."""
        e = self.engine
        bucket = e.begin_load(inputs, self.noise)
        e.run_stage("vision", bucket)
        e.finish_load()
        if variant == "dense":
            e.run_stage("tail", bucket)
        else:
            e.run_stage("prefill", bucket)
            e.run_stage("denoise", bucket, variant=variant)
        return e.actions

    def runtime_call(self, inputs: ModelInputs) -> tuple[torch.Tensor, CallInfo]:
        return self.runtime.infer(inputs, self.noise)

    def match_on(self, on_gpu: bool) -> None:
        """Where the runtime matches (RMuscleConfig.match_on_gpu), for the calls that follow."""
        self.runtime.cfg = dataclasses.replace(self.runtime.cfg, match_on_gpu=on_gpu)

    def refill_window(self) -> None:
        """What the node does in the motion window after a publish: rebuild the wanted entries."""
        self.runtime.rebuild(max_entries=len(self.runtime.window))
        wait(self.engine.rebuild_stream)

    def record_reference(self) -> None:
        """A dense episode through the runtime (recorded into its library), then the rebuild cost of one
        entry on the rebuild lane alone (into a scratch entry: the window's slots belong to the runtime)."""
        cfg, n = self.cfg, self.args.calls
        self.ref_obs = [
            observation(cfg, t / (n - 1), 1.0, 0.01, 100 + t, self.args.prompt_tokens, self.device)
            for t in range(n)
        ]
        recorded = []  # wall ms of each call: a dense call of a dense episode, recorded as it runs
        for obs in self.ref_obs:
            sync()
            start = time.perf_counter()
            _, info = self.runtime_call(obs)
            sync()
            recorded.append((time.perf_counter() - start) * 1e3)
            if info.mode != "dense":
                raise RuntimeError(f"a reference call ran {info.mode}: the library was not empty")
        self.recorded_call_ms = statistics.median(recorded[1:] or recorded)  # the first sets things up
        if self.runtime.reset_episode() is None:
            raise RuntimeError("the reference episode was not recorded")
        log(f"reference episode recorded ({n} dense calls)")
        self.scratch = ContextRef.allocate(cfg, self.device, self.engine.dtype)
        if not self.engine.context_cache:  # ρp = 1: an entry is its masks and key, nothing is rebuilt
            self.rebuild_ms, self.rebuild_part_ms = 0.0, []
            log("ρp = 1: window entries need no rebuild")
            return
        times = []
        for obs in self.ref_obs:
            sync()
            start = time.perf_counter()
            self.engine.rebuild_entry(obs, self.scratch)
            wait(self.engine.rebuild_stream)
            times.append((time.perf_counter() - start) * 1e3)
        self.rebuild_ms = statistics.median(times)  # wall clock per entry, rebuild lane alone
        parts: list[list[float]] = [[] for _ in self.engine.rebuild_parts]
        for obs in self.ref_obs:  # each part alone: the most a live call queued behind one waits
            self.engine.begin_rebuild(obs, self.scratch)
            for samples in parts:
                sync()
                start = time.perf_counter()
                self.engine.rebuild_step()
                wait(self.engine.rebuild_stream)
                samples.append((time.perf_counter() - start) * 1e3)
        self.rebuild_part_ms = [round(statistics.median(p), 3) for p in parts]
        if not self.scratch.ffn_in.abs().sum() > 0:
            raise RuntimeError("a rebuilt entry is empty")
        log(f"one entry rebuilt in {self.rebuild_ms:.2f} ms")

    def live_episode(self) -> dict:
        """The task again (other light, sensor noise): each call through the runtime, compared with the
        dense graph on the same inputs; the window is refilled after each call, as on the cell. Each call
        is also timed (synchronised; the refill outside), a new observation each, after the refill: the
        node's sequence, where the headline (`interleaved`) repeats one observation with its window entry
        ready (found in review: node-like calls spent ~0.35 ms more GPU time cached; bench_policy)."""
        cfg, n = self.cfg, self.args.calls
        errors, sims, modes = [], [], []
        dense_ms, cached_ms = [], []  # of the calls served cached: the dense call, then the runtime's
        self.live_obs = [
            observation(cfg, (t + 0.3) / (n - 1), 0.97, 0.02, 500 + t, self.args.prompt_tokens, self.device)
            for t in range(n - 1)
        ]
        for obs in self.live_obs:
            sync()
            start = time.perf_counter()
            dense = self.dense_call(obs).clone()
            sync()
            middle = time.perf_counter()
            actions, info = self.runtime_call(obs)
            sync()
            end = time.perf_counter()
            self.refill_window()
            modes.append(info.mode)
            if info.mode == "cached":
                errors.append(rel_l2(actions[0], dense))
                sims.append(info.similarity)
                dense_ms.append((middle - start) * 1e3)
                cached_ms.append((end - middle) * 1e3)
        if not errors:
            raise RuntimeError(f"no live call was served from the cache: {modes}")
        node_like = {
            "calls": len(cached_ms),
            "dense_ms": round(statistics.median(dense_ms), 3),
            "rmuscle_ms": round(statistics.median(cached_ms), 3),
            "speedup": round(statistics.median(dense_ms) / statistics.median(cached_ms), 3),
        }
        log(f"node-like calls ({node_like['calls']} cached): {node_like}")
        return {"action_rel_l2_median": statistics.median(errors), "action_rel_l2_max": max(errors),
                "similarity_min": min(sims), "similarity_median": statistics.median(sims),
                "live_modes": modes, "node_like": node_like}  # fmt: skip

    def _prime(self, obs: ModelInputs, on_gpu: bool) -> None:
        """Cached calls on `obs` from now on: one call aligns retrieval, the window gets its entries."""
        self.match_on(on_gpu)
        self.runtime_call(obs)
        self.refill_window()
        _, info = self.runtime_call(obs)
        if info.mode != "cached":
            raise RuntimeError(f"the timed observation is not served cached ({info})")

    def wall_ms_cached(self, call, iters: int) -> list[float]:
        """`wall_ms(call, iters)` of runtime calls, every one of them (warm-up included) checked to have
        been served cached: the runtime's cached-call count must rise by the number of calls made, and no
        call may have run again dense (`match_reruns`). A timing of a loop with a dense call in it fails."""
        before = self._call_counts()
        samples = wall_ms(call, iters, WARMUP)
        self._check_served_cached(before, WARMUP + iters)
        return samples

    def _call_counts(self) -> tuple[int, int, int]:
        rt = self.runtime
        return rt.calls, rt.cached_calls, rt.match_reruns

    def _check_served_cached(self, before: tuple[int, int, int], made: int) -> None:
        """RuntimeError unless every one of the `made` runtime calls since `before` (`_call_counts`) was
        served cached: the cached-call count risen by `made`, and none run again dense (`match_reruns`)."""
        ran, cached, reruns = (now - then for now, then in zip(self._call_counts(), before, strict=True))
        if (ran, cached, reruns) != (made, made, 0):
            raise RuntimeError(
                f"of {made} timed calls {ran} ran, {cached} cached, {reruns} run again dense: not every call "
                f"was served cached ({self.runtime.last})"
            )

    def interleaved(self, obs: ModelInputs, rounds: int) -> tuple[list[float], list[float]]:
        """The headline pair: a dense engine call, then a runtime call (matched where the runtime matches by
        default), alternated call by call, each synchronised, `rounds` of each after WARMUP of each. Loops
        timed one after the other drift by up to ~0.4 ms on the H200, and two fixed-order blocks put the
        dense figure 0.2 ms above a call-by-call alternation in one lease (found in review, 2026-12-05:
        `rmuscle_pi05_h200_77c9407`'s 13.40 against 13.33 in `probe_call_timeline_pi05_h200_77c9407`).
        Every runtime call is checked served cached, `_check_served_cached`."""
        self._prime(obs, self.default_match)
        before = self._call_counts()
        dense, rmuscle = [], []
        for k in range(WARMUP + rounds):
            for call, out in (
                (lambda: self.dense_call(obs), dense),
                (lambda: self.runtime_call(obs), rmuscle),
            ):
                sync()
                start = time.perf_counter()
                call()
                sync()
                if k >= WARMUP:
                    out.append((time.perf_counter() - start) * 1e3)
        self._check_served_cached(before, WARMUP + rounds)
        return dense, rmuscle

    def idle_gaps(self, rows: int = 6) -> dict:
        """One dense and one cached call under the profiler: the GPU's span, busy and idle time, and the
        largest idle gaps with the kernel that ended each (what the GPU waited on the host for)."""
        obs = self.live_obs[len(self.live_obs) // 2]
        out = {}
        for name, on_gpu in (("dense", None), ("rmuscle", False), ("rmuscle_gpu_match", True)):
            if on_gpu is None:
                call = lambda: self.dense_call(obs)  # noqa: E731
            else:
                self._prime(obs, on_gpu)
                call = lambda: self.runtime_call(obs)  # noqa: E731
            for _ in range(3):
                call()
            events = traced_events(call)
            gaps = idle_gaps(events)
            span = max(stop for _, _, stop in events) - events[0][1]
            idle = sum(g["us"] for g in gaps)
            out[name] = {"span_us": round(span, 1), "idle_us": round(idle, 1), "kernels": len(events),
                         "largest_gaps": sorted(gaps, key=lambda g: -g["us"])[:rows]}  # fmt: skip
        self.match_on(self.default_match)
        log(f"idle gaps {out}")
        return out

    def library_scaling(self, episodes: int, calls: int = 30) -> dict:
        """Wall ms of the calls whose retrieval depends on the library's size, with `episodes` library
        episodes: the recorded one and `episodes - 1` synthetic ones of `calls` calls each (its descriptors
        plus noise, ranking below it). The synthetic episodes exist for retrieval only (descriptors, no
        observations), so the window keeps the recorded episode's entries and nothing is rebuilt here.
        - `dense`: the engine's dense call, no retrieval;
        - `first_call`: an episode's first call (alignment reset): the runtime queues the dense stages,
          then scans the whole library while they run;
        - `fallback`: a call of an episode that fell back: dense, the similarity scanned over the library;
        - `cached`: a cached call, matched on the host: its retrieval sits on its critical path;
        - `scan_ms`: the whole-library retrieval alone (on the GPU: queued, waited for, picked).
        Each with the similarities computed on the GPU (the runtime's default on a GPU) and on the host."""
        if episodes < 1:
            raise ValueError(f"--library-episodes: a library has at least one episode, got {episodes}")
        rt, it = self.runtime, self.args.iters
        obs = self.live_obs[len(self.live_obs) // 2]
        self._prime(obs, on_gpu=False)  # the window holds the recorded episode's entries for obs
        real, retrieval = rt._descriptors, rt.retriever.cfg  # the runtime's own; restored below
        (ref_id, ref), rng = next(iter(real.items())), np.random.default_rng(0)
        base = ref[np.arange(calls) % len(ref)]
        fake = {10_000 + i: base + rng.normal(0, 2 * float(base.std()), base.shape).astype(np.float32)
                for i in range(episodes - 1)}  # fmt: skip
        rt._descriptors = {ref_id: ref, **fake}
        descriptor = rt.engine.descriptor_host.numpy().copy()  # obs's, from priming

        def first_call() -> None:
            rt.retriever.reset()
            rt.infer(obs, self.noise)

        def fallback() -> None:
            rt.retriever.fallback = True
            rt.infer(obs, self.noise)

        def scan() -> None:
            rt.retriever.reset()
            if rt.retriever.on_device:
                rt.retriever.queue(rt.engine.descriptor())
            rt.retriever.query(None if rt.retriever.on_device else descriptor)

        out: dict = {"episodes": episodes, "calls_per_episode": calls}
        places = {"gpu": self.device, "host": None} if self.device.type == "cuda" else {"host": None}
        try:
            for place, device in places.items():
                rt.retriever = Retriever(retrieval, rt._descriptors, device)
                # Every call of the recorded episode in the window: random-weight descriptors tie to ~1e-6,
                # so host and GPU rounding may align on neighbouring calls (the synthetic episodes, which
                # have nothing to rebuild, rank below it).
                rt._wanted = [(ref_id, p) for p in range(len(ref))]
                self.runtime.rebuild(max_entries=len(rt.window))
                wait(self.engine.rebuild_stream)
                samples: dict[str, list[float]] = {
                    "dense": [],
                    "first_call": [],
                    "fallback": [],
                    "cached": [],
                }
                for _ in range(2):  # alternated halves, as in `timings`
                    samples["dense"] += wall_ms(lambda: self.dense_call(obs), max(1, it // 2))
                    samples["first_call"] += wall_ms(first_call, max(1, it // 2))
                    samples["fallback"] += wall_ms(fallback, max(1, it // 2))
                    rt.retriever.reset()
                    rt.infer(obs, self.noise)  # aligns again; the window still holds obs's entry
                    samples["cached"] += self.wall_ms_cached(
                        lambda: rt.infer(obs, self.noise), max(1, it // 2)
                    )
                    if rt.last.episode != ref_id:
                        raise RuntimeError(
                            f"the timed call was not served from the recorded episode ({rt.last})"
                        )
                out[place] = {k: round(statistics.median(v), 3) for k, v in samples.items()}
                out[place]["scan_ms"] = round(statistics.median(wall_ms(scan, it)), 3)
        finally:
            rt._descriptors = real
            rt._refresh_retriever()
            self.match_on(self.default_match)
        log(f"library of {episodes} episodes: {out}")
        return out

    def timings(self) -> dict:
        e, it, dev = self.engine, self.args.iters, self.device
        obs = self.live_obs[len(self.live_obs) // 2]
        # Dense, matched on the host and matched on the GPU, each in two halves, alternated: on the H200 the
        # medians of back-to-back loops moved by up to ~0.4 ms, and one dense loop per row left the dense
        # figure 13.93-14.58 ms across the rows of one run (rmuscle_pi05_h200_d9f2611).
        samples: dict[str, list[float]] = {"dense": [], "host": [], "gpu": []}
        for _ in range(2):
            samples["dense"] += wall_ms(lambda: self.dense_call(obs), max(1, it // 2))
            for on_gpu in (False, True):
                self._prime(obs, on_gpu)
                samples["gpu" if on_gpu else "host"] += self.wall_ms_cached(
                    lambda: self.runtime_call(obs), max(1, it // 2)
                )
        self.match_on(self.default_match)
        block_dense = statistics.median(samples["dense"])
        walls = {False: statistics.median(samples["host"]), True: statistics.median(samples["gpu"])}
        log(
            f"in blocks: dense {block_dense:.3f} ms, matched on the host {walls[False]:.3f} ms, on the GPU "
            f"{walls[True]:.3f} ms"
        )
        dense_calls, rmuscle_calls = self.interleaved(obs, it)
        dense_wall, rmuscle_wall = statistics.median(dense_calls), statistics.median(rmuscle_calls)
        log(f"end to end, alternated call by call: dense {dense_wall:.3f} ms, rMuscle {rmuscle_wall:.3f} ms")
        slot = next(s for s in self.runtime.window if s.key is not None)
        usable = [s.key is not None for s in self.runtime.window]
        bucket = e.load_inputs(obs, self.noise, usable)
        e.load_window_entry(slot.index)
        stages = {}
        for stage, variant in (("vision", "dense"), ("prefill", "dense"), ("prefill", "cached"),
                               ("denoise", "dense"), ("denoise", "cached"), ("denoise", "record"), ("match", "cached"),
                               ("tail", "dense"), ("tail", "cached")):  # fmt: skip
            run = lambda s=stage, v=variant: e.run_stage(s, bucket, variant=v)  # noqa: E731
            stages[f"{stage}_{variant}"] = round(device_ms(run, it, dev), 3)
        load = device_ms(lambda: e.load_window_entry(slot.index), it, dev)  # as the runtime loads it
        log(f"stages {stages}")
        # An audit (RMuscle.audit, which the node runs in the motion window after a cached call due for
        # one): the call's prefill and denoise again, dense, and the comparison. Wall clock, each right
        # after a cached call.
        self.runtime.reconfigure(audit_every=1)  # a live setting, as `ros2 param set` changes it
        audit_ms = []
        for _ in range(max(3, it // 3)):
            self.runtime_call(obs)
            sync()
            start = time.perf_counter()
            if self.runtime.audit() is None:
                raise RuntimeError(f"a cached call was not due for an audit ({self.runtime.last})")
            audit_ms.append((time.perf_counter() - start) * 1e3)
        self.runtime.reconfigure(audit_every=0)
        q = lambda xs, f: round(float(np.quantile(xs, f)), 3)  # noqa: E731
        out = {
            # The headline: dense and rMuscle calls alternated call by call (`interleaved`), `it` each
            "timed_calls": len(dense_calls),
            "prompt_bucket": bucket,
            "dense_ms": round(dense_wall, 3),
            "rmuscle_ms": round(rmuscle_wall, 3),  # as the runtime runs by default
            "speedup": round(dense_wall / rmuscle_wall, 3),
            "dense_p10_p90_ms": [q(dense_calls, 0.1), q(dense_calls, 0.9)],
            "rmuscle_p10_p90_ms": [q(rmuscle_calls, 0.1), q(rmuscle_calls, 0.9)],
            "match_on_gpu": self.default_match,
            # Each match place against dense in two fixed-order blocks (dense, host, GPU; twice): the
            # headline until 2026-12-05, kept to compare the match places and with earlier runs
            "block_timed_calls": len(samples["dense"]),
            "block_dense_ms": round(block_dense, 3),
            "rmuscle_host_match_ms": round(walls[False], 3),
            "rmuscle_gpu_match_ms": round(walls[True], 3),
            "block_speedup": round(block_dense / walls[self.default_match], 3),
            "speedup_gpu_match": round(block_dense / walls[True], 3),
            "stages_ms": stages,
            "load_reference_ms": round(load, 3),
            "rebuild_entry_ms": round(self.rebuild_ms, 3),
            "recorded_call_ms": round(self.recorded_call_ms, 3),
            "rebuild_part_ms": self.rebuild_part_ms,
            "audit_ms": round(statistics.median(audit_ms), 3),
        }
        if not self.args.interference:
            return out
        if not e.rebuild_parts:  # ρp = 1: no rebuild to run beside a live call
            log("interference: none to measure (ρp = 1 rebuilds nothing)")
            return out
        # A live call right after two rebuilds were queued on the low-priority lane (back to back), and
        # right after one: the node rebuilds entry by entry, so one entry in flight is its worst case.
        # Without concurrent_rebuilds the runtime orders the call after them; with it, the rebuilds launch
        # kernel by kernel and run alongside. Rebuild graphs alongside a live call once hung the H200
        # (cause not found): if this stalls, dump every thread's Python stack and exit.
        faulthandler.dump_traceback_later(self.args.interference_timeout_s, exit=True)
        self._prime(obs, self.default_match)
        concurrent = self.rm_cfg.concurrent_rebuilds
        graphs = not concurrent or self.args.concurrent_rebuild_graphs
        busy: dict[str, list[float]] = {"2": [], "1": [], "part": []}
        # From queueing the rebuilds to their last kernel's end, the live call included: how long a
        # refill of the window takes in each mode.
        done: dict[str, list[float]] = {"2": [], "1": []}
        quiet = []
        served_cached = dict.fromkeys([*busy, "alone"], 0)  # live calls served cached, of `it` each
        longest = max(range(len(e.rebuild_parts)), key=lambda i: self.rebuild_part_ms[i])
        for queued, samples in busy.items():
            log(f"interference: live calls with {queued} rebuild(s) queued")
            for _ in range(it):
                if queued == "part":  # the node's worst case: the rebuild's longest part just queued
                    e.begin_rebuild(self.ref_obs[0], self.scratch)
                    for _ in range(longest):
                        e.rebuild_step(graphs)
                    wait(e.rebuild_stream)
                    e.rebuild_step(graphs)
                else:
                    queued_at = time.perf_counter()
                    for k in range(int(queued)):
                        e.rebuild_entry(self.ref_obs[k], self.scratch, use_graphs=graphs)
                start = time.perf_counter()
                _, info = self.runtime_call(obs)
                sync()
                samples.append((time.perf_counter() - start) * 1e3)
                served_cached[queued] += info.mode == "cached"
                wait(e.rebuild_stream)
                if queued in done:
                    done[queued].append((time.perf_counter() - queued_at) * 1e3)
        for _ in range(it):
            start = time.perf_counter()
            _, info = self.runtime_call(obs)
            sync()
            quiet.append((time.perf_counter() - start) * 1e3)
            served_cached["alone"] += info.mode == "cached"
        if min(served_cached.values()) < it:
            log(f"interference: not every live call was served cached ({served_cached} of {it} each)")
        faulthandler.cancel_dump_traceback_later()
        log("interference measured")
        return out | {
            "live_call_alone_ms": round(statistics.median(quiet), 3),
            "live_call_during_rebuild_ms": round(statistics.median(busy["2"]), 3),
            "live_call_one_rebuild_queued_ms": round(statistics.median(busy["1"]), 3),
            "live_call_one_part_queued_ms": round(statistics.median(busy["part"]), 3),
            "rebuilds_done_ms": {k: round(statistics.median(v), 3) for k, v in done.items()},
            "live_calls_served_cached": served_cached,  # of `interference_calls` each
            "interference_calls": it,
            "rebuilds_concurrent": concurrent,
            "rebuild_graphs": graphs,
        }


def parse_rho(text: str) -> tuple[float, float, str]:
    """'0.4,0.5' or '0.4,0.5,ramp' -> (ρp, ρn, neuron schedule)."""
    parts = text.split(",")
    schedule = parts[2] if len(parts) == 3 else "uniform"
    if len(parts) not in (2, 3) or schedule not in NEURON_SCHEDULES:  # said before minutes of set-up
        raise SystemExit(f"--rho: ρp,ρn or ρp,ρn,schedule (one of {NEURON_SCHEDULES}), got {text!r}")
    return float(parts[0]), float(parts[1]), schedule


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="pi05")
    p.add_argument("--prompt-tokens", type=int, default=50)
    p.add_argument("--calls", type=int, default=8, help="calls per episode")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rho", action="append", default=None,
                   help="ρp,ρn pairs (default: a table), or ρp,ρn,schedule (RMuscleConfig.neuron_schedule)")  # fmt: skip
    p.add_argument("--commit", default="unknown")
    p.add_argument("--name", default=None)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script (tiny)")
    p.add_argument(
        "--interference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time a live call while rebuilds are queued on the low-priority stream",
    )
    p.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=True,
                   help="programmatic dependent launch in the engine's graphs (where supported)")  # fmt: skip
    p.add_argument("--concurrent-rebuilds", action="store_true",
                   help="RMuscleConfig.concurrent_rebuilds: rebuilds launch kernel by kernel alongside live calls")  # fmt: skip
    p.add_argument("--concurrent-rebuild-graphs", action="store_true",
                   help="the interference phase's rebuilds replay their graphs while the live call does not "
                        "wait for them (the combination that once hung the H200; a probe, not a runtime mode)")  # fmt: skip
    p.add_argument("--interference-timeout-s", type=float, default=120.0,
                   help="dump the Python stacks and exit if the interference phase takes longer")  # fmt: skip
    p.add_argument("--library-episodes", type=int, nargs="*", default=[],
                   help="also time first, fallback and cached calls with libraries of these many episodes "
                        "(synthetic descriptors; at the first ρ pair only)")  # fmt: skip
    p.add_argument("--trace", action="store_true",
                   help="also profile one dense and one cached call: GPU idle time and its largest gaps. On "
                        "the H200 every ρ row timed after the profiler ran slower (rmuscle_pi05_h200_a20adb2_trace): "
                        "use it with one --rho")  # fmt: skip
    args = p.parse_args()
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cfg = get_preset(args.preset)
    rhos = [parse_rho(r) for r in args.rho] if args.rho else [
        (0.4, 0.5, "ramp"), (0.4, 0.5, "uniform"), (1.0, 1.0, "uniform"), (0.2, 0.5, "ramp"),
        (0.2, 1.0, "uniform"), (0.4, 1.0, "uniform"), (1.0, 0.5, "ramp")
    ]  # fmt: skip
    cuda = device.type == "cuda"
    ceilings = measure_ceilings(device) if cuda else {"bf16_tflops": float("nan"), "copy_tb_s": float("nan")}
    log(f"{gpu}, preset {args.preset}, ceilings {ceilings}")
    model = random_model(cfg, device, 0)
    eager_obs = observation(cfg, 0.5, 1.0, 0.01, 1, args.prompt_tokens).to(device)
    eager_dtype = torch.bfloat16 if cuda else torch.float32
    model.to(eager_dtype)
    noise = torch.randn(1, cfg.horizon, cfg.action_dim, device=device)
    eager_samples = 5
    eager_ms = device_ms(lambda: model.sample_actions(eager_obs, noise), eager_samples, device)
    results: dict[str, dict] = {"eager": {
        "median_ms": round(eager_ms, 3), "samples": eager_samples, "dtype": str(eager_dtype).removeprefix("torch."),
        "device": gpu, "timer": "CUDA events" if cuda else "wall clock"}}  # fmt: skip
    log(f"eager {eager_ms:.1f} ms")
    model.float()
    # What each row's engine work allocates on the GPU beyond what is allocated before it (the float32 eager
    # model, kept loaded to build each row's engine, and anything an earlier row left).
    for rho_p, rho_n, schedule in rhos:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            baseline = torch.cuda.memory_allocated(device)
        bench = Bench(model, rho_p, rho_n, args, device, schedule)
        bench.record_reference()
        quality = bench.live_episode()
        timing = bench.timings()
        if args.trace and args.device == "cuda":
            timing["gpu_timeline"] = bench.idle_gaps()
        if args.library_episodes and (rho_p, rho_n, schedule) == rhos[0]:
            timing["library_scaling"] = [bench.library_scaling(n) for n in args.library_episodes]
        key = f"rmuscle_p{rho_p:g}_n{rho_n:g}" + ("" if schedule == "uniform" else f"_{schedule}")
        results.setdefault("graph", {"median_ms": timing["dense_ms"], "stages_ms": {
            k.split("_")[0]: v for k, v in timing["stages_ms"].items() if k.endswith("dense")}})  # fmt: skip
        results[key] = {
            "rho_p": rho_p, "rho_n": rho_n, "neuron_schedule": schedule, "median_ms": timing["rmuscle_ms"], "dense_same_run_ms": timing["dense_ms"],
            "speedup": timing["speedup"], **quality, **{k: v for k, v in timing.items() if k not in ("rmuscle_ms", "dense_ms", "speedup")},
            "window_entry_mb": round(bench.engine.ctx_ref.nbytes / 2**20, 1),  # FFN states; 0 at ρp = 1
            "engine_cache_mb": round(bench.engine.cache_bytes / 2**20, 1),
        }  # fmt: skip
        if cuda:
            peak = torch.cuda.max_memory_allocated(device)
            results[key] |= {
                "gpu_memory_before_row_gb": round(baseline / 1e9, 2),
                "gpu_peak_memory_gb_row_incl_eager_model": round(peak / 1e9, 2),
                "gpu_peak_memory_gb_row_above_row_start": round((peak - baseline) / 1e9, 2),
            }
        log(f"{key}: {json.dumps(results[key])}")
        del bench
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    # The bar's setting (ρ 0.4 / 0.5) with the runtime's default schedule, else the first one run (found in
    # review: the first row run, uniform in the 7B run, stood for it whatever the default)
    schedule = RMuscleConfig().neuron_schedule
    default = "rmuscle_p0.4_n0.5" + ("" if schedule == "uniform" else f"_{schedule}")
    main_key = (
        default
        if default in results
        else next((k for k in results if k.startswith("rmuscle_p0.4_n0.5")), None)
    )
    if main_key is not None:
        results["rmuscle"] = dict(results[main_key])
    flops_peak, bw = ceilings["bf16_tflops"] * 1e12, ceilings["copy_tb_s"] * 1e12
    dense_cost = call_cost(cfg, args.prompt_tokens)
    cached_cost = rmuscle_cost(cfg, args.prompt_tokens, 0.4, 0.5)
    projection = {}
    here = f"{gpu_tag(gpu)}_measured_ceilings"  # h200_measured_ceilings on an H200
    measured = {here: {"tb_s": bw / 1e12, "tflops": flops_peak / 1e12}} if cuda else {}
    for name, tgt in {**measured, **TARGETS}.items():

        def f(costs: dict, tgt: dict = tgt) -> float:
            return sum(c.floor_s(tgt["tflops"] * 1e12, tgt["tb_s"] * 1e12) for c in costs.values()) * 1e3

        source = "measured in this run" if name in measured else "assumed"
        projection[name] = {
            "ceilings": {"tb_s": tgt["tb_s"], "tflops": tgt["tflops"]},
            "ceilings_source": source,
            # "assumed": the key of earlier records, kept for the rows whose ceilings are assumed
            **({"assumed": {"tb_s": tgt["tb_s"], "tflops": tgt["tflops"]}} if source == "assumed" else {}),
            "dense_floor_ms": round(f(dense_cost), 3),
            "rmuscle_floor_ms": round(f(cached_cost), 3),
            "floor_ratio": round(f(dense_cost) / f(cached_cost), 3),
        }
    record = {
        **record_header(gpu, args.commit),
        "setting": {
            "preset": args.preset,
            "cameras": cfg.num_cameras,
            "prompt_tokens": args.prompt_tokens,
            "steps": cfg.num_steps,
            "horizon": cfg.horizon,
            "weights": "random (seed 0)",
            "calls_per_episode": args.calls,
            "iters": args.iters,
            "stage_timer": "CUDA events" if cuda else "wall clock",
        },
        "ceilings": {k: round(v, 2) for k, v in ceilings.items()},
        "cost_per_call": {
            "dense": {
                k: {"gflop": round(c.flops / 1e9, 1), "gbytes": round(c.bytes / 1e9, 3)}
                for k, c in dense_cost.items()
            },
            "rmuscle_p0.4_n0.5": {
                k: {"gflop": round(c.flops / 1e9, 1), "gbytes": round(c.bytes / 1e9, 3)}
                for k, c in cached_cost.items()
            },
            "dense_total_gflop": round(total(dense_cost).flops / 1e9, 1),
            "rmuscle_total_gflop": round(total(cached_cost).flops / 1e9, 1),
        },
        "roofline_projection_not_measured": projection,
        "results": results,
    }
    stem = args.name or f"rmuscle_{args.preset}_{gpu_tag(gpu)}_{record['date'][:10]}"
    save_results(args.out, stem, record, to_markdown(record))


def to_markdown(r: dict) -> str:
    s = r["setting"]
    res = r["results"]
    rows = {name: v for name, v in res.items() if name.startswith("rmuscle_p")}
    first = next(iter(rows.values()), {})
    eager = res["eager"]
    timer = s.get("stage_timer", "not recorded")
    lines = [
        f"# rMuscle vs dense graph, π0.5 `{s['preset']}` — {r['gpu']}, {r['date']}",
        "",
        f"commit `{r['commit']}`, torch {r['torch']}, command `{r['command']}`",
        "",
        f"Setting: {s['cameras']} cameras, {s['prompt_tokens']} valid prompt tokens (the engine computes the "
        f"{first.get('prompt_bucket', '?')}-token bucket), {s['steps']} steps, horizon {s['horizon']}, weights "
        f"{s['weights']}, {s['calls_per_episode']} calls per episode.",
        "",
        f"End to end (median ms: an rMuscle call through `RMuscle.infer`; dense ms: the engine's dense call, "
        f"vision then the dense tail graph): medians of {first.get('timed_calls', '?')} calls each, wall clock "
        f"with the device synchronised after each call, a dense call and an rMuscle call alternated call by call "
        f"(until 2026-12-05: the two loops in two fixed-order halves, `block_*` in the JSON); the rMuscle calls "
        f"repeat one observation with its window entry ready, as a steady repeat does (no rebuild between them); "
        f"every timed rMuscle call (and its {WARMUP} warm-up calls) checked to be served cached. Stage columns: a "
        f"stage replayed on its own, inputs loaded ({timer}, median of {s['iters']} replays): the tail graph "
        f"(prefill + denoise) that a call runs after vision (dense) or the match stage (cached), and the prefill "
        f"and denoise graphs each alone. A call is vision (or match) + tail; on a GPU the tail's denoise starts "
        f"its first step alongside the prefill, so prefill + denoise, each timed alone, do not add up to the "
        f"tail, nor the stages to the call.",
        "",
        f"Eager ({eager.get('dtype', '?')} PyTorch on {eager.get('device', '?')}, no graphs; median of "
        f"{eager.get('samples', '?')} calls, {eager.get('timer', '?')}): {eager['median_ms']} ms, for scale only: "
        "host-bound, and timed once before the rows, not interleaved with them, so it moves between runs.",
        "",
        "| variant | ρp | ρn | median ms | dense ms (same run) | speedup | tail ms (prefill + denoise graph) | prefill ms (alone) | denoise ms (alone) | action rel L2 (median / max) | similarity (min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in rows.items():
        st = v["stages_ms"]
        lines.append(
            f"| {name} | {v['rho_p']} | {v['rho_n']}{'' if v.get('neuron_schedule', 'uniform') == 'uniform' else ' ' + v['neuron_schedule']} | {v['median_ms']} | {v['dense_same_run_ms']} | "
            f"**{v['speedup']}×** | {st['tail_cached']} (dense {st['tail_dense']}) | "
            f"{st['prefill_cached']} (dense {st['prefill_dense']}) | "
            f"{st['denoise_cached']} (dense {st['denoise_dense']}) | "
            f"{v['action_rel_l2_median']:.3g} / {v['action_rel_l2_max']:.3g} | {v['similarity_min']:.3f} |"
        )
    memory = {name: v for name, v in rows.items() if "gpu_peak_memory_gb_row_above_row_start" in v}
    if memory:
        lines += ["", "GPU memory per row (`torch.cuda.max_memory_allocated`, its peak reset before the row's engine "
                  "is built): the row's peak above what was allocated at its start (the float32 eager model, kept "
                  "loaded to build each row's engine, and anything earlier rows left), and the peak in all: " + "; ".join(
                      f"{name} {v['gpu_peak_memory_gb_row_above_row_start']} GB above {v['gpu_memory_before_row_gb']} GB, "
                      f"{v['gpu_peak_memory_gb_row_incl_eager_model']} GB in all" for name, v in memory.items()) + "."]  # fmt: skip
    if "rmuscle" in res:
        v = res["rmuscle"]
        lines += [
            "",
            f"At ρp = 0.4, ρn = 0.5 ({v['neuron_schedule']}): loading the matched entry {v['load_reference_ms']} ms; rebuilding one "
            f"entry {v['rebuild_entry_ms']} ms (rebuild lane; its parts alone {v['rebuild_part_ms']} ms); window entry {v['window_entry_mb']} MB; the "
            f"cached graphs' buffers and K-major weights {v['engine_cache_mb']} MB. A dense call of a dense "
            f"episode, recorded for the library (through the runtime; median of the reference episode's calls "
            f"after its first): {v.get('recorded_call_ms', 'not measured')} ms. An audit of a cached call (its "
            f"prefill and denoise again, dense, and the comparison; wall clock): {v.get('audit_ms', 'not measured')} ms."
            + (
                f" A live call alone {v['live_call_alone_ms']} ms, with two rebuilds queued on the low-priority "
                f"stream {v['live_call_during_rebuild_ms']} ms, with one {v['live_call_one_rebuild_queued_ms']} ms, "
                f"with one part of one (the node's worst case) {v['live_call_one_part_queued_ms']} ms; from "
                f"queueing them to the rebuilds' end (the live call included): two "
                f"{v['rebuilds_done_ms']['2']} ms, one {v['rebuilds_done_ms']['1']} ms. Live calls served "
                f"cached, of {v.get('interference_calls', '?')} each: "
                + ", ".join(f"{k} {n}" for k, n in v.get("live_calls_served_cached", {}).items())
                + "."
                if "live_call_alone_ms" in v
                else " Live-call latency during rebuilds: not measured in this run."
            ),
        ]
        if "node_like" in v:
            nl = v["node_like"]
            lines += ["", f"Node-like calls (the live episode: a new observation each, timed after the motion window's "
                      f"refill, the dense call just before on the same inputs; {nl['calls']} served cached): dense "
                      f"{nl['dense_ms']} ms, rMuscle {nl['rmuscle_ms']} ms, **{nl['speedup']}×** (medians of few calls: "
                      f"`--calls` sets them)."]  # fmt: skip
        where = "on the device" if v["match_on_gpu"] else "on the host"
        other, other_ms = (
            ("on the host", v["rmuscle_host_match_ms"])
            if v["match_on_gpu"]
            else ("on the device", v["rmuscle_gpu_match_ms"])
        )
        lines += ["", f"The table's rMuscle calls are matched {where} (RMuscleConfig.match_on_gpu's default); the same "
                  f"calls matched {other}, in blocks against dense {v.get('block_dense_ms', '?')} ms: {other_ms} ms "
                  f"({round(v.get('block_dense_ms', v['dense_same_run_ms']) / other_ms, 3)}×; "
                  f"matched {where}, in the same blocks: {v.get('block_speedup', '?')}×). Replayed alone ({timer}): "
                  f"match stage (vision, pick, load) {v['stages_ms']['match_cached']} ms, cached tail (prefill + denoise graph) "
                  f"{v['stages_ms']['tail_cached']} ms."]  # fmt: skip
        if "library_scaling" in v:
            lines += ["", "By library size (all episodes but the recorded one synthetic descriptors, "
                      f"{v['library_scaling'][0]['calls_per_episode']} calls each) and where the similarities are "
                      "computed, wall ms:", "",
                      "| episodes | similarities on | dense call | first call of an episode | fallback call | cached call (host match) | whole-library retrieval alone |",
                      "|---|---|---|---|---|---|---|"]  # fmt: skip
            lines += [f"| {x['episodes']} | {place} | {y['dense']} | {y['first_call']} | {y['fallback']} | {y['cached']} | "
                      f"{y['scan_ms']} |" for x in v["library_scaling"] for place, y in x.items()
                      if isinstance(y, dict)]  # fmt: skip
        if "gpu_timeline" in v:
            t = v["gpu_timeline"]
            lines += ["", "GPU idle within one call (profiled): " + "; ".join(
                f"{k} {x['idle_us']:.0f} of {x['span_us']:.0f} µs, largest gap {x['largest_gaps'][0]['us']:.0f} µs "
                f"at {x['largest_gaps'][0]['at_us']:.0f} µs" for k, x in t.items() if x["largest_gaps"]) + "."]  # fmt: skip
    lines += ["", f"Roofline floors (projection from FLOPs and bytes per call, not measured; the {s['prompt_tokens']} "
              f"valid prompt tokens only, not the bucket's padding; rMuscle at ρp = 0.4, ρn = 0.5):", "",
              "| target | ceilings | TB/s | TFLOP/s | dense floor ms | rMuscle floor ms | ratio |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, v in r["roofline_projection_not_measured"].items():
        c = v.get("ceilings", v.get("assumed"))
        lines.append(
            f"| {name} | {v.get('ceilings_source', 'assumed')} | {c['tb_s']:.3g} | {c['tflops']:.4g} | "
            f"{v['dense_floor_ms']} | {v['rmuscle_floor_ms']} | {v['floor_ratio']} |"
        )
    lines += ["", "Random weights: the action errors show the approximation's size on this model, not a trained "
              "policy's success rate."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
