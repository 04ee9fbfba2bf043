"""Where the parallel form of a fresh segment (``chunk_parallel_forward``) stops paying against the chunked loop:
both forced on one SmolLM2-shaped call (9 query / 3 KV heads, d = dv = 64, OAL with 3 groups, key weights, floor,
final state), and the call as the cost model runs it (``default``: beyond the crossover, since stop 53, a prefix of
``parallel_prefix`` tokens in parallel form and the rest in the loop from its state), min of 5 each, alternating,
per N; ``--prefixes 768,896``: also with those prefix lengths forced. Prints JSON lines with the ratios and what
``oal.ops.quadratic.chunk.parallel_pays`` (the cost model, scaled by ``PARALLEL_COST``) chooses.

    python benchmarks/parallel_crossover.py --sizes 256,512,1024,1536,2048,3072 --threads 2
    python benchmarks/parallel_crossover.py --sizes 2048,4096 --prefixes 512,640,768,896,960 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import oal.ops.quadratic.chunk as chunk
from oal.kernels.oal import oal_coefficients, oal_factor
from oal.ops.quadratic import quadratic_attention


def choice(n: int, d: int) -> str:
    """What the cost model runs a fresh segment of ``n`` tokens in (this benchmark's R = 4 squares, P = 3 classes)."""
    if chunk.parallel_pays(n, d, d, 4, 3):
        return "parallel"
    prefix = chunk.parallel_prefix(n, d, d, 4, 3)
    return f"parallel prefix of {prefix}, then chunked" if prefix else "chunked"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,512,1024,1536,2048,3072")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefixes", default="", help="prefix lengths to force beside the three ways")
    args = ap.parse_args()
    prefixes = [int(x) for x in args.prefixes.split(",") if x]
    torch.set_num_threads(args.threads)
    Hq, Hkv, d = 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    groups = torch.randint(0, 3, (Hq, d), generator=gen)
    L = torch.randn(Hq, 4, 4, generator=gen) * 0.4
    a, b, C = oal_coefficients(groups, L, 1e-6)
    factor = oal_factor(groups, L, 1e-6)
    chosen_cost, chosen_prefix = chunk.PARALLEL_COST, chunk.parallel_prefix
    ways = [("parallel", 0.0, None), ("chunked", float("inf"), None), ("default", chosen_cost, None)]
    ways += [(f"prefix{t}", chosen_cost, t) for t in prefixes]
    for n in (int(x) for x in args.sizes.split(",")):
        q, k, v = (torch.randn(1, h, n, d, generator=gen) for h in (Hq, Hkv, Hkv))
        weights = torch.ones(1, Hkv, n)
        times: dict[str, list[float]] = {name: [] for name, _, _ in ways}
        with torch.no_grad():
            for _ in range(args.repeats):
                for name, cost, prefix in ways:
                    chunk.PARALLEL_COST = cost
                    chunk.parallel_prefix = chosen_prefix if prefix is None else lambda *shape, t=prefix: t
                    t0 = time.perf_counter()
                    quadratic_attention(
                        q, k, v, a, b, C, factor=factor, key_weight=weights, kernel_floor=1e-6,
                        output_final_state=True, return_denominator=True,
                    )  # fmt: skip
                    times[name].append(time.perf_counter() - t0)
        chunk.PARALLEL_COST, chunk.parallel_prefix = chosen_cost, chosen_prefix
        par, chk, dft = min(times["parallel"]), min(times["chunked"]), min(times["default"])
        row = {
            "n": n,
            "parallel_ms": round(par * 1e3, 2),
            "chunked_ms": round(chk * 1e3, 2),
            "default_ms": round(dft * 1e3, 2),
            **{f"{name}_ms": round(min(times[name]) * 1e3, 2) for name, _, t in ways if t is not None},
            "chunked_over_parallel": round(chk / par, 2),
            "default_over_best_forced": round(dft / min(par, chk), 2),
            "cost_model_chooses": choice(n, d),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
