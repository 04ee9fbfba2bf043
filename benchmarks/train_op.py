"""Forward + backward of the operators a converted SmolLM2 layer trains through, alone, per layer: the kernel part
(the chunked quadratic operator with key weights, floor and return_denominator, as the sink/window operator calls
it) and the whole sink/window operator (4 sinks, 256-token window), with OAL's L and β trainable, 2 KV heads × 3
query heads (a layer of the committed model keeps 2.3 of its 3 KV heads in the kernel on average), d = 64; mean of 2
after a warm-up. ``OAL_CPU_KERNEL=0`` times the torch loops under autograd instead of the fused backwards.

    python benchmarks/train_op.py --sizes 512,2048 --threads 2
    OAL_CPU_KERNEL=0 python benchmarks/train_op.py --sizes 512,2048 --threads 2

N is the block length; the kernel part runs on the N - 260 queries that have a kernel key (a fresh prompt's first
n_sink + w have none). Prints one JSON line per (operator, N).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from oal.kernels.oal import oal_coefficients, oal_factor
from oal.ops.quadratic.chunk import chunk_quadratic_attention
from oal.ops.sink_window import sink_window_attention

N_SINK, WINDOW, EPS = 4, 256, 1e-6


def inputs(n: int, Hkv: int = 2, G: int = 3, d: int = 64):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, Hkv * G, n, d, generator=gen).requires_grad_()
    k = torch.randn(1, Hkv, n, d, generator=gen).requires_grad_()
    v = torch.randn(1, Hkv, n, d, generator=gen).requires_grad_()
    groups = torch.randint(0, 4, (Hkv * G, d), generator=gen)
    L = (torch.eye(5) * 0.5 + 0.1 * torch.randn(5, 5, generator=gen)).tril().expand(Hkv * G, 5, 5).clone()
    return q, k, v, groups, L.requires_grad_(), torch.zeros(Hkv * G, requires_grad=True)


def kernel_part(q, k, v, groups, L, beta) -> None:
    a, b, C = oal_coefficients(groups, L, EPS)
    o, den, _ = chunk_quadratic_attention(
        q, k, v, a, b, C, factor=oal_factor(groups, L, EPS), kernel_floor=EPS,
        key_weight=torch.ones(k.shape[:3]), return_denominator=True,
    )  # fmt: skip
    (o.sum() + den.log().sum()).backward()


def sink_window(q, k, v, groups, L, beta) -> None:
    a, b, C = oal_coefficients(groups, L, EPS)
    o, _ = sink_window_attention(
        q, k, v, a, b, C, beta, n_sink=N_SINK, window=WINDOW, factor=oal_factor(groups, L, EPS), kernel_floor=EPS
    )
    o.sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="512,2048")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for n in (int(x) for x in args.sizes.split(",")):
        for name, step, length in (
            ("kernel part", kernel_part, n - N_SINK - WINDOW),
            ("sink/window operator", sink_window, n),
        ):
            args = inputs(length)
            step(*args)
            t0 = time.perf_counter()
            for _ in range(2):
                step(*args)
            ms = (time.perf_counter() - t0) / 2 * 1e3
            print(json.dumps({"op": name, "n": n, "fwd_bwd_ms_per_layer": round(ms, 1)}), flush=True)


if __name__ == "__main__":
    main()
