"""How fast could the chunked OAL forward be on this machine? Its state-GEMM floor beside the real call and SDPA.

    PYTHONPATH=src python benchmarks/op_floor.py --n 4096 --n 8192 --n 16384 --repeats 5 --threads 2

At the operator benchmark's shape (B = 1, Hq = 9, Hkv = 3, d = dv = 64, fp32, no autograd) it times, round-robin
so that all three share the machine's load swings:

* ``sdpa``: PyTorch SDPA (the CPU flash kernel), causal, GQA, as ``oal bench op`` runs it;
* ``oal``: the OAL operator (G = 5, chunk 64), as ``oal bench op`` runs it;
* ``gemm_floor``: a loop that runs only the two GEMMs per (KV head, chunk) step of that operator (Eq. 5–6): the
  readout ``φ_q(Q) S``, ``(Hq/Hkv · C, D) @ (D, dv+1)``, and the update ``S += φ_k(K)ᵀ U``,
  ``(D, C) @ (C, dv+1)``, with D = 1 + d + d(d+1)/2, on feature buffers filled once (so they are as
  cache-friendly as they can be). No features, no within-chunk kernel, no normalisation.

An implementation that keeps the packed state and runs these two GEMMs per chunk through this BLAS cannot be
faster than ``gemm_floor``, so ``sdpa / gemm_floor`` bounds its speed-up over SDPA. The fused CPU kernel
(``oal/ops/quadratic/cpu/chunk.cpp``) does not use the BLAS for them (see ``benchmarks/cpu_peak.py``) and can run
below this floor. Prints the minimum wall time
of each over ``--repeats`` rounds, the floor's GFLOP/s, the ratios, and optionally writes them as JSON.
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from oal.bench.devices import cpu_model
from oal.bench.flops import AttnShape, chunk_sizes
from oal.bench.methods import random_oal_kernel
from oal.bench.op import write_json_atomic
from oal.ops.quadratic.utils import feature_dim


def gemm_floor(shape: AttnShape, chunk: int):
    """The state-GEMM loop of the chunked operator at ``shape``: returns ``(fn, flops)``."""
    group = shape.heads_q // shape.heads_kv
    D, dv1 = feature_dim(shape.head_dim), shape.value_dim + 1
    gen = torch.Generator().manual_seed(0)
    pq = torch.randn(group * chunk, D, generator=gen)
    pk = torch.randn(chunk, D, generator=gen)
    u = torch.randn(chunk, dv1, generator=gen)
    num = torch.empty(group * chunk, dv1)
    sizes = chunk_sizes(shape.n, chunk)

    def fn() -> None:
        for _ in range(shape.batch * shape.heads_kv):
            state = torch.zeros(D, dv1)
            for n in sizes:
                torch.mm(pq[: group * n], state, out=num[: group * n])
                state.addmm_(pk[:n].T, u[:n])

    flops = shape.batch * sum(2 * D * dv1 * n * (shape.heads_q + shape.heads_kv) for n in sizes)
    return fn, flops


def measure(fns: dict, repeats: int) -> dict[str, float]:
    """Minimum wall seconds per function over ``repeats`` round-robin rounds, after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, action="append", help="sequence lengths (repeatable; default 8192)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    print(f"threads={torch.get_num_threads()} Hq={args.heads} Hkv={args.kv_heads} d={args.head_dim} fp32 no-grad")
    for n in args.n or [8192]:
        shape = AttnShape(1, args.heads, args.kv_heads, n, args.head_dim, args.head_dim)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, shape.heads_q, n, shape.head_dim, generator=gen)
        k = torch.randn(1, shape.heads_kv, n, shape.head_dim, generator=gen)
        v = torch.randn(1, shape.heads_kv, n, shape.value_dim, generator=gen)
        kernel = random_oal_kernel(shape, 5, 0).eval().requires_grad_(False)
        floor, flops = gemm_floor(shape, args.chunk)
        fns = {
            "sdpa": partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True),
            "oal": partial(kernel, q, k, v, chunk_size=args.chunk),
            "gemm_floor": floor,
        }
        with torch.no_grad():
            best = measure(fns, args.repeats)
        row = {
            "n": n,
            **{f"{name}_ms": 1e3 * t for name, t in best.items()},
            "gemm_floor_gflop_s": flops / best["gemm_floor"] / 1e9,
            "sdpa_over_oal": best["sdpa"] / best["oal"],
            "sdpa_over_gemm_floor": best["sdpa"] / best["gemm_floor"],
        }
        rows.append(row)
        print(
            f"N={n:6d}  sdpa {row['sdpa_ms']:8.1f} ms  oal {row['oal_ms']:8.1f} ms  gemm_floor "
            f"{row['gemm_floor_ms']:8.1f} ms ({row['gemm_floor_gflop_s']:5.1f} GFLOP/s)  sdpa/oal "
            f"{row['sdpa_over_oal']:5.2f}  sdpa/gemm_floor {row['sdpa_over_gemm_floor']:5.2f}"
        )
    if args.json is not None:
        doc = {
            "command": vars(args) | {"json": str(args.json)},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads()},
            "rows": rows,
        }
        write_json_atomic(args.json, doc)


if __name__ == "__main__":
    main()
