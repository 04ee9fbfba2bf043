"""Where the parallel form of a fresh segment (``chunk_parallel_forward``) stops paying against the chunked loop:
both forced on one SmolLM2-shaped call (9 query / 3 KV heads, d = dv = 64, OAL with 3 groups, key weights, floor,
final state), min of 5 each, alternating, per N. Prints JSON lines with the ratio and what
``oal.ops.quadratic.chunk.parallel_pays`` (the cost model, scaled by ``PARALLEL_COST``) chooses.

    python benchmarks/parallel_crossover.py --sizes 256,512,1024,1536,2048,3072 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import oal.ops.quadratic.chunk as chunk
from oal.kernels.oal import oal_coefficients, oal_factor
from oal.ops.quadratic import quadratic_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,512,1024,1536,2048,3072")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Hq, Hkv, d = 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    groups = torch.randint(0, 3, (Hq, d), generator=gen)
    L = torch.randn(Hq, 4, 4, generator=gen) * 0.4
    a, b, C = oal_coefficients(groups, L, 1e-6)
    factor = oal_factor(groups, L, 1e-6)
    chosen_cost = chunk.PARALLEL_COST
    for n in (int(x) for x in args.sizes.split(",")):
        q, k, v = (torch.randn(1, h, n, d, generator=gen) for h in (Hq, Hkv, Hkv))
        weights = torch.ones(1, Hkv, n)
        times: dict[str, list[float]] = {"parallel": [], "chunked": []}
        with torch.no_grad():
            for _ in range(args.repeats):
                for name, cost in (("parallel", 0.0), ("chunked", float("inf"))):
                    chunk.PARALLEL_COST = cost
                    t0 = time.perf_counter()
                    quadratic_attention(
                        q, k, v, a, b, C, factor=factor, key_weight=weights, kernel_floor=1e-6,
                        output_final_state=True, return_denominator=True,
                    )  # fmt: skip
                    times[name].append(time.perf_counter() - t0)
        chunk.PARALLEL_COST = chosen_cost
        par, chk = min(times["parallel"]), min(times["chunked"])
        row = {
            "n": n,
            "parallel_ms": round(par * 1e3, 2),
            "chunked_ms": round(chk * 1e3, 2),
            "chunked_over_parallel": round(chk / par, 2),
            "cost_model_chooses": "parallel" if chunk.parallel_pays(n, d, d, 4, 3) else "chunked",
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
