"""How much of a converted model's decode step is the fused per-layer C++ step (``oal.kernels.decode.decode_step``,
summed over the layers) and the softmax layers' fused step (``softmax_decode_step``) at each context: a prefill of
N random tokens, 2 untimed steps, then the median of ``--steps`` greedy steps, the contexts alternating
``--rounds`` times in one process.

    python benchmarks/decode_parts.py --converted docs/results/conversion/model --sizes 1024,8192 --threads 2
    python benchmarks/decode_parts.py --plain 3-26 --sizes 1024,8192 --threads 2   # plain OAL, synthetic groups
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import oal.models.hooks as hooks
from oal.bench.decode import DecodeConfig, build_model
from oal.models import KernelCache, load_model

FUSED = [0.0]
SOFTMAX = [0.0]


def timed(fn, total: list[float]):
    def wrapper(*a, **kw):
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            total[0] += time.perf_counter() - start

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--converted", default="docs/results/conversion/model")
    ap.add_argument("--plain", default=None, help="layers of a plain OAL conversion (then --converted is not used)")
    ap.add_argument("--sizes", default="1024,8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hooks.decode_step = timed(hooks.decode_step, FUSED)
    hooks.softmax_decode_step = timed(hooks.softmax_decode_step, SOFTMAX)
    if args.plain:
        model = build_model("converted", DecodeConfig(layers=args.plain, threads=args.threads)).eval()
    else:
        model = load_model(args.converted).eval()
    for rnd in range(args.rounds):
        for n in (int(x) for x in args.sizes.split(",")):
            ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
            cache = KernelCache(model)
            totals, fused, softmax = [], [], []
            with torch.no_grad():
                token = model(ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
                for i in range(2 + args.steps):
                    FUSED[0] = SOFTMAX[0] = 0.0
                    start = time.perf_counter()
                    token = model(token, cache=cache).logits[:, -1:].argmax(-1)
                    if i >= 2:
                        totals.append(time.perf_counter() - start)
                        fused.append(FUSED[0])
                        softmax.append(SOFTMAX[0])
            row = {"round": rnd, "n": n, "step_ms": round(statistics.median(totals) * 1e3, 2)}
            row["fused_ms"] = round(statistics.median(fused) * 1e3, 2)
            row["softmax_ms"] = round(statistics.median(softmax) * 1e3, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
