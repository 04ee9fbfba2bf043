"""One fused decode step (oal.kernels.decode) of a SmolLM2-shaped layer (9 query / 3 KV heads, d = 64) at N tokens with
all three KV heads exact, their keys/values in fp32, bf16 or int8 (an 8-bit exact cache with per-token scales), with
fp32 or bf16 products (bf16 also with a decode budget: page-selected steps), and with none exact (sinks + 256 window
+ kernel): median of --steps steps (40) after a prefill. Reports the exact keys/values' MB (with the int8 scales)
and the rate they are read at.

    python benchmarks/exact_decode.py --n 8192 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from oal.kernels import ExactHeadsKernel, OALKernel, SinkWindowKernel
from oal.kernels.decode import decode_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--budget", type=int, default=1024, help="decode budget of the budgeted row (keys per exact head)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Hq, Hkv, d, n = 9, 3, 64, args.n
    gen = torch.Generator().manual_seed(0)
    oal = OALKernel(
        torch.randint(0, 3, (Hq, d), generator=gen), Hkv, num_groups=3, L=torch.randn(Hq, 4, 4, generator=gen) * 0.4
    )
    sw = SinkWindowKernel(oal, n_sink=4, window=256, beta=torch.randn(Hq, generator=gen))
    for name, kernel in (
        ("3 exact KV heads, fp32", ExactHeadsKernel(sw, (0, 1, 2))),
        ("3 exact KV heads, bf16", ExactHeadsKernel(sw, (0, 1, 2), kv_dtype=torch.bfloat16)),
        ("3 exact KV heads, bf16, bf16 products", ExactHeadsKernel(sw, (0, 1, 2), torch.bfloat16, torch.bfloat16)),
        (
            f"3 exact KV heads, bf16, bf16 products, decode budget {args.budget}",
            ExactHeadsKernel(sw, (0, 1, 2), torch.bfloat16, torch.bfloat16, decode_budget=args.budget),
        ),
        ("3 exact KV heads, int8", ExactHeadsKernel(sw, (0, 1, 2), kv_dtype=torch.int8)),
        ("3 exact KV heads, int8, bf16 products", ExactHeadsKernel(sw, (0, 1, 2), torch.int8, torch.bfloat16)),
        ("no exact head", sw),
    ):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, n + args.steps, d, generator=gen) for h in (Hq, Hkv, Hkv))
        times = []
        with torch.no_grad():
            _, state = kernel(q[:, :, :n], k[:, :, :n], v[:, :, :n], output_final_state=True)
            for t in range(n, n + args.steps):
                t0 = time.perf_counter()
                _, state = decode_step(kernel, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, t)
                times.append(time.perf_counter() - t0)
        ms = sorted(times)[len(times) // 2] * 1e3
        row = {"layer": name, "n": n, "ms_per_step": round(ms, 3)}
        if isinstance(kernel, ExactHeadsKernel):
            parts = (state.k, state.v) + (() if state.k_scale is None else (state.k_scale, state.v_scale))
            mb = sum(x[:, :, :n].numel() * x.element_size() for x in parts) / 1e6
            row.update(exact_kv_mb=round(mb, 2), gb_per_s=round(mb / ms, 1))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
