"""Decode growth from a short to a long context (issue #15 goal 1: ≤ 10 % from 1k to 8k), measured side by side:
every model is loaded once and prefilled with a seeded random prompt of each length into its own cache, then
greedy one-token steps run round-robin over every (model, length) pair, the order rotated every round, so that this
machine's minute-scale speed swings (±30 %) move all of them alike; separate processes minutes apart (`oal bench
decode`) do not separate a few per cent of growth. Prints one JSON line per model: median ms per step at each
length, ``growth`` = median(long) / median(short) − 1, and ``paired_growth``, the median over rounds of the ratio
of the two steps taken in the same round.

What it measures with ``--block 1`` differs from a single stream's growth (each model alone, `oal bench
decode`): between two steps of one context the other context's step streams its own cache through the processor's
caches, so the short context's step finds less of the weights and cache still cached than it would alone. Several
models at once go further (every step finds the caches cold). ``--block K`` runs K consecutive steps of one
(model, length) pair per turn and times the last K − 2 (the first two warm the caches): each stream then runs as
it would alone, and the turns still alternate within seconds. The figures are comparable between models
measured the same way; ``paired_growth`` then pairs the i-th timed steps of the two lengths' turns in a round.

    python benchmarks/decode_growth.py smollm2-135m docs/results/conversion/model --lengths 1024,8192 --steps 48
    python benchmarks/decode_growth.py docs/results/conversion/model DIR --steps 24 --block 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.progress import track

from oal.models import load_model
from oal.models.state_cache import KernelCache, cache_nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", help="model names or converted model directories (load_model)")
    ap.add_argument("--lengths", default="1024,8192", help="two prompt lengths: short,long")
    ap.add_argument(
        "--steps", type=int, default=48, help="rounds: turns of every (model, length) pair (the first 2 untimed)"
    )
    ap.add_argument("--block", type=int, default=1, help="consecutive steps per turn (with K > 1 the first 2 untimed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if len(lengths) != 2 or not 0 < lengths[0] < lengths[1]:
        ap.error(f"--lengths: expected two increasing positive lengths 'short,long', got {args.lengths!r}")
    if args.steps < 3:
        ap.error(f"--steps: expected at least 3 (2 untimed), got {args.steps}")
    if args.block < 1 or args.block == 2:
        ap.error(f"--block: expected 1, or at least 3 consecutive steps (the first 2 untimed), got {args.block}")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = {n: torch.randint(0, 49152, (1, n), generator=gen) for n in lengths}
    models, state = {}, {}
    with torch.no_grad():
        for name in args.models:
            models[name] = load_model(name)
            for n, ids in prompts.items():
                cache = KernelCache(models[name])
                out = models[name](ids, cache=cache, use_cache=True)
                state[name, n] = (cache, out.logits[:, -1:].argmax(-1))
                del out
    pairs = list(state)
    times: dict[tuple[str, int], list[float]] = {p: [] for p in pairs}
    with torch.no_grad():
        for i in track(range(args.steps), description="decode rounds", console=Console(stderr=True)):
            shift = i % len(pairs)
            for name, n in pairs[shift:] + pairs[:shift]:
                cache, token = state[name, n]
                for j in range(args.block):
                    t0 = time.perf_counter()
                    out = models[name](token, cache=cache, use_cache=True)
                    dt = time.perf_counter() - t0
                    token = out.logits[:, -1:].argmax(-1)
                    if i >= 2 if args.block == 1 else j >= 2:
                        times[name, n].append(dt * 1e3)
                state[name, n] = (cache, token)
    short, long = lengths
    for name in models:
        a, b = times[name, short], times[name, long]
        row = {"model": name, "lengths": lengths, "threads": args.threads, "steps": len(a), "block": args.block}
        row.update({f"median_ms_{n}": round(statistics.median(times[name, n]), 2) for n in lengths})
        row["growth"] = round(statistics.median(b) / statistics.median(a) - 1, 4)
        row["paired_growth"] = round(statistics.median(y / x for x, y in zip(a, b, strict=True)) - 1, 4)
        row.update({f"cache_mb_{n}": round(cache_nbytes(state[name, n][0]) / 1e6, 1) for n in lengths})
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
