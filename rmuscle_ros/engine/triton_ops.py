"""Triton kernels for the graph engine's fused operators (CUDA; `TRITON_INTERPRET=1` runs them on CPU).

Each function has the same signature and meaning as its definition in `rmuscle_ros.engine.ops`.
Only imported by the graph engine on a CUDA device (and by the interpreter-mode tests).

**Programmatic dependent launch (PDL, Hopper and later).** Inside `programmatic_launch(True)` every
kernel is launched so that it may start while the kernel before it is still running: it first prefetches
what does not depend on that kernel (its weights, into L2), then waits (`griddepcontrol.wait`, which
returns once the previous kernel has completed and its writes are visible) and only then reads
activations or writes anything, and right after the wait it lets the next kernel start launching. A
kernel may therefore overlap only the one before it, and only with weight prefetches: the results are
the same as without PDL. The denoising loop is a chain of ~1,400 small dependent kernels, so hiding each
launch and overlapping each weight stream with the previous kernel is where its time goes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from rmuscle_ros.engine import ops
from rmuscle_ros.engine.ops import _check_context_select

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)

_pdl = False  # read at launch time: graphs captured inside `programmatic_launch(True)` keep it


@contextlib.contextmanager
def programmatic_launch(enabled: bool) -> Iterator[None]:
    """Launch the kernels issued inside this block with programmatic dependent launch (module docstring)."""
    global _pdl
    previous, _pdl = _pdl, enabled
    try:
        yield
    finally:
        _pdl = previous


def pdl_supported(device: torch.device) -> bool:
    """PDL needs compute capability 9.0 (Hopper) or later; the Triton interpreter has none."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


@functools.cache
def assembler_problem(arch: int) -> str | None:
    """What keeps Triton from assembling the kernels for compute capability `arch` (90 for an H200, 110 for
    a Jetson Thor), or None.

    Triton compiles each kernel to PTX for sm_<arch>a and assembles it with a ptxas: the one its wheel
    bundles, or the one an environment variable names. Triton 3.6 bundles CUDA 12.8's (below sm_100) and
    12.9's (from sm_100), and neither knows the Thor's sm_110a, which came with CUDA 13: there the engine's
    warm-up would fail on its first kernel with ptxas's "Value 'sm_110a' is not defined". This asks that
    ptxas which targets it knows (`ptxas --help`) and says which variable to set."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    target = sm_arch_from_capability(arch)
    tool = get_ptxas(arch)
    listed = subprocess.run([tool.path, "--help"], capture_output=True, text=True, check=False).stdout
    if f"'{target}'" in listed:
        return None
    variables = [
        knob.key
        for knob in vars(type(knobs.nvidia)).values()
        if isinstance(knob, knobs.env_nvidia_tool) and _resolves_to(knob, tool.path)
    ]
    return (
        f"Triton {triton.__version__} assembles kernels for {target} with {tool.path} (CUDA {tool.version}), "
        f"which does not know {target}. Set {' or '.join(variables) or 'TRITON_PTXAS_PATH'} to a ptxas that "
        "does (for a Jetson Thor's sm_110a, CUDA 13 or later: e.g. /usr/local/cuda/bin/ptxas on JetPack 7)"
    )


def keep_kernels_in(path: str | os.PathLike[str]) -> str:
    """Keep Triton's compiled kernels under `path`, unless TRITON_CACHE_DIR already names a place; returns
    where they are kept. Process-wide (Triton has one cache). Triton's default is ~/.triton/cache: in a
    container without a volume there, every start compiles every kernel again (38-49 s of the first
    configure on the H200's host; a Thor's CPU has not been timed)."""
    from triton import knobs

    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    Path(path).mkdir(parents=True, exist_ok=True)
    knobs.cache.dir = str(path)
    return str(path)


def _resolves_to(knob: object, path: str) -> bool:
    try:
        return knob.get().path == path  # type: ignore[attr-defined]
    except RuntimeError:  # a tool this Triton install does not ship (and no variable names one)
        return False


def _launch_opts() -> dict[str, bool]:
    """Extra launch arguments: the PDL attribute when enabled, and floating-point fusion (multiply-adds
    contracted into FMAs) on by name. It is Triton 3.6's default, under which the kernels were measured
    and tested; Triton 3.9 warns that 3.10 turns it off by default."""
    return {"enable_fp_fusion": True} | ({"launch_pdl": True} if _pdl else {})


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 to fetch the 128-byte lines under `ptrs` (no registers are filled, nothing waits on it)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _prefetch_rows(w_ptr, rows, n_rows, stride_w, k_start, K_LEN: tl.constexpr, LINES: tl.constexpr):
    """Prefetch w[rows, k_start : k_start + K_LEN] (bf16: one 128-byte line per 64 elements) into L2.
    Out-of-range rows and the padding of LINES to a power of two are clamped to valid addresses."""
    ks = k_start + tl.minimum(tl.arange(0, LINES) * 64, K_LEN - 1)
    _prefetch_l2(w_ptr + tl.minimum(rows, n_rows - 1)[:, None] * stride_w + ks[None, :])


@triton.jit
def _flat_program():
    """(this program's index, the number of programs) over the whole grid."""
    pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    return pid, tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)


@triton.jit
def _prefetch_span(ptr, n_bytes, pid, nprog, CHUNK: tl.constexpr = 256):
    """This program's share of the first n_bytes from ptr into L2: chunks of CHUNK 128-byte lines, dealt
    round-robin to the programs."""
    base = ptr.to(tl.pointer_type(tl.int8))
    last = n_bytes - 1
    for start in range(pid * CHUNK, tl.cdiv(n_bytes, 128), nprog * CHUNK):
        lines = (start + tl.arange(0, CHUNK)).to(tl.int64) * 128
        _prefetch_l2(base + tl.minimum(lines, last))


@triton.jit
def _prefetch_table_rows(
    ptr, offset, rows_ptr, n_rows, row_bytes, pid, nprog, ROW_LINES: tl.constexpr, CHUNK: tl.constexpr = 16
):  # fmt: skip
    """This program's share of rows `offset + rows[j]` (row_bytes each, contiguous rows) into L2."""
    base = ptr.to(tl.pointer_type(tl.int8))
    line = tl.minimum(tl.arange(0, ROW_LINES).to(tl.int64) * 128, row_bytes - 1)
    for start in range(pid * CHUNK, n_rows, nprog * CHUNK):
        j = tl.minimum(start + tl.arange(0, CHUNK), n_rows - 1)
        r = tl.load(rows_ptr + j).to(tl.int64) + offset
        _prefetch_l2(base + r[:, None] * row_bytes + line[None, :])


@triton.jit
def _prefetch_ahead(
    whole_ptr, whole_bytes, rows_ptr, n_rows, t0_ptr, t0_off, t1_ptr, t1_off, row_bytes,
    WHOLE: tl.constexpr, N_TABLES: tl.constexpr, ROW_LINES: tl.constexpr,
):  # fmt: skip
    """Fetch into L2, spread over this kernel's programs, weights that later kernels read (ops.Prefetch)."""
    pid, nprog = _flat_program()
    if WHOLE:
        _prefetch_span(whole_ptr, whole_bytes, pid, nprog)
    if N_TABLES > 0:
        _prefetch_table_rows(t0_ptr, t0_off, rows_ptr, n_rows, row_bytes, pid, nprog, ROW_LINES)
    if N_TABLES > 1:
        _prefetch_table_rows(t1_ptr, t1_off, rows_ptr, n_rows, row_bytes, pid, nprog, ROW_LINES)


def _prefetch_args(prefetch: ops.Prefetch | None, placeholder: Tensor, device: torch.device) -> dict:
    """The kernel arguments of `_prefetch_ahead` for a Prefetch hint (`placeholder` stands in for unused
    pointers), within a budget of half the L2 cache: the whole tensor, cut short if it must be, then the
    row tables if they fit in what is left."""
    none = {"whole_ptr": placeholder, "whole_bytes": 0, "rows_ptr": placeholder, "n_rows": 0,
            "t0_ptr": placeholder, "t0_off": 0, "t1_ptr": placeholder, "t1_off": 0, "row_bytes": 128,
            "WHOLE": False, "N_TABLES": 0, "ROW_LINES": 1}  # fmt: skip
    if prefetch is None:
        return none  # (the kernels read these arguments under PDL only)
    budget = _l2_bytes(device) // 2
    args = dict(none)
    t = prefetch.whole
    if t is not None and t.is_contiguous():
        n = min(t.numel() * t.element_size(), budget)
        args |= {"whole_ptr": t, "whole_bytes": n, "WHOLE": True}
        budget -= n
    tables = prefetch.tables
    if prefetch.rows is not None and tables:
        row_bytes = tables[0][0].stride(0) * tables[0][0].element_size()
        if all(m.stride(0) * m.element_size() == row_bytes and m.stride(-1) == 1 for m, _ in tables) and (
            len(tables) * prefetch.rows.numel() * row_bytes <= budget
        ):
            args |= {"rows_ptr": prefetch.rows, "n_rows": prefetch.rows.numel(), "row_bytes": row_bytes,
                     "N_TABLES": len(tables), "ROW_LINES": triton.next_power_of_2(triton.cdiv(row_bytes, 128))}  # fmt: skip
            for i, (m, off) in enumerate(tables):
                args |= {f"t{i}_ptr": m, f"t{i}_off": off}
    return args


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 50 * 2**20
    return torch.cuda.get_device_properties(device).L2_cache_size


@triton.jit
def _pdl_enter():
    """Wait until the previous kernel has finished (its writes visible), then let the next one launch."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _add_norm_kernel(
    res_ptr,
    y_ptr,
    y_bias_ptr,
    gate_ptr,
    mul_ptr,
    add_ptr,
    out_ptr,
    base_ptr,
    store_ptr,
    D,
    eps,
    stride_res,
    stride_y,
    stride_y_split,
    stride_out,
    stride_base,
    stride_store,
    Y_SPLITS: tl.constexpr,
    HAS_Y: tl.constexpr,
    HAS_Y_BIAS: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_MUL: tl.constexpr,
    HAS_ADD: tl.constexpr,
    RMS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    HAS_BASE: tl.constexpr,
    STORE_Y: tl.constexpr,
    y_rows_ptr,
    y_alt_ptr,
    stride_alt,
    n_alt,
    drift_ref_ptr,
    stride_drift_ref,
    drift_out_ptr,
    n_drift,
    Y_ROWS: tl.constexpr,
    DRIFT: tl.constexpr,
    ref_slot_ptr,
    stride_ref_slot,
    REF_SLOT: tl.constexpr,
    RES_EARLY: tl.constexpr,
    drift_scale_ptr,
    DRIFT_SCALE: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < D
    # Under PDL, what the previous kernel cannot have written is loaded before the wait, while it runs:
    # the constant vectors and the anchor step's output (y_base), each from before this call's chain.
    if HAS_Y_BIAS:
        y_bias = tl.load(y_bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_GATE:
        gate = tl.load(gate_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_MUL:
        mul = tl.load(mul_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_ADD:
        add = tl.load(add_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_BASE:
        base = tl.load(base_ptr + row * stride_base + cols, mask=valid, other=0.0)
    if DRIFT_SCALE:  # a weight: loaded before the wait
        drift_scale = tl.load(drift_scale_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if RES_EARLY:  # the caller says the residual was last written two or more kernels back: finished by now
        x = tl.load(res_ptr + row * stride_res + cols, mask=valid, other=0.0).to(tl.float32)
    if PDL:
        _pdl_enter()
    ref_off = 0  # y_alt and drift_ref: with REF_SLOT, stacks of entries, ref_slot[0] the one read
    if REF_SLOT:
        ref_off = tl.load(ref_slot_ptr).to(tl.int64) * stride_ref_slot
    if not RES_EARLY:
        x = tl.load(res_ptr + row * stride_res + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_Y:
        y_row = row
        y_mask = valid
        if Y_ROWS:  # the Context Cache: y holds only the recomputed rows, y_alt stands in for the others
            src = tl.load(y_rows_ptr + row)
            y_row = tl.maximum(src, 0)
            y_mask = valid & (src >= 0)
        y = tl.load(y_ptr + y_row * stride_y + cols, mask=y_mask, other=0.0).to(tl.float32)
        for split in range(1, Y_SPLITS):  # split-K partial products, summed in a fixed order
            y += tl.load(y_ptr + split * stride_y_split + y_row * stride_y + cols, mask=y_mask, other=0.0)
        if Y_ROWS:
            alt_mask = valid & (src < 0) & (row < n_alt)
            alt = tl.load(y_alt_ptr + ref_off + row * stride_alt + cols, mask=alt_mask, other=0.0).to(
                tl.float32
            )
            y = tl.where(src >= 0, y, alt)
        if HAS_BASE:
            y += base
        if HAS_Y_BIAS:
            y += y_bias
        if STORE_Y:
            tl.store(store_ptr + row * stride_store + cols, y, mask=valid)
        if HAS_GATE:
            y *= gate
        x += y
        tl.store(res_ptr + row * stride_res + cols, x, mask=valid)
    if RMS:
        h = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    else:
        centred = tl.where(valid, x - tl.sum(x, axis=0) / D, 0.0)
        h = centred * tl.rsqrt(tl.sum(centred * centred, axis=0) / D + eps)
    if HAS_MUL:
        h *= mul
    if HAS_ADD:
        h += add
    h_out = h.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, h_out, mask=valid)
    if DRIFT:  # the Context Cache's drift of this row from the reference, measured on the stored values
        is_visual = row < n_drift
        ref = tl.load(
            drift_ref_ptr + ref_off + row * stride_drift_ref + cols, mask=valid & is_visual, other=0.0
        )
        diff = tl.where(valid, h_out.to(tl.float32) - ref.to(tl.float32), 0.0)
        if DRIFT_SCALE:
            diff *= drift_scale
        tl.store(drift_out_ptr + row, tl.sum(diff * diff, axis=0), mask=is_visual)


def add_norm(
    res: Tensor,
    y: Tensor | None,
    out: Tensor,
    *,
    eps: float,
    rms: bool,
    y_bias: Tensor | None = None,
    gate: Tensor | None = None,
    mul: Tensor | None = None,
    add: Tensor | None = None,
    y_base: Tensor | None = None,
    y_store: Tensor | None = None,
    y_rows: Tensor | None = None,
    y_alt: Tensor | None = None,
    drift_ref: Tensor | None = None,
    drift_out: Tensor | None = None,
    ref_slot: Tensor | None = None,
    res_ready: bool = False,
    drift_scale: Tensor | None = None,
) -> Tensor:
    """ops.add_norm in one kernel per row (see it for the terms). res_ready: `res` was last written two or
    more kernels before this one, so under PDL it may be read before the wait. (A kernel starts only once
    every program of the one before it has passed its own wait, i.e. once the kernel two back has
    finished and its writes are visible.)"""
    n, d = res.shape
    if y_rows is not None and y_alt is None:
        raise ValueError("add_norm: y_rows needs y_alt, the rows read where y_rows is negative")
    if y is None and (y_base is not None or y_store is not None):
        raise ValueError("add_norm: y_base and y_store go with y (without it nothing is added or stored)")
    rowwise = (res, y, out, y_base, y_store, y_rows, y_alt, drift_ref, drift_out, drift_scale)
    stacks = [t for t in (y_alt, drift_ref) if t is not None and ref_slot is not None]
    if any(t is not None and t.stride(-1) != 1 for t in rowwise) or len({t.stride(0) for t in stacks}) > 1:
        return ops.add_norm(
            res, y, out, eps=eps, rms=rms, y_bias=y_bias, gate=gate, mul=mul, add=add, y_base=y_base,
            y_store=y_store, y_rows=y_rows, y_alt=y_alt, drift_ref=drift_ref, drift_out=drift_out,
            ref_slot=ref_slot, drift_scale=drift_scale,
        )  # fmt: skip
    y_rows = None if y is None else y_rows  # nothing to read without y
    block = triton.next_power_of_2(d)
    _add_norm_kernel[(n,)](
        res,
        res if y is None else y,
        res if y_bias is None else y_bias,
        res if gate is None else gate,
        res if mul is None else mul,
        res if add is None else add,
        out,
        res if y_base is None else y_base,
        res if y_store is None else y_store,
        d,
        eps,
        res.stride(0),
        0 if y is None else y.stride(-2),
        y.stride(0) if y is not None and y.ndim == 3 else 0,
        out.stride(0),
        0 if y_base is None else y_base.stride(0),
        0 if y_store is None else y_store.stride(0),
        Y_SPLITS=y.shape[0] if y is not None and y.ndim == 3 else 1,
        HAS_Y=y is not None,
        HAS_Y_BIAS=y_bias is not None,
        HAS_GATE=gate is not None,
        HAS_MUL=mul is not None,
        HAS_ADD=add is not None,
        RMS=rms,
        BLOCK=block,
        PDL=_pdl,
        HAS_BASE=y_base is not None and y is not None,
        STORE_Y=y_store is not None and y is not None,
        y_rows_ptr=res if y_rows is None else y_rows,
        y_alt_ptr=res if y_rows is None else y_alt,
        stride_alt=0 if y_rows is None else y_alt.stride(-2),
        n_alt=0 if y_rows is None else y_alt.shape[-2],
        drift_ref_ptr=res if drift_ref is None else drift_ref,
        stride_drift_ref=0 if drift_ref is None else drift_ref.stride(-2),
        drift_out_ptr=res if drift_ref is None else drift_out,
        n_drift=0 if drift_ref is None else drift_ref.shape[-2],
        Y_ROWS=y_rows is not None,
        DRIFT=drift_ref is not None,
        ref_slot_ptr=res if ref_slot is None else ref_slot,
        stride_ref_slot=stacks[0].stride(0) if stacks else 0,
        REF_SLOT=bool(stacks),
        RES_EARLY=res_ready,
        drift_scale_ptr=res if drift_scale is None or drift_ref is None else drift_scale,
        DRIFT_SCALE=drift_scale is not None and drift_ref is not None,
        num_warps=4 if block <= 1024 else 8,
        **_launch_opts(),
    )
    return out


@triton.jit
def _context_select_kernel(
    drift_ptr, bias_ptr, rows_ptr, inv_ptr, keep, num_rows,
    NV: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """ops.context_select for BLOCK_R rows of the prefix. No sort: a visual row's rank is the number of
    visual rows ranked before it, counted against all Nv drifts CHUNK at a time; ranks are distinct, so
    every chosen row has its own slot in rows_out."""
    if PDL:
        _pdl_enter()
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    is_visual = r < NV
    d_r = tl.load(drift_ptr + r, mask=is_visual, other=0.0)
    d_r = tl.where(d_r != d_r, float("inf"), d_r)  # NaN ranks as +inf (a total order, as in the definition)
    if HAS_BIAS:  # a row nothing attends ranks after every attended one (ops.context_select)
        d_r = tl.where(tl.load(bias_ptr + r, mask=is_visual, other=0.0) < 0, float("-inf"), d_r)
    rank = tl.zeros([BLOCK_R], tl.int32)
    for j0 in range(0, NV, CHUNK):  # a static trip count: Nv is fixed per engine (768 at full size)
        j = j0 + tl.arange(0, CHUNK)
        d_j = tl.load(drift_ptr + j, mask=j < NV, other=0.0)
        d_j = tl.where(d_j != d_j, float("inf"), d_j)
        if HAS_BIAS:
            d_j = tl.where(tl.load(bias_ptr + j, mask=j < NV, other=0.0) < 0, float("-inf"), d_j)
        ahead = (d_j[None, :] > d_r[:, None]) | ((d_j[None, :] == d_r[:, None]) & (j[None, :] < r[:, None]))
        rank += tl.sum((ahead & (j < NV)[None, :]).to(tl.int32), axis=1)
    pos = tl.where(is_visual, tl.where(rank < keep, rank, -1), keep + r - NV)  # prompt rows: all, in order
    in_prefix = r < num_rows
    tl.store(inv_ptr + r, pos.to(inv_ptr.dtype.element_ty), mask=in_prefix)
    tl.store(rows_ptr + pos, r.to(rows_ptr.dtype.element_ty), mask=in_prefix & (pos >= 0))


def context_select(
    drift: Tensor, keep: int, num_rows: int, rows_out: Tensor, inv_out: Tensor, key_bias: Tensor | None = None
) -> None:
    """ops.context_select in one kernel: ranks by comparison counting, every row's rank in parallel."""
    _check_context_select(drift.shape[0], keep, num_rows, rows_out, inv_out, key_bias)
    strides = [t.stride(0) for t in (drift, rows_out, inv_out, key_bias) if t is not None]
    if any(st != 1 for st in strides):
        return ops.context_select(drift, keep, num_rows, rows_out, inv_out, key_bias)
    # Small row blocks and all drifts in one chunk (up to 1,024): one pass, ~100 programs at full size,
    # instead of a serial loop of loads and counts.
    nv = drift.shape[0]
    block_r, chunk = 8, min(1024, triton.next_power_of_2(nv))
    _context_select_kernel[(triton.cdiv(num_rows, block_r),)](
        drift, drift if key_bias is None else key_bias, rows_out, inv_out, keep, num_rows,
        NV=nv, BLOCK_R=block_r, CHUNK=chunk, HAS_BIAS=key_bias is not None, PDL=_pdl, num_warps=4,
        **_launch_opts(),
    )  # fmt: skip


@triton.jit
def _window_match_kernel(
    d_ptr, keys_ptr, usable_ptr, slot_ptr, out_ptr, S, stride_k,
    D: tl.constexpr, SP: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """ops.window_match in one program: every entry's dot product with the descriptor, BLOCK_D columns at
    a time, then the pick (the first of equal maxima)."""
    s = tl.arange(0, SP)
    s_ok = s < S
    usable = tl.load(usable_ptr + s, mask=s_ok, other=0) != 0  # set by the host before the call
    if PDL:
        _pdl_enter()
    dots = tl.zeros([SP], tl.float32)
    squares = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + tl.arange(0, BLOCK_D)
        c_ok = c < D
        d = tl.load(d_ptr + c, mask=c_ok, other=0.0)
        squares += d * d
        k = tl.load(
            keys_ptr + s[:, None] * stride_k + c[None, :], mask=s_ok[:, None] & c_ok[None, :], other=0.0
        )
        dots += tl.sum(k * d[None, :], axis=1)
    sims = dots * (1.0 / tl.sqrt(tl.maximum(tl.sum(squares, axis=0), 1e-24)))
    sims = tl.where(usable & (sims == sims), sims, -2.0)
    best_sim = tl.max(sims, axis=0)
    best = tl.min(tl.where(sims == best_sim, s, SP), axis=0)
    tl.store(slot_ptr, best.to(tl.int64))
    tl.store(out_ptr, best.to(tl.float32))
    tl.store(out_ptr + 1, best_sim)


def window_match(
    descriptor: Tensor, keys: Tensor, usable: Tensor, slot_out: Tensor, match_out: Tensor
) -> None:
    """ops.window_match in one kernel (the match stage's ~10 small torch kernels were 65 µs on an H200)."""
    d = descriptor.reshape(-1)
    ok = d.dtype == keys.dtype == torch.float32 and d.is_contiguous() and keys.stride(-1) == 1
    if not ok or usable.dtype != torch.bool or keys.shape[0] > 64:
        return ops.window_match(descriptor, keys, usable, slot_out, match_out)
    _window_match_kernel[(1,)](
        d, keys, usable.view(torch.uint8), slot_out, match_out, keys.shape[0], keys.stride(0), D=d.shape[0],
        SP=max(16, triton.next_power_of_2(keys.shape[0])), BLOCK_D=256, PDL=_pdl, num_warps=8,
        **_launch_opts(),
    )  # fmt: skip


@triton.jit
def _geglu_kernel(gu_ptr, out_ptr, F, stride_gu, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        _pdl_enter()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < F
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + F + cols, mask=valid, other=0.0).to(tl.float32)
    # gelu_tanh(g) = 0.5·g·(1 + tanh(z)) = g·sigmoid(2z), z = √(2/π)·(g + 0.044715·g³)
    z = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
    out = g * tl.sigmoid(2.0 * z) * u
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=valid)


def geglu(gate_up: Tensor, out: Tensor) -> Tensor:
    n, f = out.shape
    block = 1024
    _geglu_kernel[(n, triton.cdiv(f, block))](
        gate_up, out, f, gate_up.stride(0), out.stride(0), BLOCK=block, PDL=_pdl, **_launch_opts()
    )
    return out


@triton.jit
def _neuron_scores_kernel(
    act_ptr, anchor_ptr, out_ptr, F, stride_act, stride_anchor,
    M: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        _pdl_enter()
    cols = tl.program_id(0) * BF + tl.arange(0, BF)
    col_ok = cols < F
    total = tl.zeros([BF], tl.float32)
    for r0 in range(0, M, BM):
        rows = r0 + tl.arange(0, BM)
        ok = (rows[:, None] < M) & col_ok[None, :]
        a = tl.load(act_ptr + rows[:, None] * stride_act + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        b = tl.load(anchor_ptr + rows[:, None] * stride_anchor + cols[None, :], mask=ok, other=0.0)
        total += tl.sum(tl.abs(a - b.to(tl.float32)), axis=0)
    tl.store(out_ptr + cols, total, mask=col_ok)


def neuron_scores(act: Tensor, anchor: Tensor, out: Tensor) -> Tensor:
    """ops.neuron_scores in one kernel (the recording denoise: one launch per layer-step instead of five)."""
    if act.stride(-1) != 1 or anchor.stride(-1) != 1 or out.stride(-1) != 1 or out.dtype != torch.float32:
        return ops.neuron_scores(act, anchor, out)
    m, f = act.shape
    block = 128
    _neuron_scores_kernel[(triton.cdiv(f, block),)](
        act, anchor, out, f, act.stride(0), anchor.stride(0),
        M=m, BM=min(64, max(16, triton.next_power_of_2(m))), BF=block, PDL=_pdl, **_launch_opts(),
    )  # fmt: skip
    return out


@triton.jit
def _rope_qkv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    N,
    stride_qkv,
    stride_cs,
    stride_q,
    stride_k_head,
    stride_k_tok,
    stride_v_head,
    stride_v_tok,
    H: tl.constexpr,
    KVH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (block of BLOCK_T tokens, head), on [BLOCK_T, HALF] tiles of each half of the head:
    one program per (token, head) moved too little data to cover its launch and scheduling cost."""
    if PDL:
        _pdl_enter()
    toks = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]  # (BLOCK_T, 1)
    head = tl.program_id(1)  # 0..H-1 query heads, then KVH key heads, then KVH value heads
    offs = tl.arange(0, HALF)[None, :]  # (1, HALF)
    ok = toks < N  # the last block may be partial
    src = qkv_ptr + toks * stride_qkv + head * 2 * HALF + offs
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    if head < H + KVH:
        c = tl.load(cos_ptr + toks * stride_cs + offs, mask=ok, other=0.0)
        s = tl.load(sin_ptr + toks * stride_cs + offs, mask=ok, other=0.0)
        r1 = x1 * c - x2 * s
        r2 = x2 * c + x1 * s
        if head < H:
            dst = q_ptr + toks * stride_q + head * 2 * HALF + offs
            tl.store(dst, r1.to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + HALF, r2.to(q_ptr.dtype.element_ty), mask=ok)
        else:
            dst = k_ptr + (head - H) * stride_k_head + toks * stride_k_tok + offs
            tl.store(dst, r1.to(k_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + HALF, r2.to(k_ptr.dtype.element_ty), mask=ok)
    else:
        dst = v_ptr + (head - H - KVH) * stride_v_head + toks * stride_v_tok + offs
        tl.store(dst, x1.to(v_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, x2.to(v_ptr.dtype.element_ty), mask=ok)


def rope_qkv(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_out: Tensor,
    k_out: Tensor,
    v_out: Tensor,
    num_heads: int,
    num_kv_heads: int,
    config: dict[str, int] | None = None,
) -> None:
    """`ops.rope_qkv`. config: block_t tokens per program (a power of two), warps. The default's
    [16, 128] tile (π0.5, Dh = 256) is 16 values per thread with 4 warps; not yet tuned on a GPU."""
    n = qkv.shape[0]
    half = cos.shape[-1]
    cfg = {"block_t": 16, "warps": 4} | (config or {})
    if half & (half - 1) or qkv.stride(-1) != 1 or q_out.stride(-1) != 1 or k_out.stride(-1) != 1:
        return ops.rope_qkv(qkv, cos, sin, q_out, k_out, v_out, num_heads, num_kv_heads)
    _rope_qkv_kernel[(triton.cdiv(n, cfg["block_t"]), num_heads + 2 * num_kv_heads)](
        qkv,
        cos,
        sin,
        q_out,
        k_out,
        v_out,
        n,
        qkv.stride(0),
        cos.stride(0),
        q_out.stride(0),
        k_out.stride(0),
        k_out.stride(1),
        v_out.stride(0),
        v_out.stride(1),
        H=num_heads,
        KVH=num_kv_heads,
        HALF=half,
        BLOCK_T=cfg["block_t"],
        PDL=_pdl,
        num_warps=cfg["warps"],
        **_launch_opts(),
    )


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    stats_ptr,
    N,
    Lk,
    scale,
    stride_q,
    stride_k_head,
    stride_k_tok,
    stride_v_head,
    stride_v_tok,
    stride_out,
    G: tl.constexpr,
    DH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    SPLIT: tl.constexpr,
    KEYS_PER_SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Flash attention over one K/V head for a block of its G·N query rows (query heads folded into rows).

    With SPLIT, each program covers one slice of the keys and writes an unnormalised partial result plus
    its running max and denominator; `_attention_combine_kernel` merges the slices (flash-decoding).
    """
    if PDL:
        _pdl_enter()
    kv_head = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)  # row r = (head-in-group r // N, token r % N)
    split = tl.program_id(2)
    row_ok = rows < G * N
    head = kv_head * G + rows // N
    tok = rows % N
    d = tl.arange(0, DH)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q + head[:, None] * DH + d[None, :], mask=row_ok[:, None], other=0.0
    )
    m_i = tl.full([BM], -1e30, tl.float32)  # finite: a fully masked block must not produce inf - inf
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DH], tl.float32)
    start = split * KEYS_PER_SPLIT
    stop = tl.minimum(start + KEYS_PER_SPLIT, Lk)
    for n0 in range(0, KEYS_PER_SPLIT, BN):
        cols = start + n0 + tl.arange(0, BN)
        col_ok = cols < stop
        k = tl.load(
            k_ptr + kv_head * stride_k_head + cols[:, None] * stride_k_tok + d[None, :],
            mask=col_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k)) * scale
        s += tl.load(bias_ptr + cols, mask=col_ok, other=-1e30)[None, :]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(
            v_ptr + kv_head * stride_v_head + cols[:, None] * stride_v_tok + d[None, :],
            mask=col_ok[:, None],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if SPLIT:
        flat = kv_head * G * N + rows  # partials are indexed by (split, global row)
        total = tl.num_programs(0) * G * N
        tl.store(part_ptr + (split * total + flat)[:, None] * DH + d[None, :], acc, mask=row_ok[:, None])
        tl.store(stats_ptr + (2 * split) * total + flat, m_i, mask=row_ok)
        tl.store(stats_ptr + (2 * split + 1) * total + flat, l_i, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        dst = out_ptr + tok[:, None] * stride_out + head[:, None] * DH + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attention_combine_kernel(
    part_ptr, stats_ptr, out_ptr, N, total, num_splits, stride_out,
    SPLITS_P2: tl.constexpr, DH: tl.constexpr, PDL: tl.constexpr,
    whole_ptr, whole_bytes, rows_ptr, n_rows, t0_ptr, t0_off, t1_ptr, t1_off, row_bytes,
    WHOLE: tl.constexpr, N_TABLES: tl.constexpr, ROW_LINES: tl.constexpr,
):  # fmt: skip
    """Merge the split-KV partials of one query row. Under PDL it first starts fetching into L2 what the
    attention's `prefetch` names (`_prefetch_ahead`). It starts while the attention runs, three kernels
    before the denoising FFN's gate/up, whose own prefetch starts too late to hide its 16.8 MB."""
    if PDL:
        _prefetch_ahead(
            whole_ptr, whole_bytes, rows_ptr, n_rows, t0_ptr, t0_off, t1_ptr, t1_off, row_bytes,
            WHOLE, N_TABLES, ROW_LINES,
        )  # fmt: skip
        _pdl_enter()
    row = tl.program_id(0)  # global row = kv_head·G·N + head-in-group·N + token = head·N + token
    head = row // N
    tok = row % N
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < num_splits
    m = tl.load(stats_ptr + (2 * s) * total + row, mask=s_ok, other=-1e30)
    l_s = tl.load(stats_ptr + (2 * s + 1) * total + row, mask=s_ok, other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))
    d = tl.arange(0, DH)
    acc = tl.load(part_ptr + (s[:, None] * total + row) * DH + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + tok * stride_out + head * DH + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _skinny_matmul_kernel(
    a_ptr, w_ptr, c_ptr, M, N, K, stride_a, stride_w, stride_c, stride_c_split, idx_ptr, up_offset,
    anchor_ptr, stride_anchor,
    K_PER_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GEGLU: tl.constexpr,
    PDL: tl.constexpr, LINES: tl.constexpr, GATHER_N: tl.constexpr, GATHER_K: tl.constexpr,
    SUB_ANCHOR: tl.constexpr, PRELOAD: tl.constexpr = False,
):  # fmt: skip
    """c[split] = a[:, K-slice] @ w[:, K-slice]ᵀ for a few rows of `a`: streams the weight once.

    PRELOAD (not with GEGLU): the program's whole weight slice is loaded into registers before the PDL wait
    (not only prefetched into L2), and after it one dot over the K-slice (K_PER_SPLIT a power of two, no BK
    loop).

    GEGLU: w is [W_gate; W_up] (up rows start at `up_offset`) and c = gelu_tanh(g) * u, (M, N).
    The Action Cache's gathers read only the selected neurons' weights, where they lie:
    GATHER_N: output column j uses weight row idx[j] (and up_offset + idx[j]); SUB_ANCHOR: c -= anchor[:, idx[j]].
    GATHER_K: w is K-major (K_full, N) and reduction index k reads its row idx[k]; the K slices may
    overrun K (the last slice shorter, or empty), and what lies beyond K is masked.
    The indices are written before the call and the anchor by the first step, so both may be read before
    the PDL wait.
    """
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    split = tl.program_id(1)
    col_ok = cols < N
    src = tl.load(idx_ptr + cols, mask=col_ok, other=0).to(tl.int64) if GATHER_N else cols
    rows = tl.arange(0, BM)
    out_ok = (rows[:, None] < M) & col_ok[None, :]
    if SUB_ANCHOR:  # the anchor step's activations, from before the previous kernel: read before the wait
        anchor = tl.load(anchor_ptr + rows[:, None] * stride_anchor + src[None, :], mask=out_ok, other=0.0)
    if PRELOAD:  # the weights, from before the call: into registers while the previous kernel runs
        kp = split * K_PER_SPLIT + tl.arange(0, K_PER_SPLIT)
        if GATHER_K:
            kp_ok = kp < K
            kp_src = tl.load(idx_ptr + kp, mask=kp_ok, other=0).to(tl.int64)
            w_pre = tl.load(w_ptr + kp_src[:, None] * stride_w + cols[None, :], mask=kp_ok[:, None] & col_ok[None, :],
                            other=0.0)  # fmt: skip
        else:  # (K-slice, BN), like the gathered one
            w_pre = tl.load(w_ptr + src[None, :] * stride_w + kp[:, None], mask=col_ok[None, :], other=0.0)
        if PDL:
            _pdl_enter()
    elif PDL:  # this program's weight slice does not depend on the previous kernel: start fetching it
        if GATHER_K:  # one short segment (BN columns) per selected row
            kk = tl.minimum(split * K_PER_SPLIT + tl.minimum(tl.arange(0, LINES), K_PER_SPLIT - 1), K - 1)
            _prefetch_l2(w_ptr + tl.load(idx_ptr + kk).to(tl.int64) * stride_w + tl.program_id(0) * BN)
        else:
            _prefetch_rows(w_ptr, src, up_offset, stride_w, split * K_PER_SPLIT, K_PER_SPLIT, LINES)
            if GEGLU:
                _prefetch_rows(
                    w_ptr, up_offset + src, 2 * up_offset, stride_w, split * K_PER_SPLIT, K_PER_SPLIT, LINES
                )
        _pdl_enter()
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    if PRELOAD:
        a_mask = rows[:, None] < M
        if GATHER_K:
            a_mask = a_mask & kp_ok[None, :]
        a_pre = tl.load(a_ptr + rows[:, None] * stride_a + kp[None, :], mask=a_mask, other=0.0)
        acc = tl.dot(a_pre, w_pre)
    for k0 in range(0, K_PER_SPLIT if not PRELOAD else 0, BK):
        ks = split * K_PER_SPLIT + k0 + tl.arange(0, BK)
        if GATHER_K:
            k_ok = ks < K
            a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=(rows[:, None] < M) & k_ok[None, :],
                        other=0.0)  # fmt: skip
            k_src = tl.load(idx_ptr + ks, mask=k_ok, other=0).to(tl.int64)
            w_kn = tl.load(w_ptr + k_src[:, None] * stride_w + cols[None, :], mask=k_ok[:, None] & col_ok[None, :],
                           other=0.0)  # fmt: skip
            acc += tl.dot(a, w_kn)
        else:
            a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=rows[:, None] < M, other=0.0)
            w = tl.load(w_ptr + src[:, None] * stride_w + ks[None, :], mask=col_ok[:, None], other=0.0)
            acc += tl.dot(a, tl.trans(w))
        if GEGLU:
            w_up = tl.load(
                w_ptr + (up_offset + src)[:, None] * stride_w + ks[None, :], mask=col_ok[:, None], other=0.0
            )
            acc_up += tl.dot(a, tl.trans(w_up))
    if GEGLU:
        z = SQRT_2_OVER_PI * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * z) * acc_up
    if SUB_ANCHOR:
        acc -= anchor.to(tl.float32)
    dst = c_ptr + split * stride_c_split + rows[:, None] * stride_c + cols[None, :]
    tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=out_ok)


def _launch_skinny(
    a: Tensor, w: Tensor, c: Tensor, n: int, splits: int, geglu: bool, cfg: dict[str, int],
    neurons: Tensor | None = None, gather_k: bool = False, anchor: Tensor | None = None,
) -> None:  # fmt: skip
    k = a.shape[1]
    # Gathered K: slices of whole BK blocks, the last one shorter (masked); otherwise K divides evenly.
    k_split = triton.cdiv(triton.cdiv(k, splits), cfg["bk"]) * cfg["bk"] if gather_k else k // splits
    # PRELOAD: the weight slice into registers before the PDL wait, when it is at most cfg["preload"] bytes
    w_bytes = k_split * cfg["bn"] * w.element_size()
    preload = not geglu and w_bytes <= cfg.get("preload", 0) and not k_split & (k_split - 1)
    _skinny_matmul_kernel[(triton.cdiv(n, cfg["bn"]), splits)](
        a, w, c, a.shape[0], n, k, a.stride(0), w.stride(0), c.stride(-2), c.stride(0) if splits > 1 else 0,
        a if neurons is None else neurons, w.shape[0] // 2 if geglu else w.shape[0],
        a if anchor is None else anchor, 0 if anchor is None else anchor.stride(0),
        K_PER_SPLIT=k_split, BM=max(16, triton.next_power_of_2(a.shape[0])), BN=cfg["bn"],
        BK=cfg["bk"], GEGLU=geglu, PDL=_pdl,
        LINES=triton.next_power_of_2(k_split) if gather_k else _prefetch_lines(k_split),
        GATHER_N=neurons is not None and not gather_k, GATHER_K=gather_k, SUB_ANCHOR=anchor is not None,
        PRELOAD=preload, num_warps=cfg["warps"], num_stages=cfg["stages"], **_launch_opts(),
    )  # fmt: skip


def _prefetch_lines(k: int) -> int:
    return triton.next_power_of_2(max(1, k // 64))


def _skinny_ok(a: Tensor, w: Tensor, splits: int, bk: int, uneven: bool = False) -> bool:
    """Few rows, unit strides, and K in whole BK blocks: split evenly, or (`uneven`, gathered K) not."""
    k_ok = a.shape[1] % bk == 0 if uneven else a.shape[1] % (splits * bk) == 0
    return a.shape[0] <= 64 and k_ok and a.stride(-1) == 1 and w.stride(-1) == 1


def linear(
    a: Tensor,
    w: Tensor,
    splits: int = 1,
    config: dict[str, int] | None = None,
    *,
    neurons: Tensor | None = None,
) -> Tensor:
    """a (M, K) @ w (N, K)ᵀ. Few rows (the denoising steps): a weight-streaming Triton kernel, returning
    `splits` float32 partial products (splits, M, N) when splits > 1 (summed by `add_norm`), else (M, N)
    in a's dtype. Many rows: cuBLAS. Default launch configs come from bench/tune_kernels.py on an H200.
    `neurons`: w is K-major (K_full, N) and only those rows are read (see ops.linear)."""
    m = a.shape[0]
    n = w.shape[1] if neurons is not None else w.shape[0]
    # The expert's o (split 4) and down (split 8) projections: tuned inside the denoise graph with PDL
    # (bench/results/tune_in_graph_h200.json; BN 64 beat 32 by 0.13 and 0.22 ms per call).
    # Gathered (Action Cache) rows the same: tuned in the cached denoise graph, BN 64 beat 32 by 0.09 ms per
    # call (bench/results/tune_in_graph_h200_cached_5b80a0c.json).
    # Weight slices of at most 32 KB are loaded into registers before the PDL wait (PRELOAD): the gathered
    # down-projection at ρn = 0.5 went 4.31 -> 2.74 us per layer-step; at 64 KB (o and the dense down) it
    # spilled and ran slower, 3.0 -> 4.7 and 3.9 -> 6.3 (bench/results/trace_graphs_h200_cached_a58c3bc_wts).
    cfg = {"bn": 64, "bk": 128, "warps": 4, "stages": 4, "preload": 32768} | (config or {})
    if not _skinny_ok(a, w, splits, cfg["bk"], uneven=neurons is not None) or (
        neurons is not None and neurons.numel() != a.shape[1]
    ):
        return ops.linear(a, w, splits, neurons=neurons)
    shape = (splits, m, n) if splits > 1 else (m, n)
    c = torch.empty(shape, device=a.device, dtype=torch.float32 if splits > 1 else a.dtype)
    _launch_skinny(a, w, c, n, splits, False, cfg, neurons, gather_k=neurons is not None)
    return c


def linear_geglu(
    a: Tensor,
    gate_up: Tensor,
    out: Tensor,
    *,
    neurons: Tensor | None = None,
    anchor: Tensor | None = None,
    config: dict[str, int] | None = None,
) -> Tensor:
    """ops.linear_geglu in one kernel: for a few rows (the denoising steps) the weight-streaming kernel
    (H200, dense: 7.2 µs vs 9.4 unfused), for many (the prefill) `gemm_geglu`."""
    if a.shape[0] > 64 and neurons is None and anchor is None:
        return gemm_geglu(a, gate_up, out, config)
    # Gathered too: BN 32 beat 16 by 0.19 ms per call in the cached denoise graph (tune_in_graph --cache).
    cfg = {"bn": 32, "bk": 128, "warps": 4, "stages": 4} | (config or {})
    if not _skinny_ok(a, gate_up, 1, cfg["bk"]) or out.stride(-1) != 1:
        return ops.linear_geglu(a, gate_up, out, neurons=neurons, anchor=anchor)
    _launch_skinny(a, gate_up, out, out.shape[1], 1, True, cfg, neurons, anchor=anchor)
    return out


@triton.jit
def _gemm_geglu_kernel(
    a_desc, w_desc, c_desc, up_offset,
    K: tl.constexpr, NUM_M: tl.constexpr, NUM_N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """c = gelu_tanh(a W_gateᵀ) ⊙ (a W_upᵀ) for many rows (the prefill's FFN), w = [W_gate; W_up] with the
    up rows from `up_offset`: the GEMM and the GeGLU in one kernel, so the (M, 2F) product never reaches
    memory. Tiles move through the tensor-memory accelerator (TMA descriptors: reads past the edges are
    zeros, writes past them are dropped). Program p computes the BM×BN output tiles p, p + PROGRAMS, ...;
    tiles are numbered GROUP_M row blocks at a time, so that one weight tile serves all of them from L2."""
    if PDL:
        _pdl_enter()
    per_group = GROUP_M * NUM_N
    for i in tl.range(0, TILES_PER_PROGRAM, flatten=TILES_PER_PROGRAM > 1):
        tile = tl.program_id(0) + i * PROGRAMS  # past the last tile: the rows are past M, nothing is stored
        first_m = (tile // per_group) * GROUP_M
        rows_in_group = tl.maximum(tl.minimum(NUM_M - first_m, GROUP_M), 1)
        off_m = (first_m + tile % rows_in_group) * BM
        off_n = ((tile % per_group) // rows_in_group) * BN
        acc = tl.zeros((BM, BN), tl.float32)
        acc_up = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([off_m, k])
            acc = tl.dot(a, w_desc.load([off_n, k]).T, acc)
            acc_up = tl.dot(a, w_desc.load([up_offset + off_n, k]).T, acc_up)
        z = SQRT_2_OVER_PI * (acc + 0.044715 * acc * acc * acc)
        c_desc.store([off_m, off_n], (acc * tl.sigmoid(2.0 * z) * acc_up).to(c_desc.dtype))


# gemm_geglu's launch configuration; "kernel": 0 runs cuBLAS then the GeGLU kernel instead.
# H200, gate/up of the prefill (832 rows) and of the Context Cache's (372): 191.7 and 84.5 µs against
# 208.4 and 94.2 for cuBLAS + the GeGLU kernel (bench/results/triton_tuning_gemm_tma*_h200_*.json; warp
# specialisation of the K loop failed to compile at 832 rows and was slower at 372).
GEMM_GEGLU = {
    "kernel": 1,
    "bm": 128,
    "bn": 128,
    "bk": 64,
    "group_m": 8,
    "programs": 0,
    "warps": 8,
    "stages": 4,
}


def gemm_geglu(a: Tensor, gate_up: Tensor, out: Tensor, config: dict[str, int] | None = None) -> Tensor:
    """ops.linear_geglu for many rows (the prefill's and the Context Cache's FFN) in one kernel.
    config["programs"]: at most this many programs, each taking several tiles (0: one per tile)."""
    cfg = GEMM_GEGLU | (config or {})
    (m, k), f = a.shape, out.shape[1]
    if (
        not cfg["kernel"]
        or gate_up.shape != (2 * f, k)
        or f % cfg["bn"]
        or k % cfg["bk"]
        or any(t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16
               for t in (a, gate_up, out))
    ):  # fmt: skip
        return geglu(a @ gate_up.t(), out)
    num_m, num_n = triton.cdiv(m, cfg["bm"]), f // cfg["bn"]
    tiles = num_m * num_n
    per_program = triton.cdiv(tiles, cfg["programs"]) if cfg["programs"] else 1
    programs = triton.cdiv(tiles, per_program)  # as few idle tiles as the rounding allows
    _gemm_geglu_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [cfg["bm"], cfg["bk"]]),
        TensorDescriptor.from_tensor(gate_up, [cfg["bn"], cfg["bk"]]),
        TensorDescriptor.from_tensor(out, [cfg["bm"], cfg["bn"]]),
        f, K=k, NUM_M=num_m, NUM_N=num_n, BM=cfg["bm"], BN=cfg["bn"], BK=cfg["bk"], GROUP_M=cfg["group_m"],
        PROGRAMS=programs, TILES_PER_PROGRAM=per_program, PDL=_pdl,
        num_warps=cfg["warps"], num_stages=cfg["stages"], **_launch_opts(),
    )  # fmt: skip
    return out


@triton.jit
def _skinny_qkv_rope_kernel(
    a_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, M,
    stride_a, stride_w, stride_cs, stride_q, stride_k_head, stride_k_tok, stride_v_head, stride_v_tok,
    K: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr,
):  # fmt: skip
    """QKV projection with RoPE in the epilogue, for a few rows. Each program owns BN rotation pairs of
    one head: columns d and d + Dh/2, so the rotation needs nothing from other programs."""
    blocks_per_head: tl.constexpr = HALF // BN
    head = tl.program_id(0) // blocks_per_head
    d = (tl.program_id(0) % blocks_per_head) * BN + tl.arange(0, BN)  # index within the first half
    cols = head * 2 * HALF + d
    rows = tl.arange(0, BM)
    row_ok = rows[:, None] < M
    # The call's RoPE rows (gathered at its start) are read before the wait; V heads need none.
    rope_ok = row_ok & (head < H + KVH)
    c = tl.load(cos_ptr + rows[:, None] * stride_cs + d[None, :], mask=rope_ok, other=0.0)
    s = tl.load(sin_ptr + rows[:, None] * stride_cs + d[None, :], mask=rope_ok, other=0.0)
    if PDL:  # prefetch this program's weight rows (both halves of each rotation pair), then wait
        n_rows = (H + 2 * KVH) * 2 * HALF
        _prefetch_rows(w_ptr, cols, n_rows, stride_w, 0, K, LINES)
        _prefetch_rows(w_ptr, cols + HALF, n_rows, stride_w, 0, K, LINES)
        _pdl_enter()
    acc1 = tl.zeros([BM, BN], tl.float32)
    acc2 = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=rows[:, None] < M, other=0.0)
        w1 = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :])
        w2 = tl.load(w_ptr + (cols + HALF)[:, None] * stride_w + ks[None, :])
        acc1 += tl.dot(a, tl.trans(w1))
        acc2 += tl.dot(a, tl.trans(w2))
    if head < H + KVH:
        r1 = acc1 * c - acc2 * s
        r2 = acc2 * c + acc1 * s
        if head < H:
            dst = q_ptr + rows[:, None] * stride_q + head * 2 * HALF + d[None, :]
            tl.store(dst, r1.to(q_ptr.dtype.element_ty), mask=row_ok)
            tl.store(dst + HALF, r2.to(q_ptr.dtype.element_ty), mask=row_ok)
        else:
            dst = k_ptr + (head - H) * stride_k_head + rows[:, None] * stride_k_tok + d[None, :]
            tl.store(dst, r1.to(k_ptr.dtype.element_ty), mask=row_ok)
            tl.store(dst + HALF, r2.to(k_ptr.dtype.element_ty), mask=row_ok)
    else:
        dst = v_ptr + (head - H - KVH) * stride_v_head + rows[:, None] * stride_v_tok + d[None, :]
        tl.store(dst, acc1.to(v_ptr.dtype.element_ty), mask=row_ok)
        tl.store(dst + HALF, acc2.to(v_ptr.dtype.element_ty), mask=row_ok)


def qkv_rope(
    a: Tensor,
    w_qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_out: Tensor,
    k_out: Tensor,
    v_out: Tensor,
    num_heads: int,
    num_kv_heads: int,
    config: dict[str, int] | None = None,
) -> None:
    half = cos.shape[-1]
    cfg = {"bn": 16, "bk": 128, "warps": 4, "stages": 3} | (config or {})  # in-graph tuning, H200
    if (
        not _skinny_ok(a, w_qkv, 1, cfg["bk"])
        or half % cfg["bn"]
        or q_out.stride(-1) != 1
        or k_out.stride(-1) != 1
        or v_out.stride(-1) != 1
    ):
        return ops.qkv_rope(a, w_qkv, cos, sin, q_out, k_out, v_out, num_heads, num_kv_heads)
    grid = ((num_heads + 2 * num_kv_heads) * (half // cfg["bn"]),)
    _skinny_qkv_rope_kernel[grid](
        a, w_qkv, cos, sin, q_out, k_out, v_out, a.shape[0],
        a.stride(0), w_qkv.stride(0), cos.stride(0), q_out.stride(0),
        k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
        K=a.shape[1], H=num_heads, KVH=num_kv_heads, HALF=half,
        BM=max(16, triton.next_power_of_2(a.shape[0])), BN=cfg["bn"], BK=cfg["bk"], PDL=_pdl,
        LINES=_prefetch_lines(a.shape[1]), num_warps=cfg["warps"], num_stages=cfg["stages"], **_launch_opts(),
    )  # fmt: skip


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # interpreter mode: pretend to be an H100/H200
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_bias: Tensor,
    num_heads: int,
    prefetch: ops.Prefetch | None = None,
    config: dict[str, int] | None = None,
) -> Tensor:
    n = q.shape[0]
    kvh, lk, dh = k.shape
    group = num_heads // kvh
    if dh & (dh - 1) or dh < 16 or k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        return ops.attention(q, k, v, key_bias, num_heads, prefetch)
    out = torch.empty(n, num_heads * dh, device=q.device, dtype=q.dtype)
    if group * n <= 1024:  # denoising steps: few query rows, split the keys (H200: 10.2 µs vs 54 for SDPA)
        cfg = {"bm": 32, "bn": 64, "warps": 4, "stages": 3, "max_splits": 8}
    else:  # prefill (H200, in a graph of 17 calls: 26.0 µs; cuDNN SDPA 53, bn 32 / 3 stages 27.6;
        # bench/results/probe_prefill_attention_h200_e4a7bca_sweep)
        cfg = {"bm": 64, "bn": 64, "warps": 4, "stages": 2, "max_splits": 1}
    cfg |= config or {}
    bm, bn = cfg["bm"], cfg["bn"]
    row_blocks = triton.cdiv(group * n, bm)
    # Few query rows (the denoising steps): split the keys so that every SM has work (flash-decoding).
    splits = min(max(1, _sm_count(q.device) // (kvh * row_blocks)), triton.cdiv(lk, bn), cfg["max_splits"])
    keys_per_split = triton.cdiv(triton.cdiv(lk, splits), bn) * bn
    splits = triton.cdiv(lk, keys_per_split)
    split = splits > 1
    total = kvh * group * n
    part = torch.empty(splits, total, dh, device=q.device, dtype=torch.float32) if split else out
    stats = torch.empty(2 * splits, total, device=q.device, dtype=torch.float32) if split else out
    _attention_kernel[(kvh, row_blocks, splits)](
        q, k, v, key_bias, out, part, stats, n, lk, dh**-0.5,
        q.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
        G=group, DH=dh, BM=bm, BN=bn, SPLIT=split, KEYS_PER_SPLIT=keys_per_split, PDL=_pdl,
        num_warps=cfg["warps"], num_stages=cfg["stages"], **_launch_opts(),
    )  # fmt: skip
    if split:
        _attention_combine_kernel[(total,)](
            part, stats, out, n, total, splits, out.stride(0),
            SPLITS_P2=triton.next_power_of_2(splits), DH=dh, PDL=_pdl,
            **_prefetch_args(prefetch, q, q.device), num_warps=4, **_launch_opts(),
        )  # fmt: skip
    return out


@triton.jit
def _packed_attention_kernel(
    qkv_ptr, out_ptr, scale, stride_qkv, stride_out,
    T: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Attention of BM queries of one (sequence, head) over that sequence, q/k/v read in place from the
    packed QKV matmul output (row = sequence·T + token; columns [q | k | v], Dh per head). DP is Dh
    rounded up to a power of two; the padding lanes are masked to zero and add nothing."""
    if PDL:
        _pdl_enter()
    seq, head = tl.program_id(0) // H, tl.program_id(0) % H
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    row_ok = rows < T
    d = tl.arange(0, DP)
    d_ok = d < DH
    base = qkv_ptr + seq * T * stride_qkv
    q = tl.load(base + rows[:, None] * stride_qkv + head * DH + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)  # fmt: skip
    m_i = tl.full([BM], -1e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DP], tl.float32)
    for n0 in range(0, T, BN):
        cols = n0 + tl.arange(0, BN)
        kv_ok = (cols < T)[:, None] & d_ok[None, :]
        k = tl.load(base + cols[:, None] * stride_qkv + (H + head) * DH + d[None, :], mask=kv_ok, other=0.0)
        s = tl.where((cols < T)[None, :], tl.dot(q, tl.trans(k)) * scale, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(
            base + cols[:, None] * stride_qkv + (2 * H + head) * DH + d[None, :], mask=kv_ok, other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    dst = out_ptr + (seq * T + rows)[:, None] * stride_out + head * DH + d[None, :]
    tl.store(dst, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def packed_attention(qkv: Tensor, batch: int, num_heads: int, config: dict[str, int] | None = None) -> Tensor:
    """ops.packed_attention as the Triton kernel above: q/k/v read in place, no memset, launched with PDL.
    H200, SigLIP's shape: 9.84 µs against 10.91 for cuDNN, the fastest SDPA backend, which in the vision
    graph also costs a memset and ~4 µs of gaps per layer (bench/results/triton_tuning_vision_h200_567ef39.json,
    trace_graphs_h200_cached_567ef39). kernel=0 selects SDPA."""
    cfg = {"kernel": 1, "bm": 128, "bn": 64, "warps": 8, "stages": 3} | (config or {})
    n, width = qkv.shape[0], qkv.shape[1] // 3
    dh = width // num_heads
    if not cfg["kernel"] or n % batch or dh > 256 or qkv.stride(-1) != 1:
        return ops.packed_attention(qkv, batch, num_heads)
    t = n // batch
    out = torch.empty(n, width, device=qkv.device, dtype=qkv.dtype)
    _packed_attention_kernel[(batch * num_heads, triton.cdiv(t, cfg["bm"]))](
        qkv, out, dh**-0.5, qkv.stride(0), out.stride(0),
        T=t, H=num_heads, DH=dh, DP=max(16, triton.next_power_of_2(dh)), BM=cfg["bm"], BN=cfg["bn"], PDL=_pdl,
        num_warps=cfg["warps"], num_stages=cfg["stages"], **_launch_opts(),
    )  # fmt: skip
    return out


@triton.jit
def _action_step_kernel(
    x_ptr, h_ptr, ew_ptr, eb_ptr, res_ptr, out_ptr, iw_ptr, ib_ptr, mul_ptr, add_ptr, eps,
    stride_x, stride_h, stride_res, stride_out,
    A: tl.constexpr, WE: tl.constexpr, BLOCK: tl.constexpr, EULER: tl.constexpr, PROJECT: tl.constexpr,
    HAS_MUL: tl.constexpr, HAS_ADD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """ops.action_step for one action token: Euler update of x, then the next step's input projection and
    its adaRMS-modulated RMSNorm, in three passes over the width (BLOCK features at a time)."""
    if PDL:
        _pdl_enter()
    row = tl.program_id(0)
    a = tl.arange(0, A)
    x = tl.load(x_ptr + row * stride_x + a)
    if EULER:  # x += h · euler_wᵀ + euler_b
        v = tl.zeros([A], tl.float32)
        for c0 in range(0, WE, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            hc = tl.load(h_ptr + row * stride_h + c).to(tl.float32)
            w = tl.load(ew_ptr + a[:, None] * WE + c[None, :])  # (A, BLOCK)
            v += tl.sum(w * hc[None, :], axis=1)
        x += v + tl.load(eb_ptr + a)
        tl.store(x_ptr + row * stride_x + a, x)
    if PROJECT:  # res = x · in_wᵀ + in_b, then out = RMSNorm(res) · mul + add
        ss = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, WE, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            w = tl.load(iw_ptr + c[:, None] * A + a[None, :])  # (BLOCK, A)
            r = tl.sum(w * x[None, :], axis=1) + tl.load(ib_ptr + c)
            tl.store(res_ptr + row * stride_res + c, r)
            ss += r * r
        scale = tl.rsqrt(tl.sum(ss, axis=0) / WE + eps)
        tl.debug_barrier()  # the residual row written above is read back below by other threads
        for c0 in range(0, WE, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            h = tl.load(res_ptr + row * stride_res + c) * scale
            if HAS_MUL:
                h *= tl.load(mul_ptr + c)
            if HAS_ADD:
                h += tl.load(add_ptr + c)
            tl.store(out_ptr + row * stride_out + c, h.to(out_ptr.dtype.element_ty))


@triton.jit
def _action_step_row_kernel(
    x_ptr, h_ptr, ew_ptr, eb_ptr, res_ptr, out_ptr, iw_ptr, ib_ptr, mul_ptr, add_ptr, eps,
    stride_x, stride_h, stride_res, stride_out,
    A: tl.constexpr, WE: tl.constexpr, EULER: tl.constexpr, PROJECT: tl.constexpr,
    HAS_MUL: tl.constexpr, HAS_ADD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """_action_step_kernel with the whole width in one tile: the constant weights and the step's norm terms
    are loaded before the PDL wait (while the previous kernel finishes) and the residual row stays in
    registers for the norm."""
    row = tl.program_id(0)
    a = tl.arange(0, A)
    c = tl.arange(0, WE)
    if EULER:
        ew = tl.load(ew_ptr + a[:, None] * WE + c[None, :])  # (A, WE)
        eb = tl.load(eb_ptr + a)
    if PROJECT:
        iw = tl.load(iw_ptr + c[:, None] * A + a[None, :])  # (WE, A)
        ib = tl.load(ib_ptr + c)
        if HAS_MUL:
            mul = tl.load(mul_ptr + c)
        if HAS_ADD:
            add = tl.load(add_ptr + c)
    if PDL:
        _pdl_enter()
    x = tl.load(x_ptr + row * stride_x + a)
    if EULER:  # x += h · euler_wᵀ + euler_b
        hr = tl.load(h_ptr + row * stride_h + c).to(tl.float32)
        x += tl.sum(ew * hr[None, :], axis=1) + eb
        tl.store(x_ptr + row * stride_x + a, x)
    if PROJECT:  # res = x · in_wᵀ + in_b, then out = RMSNorm(res) · mul + add
        r = tl.sum(iw * x[None, :], axis=1) + ib
        tl.store(res_ptr + row * stride_res + c, r)
        h = r * tl.rsqrt(tl.sum(r * r, axis=0) / WE + eps)
        if HAS_MUL:
            h *= mul
        if HAS_ADD:
            h += add
        tl.store(out_ptr + row * stride_out + c, h.to(out_ptr.dtype.element_ty))


def action_step(
    x: Tensor,
    *,
    h: Tensor | None = None,
    euler_w: Tensor | None = None,
    euler_b: Tensor | None = None,
    res: Tensor | None = None,
    out: Tensor | None = None,
    in_w: Tensor | None = None,
    in_b: Tensor | None = None,
    eps: float = 1e-6,
    mul: Tensor | None = None,
    add: Tensor | None = None,
    config: dict[str, int] | None = None,
) -> Tensor:
    """ops.action_step in one kernel, one program per action token (on the H200 this measured faster in
    the denoise graph than 16-token blocks with float32 `tl.dot`: 6.65 vs 7.10 ms per denoise). Up to
    1024 features the whole row is one tile; wider experts go through it 256 features at a time."""
    a, we = x.shape[1], (h if h is not None else res).shape[1]
    cfg = {"row_max": 1024, "row_warps": 16} | (config or {})
    block = 256
    tensors = [t for t in (x, h, euler_w, res, out, in_w) if t is not None]
    if (
        a & (a - 1)
        or we % block
        or any(t.stride(-1) != 1 for t in tensors)
        or (euler_w is not None and not euler_w.is_contiguous())
        or (in_w is not None and not in_w.is_contiguous())
    ):
        return ops.action_step(
            x, h=h, euler_w=euler_w, euler_b=euler_b, res=res, out=out, in_w=in_w, in_b=in_b, eps=eps,
            mul=mul, add=add,
        )  # fmt: skip
    row = we <= cfg["row_max"] and not we & (we - 1)
    kernel, opts = (_action_step_row_kernel, {}) if row else (_action_step_kernel, {"BLOCK": block})
    kernel[(x.shape[0],)](
        x, x if h is None else h, x if euler_w is None else euler_w, x if euler_b is None else euler_b,
        x if res is None else res, x if out is None else out, x if in_w is None else in_w,
        x if in_b is None else in_b, x if mul is None else mul, x if add is None else add, eps,
        x.stride(0), 0 if h is None else h.stride(0), 0 if res is None else res.stride(0),
        0 if out is None else out.stride(0),
        A=a, WE=we, EULER=h is not None, PROJECT=res is not None, HAS_MUL=mul is not None,
        HAS_ADD=add is not None, PDL=_pdl, num_warps=cfg["row_warps"] if row else 4, **opts, **_launch_opts(),
    )  # fmt: skip
    return x
