"""Prefill time of two models side by side in one process: round after round, each model prefills the same seeded
random prompt into a fresh cache at every context, the models' order reversed every round, so that the machine's
state moves both alike (this machine's speed swings ±10–30 % between minutes; separate processes minutes apart
gave one converted model's 8k prefill 1.40× and then 1.12× the original's speed, stop 47). A model is named as
``decode_ab.py`` takes it: a converted model's directory, a base model's name (``smollm2-135m``: the original) or
``plain`` (plain OAL on layers 3–26). Each model first prefills ``--warmup`` tokens untimed (what a process pays
once: the kernels' libraries, the thread pool).

Prints one JSON line per prefill (``round``, model, context, seconds), then one line per (model, context) with the
median and min seconds, then one ``ratio`` line per context: the first model's median over the second's
(``speedup``: issue #15's goal 3 puts the original first) and each round's own ratio (``rounds``).

    python benchmarks/prefill_ab.py smollm2-135m docs/results/conversion/model --n 1024,8192 --rounds 3
    python benchmarks/prefill_ab.py smollm2-135m plain --n 1024,8192 --rounds 3

The first line of the output is the machine record (``oal.bench.devices.machine_record``: the command, the
versions, the CPU's flags).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch


def summarize(times: dict[tuple[str, int], list[float]], models: list[str], sizes: list[int]) -> list[dict]:
    """The summary lines of ``times[(model, n)]`` (seconds, one per round, in round order): per (model, context)
    the median and min, then per context the ``ratio`` of the first model's median over the second's and of each
    round's pair."""
    rows = []
    for (name, n), secs in times.items():
        rows.append(
            {"model": name, "n": n, "median_s": round(statistics.median(secs), 3), "min_s": round(min(secs), 3)}
        )
    first, second = models
    for n in sizes:
        rows.append({"ratio": f"{first} / {second}", "n": n, **ratios(times[first, n], times[second, n])})
    return rows


def ratios(a: list[float], b: list[float], prefix: str = "") -> dict[str, object]:
    """``{prefix}speedup``: the median of ``a`` over the median of ``b``; ``{prefix}rounds``: each round's own
    quotient (``a`` and ``b`` one value per round, in round order)."""
    return {
        f"{prefix}speedup": round(statistics.median(a) / statistics.median(b), 3),
        f"{prefix}rounds": [round(x / y, 3) for x, y in zip(a, b, strict=True)],
    }


def main() -> None:
    # the same models and arguments as decode_ab.py (run from benchmarks/)
    from decode_ab import build, check_rounds, checked_sizes, pair_arguments, round_arguments

    ap = argparse.ArgumentParser()
    pair_arguments(ap, "prefilled together")
    round_arguments(ap, 3, "prefills")
    args = ap.parse_args()
    sizes = checked_sizes(args)
    check_rounds(args)
    from oal.bench.devices import machine_record
    from oal.models.state_cache import KernelCache

    torch.set_num_threads(args.threads)
    print(json.dumps(machine_record()), flush=True)
    models = {name: build(name, args.dtype).eval() for name in args.models}
    if args.warmup:  # what a process pays once (the kernels' libraries, thread pools), before any timed prefill
        for model in models.values():
            with torch.no_grad():
                model(torch.zeros(args.batch, args.warmup, dtype=torch.long), cache=KernelCache(model), use_cache=True)
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in args.models for n in sizes}
    for r in range(args.rounds):
        for n in sizes:
            for name in args.models if r % 2 == 0 else args.models[::-1]:
                model = models[name]
                ids = torch.randint(
                    0, model.config.vocab_size, (args.batch, n), generator=torch.Generator().manual_seed(args.seed)
                )
                with torch.no_grad():
                    start = time.perf_counter()
                    out = model(ids, cache=KernelCache(model), use_cache=True, logits_to_keep=1)
                    seconds = time.perf_counter() - start
                del out
                gc.collect()  # the cache goes before the next prefill, as in a fresh process
                times[name, n].append(seconds)
                row = {"round": r, "model": name, "n": n, "prefill_s": round(seconds, 3), "batch": args.batch}
                print(json.dumps({**row, "dtype": args.dtype, "threads": args.threads}), flush=True)
    for row in summarize(times, args.models, sizes):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
