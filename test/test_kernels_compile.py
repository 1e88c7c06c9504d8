"""The Triton kernels compile for Hopper (sm_90, the H200) on this CPU machine, as the engine launches them.

The interpreter tests (test_triton_interpret.py) run the kernels as Python, which accepts code Triton's
compiler rejects: a name defined under a branch on a runtime value and used after it passed them and
failed on the H200. `sm90_compile.py` records the engine's launches at full size under PDL and compiles
each one through ptxas, with and without PDL. It runs in a child process because the interpreter tests
switch this process's Triton to interpreting.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Located, not imported: this process's Triton is the interpreter's (conftest.py), the child's is not.
TRITON = importlib.util.find_spec("triton")
PTXAS = None if TRITON is None else Path(TRITON.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
SCRIPT = Path(__file__).with_name("sm90_compile.py")


@pytest.mark.skipif(TRITON is None, reason="Triton is not installed (pip install -e '.[kernels]')")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the GPU tests compile the kernels")
@pytest.mark.skipif(PTXAS is None or not PTXAS.exists(), reason=f"this Triton install has no ptxas ({PTXAS})")
def test_every_engine_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "of" in out and "kernel specializations compiled for sm_90" in out
    assert "FAIL" not in out
