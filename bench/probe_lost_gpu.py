"""What a lost CUDA context does to a process that goes on: the facts behind the node's `device_lost` exit.

After an asynchronous CUDA fault (here a Triton kernel storing 4 TiB past its tensor: an illegal address)
every later CUDA call of the process raises. The node ends its process at once then (docs/node.md,
`device_lost`). This probe says why it does not stay up: each case runs in a process of its own, on the
graph backend (`tiny`, the rMuscle cache on unless said), faults the GPU after one call, checks
`Policy.device_fault`, then lets the policy go one way, and reports how the process ended and the last
step it reached:
- `exit`: nothing released, the interpreter's normal exit (its finalisation frees what is left);
- `discard`: the episode's recording dropped (`Policy.discard_episode`), as a cleanup would first;
- `reset`: `Policy.reset_episode()`, which records the episode into the library and starts the next, as
  an episode's reset does;
- `close`: `Policy.close()` (without the discard);
- `del`: the policy deleted and collected;
- `os_exit`: the policy deleted, then `os._exit(0)`; `os_exit_kept`: `os._exit(0)` with nothing freed,
  which is what the node does (through its stall exit's path);
- `no_cache_del`: as `del`, the policy without the cache.

    python bench/probe_lost_gpu.py --out bench/results --commit $(git rev-parse --short HEAD)

Writes `probe_lost_gpu_<gpu>_<commit>.{md,json}`. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = ("exit", "discard", "reset", "close", "del", "os_exit", "os_exit_kept", "no_cache_del")

# A module (written beside the script that imports it) whose fault_the_gpu runs a Triton kernel storing 4
# TiB past its tensor: an illegal address, which loses the process's CUDA context for good, as an
# uncorrectable ECC error or a GPU fallen off the bus would. The GPU tests fault a GPU with it too.
WILD_STORE = """
import triton
import triton.language as tl


@triton.jit
def _wild_store(ptr):
    tl.store(ptr + (1 << 40), 1.0)


def fault_the_gpu(torch):
    x = torch.zeros(1, device="cuda")
    _wild_store[(1,)](x)
    torch.cuda.synchronize()  # raises: an illegal memory access
"""

CHILD = """
import gc
import os
import sys

import torch
from wild_store import fault_the_gpu

from rmuscle_ros.cache.runtime import RMuscleConfig
from rmuscle_ros.runtime.policy import Policy, PolicyConfig, synthetic_observation


def step(name):
    print("STEP", name, flush=True)


case, library = sys.argv[1], sys.argv[2]
cache = None if case.startswith("no_cache") else RMuscleConfig(library_path=library)
policy = Policy(PolicyConfig(backend="graph", device="cuda"), cache)
policy.infer(synthetic_observation(policy.cfg, "pick"))
step("called")
try:
    fault_the_gpu(torch)
except Exception:
    step("faulted")
fault = policy.device_fault()
print("FAULT", fault, flush=True)
if case == "discard":
    policy.discard_episode("the GPU's CUDA context is lost")
    step("discarded")
if case == "reset":
    policy.reset_episode()
    step("reset")
if case == "close":
    policy.close()
    step("closed")
if case in ("del", "os_exit", "no_cache_del"):
    del policy
    gc.collect()
    step("collected")
if case.startswith("os_exit"):
    os._exit(0)
step("exiting")
"""


def run_case(case: str, child: Path, folder: Path) -> dict:
    run = subprocess.run(
        [sys.executable, str(child), case, str(folder / f"library_{case}")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    steps = [line.split(" ", 1)[1] for line in run.stdout.splitlines() if line.startswith("STEP ")]
    fault = next((line[6:] for line in run.stdout.splitlines() if line.startswith("FAULT ")), None)
    terminate = next((line for line in run.stderr.splitlines() if line.startswith("terminate called")), "")
    raised_from = next((line for line in run.stderr.splitlines() if line.startswith("Exception raised")), "")
    # a Python exception that ended the script (a traceback's last line), if one did
    uncaught = [
        line for line in run.stderr.splitlines() if re.match(r"^[A-Za-z_.]*(Error|Exception): ", line)
    ]
    return {
        "exit_status": run.returncode,
        "last_step": steps[-1] if steps else "",
        "device_fault": fault,
        "terminate": terminate,
        "raised_from": raised_from,
        "uncaught": uncaught[-1][:200].replace("|", "/") if uncaught else "",  # a Markdown table cell
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--commit", default="")
    args = parser.parse_args(argv)

    import torch

    from bench import gpu_tag
    from bench.bench_pi05 import record_header, save_results

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "wild_store.py").write_text(WILD_STORE)
        child = folder / "child.py"  # its folder first on its path: wild_store imports from there
        child.write_text(CHILD)
        for case in CASES:
            results[case] = run_case(case, child, folder)
            print(case, results[case], flush=True)
    record = {**record_header(gpu, args.commit), "results": results}
    rows = [
        f"| `{case}` | {r['exit_status']} | {r['last_step']} | {r['terminate'] or '-'} | {r['raised_from'] or '-'} "
        f"| {r['uncaught'] or '-'} |"
        for case, r in results.items()
    ]
    markdown = (
        f"# A lost CUDA context and the process that goes on — {gpu}, {record['date']}\n\n"
        f"commit `{args.commit}`, torch {record['torch']}, command `{record['command']}`\n\n"
        "Each case a process of its own (graph backend, `tiny`), its GPU faulted after one call "
        "(bench/probe_lost_gpu.py says what each case does); exit status -6 is SIGABRT.\n\n"
        "| case | exit status | last step reached | terminate | raised from | uncaught Python exception |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    save_results(Path(args.out), f"probe_lost_gpu_{gpu_tag(gpu)}_{args.commit}", record, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
