"""Launch-side helpers of the Triton backend: availability, limits and per-call constants."""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import NamedTuple

import torch

#: Largest head dimensions the kernels take (one feature block is a [chunk, next_pow2(d)] register tile).
MAX_HEAD_DIM = 128
MAX_VALUE_DIM = 128
#: Chunk sizes the kernels take (tl.dot needs power-of-two tiles of at least 16).
CHUNK_SIZES = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` before the kernels load)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


FP32_DOT_CHOICES = ("tf32x3", "split", "ieee")


def fp32_dot_precision() -> str:
    """How the kernels' fp32 products run on the GPU: ``$OAL_TRITON_FP32_DOT`` if set, else "ieee" (FMAs).
    All three give fp32-level accuracy. The tensor-core lowerings ("tf32x3": Triton's three tf32 products;
    "split": the same three formed in the kernel) are opt-in: on an H200 with Triton 3.6.0 tf32x3 at 8 warps
    and split at d = 16 hit illegal memory accesses (docs/results/gpu; ``benchmarks/gpu_triage.py`` tries each
    in a fresh process). bf16 and fp16 inputs, the fast path, never use this."""
    choice = os.environ.get("OAL_TRITON_FP32_DOT", "ieee")
    if choice not in FP32_DOT_CHOICES:
        raise ValueError(f"OAL_TRITON_FP32_DOT: expected one of {FP32_DOT_CHOICES}, got {choice!r}")
    return choice


def next_pow2(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def unsupported_reason(q: torch.Tensor, v: torch.Tensor, chunk_size: int | None) -> str | None:
    """Why the Triton kernels cannot run this call, or None. Shapes are assumed validated already."""
    if not triton_importable():
        return "the triton package is not installed"
    if q.device.type != "cuda" and not interpreting():
        return f"tensors are on {q.device.type}; the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)"
    if q.device.type == "cuda" and interpreting():
        return "TRITON_INTERPRET=1 runs kernels on CPU tensors only, got CUDA tensors"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not one of {SUPPORTED_DTYPES}"
    if q.dtype == torch.float64 and not interpreting():
        return "float64 runs only in the interpreter (a test path); use the torch backend for float64 on GPU"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dimension d={q.shape[-1]} exceeds {MAX_HEAD_DIM}"
    if v.shape[-1] > MAX_VALUE_DIM:
        return f"value dimension dv={v.shape[-1]} exceeds {MAX_VALUE_DIM}"
    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        return f"chunk_size must be one of {CHUNK_SIZES} for the Triton kernels, got {chunk_size!r}"
    return None


class Consts(NamedTuple):
    """Compile-time constants shared by the kernels of one call."""

    D_HEAD: int
    DV: int
    D_FEAT: int
    NPB: int
    BK: int
    BV: int
    DT: object
    ADT: object
    INTERP: bool

    @property
    def NBLK(self) -> int:
        """Feature blocks: constant, linear, and one per pair offset."""
        return 2 + self.NPB


def consts(d: int, dv: int, dtype: torch.dtype) -> Consts:
    import triton.language as tl

    from ..utils import feature_dim

    if dtype == torch.float64:
        dt, adt = tl.float64, tl.float64
    elif dtype == torch.float32:
        dt, adt = tl.float32, tl.float32
    else:
        # bf16 operands for fp16 inputs too: the states grow with the sequence and bf16 keeps fp32's range
        dt, adt = tl.bfloat16, tl.float32
    return Consts(
        D_HEAD=d,
        DV=dv,
        D_FEAT=feature_dim(d),
        NPB=d // 2 + 1,
        BK=next_pow2(d),
        BV=next_pow2(dv),
        DT=dt,
        ADT=adt,
        INTERP=interpreting(),
    )


def snapshot_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of per-chunk state snapshots: what the readout GEMM consumes."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.bfloat16


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def strides3(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, token) strides of a ``(B, H, N, d)`` tensor whose last dimension is contiguous."""
    return x.stride(0), x.stride(1), x.stride(2)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@lru_cache(maxsize=16)
def _block_table_cpu(d: int) -> torch.Tensor:
    from ..utils import triu_indices

    BK = next_pow2(d)
    npb = d // 2 + 1
    nblk = 2 + npb
    col1 = torch.full((nblk, BK), d, dtype=torch.int32)
    col2 = torch.full((nblk, BK), d, dtype=torch.int32)
    row = torch.full((nblk, BK), -1, dtype=torch.int32)
    r = torch.arange(d)
    row[0, 0] = 0
    col1[1, :d] = r.int()
    row[1, :d] = 1 + r.int()
    # canonical row of pair (lo, hi), lo ≤ hi: position in the row-major upper triangle, after 1 + d rows
    canon = torch.empty(d, d, dtype=torch.int32)
    lo, hi = triu_indices(d, torch.device("cpu"))
    canon[lo, hi] = torch.arange(1 + d, 1 + d + lo.numel(), dtype=torch.int32)
    for delta in range(npb):
        t = (r + delta) % d
        col1[2 + delta, :d] = r.int()
        col2[2 + delta] = 0  # padding rows of pair blocks point at a real column: loads need no mask
        col2[2 + delta, :d] = t.int()
        rows = canon[torch.minimum(r, t), torch.maximum(r, t)]
        if 2 * delta == d:  # offset d/2 lists each pair twice: keep r < d/2
            rows[d // 2 :] = -1
        row[2 + delta, :d] = rows
    return torch.stack([col1, col2, row]).contiguous()


def block_table(d: int, device: torch.device) -> torch.Tensor:
    """``(3, NBLK, BK)`` int32: per feature block (0 constant, 1 linear, 2 + δ pairs at offset δ) and block row,
    the column of the first factor, of the second (``d`` stands for the appended 1 of ``x' = [x, 1]``; padding
    rows of pair blocks name columns d and 0) and the canonical packed-state row (-1 where the block row is padding or a
    duplicate pair). Every canonical row appears exactly once. One read-only copy per device: a decode step
    would otherwise pay a host-to-device copy for it."""
    key = (d, torch.device(device))
    if key not in _BLOCK_TABLES:
        _BLOCK_TABLES[key] = _block_table_cpu(d).to(device)
    return _BLOCK_TABLES[key]


_BLOCK_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def snapshot_rows(d: int) -> int:
    """Rows of a block-ordered snapshot: NBLK·BK (a few more than D: padding and the duplicated δ = d/2 half)."""
    return (2 + d // 2 + 1) * next_pow2(d)


def block_weights(qw: torch.Tensor, d: int) -> torch.Tensor:
    """Canonical query weights ``(Hq, D)`` in block order ``(Hq, NBLK·BK)``, zero on block rows that are not
    state rows. Differentiable (a gather), so the kernels' gradient for this layout flows back to ``qw``."""
    row = block_table(d, qw.device)[2].flatten().long()
    return torch.where(row >= 0, qw[:, row.clamp(min=0)], torch.zeros((), dtype=qw.dtype, device=qw.device))
