"""The machine block of a benchmark: what ran the points, and its measured matmul and copy throughput."""

from __future__ import annotations

import platform
import re
import statistics
import time
from collections.abc import Callable

import torch

from .devices import BenchDevice

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtypes: expected names from {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def time_call(fn: Callable[[], object], device: BenchDevice) -> float:
    """Wall-clock seconds of one call, the device synchronised before and after."""
    device.synchronize()
    start = time.perf_counter()
    out = fn()
    device.synchronize()
    elapsed = time.perf_counter() - start
    del out
    return elapsed


def repeat_times(fn: Callable[[], object], device: BenchDevice, first: float, *, budget_s: float, lo: int, hi: int):
    """Time ``fn`` ``R`` times, ``R = clamp(budget_s / first, lo, hi)`` with ``first`` an earlier call's time."""
    repeats = max(lo, min(hi, int(budget_s / max(first, 1e-9))))
    return [time_call(fn, device) for _ in range(repeats)]


def blas_info() -> str:
    """The BLAS torch was built with (``BLAS_INFO`` in ``torch.__config__.show()``)."""
    match = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    return match.group(1) if match else "unknown"


def matmul_gflops(
    device: BenchDevice,
    dtype: torch.dtype,
    *,
    max_size: int | None = None,
    min_call_s: float = 0.05,
    budget_s: float = 2.0,
) -> dict[str, float]:
    """Median GFLOP/s of a square GEMM ``(s, s) @ (s, s)`` (2·s³ FLOPs).

    s doubles from 256 until one call takes ``min_call_s`` or s reaches ``max_size`` (default 2048 on a CPU,
    8192 on a GPU), so a dtype that the CPU runs slowly (bf16 without native instructions) still finishes
    quickly; the size used is reported.
    """
    if max_size is None:
        max_size = 8192 if device.kind == "cuda" else 2048
    size = 256
    while True:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=gen).to(device=device.device, dtype=dtype)
        b = torch.randn(size, size, generator=gen).to(device=device.device, dtype=dtype)
        time_call(lambda a=a, b=b: a @ b, device)  # warm-up
        first = time_call(lambda a=a, b=b: a @ b, device)
        if first >= min_call_s or size >= max_size:
            break
        size *= 2
    times = repeat_times(lambda: a @ b, device, first, budget_s=budget_s, lo=3, hi=50)
    median = statistics.median(times)
    return {"size": size, "ms": median * 1e3, "gflop_s": 2 * size**3 / median / 1e9}


def copy_gb_s(device: BenchDevice, mbytes: int = 256) -> float:
    """Memory bandwidth of ``dst.copy_(src)`` on a ``mbytes`` MiB buffer, bytes read plus written, GB/s."""
    src = torch.ones(mbytes * 2**20 // 4, device=device.device)
    dst = torch.empty_like(src)
    time_call(lambda: dst.copy_(src), device)
    times = repeat_times(lambda: dst.copy_(src), device, 1.0, budget_s=1.0, lo=5, hi=5)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def machine_info(device: BenchDevice, dtypes: list[str]) -> dict[str, object]:
    """Host, software and device description plus measured matmul GFLOP/s per dtype and copy bandwidth.

    Call it in the process and thread setting the points use (see :func:`oal.bench.op.measure_machine`).
    """
    with torch.no_grad():
        matmul = {name: matmul_gflops(device, parse_dtype(name)) for name in dtypes}
        bandwidth = copy_gb_s(device)
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "blas": blas_info(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "threads": torch.get_num_threads(),
        "device": device.describe(),
        "matmul": matmul,
        "copy_gb_s": round(bandwidth, 2),
    }
