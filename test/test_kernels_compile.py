"""The Triton kernels compile, as the engine launches them, for the H200 we measure on (sm_90a) and for
the Jetson Thor the product deploys on (sm_110a), on this CPU machine.

The interpreter tests (test_triton_interpret.py) run the kernels as Python, which accepts code Triton's
compiler rejects: a name defined under a branch on a runtime value and used after it passed them and
failed on the H200. `kernels_compile.py` records the engine's launches at full size under PDL and compiles
each one through ptxas, with and without PDL. It runs in a child process because the interpreter tests
switch this process's Triton to interpreting.

Nothing runs on a Thor here: this checks that Triton and CUDA 13's ptxas accept every kernel for its
architecture, not what they compute there or how fast.
"""

from __future__ import annotations

import importlib.util
import os
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Located, not imported: this process's Triton is the interpreter's (conftest.py), the child's is not.
TRITON = importlib.util.find_spec("triton")
PTXAS = None if TRITON is None else Path(TRITON.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
SCRIPT = Path(__file__).with_name("kernels_compile.py")
NO_TRITON = "Triton is not installed (pip install -e '.[kernels]')"


def cuda13_ptxas() -> Path | None:
    """CUDA 13's ptxas from the nvidia-cuda-nvcc wheel (`make venv` installs it), if installed."""
    for root in site.getsitepackages():
        path = Path(root) / "nvidia" / "cu13" / "bin" / "ptxas"
        if path.is_file():
            return path
    return None


NO_CUDA13 = "CUDA 13's ptxas is not installed (make venv: pip install --no-deps nvidia-cuda-nvcc)"


# What one program (thread block) may use with the opt-in: 227 KB on Hopper and on Blackwell's sm_100
# (NVIDIA's tuning guides), whose architecture the Thor's sm_110a follows (it lacks only stochastic
# rounding, by flash-attention's pull request 2108); not read off a Thor.
SHARED_LIMIT = 227 * 1024


def largest_shared(out: str) -> int:
    match = re.search(r"largest shared memory per program: (\d+) bytes", out)
    assert match is not None, out[-2000:]
    return int(match.group(1))


def compile_all(arch: int, **env: str) -> str:
    child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", str(arch)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    return out


@pytest.mark.skipif(TRITON is None, reason=NO_TRITON)
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the GPU tests compile the kernels")
@pytest.mark.skipif(PTXAS is None or not PTXAS.exists(), reason=f"this Triton install has no ptxas ({PTXAS})")
def test_every_engine_kernel_compiles_for_the_h200_sm90() -> None:
    out = compile_all(90)
    assert "of" in out and "kernel specializations compiled for sm_90a" in out
    assert "FAIL" not in out
    assert largest_shared(out) <= SHARED_LIMIT


@pytest.mark.skipif(TRITON is None, reason=NO_TRITON)
@pytest.mark.skipif(cuda13_ptxas() is None, reason=NO_CUDA13)
def test_every_engine_kernel_compiles_for_a_jetson_thor_sm110_with_cuda13s_ptxas() -> None:
    """Nothing runs on a Thor here: Triton and CUDA 13's ptxas accept every kernel for its architecture,
    and no program needs more shared memory than a block may have."""
    out = compile_all(110, TRITON_PTXAS_BLACKWELL_PATH=str(cuda13_ptxas()))
    assert "kernel specializations compiled for sm_110a" in out and "FAIL" not in out
    assert largest_shared(out) <= SHARED_LIMIT


@pytest.mark.skipif(TRITON is None, reason=NO_TRITON)
def test_a_ptxas_that_does_not_know_the_gpu_is_named_before_any_kernel_compiles(monkeypatch) -> None:
    """Triton 3.6's own ptxas does not know the Thor's sm_110a: the graph engine says so at construction,
    naming the variable to set, instead of failing in its warm-up's first kernel with ptxas's error."""
    from rmuscle_ros.engine.triton_ops import assembler_problem

    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)
    assembler_problem.cache_clear()
    assert assembler_problem(90) is None, "the bundled ptxas assembles for the H200"
    problem = assembler_problem(110)
    assert problem is not None and "does not know sm_110a" in problem
    assert "Set TRITON_PTXAS_BLACKWELL_PATH to a ptxas that does" in problem
    if (ptxas := cuda13_ptxas()) is not None:
        monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", str(ptxas))
        assembler_problem.cache_clear()
        assert assembler_problem(110) is None
    assembler_problem.cache_clear()


@pytest.mark.skipif(TRITON is None, reason=NO_TRITON)
def test_compiled_kernels_are_kept_where_the_deployment_says_unless_triton_cache_dir_does(
    tmp_path, monkeypatch
) -> None:
    """The graph backend keeps Triton's compiled kernels under `model.engine_cache_dir`/triton, so that a
    container whose home is not a volume does not compile them all again at every start; a
    TRITON_CACHE_DIR set by the operator wins."""
    from triton import knobs

    from rmuscle_ros.engine.triton_ops import keep_kernels_in

    monkeypatch.setattr(knobs.cache, "dir", knobs.cache.dir)  # restored after the test
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    kept = tmp_path / "engines" / "triton"
    assert keep_kernels_in(kept) == str(kept) and kept.is_dir() and knobs.cache.dir == str(kept)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "operator"))
    assert keep_kernels_in(tmp_path / "elsewhere") == str(tmp_path / "operator")
    assert not (tmp_path / "elsewhere").exists()
