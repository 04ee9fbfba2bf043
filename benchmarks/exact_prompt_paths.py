"""The exact heads' prompt attention (bf16 products) on its two CPU paths: ``window.cpp``'s fused AVX-512 kernel
(``oal.kernels.hybrid._fused_exact``) and torch's bf16 SDPA on the same rounded numbers
(``oal.kernels.hybrid._bf16_sdpa``, what a CPU with AMX tiles takes), for one layer of SmolLM2's shape (9 query
heads over 3 bf16 KV heads, d = 64): one causal call of N tokens, and N tokens in the prefill's 512-token chunks
after their past. Min of ``--repeats`` seconds per path, one JSON line per size.

    python benchmarks/exact_prompt_paths.py --sizes 1024,2048,8192 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from oal.kernels.hybrid import _bf16_sdpa, _fused_exact
from oal.ops.quadratic import cpu as cpu_kernels


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(n: int, chunk: int, repeats: int) -> dict:
    """Seconds of each path for one layer's exact heads over an n-token prompt (one call, and in chunks)."""
    d, scale = 64, 64**-0.5
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, n, d, generator=gen)
    k, v = (torch.randn(1, 3, n, d, generator=gen).bfloat16() for _ in range(2))
    chunks = [(c0, min(n, c0 + chunk)) for c0 in range(0, n, chunk)]
    row = {"n": n, "amx_bf16": cpu_kernels.amx_bf16()}
    with torch.no_grad():
        row["one_call_fused_ms"] = 1e3 * best(lambda: _fused_exact(q, k, v, 0, scale, True), repeats)
        row["one_call_sdpa_ms"] = 1e3 * best(lambda: _bf16_sdpa(q, k, v, 0, scale), repeats)
        row["chunked_fused_ms"] = 1e3 * best(
            lambda: [_fused_exact(q[:, :, a:b], k[:, :, :b], v[:, :, :b], a, scale, True) for a, b in chunks], repeats
        )
        row["chunked_sdpa_ms"] = 1e3 * best(
            lambda: [_bf16_sdpa(q[:, :, a:b], k[:, :, :b], v[:, :, :b], a, scale) for a, b in chunks], repeats
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,8192")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for n in (int(x) for x in args.sizes.split(",")):
        row = {**measure(n, args.chunk, args.repeats), "threads": args.threads}
        print(
            json.dumps({key: round(val, 2) if isinstance(val, float) else val for key, val in row.items()}), flush=True
        )


if __name__ == "__main__":
    main()
