"""Decode latency of two models side by side in one process, at one or more contexts: every (model, context) pair
prefilled once with the same seeded random prompt, then greedy decode steps taking the pairs in turn (the order
reversed every step), so that the machine's state moves all alike (this machine's speed swings ±30 % between
minutes; separate processes minutes apart do not separate a few per cent). A model is a converted model's
directory, a base model's name (``smollm2-135m``: the original, in a plain ``DynamicCache``) or ``plain`` (plain OAL
on layers 3–26 with synthetic groups, as ``oal bench decode --kernel oal --layers 3-26`` builds it).

Prints one JSON line per (model, context): median and min ms per step, tokens/s; then one ``ratio`` line per
context (the second model's median over the first's: issue #15's goal 1 compares the converted model's latency to
the original's, goal 2 its tokens/s at ``--batch 8``, the inverse) and, with two or more contexts, one ``growth``
line per model (its median at the longest context over its median at the shortest, from steps taken in turn with
the shorter context's).

    python benchmarks/decode_ab.py docs/results/conversion/model docs/results/conversion/model_int8kv --n 8192
    python benchmarks/decode_ab.py smollm2-135m docs/results/conversion/model --n 1024,8192 --steps 66
    python benchmarks/decode_ab.py smollm2-135m plain --n 1024,8192 --steps 66
    python benchmarks/decode_ab.py smollm2-135m docs/results/conversion/model --n 4096 --batch 8 --steps 34

The first line of the output is the machine record (``oal.bench.devices.machine_record``: the command, the
versions, the CPU's flags).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from oal.bench.decode import DecodeConfig, build_model
from oal.bench.devices import machine_record
from oal.models import load_model
from oal.models.state_cache import KernelCache, cache_nbytes


def build(name: str, dtype: str) -> torch.nn.Module:
    """A converted model's directory or a base model's name (loaded as it is), or ``plain``."""
    if name == "plain":
        return build_model("converted", DecodeConfig(kernel="oal", layers="3-26", dtype=dtype))
    return load_model(name, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)


def pair_arguments(ap: argparse.ArgumentParser, together: str) -> None:
    """The arguments this script shares with ``prefill_ab.py``: the two models, ``--n``, ``--threads``, ``--dtype``,
    ``--batch`` (equal-length prompts ``together``) and ``--seed``."""
    ap.add_argument("models", nargs=2, help="two models: converted model directories, base model names or plain")
    ap.add_argument("--n", default="8192", help="prompt tokens, comma-separated for several contexts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--batch", type=int, default=1, help=f"equal-length prompts {together}")
    ap.add_argument("--seed", type=int, default=0)


def checked_sizes(args: argparse.Namespace) -> list[int]:
    """``--n``'s comma-separated prompt lengths; SystemExit unless all are positive integers and ``--batch`` is
    positive."""
    try:
        sizes = [int(s) for s in args.n.split(",")]
    except ValueError:
        sizes = [0]
    if min(sizes) < 1:
        raise SystemExit(f"--n: expected positive prompt lengths, got {args.n!r}")
    if args.batch < 1:
        raise SystemExit(f"--batch: expected a positive batch size, got {args.batch}")
    return sizes


def round_arguments(ap: argparse.ArgumentParser, rounds: int, what: str) -> None:
    """``--rounds`` (``rounds`` by default, of ``what`` per model and context) and ``--warmup``: the arguments of the
    scripts that repeat a prompt in rounds (``prefill_ab.py``, ``generate_ab.py``)."""
    ap.add_argument("--rounds", type=int, default=rounds, help=f"{what} per model and context, alternating")
    ap.add_argument("--warmup", type=int, default=64, help="tokens of an untimed first prompt per model (0: none)")


def check_rounds(args: argparse.Namespace) -> None:
    """SystemExit unless ``--rounds`` is positive, ``--warmup`` ≥ 0 and the two models differ."""
    if args.rounds < 1:
        raise SystemExit(f"--rounds: expected a positive number of rounds, got {args.rounds}")
    if args.models[0] == args.models[1]:
        raise SystemExit(f"models: expected two different models, got {args.models[0]!r} twice")
    if args.warmup < 0:
        raise SystemExit(f"--warmup: expected a number of tokens ≥ 0, got {args.warmup}")


def main() -> None:
    ap = argparse.ArgumentParser()
    pair_arguments(ap, "decoded together")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per model and context (the first 2 untimed)")
    args = ap.parse_args()
    sizes = checked_sizes(args)
    torch.set_num_threads(args.threads)
    print(json.dumps(machine_record()), flush=True)
    models = {name: build(name, args.dtype).eval() for name in args.models}
    pairs = [(name, n) for n in sizes for name in args.models]
    state = {}
    with torch.no_grad():
        for name, n in pairs:
            ids = torch.randint(
                0, models[name].config.vocab_size, (args.batch, n), generator=torch.Generator().manual_seed(args.seed)
            )
            cache = KernelCache(models[name])
            out = models[name](ids, cache=cache, use_cache=True, logits_to_keep=1)
            state[name, n] = (cache, out.logits[:, -1:].argmax(-1))
    times: dict[tuple[str, int], list[float]] = {pair: [] for pair in pairs}
    with torch.no_grad():
        for i in range(args.steps):
            for pair in pairs if i % 2 == 0 else pairs[::-1]:
                cache, token = state[pair]
                t0 = time.perf_counter()
                out = models[pair[0]](token, cache=cache, use_cache=True)
                dt = time.perf_counter() - t0
                state[pair] = (cache, out.logits[:, -1:].argmax(-1))
                if i >= 2:
                    times[pair].append(dt * 1e3)
    median = {pair: statistics.median(ms) for pair, ms in times.items()}
    for (name, n), ms in times.items():
        row = {"model": name, "n": n, "median_ms": round(median[name, n], 2), "min_ms": round(min(ms), 2)}
        row.update(cache_mb=round(cache_nbytes(state[name, n][0]) / 1e6, 1), steps=len(ms), threads=args.threads)
        row.update(batch=args.batch, tokens_per_s=round(args.batch * 1e3 / median[name, n], 1))
        print(json.dumps({**row, "dtype": args.dtype}), flush=True)
    first, second = args.models
    for n in sizes:
        ratio = median[second, n] / median[first, n]
        print(json.dumps({"ratio": f"{second} / {first}", "n": n, "latency_ratio": round(ratio, 3)}), flush=True)
    if len(sizes) > 1:
        lo, hi = min(sizes), max(sizes)
        for name in args.models:
            growth = median[name, hi] / median[name, lo] - 1
            print(json.dumps({"growth": name, "from": lo, "to": hi, "growth_pct": round(100 * growth, 1)}), flush=True)


if __name__ == "__main__":
    main()
