"""The README's first command.

    python -m rmuscle_ros.demo              # rmuscle_node on a replayed ALOHA-like bag (node/replay_demo.py)
    python -m rmuscle_ros.demo --synthetic  # the policy alone (config/demo.yaml), synthetic observations
    python -m rmuscle_ros.demo --bags ep0 ep1 ep2 --param prompt="fold the towel"  # your recorded episodes
    python -m rmuscle_ros.demo --sim        # the node driving a simulated ALOHA (MuJoCo) in closed loop

Both need no files and no GPU: the `tiny` preset on the CPU with seeded weights. The bag demo replays
the episode twice with rMuscle on: a dense warm-up episode that the node records into its reference
library, then a repeat of the task served from the cache. It prints chunks by cache mode and hit rate
per episode, rate, latency p50/p99 and drops by reason, and writes a plot; the synthetic one prints the
chunk shape and the latency per call (median and p90 after warm-up).

With --bags the node replays recorded episodes instead (one rosbag2 folder per episode, in order, a
reset before each after the first), on one clock; --remap maps a bag's topics onto the node's where
they are not an ALOHA cell's (/cam_high/camera/color/image_rect_raw, ..., /follower_left/joint_states).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rmuscle_ros.paths import package_file, source_checkout
from rmuscle_ros.runtime.policy import Policy, PolicyConfig, synthetic_observation

DEFAULT_CONFIG = "demo.yaml"  # under config/ (paths.package_file)
POLICY_KEYS = {f for f in PolicyConfig.__dataclass_fields__}


def load_demo_config(path: Path) -> tuple[PolicyConfig, dict[str, Any]]:
    """Split the YAML into PolicyConfig fields and demo settings (prompt, calls); unknown keys are errors."""
    raw = yaml.safe_load(path.read_text()) or {}
    demo_keys = {"prompt", "calls"}
    unknown = set(raw) - POLICY_KEYS - demo_keys
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {sorted(unknown)}")
    policy = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k in POLICY_KEYS}
    calls = raw.get("calls", 20)
    if (
        isinstance(calls, bool) or not isinstance(calls, int) or calls < 1
    ):  # 0 crashed the run (found in review)
        raise ValueError(f"{path}: calls: an integer of at least 1, got {calls!r}")
    return PolicyConfig(**policy), {"prompt": raw.get("prompt", "do the task"), "calls": calls}


def parse_param(name: str, text: str, defaults: dict[str, Any]) -> Any:
    """A `--param NAME=VALUE`'s value as the parameter's type: a string parameter takes the text as written
    (a prompt with '#' or ':' in it: YAML cut it at the '#' or made it a mapping, found in review), an int
    given for a float parameter (or in a list of floats) is that float; the rest is read as YAML (true, 0.2, [a, b]). Raises
    ValueError naming the parameter for a value no parameter takes (a mapping, nothing)."""
    default = defaults.get(name)
    if isinstance(default, str):
        return text
    value = yaml.safe_load(text)
    if isinstance(value, dict) or value is None:
        raise ValueError(f"{name}: {text!r} is no parameter value (a number, true/false, a string or a list)")

    def number(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if isinstance(default, float) and number(value):
        return float(value)
    floats = isinstance(default, list) and bool(default) and isinstance(default[0], float)
    if floats and isinstance(value, list) and all(map(number, value)):
        return [float(v) for v in value]  # gripper_state_range=[0, 1]
    return value


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _notes(error: BaseException) -> str:
    """What the run added to the error it ended with (where its chunks were saved): "; " + each note."""
    return "".join(f"; {note}" for note in getattr(error, "__notes__", ()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--synthetic", action="store_true", help="policy only, synthetic observations, no ROS")
    p.add_argument("--config", type=Path, help="--synthetic: policy config (default config/demo.yaml)")
    p.add_argument("--calls", type=int, default=None, help="--synthetic: number of timed calls")
    p.add_argument("--seconds", type=float, default=6.0, help="bag demo: episode length")
    p.add_argument(
        "--episodes", type=int, default=2, help="bag demo: the warm-up, then this minus one repeats (a shift)"
    )
    p.add_argument(
        "--out",
        type=Path,
        help="bag demo: output folder (default build/demo in a source checkout, else rmuscle_demo here)",
    )
    p.add_argument(
        "--bags", type=Path, nargs="+", default=None, metavar="BAG",
        help="bag demo: replay these recorded episodes (rosbag2 folders, one per episode, in order)",
    )  # fmt: skip
    p.add_argument(
        "--remap", action="append", default=[], metavar="FROM:=TO",
        help="--bags: a bag topic onto one of the node's (repeatable; ALOHA topics are mapped by default)",
    )  # fmt: skip
    p.add_argument(
        "--recorded-clock", action="store_true",
        help="--bags: play each on its own recorded /clock (a simulator's, recorded without --use-sim-time)",
    )  # fmt: skip
    p.add_argument(
        "--domain-id", type=int, default=77, metavar="N",
        help="bag demo: the DDS domain of its node and player (default 77, away from a robot's usual 0)",
    )  # fmt: skip
    p.add_argument(
        "--sim", action="store_true",
        help="bag demo: a simulated ALOHA (MuJoCo, aloha_sim) in closed loop instead of bags",
    )  # fmt: skip
    p.add_argument(
        "--no-stream", action="store_true",
        help="bag demo: without action_streamer (the chunks are not turned into the arms' commands)",
    )  # fmt: skip
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="bag demo: a node parameter over config/rmuscle_default.yaml, e.g. cache.rho_p=0.2 (repeatable)",
    )
    p.add_argument(
        "--sim-param", action="append", default=[], metavar="NAME=VALUE",
        help="--sim: an aloha_sim parameter, e.g. placement_spread=0.25 or seed=3 (repeatable)",
    )  # fmt: skip
    args = p.parse_args(argv)
    try:
        if args.config is None:
            args.config = package_file("config", DEFAULT_CONFIG)
        if args.out is None:
            args.out = package_file("build", "demo") if source_checkout() else Path("rmuscle_demo")
    except FileNotFoundError as e:
        p.error(str(e))
    if args.calls is not None and args.calls < 1:
        p.error(f"--calls: at least 1, got {args.calls}")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out}: is a file, not a folder")
    if args.synthetic and (args.param or args.sim_param):
        p.error("--param / --sim-param: for the node (bag or --sim demo), not --synthetic (use --config)")
    if not args.synthetic:
        from rmuscle_ros.node.aloha_sim import sim_defaults
        from rmuscle_ros.node.params import parameter_defaults
        from rmuscle_ros.node.replay_demo import print_summary, run

        overrides: dict[str, Any] = {}
        sim_params: dict[str, Any] = {}
        for flag, items, into, defaults in (
            ("--param", args.param, overrides, parameter_defaults()),
            ("--sim-param", args.sim_param, sim_params, sim_defaults()),
        ):
            for item in items:
                name, sep, value = item.partition("=")
                if not sep or not name:
                    p.error(f"{flag} {item!r}: expected NAME=VALUE")
                try:
                    into[name] = parse_param(name, value, defaults)
                except ValueError as e:
                    p.error(f"{flag} {e}")
        if sim_params and not args.sim:
            p.error("--sim-param: only with --sim")
        from rmuscle_ros.node.bags import parse_remaps

        try:
            remap = parse_remaps(args.remap)
        except ValueError as e:
            p.error(str(e))
        if remap and args.bags is None:
            p.error("--remap: only with --bags (the demo's own bags use the node's topics)")

        def banner() -> None:  # once run() has checked the arguments
            if args.sim:
                print(
                    f"[demo] rmuscle_node (config/rmuscle_default.yaml) driving a simulated ALOHA (transfer_cube) in closed "
                    f"loop through action_streamer: {args.episodes} episode(s) of {args.seconds:g} s on one scene, a dense "
                    "warm-up, then repeats served by rMuscle"
                )
            elif args.bags is not None:
                print(
                    f"[demo] rmuscle_node (config/rmuscle_default.yaml) on {len(args.bags)} recorded episode(s)"
                )
            else:
                print(
                    f"[demo] rmuscle_node (config/rmuscle_default.yaml) on a {args.seconds:g} s ALOHA-like episode, "
                    f"replayed {args.episodes} time(s): a dense warm-up, then {args.episodes - 1} repeat(s) "
                    "served by rMuscle"
                )

        # SIGTERM (`kill`, `timeout`, a CI runner) ends the run as Ctrl-C does, through run()'s cleanup:
        # before (found in review) it ended this process at once and left aloha_sim and action_streamer
        # running, re-parented, the sim still publishing /clock.
        # Only where nobody else handles it: rclpy installs its own (in C, so Python's table reads SIG_DFL)
        # when its default context is initialised, and restoring SIG_DFL after would remove that (review).
        import rclpy

        ours = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not rclpy.ok()
        previous = signal.signal(signal.SIGTERM, _terminated) if ours else None
        try:
            summary = run(
                args.out, seconds=args.seconds, domain_id=args.domain_id, overrides=overrides,
                episodes=args.episodes, bags=args.bags, remap=remap, stream=not args.no_stream, sim=args.sim,
                sim_params=sim_params, announce=banner, bags_clock=args.recorded_clock,
            )  # fmt: skip
        except ValueError as e:
            p.error(str(e))
        except (RuntimeError, OSError) as e:  # the bag player failed, a service timed out, a file missing
            print(f"[demo] error: {e}{_notes(e)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the processes it started are stopped
            print(f"[demo] interrupted: the processes it started were stopped{_notes(e)}", file=sys.stderr)
            return 130
        finally:
            if ours:
                signal.signal(signal.SIGTERM, previous)
        print_summary(summary)
        return 0 if summary["chunks"] > 0 else 1
    if not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    try:
        cfg, demo = load_demo_config(args.config)
    except (ValueError, TypeError) as e:  # PolicyConfig's own checks; an unknown field's TypeError
        p.error(f"--config {args.config}: {e}")
    calls = args.calls or demo["calls"]

    print(
        f"[demo] preset {cfg.preset}, backend {cfg.backend} ({cfg.dtype}) on {cfg.device}, cameras {list(cfg.cameras)}"
    )
    policy = Policy(cfg)
    warm = policy.warmup(demo["prompt"])
    print(f"[demo] warm-up {warm['warmup_total'] * 1e3:.0f} ms")
    latencies = []
    for i in range(calls):
        chunk = policy.infer(synthetic_observation(cfg, demo["prompt"], seed=i))
        latencies.append(chunk.latency_s * 1e3)
    assert np.isfinite(chunk.actions).all()
    p90 = statistics.quantiles(latencies, n=10)[-1] if len(latencies) > 1 else latencies[0]
    print(
        f"[demo] action chunk {chunk.actions.shape[0]} x {chunk.actions.shape[1]} (horizon x action dim), "
        f"prompt {chunk.prompt_tokens} tokens"
    )
    print(
        f"[demo] latency over {calls} calls: median {statistics.median(latencies):.1f} ms, p90 {p90:.1f} ms"
    )
    print(f"[demo] first actions: {np.array2string(chunk.actions[0, :7], precision=3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
