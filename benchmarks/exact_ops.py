"""The two exact-softmax fast paths of a converted model against torch's SDPA, on SmolLM2 shapes (9 query heads,
3 KV heads, d = 64), one process, both alternating, minimum of ``--repeats``:

* prefill: ``window.cpp``'s ``exact_prefill`` (the exact heads of ``ExactHeadsKernel`` over a prompt) against
  ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``, fp32 keys/values, bf16 ones as stored, and
  bf16 ones with bf16 products (``ExactHeadsKernel(product_dtype=torch.bfloat16)``: AVX512_BF16 where the core has
  it);
* decode: ``oal.kernels.decode.softmax_decode_step`` (a softmax layer's one-token step from an ``ExactKVLayer``)
  over the buffers of 6 layers in turn (75 MB at 8k: more than the L3 cache, as inside the model) against SDPA on
  the same keys.

    python benchmarks/exact_ops.py --sizes 1024,8192 --threads 2
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from oal.bench.devices import get_device
from oal.bench.machine import time_call
from oal.kernels.decode import softmax_decode_step
from oal.ops.quadratic import cpu as cpu_kernel

CPU = get_device("cpu")


def best(fn, repeats: int) -> float:
    """Milliseconds: the fastest of ``repeats`` calls after one warm-up call."""
    fn()
    return min(time_call(fn, CPU) for _ in range(repeats)) * 1e3


def measure(n: int, ext, repeats: int) -> None:
    """Print the prefill and the decode row at context ``n``."""
    scale = 64**-0.5
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 3, n, 64, generator=gen)
    k, v = torch.randn(1, 3, n, 64, generator=gen), torch.randn(1, 3, n, 64, generator=gen)
    kb, vb = k.bfloat16(), v.bfloat16()
    q9 = q.reshape(1, 9, n, 64)
    row = {"n": n, "op": "prefill, one layer's 9 query / 3 KV heads"}
    row["sdpa_ms"] = best(
        lambda: F.scaled_dot_product_attention(q9, k, v, is_causal=True, scale=scale, enable_gqa=True),
        repeats,
    )
    row["fused_ms"] = best(lambda: ext.exact_prefill(q, k, v, 0, scale), repeats)
    row["fused_bf16_kv_ms"] = best(lambda: ext.exact_prefill(q, kb, vb, 0, scale), repeats)
    row["fused_bf16_products_ms"] = best(lambda: ext.exact_prefill(q, kb, vb, 0, scale, True), repeats)
    row["speedup"] = row["sdpa_ms"] / row["fused_ms"]
    row["bf16_products_speedup"] = row["fused_bf16_kv_ms"] / row["fused_bf16_products_ms"]
    print(json.dumps({key: round(x, 2) if isinstance(x, float) else x for key, x in row.items()}), flush=True)
    layers = [(torch.randn(1, 3, n + 64, 64, generator=gen), torch.randn(1, 3, n + 64, 64, generator=gen))]
    layers += [(a.clone(), b.clone()) for a, b in layers * 5]
    q1 = torch.randn(1, 9, 1, 64, generator=gen)
    with torch.no_grad():
        row = {"n": n, "op": "decode step of 6 softmax layers"}
        row["sdpa_ms"] = best(
            lambda: [
                F.scaled_dot_product_attention(q1, a[:, :, :n], b[:, :, :n], scale=scale, enable_gqa=True)
                for a, b in layers
            ],
            repeats * 4,
        )
        row["fused_ms"] = best(lambda: [softmax_decode_step(q1, a, b, n, scale) for a, b in layers], repeats * 4)
    row["speedup"] = row["sdpa_ms"] / row["fused_ms"]
    row["fused_gb_per_s"] = 6 * 2 * 3 * n * 64 * 4 / 1e9 / (row["fused_ms"] / 1e3)
    print(json.dumps({key: round(x, 2) if isinstance(x, float) else x for key, x in row.items()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = cpu_kernel.load("window")
    for n in (int(x) for x in args.sizes.split(",")):
        measure(n, ext, args.repeats)


if __name__ == "__main__":
    main()
