"""Decode latency of two converted models side by side in one process: each prefilled once with the same seeded
random prompt, then greedy decode steps alternating between them (the order swapped every step), so that the
machine's state moves both alike (this machine's speed swings ±30 % between minutes; separate processes minutes
apart do not separate a few per cent). Prints one JSON line per model: median and min ms per step.

    python benchmarks/decode_ab.py docs/results/conversion/model docs/results/conversion/model_int8kv --n 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from oal.models import load_model
from oal.models.state_cache import KernelCache, cache_nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs=2, help="two converted model directories")
    ap.add_argument("--n", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per model (the first 2 untimed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ids = torch.randint(0, 49152, (1, args.n), generator=torch.Generator().manual_seed(args.seed))
    models, state = {}, {}
    for name in args.models:
        model = load_model(name)
        cache = KernelCache(model)
        with torch.no_grad():
            out = model(ids, cache=cache, use_cache=True)
        models[name], state[name] = model, (cache, out.logits[:, -1:].argmax(-1))
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for i in range(args.steps):
            for name in args.models if i % 2 == 0 else args.models[::-1]:
                cache, token = state[name]
                t0 = time.perf_counter()
                out = models[name](token, cache=cache, use_cache=True)
                dt = time.perf_counter() - t0
                state[name] = (cache, out.logits[:, -1:].argmax(-1))
                if i >= 2:
                    times[name].append(dt * 1e3)
    for name, ms in times.items():
        row = {"model": name, "n": args.n, "median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2)}
        row.update(cache_mb=round(cache_nbytes(state[name][0]) / 1e6, 1), steps=len(ms), threads=args.threads)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
