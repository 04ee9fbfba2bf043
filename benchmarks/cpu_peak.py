"""What fraction of this CPU's fp32 FMA peak does the BLAS reach? The fact behind the fused kernel's own GEMM.

    PYTHONPATH=src python benchmarks/cpu_peak.py --threads 1 --threads 2 --repeats 5

For each thread count it times, round-robin so that both share the machine's load swings:

* ``fma_peak``: a C++ loop of ten independent 8-wide fused multiply-add chains per thread (OpenMP, built on the
  first run with ``torch.utils.cpp_extension.load_inline`` and ``-march=native``): the FLOP rate no fp32 kernel on
  this machine can exceed. It needs AVX2 + FMA (``__FMA__``); elsewhere the build fails with that message;
* ``matmul``: ``torch.mm`` of two fp32 (s, s) matrices (s = ``--size``), i.e. the BLAS torch was built with
  (MKL for the PyPI x86 wheels), ``2·s³`` FLOPs.

Prints the best GFLOP/s of each over ``--repeats`` rounds and their ratio, and optionally writes them as JSON.
``oal/ops/quadratic/cpu/chunk.cpp`` runs its products in a register-tiled kernel of its own because on the
AMD EPYC we measure on MKL's sgemm reaches 60–70 % of this peak.
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from oal.bench.devices import cpu_model
from oal.bench.op import write_json_atomic

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

#ifndef __FMA__
#error "fma_peak needs a CPU with AVX2 and FMA (compiled with -march=native)"
#endif

// GFLOP/s of `threads` threads each running ten independent 8-wide FMA chains for `iters` steps
double fma_peak(int64_t iters, int64_t threads) {
  float sink = 0.f;
  const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m256 acc[10];
    const __m256 scale = _mm256_set1_ps(1.0000001f), shift = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < 10; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 10
      for (int i = 0; i < 10; ++i) acc[i] = _mm256_fmadd_ps(acc[i], scale, shift);
    }
    for (int i = 0; i < 10; ++i) sink += _mm256_cvtss_f32(acc[i]);
  }
  const double seconds = omp_get_wtime() - start;
  TORCH_CHECK(sink == sink, "fma_peak: the chains overflowed");  // keeps the loop from being optimised away
  return static_cast<double>(threads) * static_cast<double>(iters) * 10 * 16 / seconds / 1e9;
}
"""


def build():
    """The compiled ``fma_peak`` extension (cached by torch after the first build)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name=f"oal_fma_peak_{torch.backends.cpu.get_cpu_capability().lower()}",
        cpp_sources=[SOURCE],
        functions=["fma_peak"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )


def matmul_gflop_s(size: int) -> float:
    """GFLOP/s of one fp32 ``(size, size) @ (size, size)`` through torch's BLAS."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    out = torch.empty(size, size)
    start = time.perf_counter()
    torch.mm(a, b, out=out)
    return 2 * size**3 / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, action="append", help="thread counts (repeatable; default 1 and 2)")
    p.add_argument("--size", type=int, default=2048, help="matmul size s")
    p.add_argument("--iters", type=int, default=100_000_000, help="FMA steps per thread and call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    args = p.parse_args()
    for name in ("size", "iters", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    ext = build()
    rows = []
    for threads in args.threads or [1, 2]:
        torch.set_num_threads(threads)
        matmul_gflop_s(args.size)  # warm-up: thread pool and BLAS buffers
        best = {"fma_peak": 0.0, "matmul": 0.0}
        for _ in range(args.repeats):
            best["fma_peak"] = max(best["fma_peak"], ext.fma_peak(args.iters, threads))
            best["matmul"] = max(best["matmul"], matmul_gflop_s(args.size))
        row = {
            "threads": threads,
            "fma_peak_gflop_s": best["fma_peak"],
            "matmul_gflop_s": best["matmul"],
            "matmul_over_peak": best["matmul"] / best["fma_peak"],
        }
        rows.append(row)
        print(
            f"threads={threads}  fma_peak {row['fma_peak_gflop_s']:6.1f} GFLOP/s  matmul {args.size}³ "
            f"{row['matmul_gflop_s']:6.1f} GFLOP/s  matmul/peak {row['matmul_over_peak']:.2f}"
        )
    if args.json is not None:
        doc = {
            "command": vars(args) | {"json": str(args.json)},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpu": cpu_model(), "torch": torch.__version__, "mkl": torch.backends.mkl.is_available()},
            "rows": rows,
        }
        write_json_atomic(args.json, doc)


if __name__ == "__main__":
    main()
