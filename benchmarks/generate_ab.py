"""End to end as a user runs it: transformers' ``generate`` on two models side by side in one process. Per context
and round, each model generates ``--new`` greedy tokens after the same seeded random prompt
(``model.generate(ids, attention_mask=…, max_new_tokens=M, min_new_tokens=M, do_sample=False)``, no cache passed:
generate makes its own), with a logits processor that stamps the time of every generated token: the time to the
first token (the prompt through the model's own prefill path) and the median time between later tokens (decode steps
as generate runs them, with its cache, masks, position ids and logits processing). The models' order is reversed
every round; each model first generates from ``--warmup`` tokens untimed (what a process pays once). A model is
named as ``decode_ab.py`` takes it (a converted model's directory, ``smollm2-135m``, or ``plain``).

Prints one JSON line per generation (``round``, model, context, ``first_token_s``, ``step_ms``: the median of its
later tokens, and whether its tokens equal the model's first round's), then one line per (model, context) with the
medians over the rounds, then one ``ratio`` line per context: the first model's medians over the second's
(``first_token_speedup``, ``step_speedup``; issue #15's goals 1 and 3 put the original first) and each round's.

    python benchmarks/generate_ab.py smollm2-135m docs/results/conversion/model --n 1024,8192 --new 33 --rounds 2

The first line of the output is the machine record (``oal.bench.devices.machine_record``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList


class Stamps(LogitsProcessor):
    """Records ``time.perf_counter()`` each time generate processes a new token's scores (once per token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores


def timings(start: float, stamps: list[float]) -> tuple[float, float]:
    """``(first_token_s, step_ms)`` of one generation: the seconds from ``start`` to the first stamp and the median
    milliseconds between consecutive later stamps."""
    if len(stamps) < 2:
        raise ValueError(f"stamps: expected at least 2 tokens' times, got {len(stamps)}")
    steps = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:], strict=False)]
    return stamps[0] - start, statistics.median(steps)


def summarize(runs: dict[tuple[str, int], list[tuple[float, float]]], models: list[str], sizes: list[int]) -> list:
    """Summary lines of ``runs[(model, n)]`` (``(first_token_s, step_ms)`` per round, in round order): per (model,
    context) the medians, then per context the first model's medians over the second's and each round's ratios."""
    rows = []
    for (name, n), rs in runs.items():
        rows.append(
            {
                "model": name,
                "n": n,
                "first_token_s": round(statistics.median(r[0] for r in rs), 3),
                "step_ms": round(statistics.median(r[1] for r in rs), 2),
            }
        )
    from prefill_ab import ratios

    first, second = models
    for n in sizes:
        a, b = runs[first, n], runs[second, n]
        row = {"ratio": f"{first} / {second}", "n": n}
        for i, prefix in enumerate(("first_token_", "step_")):
            row |= ratios([x[i] for x in a], [y[i] for y in b], prefix)
        rows.append(row)
    return rows


def main() -> None:
    # the same models and arguments as decode_ab.py and prefill_ab.py (run from benchmarks/)
    from decode_ab import build, check_rounds, checked_sizes, pair_arguments, round_arguments

    ap = argparse.ArgumentParser()
    pair_arguments(ap, "generated together")
    round_arguments(ap, 2, "generations")
    ap.add_argument("--new", type=int, default=33, help="tokens generated per prompt (the first is the prompt's)")
    args = ap.parse_args()
    sizes = checked_sizes(args)
    check_rounds(args)
    if args.new < 3:
        raise SystemExit(f"--new: expected at least 3 new tokens (a first token and 2 steps), got {args.new}")
    from oal.bench.devices import machine_record

    torch.set_num_threads(args.threads)
    print(json.dumps(machine_record()), flush=True)
    models = {name: build(name, args.dtype).eval() for name in args.models}

    def generate(model, ids: torch.Tensor, new: int, stamps: LogitsProcessor | None = None) -> torch.Tensor:
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            logits_processor=LogitsProcessorList([stamps] if stamps is not None else []),
            pad_token_id=model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id,
        )

    if args.warmup:
        for model in models.values():
            generate(model, torch.zeros(args.batch, args.warmup, dtype=torch.long), 3)
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {(name, n): [] for name in args.models for n in sizes}
    tokens: dict[tuple[str, int], torch.Tensor] = {}
    for r in range(args.rounds):
        for n in sizes:
            for name in args.models if r % 2 == 0 else args.models[::-1]:
                model = models[name]
                ids = torch.randint(
                    0, model.config.vocab_size, (args.batch, n), generator=torch.Generator().manual_seed(args.seed)
                )
                stamps = Stamps()
                start = time.perf_counter()
                out = generate(model, ids, args.new, stamps)
                first, step = timings(start, stamps.times)
                new = out[:, n:]
                same = bool(torch.equal(tokens.setdefault((name, n), new), new))
                del out
                gc.collect()
                runs[name, n].append((first, step))
                row = {"round": r, "model": name, "n": n, "first_token_s": round(first, 3), "step_ms": round(step, 2)}
                row.update(new_tokens=int(new.shape[1]), same_tokens_as_round_0=same, batch=args.batch)
                print(json.dumps({**row, "dtype": args.dtype, "threads": args.threads}), flush=True)
    for row in summarize(runs, args.models, sizes):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
