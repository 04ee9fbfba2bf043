"""Decode steps of a converted model across the kept form's crossover (oal.kernels.kept): a prompt a few tokens
below the limit, then greedy steps through it, with the cache that keeps the kernel heads' keys and values
(``keep_keys=True``, the default) and with the one that keeps their state from the first token, alternating in
one process. Prints each step's latency and the cache size after it; the steps that fold layers' kept keys into
their states (layer i at the limit + i mod 32 tokens, oal.kernels.kept.fold_point) show as slower ones.

    python benchmarks/kept_crossover.py --converted docs/results/conversion/model --threads 2
    python benchmarks/kept_crossover.py --plain 3-26 --threads 2   # plain OAL, synthetic groups
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from oal.bench.decode import DecodeConfig, build_model
from oal.kernels import kept as kept_form
from oal.models import KernelCache, attached_kernels, load_model
from oal.models.state_cache import cache_nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--converted", default="docs/results/conversion/model")
    ap.add_argument("--plain", default=None, help="layers for plain OAL with synthetic groups instead")
    ap.add_argument("--before", type=int, default=6, help="prompt length = limit - before")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plain = DecodeConfig(layers=args.plain or "3-26")
    model = build_model("converted", plain) if args.plain else load_model(args.converted)
    spec = model.config
    d = spec.head_dim
    limits = [kept_form.keep_limit(k, d, d) for k in attached_kernels(model).values()]
    limit = min(x for x in limits if x)
    n = limit - args.before
    ids = torch.randint(spec.vocab_size, (args.batch, n), generator=torch.Generator().manual_seed(0))
    for rnd in range(args.rounds):
        for keep in (True, False):
            cache = KernelCache(model, keep_keys=keep)
            with torch.no_grad():
                t0 = time.perf_counter()
                out = model(ids, cache=cache, logits_to_keep=1)
                prefill = time.perf_counter() - t0
                token = out.logits[:, -1:].argmax(-1)
                steps = []
                for i in range(args.steps):
                    t0 = time.perf_counter()
                    token = model(token, cache=cache).logits[:, -1:].argmax(-1)
                    steps.append(
                        {
                            "context": n + i + 1,
                            "ms": round((time.perf_counter() - t0) * 1e3, 1),
                            "cache_mb": round(cache_nbytes(cache) / 2**20, 2),
                        }
                    )
            record = {"round": rnd, "keep_keys": keep, "limit": limit, "prompt": n, "batch": args.batch}
            record |= {"prefill_s": round(prefill, 3), "steps": steps}
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
