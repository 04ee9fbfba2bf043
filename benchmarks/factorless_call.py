"""`quadratic_attention(q, k, v, a, b, C)` called without a factor (as the README documents it) against the same
call with the factor and against SDPA, fp32, B = 1, Hq = 9, Hkv = 3, d = dv = 64 (SmolLM2's shape).

    python benchmarks/factorless_call.py --sizes 4096,16384 --threads 2 --repeats 3

Prints the median seconds of each and the ratios; each repeat runs the three calls round-robin.

The first line of the output is the machine record (``oal.bench.devices.machine_record``: the command, the
versions, the CPU's flags).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from oal.bench.devices import machine_record
from oal.kernels import oal_coefficients, oal_factor, taylor_L
from oal.ops import quadratic_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(machine_record()), flush=True)
    gen = torch.Generator().manual_seed(0)
    groups = torch.randint(0, 4, (9, 64), generator=gen)
    L = taylor_L(9, 4) + 0.1 * torch.randn(9, 5, 5, generator=gen)
    a, b, C = oal_coefficients(groups, L, 1e-6)
    factor = oal_factor(groups, L, 1e-6)
    out = []
    for n in (int(x) for x in args.sizes.split(",")):
        q = torch.randn(1, 9, n, 64, generator=gen)
        k, v = (torch.randn(1, 3, n, 64, generator=gen) for _ in range(2))
        calls = {
            "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "without_factor": lambda q=q, k=k, v=v: quadratic_attention(q, k, v, a, b, C, kernel_floor=1e-6),
            "with_factor": lambda q=q, k=k, v=v: quadratic_attention(
                q, k, v, a, b, C, factor=factor, kernel_floor=1e-6
            ),
        }
        times = {name: [] for name in calls}
        with torch.no_grad():
            for fn in calls.values():  # warm-up (builds the fused kernel once)
                fn()
            for _ in range(args.repeats):
                for name, fn in calls.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) for name, t in times.items()}
        row = {"n": n, **{f"{k}_s": v for k, v in med.items()}}
        row["sdpa_over_without_factor"] = med["sdpa"] / med["without_factor"]
        row["sdpa_over_with_factor"] = med["sdpa"] / med["with_factor"]
        out.append(row)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
