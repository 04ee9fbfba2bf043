"""Where a prefill's tensor memory peaks: torch's CPU allocations through one prompt (``torch.profiler`` with
``profile_memory``), for the original, the committed converted model (``recipe``) and plain OAL (layers 3–26,
synthetic groups), each in a fresh process. Per point: the peak of the bytes torch holds above the prompt's start,
what it holds at the end (the cache, and what a model keeps beside it), the module in which the peak is reached,
and per decoder layer the transient of its attention and of its MLP (their peak above what was held when they
started). This is the live data of the peak resident set, without allocator retention or code pages
(``benchmarks/prefill_rss.py --mappings`` splits those); buffers the fused C++ kernels allocate with ``malloc``
(``std::vector``: the parallel form's packed values and the queries and keys of a slab of query heads, ~1.2 MB for
a 512-token chunk over 1k keys at 2 threads) are not torch's and not counted.

    python benchmarks/prefill_alloc_peak.py --n 1024 --dtype bf16 --models original,recipe
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

MB = 2**20


def attribute(memory: list[tuple[int, int]], spans: list[tuple[str, int, int]]) -> dict[str, object]:
    """The running total of ``memory`` ((time, bytes ±) allocation events) and where it peaks: ``peak_mb`` above the
    start, ``end_mb``, ``peak_in`` (the innermost of ``spans`` (name, start, end) holding the peak's event, or
    None) and ``transients_mb``: per span, its peak above the total at its start."""
    memory = sorted(memory)
    spans = sorted(spans, key=lambda s: s[1])
    total = peak = 0
    peak_time = None
    at_time: list[tuple[int, int]] = []  # (time, total after the event)
    for time, nbytes in memory:
        total += nbytes
        at_time.append((time, total))
        if total > peak:
            peak, peak_time = total, time
    holding = [s for s in spans if peak_time is not None and s[1] <= peak_time <= s[2]]
    inner = min(holding, key=lambda s: s[2] - s[1])[0] if holding else None
    transients = {}
    for name, start, end in spans:
        before = max((t for t in at_time if t[0] < start), default=(start, 0))[1]
        inside = [v for t, v in at_time if start <= t <= end]
        transients[name] = round((max(inside, default=before) - before) / MB, 2)
    return {
        "peak_mb": round(peak / MB, 2),
        "end_mb": round(total / MB, 2),
        "peak_in": inner,
        "transients_mb": transients,
    }


def point(model_name: str, n: int, dtype: str) -> dict[str, object]:
    from prefill_peak import build  # the sibling script (run as a script, benchmarks/ is on the path)
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from oal.models import KernelCache, get_decoder_layers

    torch.set_num_threads(2)
    model = build(model_name, dtype)
    open_ranges: dict[int, record_function] = {}

    def mark(module: torch.nn.Module, name: str) -> None:
        def enter(*_):
            open_ranges[id(module)] = record_function(name).__enter__()

        def leave(*_):
            open_ranges.pop(id(module)).__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)

    names = []
    for i, layer in enumerate(get_decoder_layers(model)):
        for part, module in (("attn", layer.self_attn), ("mlp", layer.mlp)):
            names.append(f"{i}.{part}")
            mark(module, names[-1])
    ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    cache = KernelCache(model)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(ids, cache=cache, logits_to_keep=1)
    events = prof.profiler.kineto_results.events()
    memory = [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"]
    wanted = set(names)
    spans = [(e.name(), e.start_ns(), e.end_ns()) for e in events if e.name() in wanted]
    found = attribute(memory, spans)
    per = found.pop("transients_mb")
    layers = len(names) // 2
    return {
        "model": model_name,
        "n": n,
        "dtype": dtype,
        **found,
        "attn_transient_mb": [per.get(f"{i}.attn") for i in range(layers)],
        "mlp_transient_mb": [per.get(f"{i}.mlp") for i in range(layers)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--models", default="original,recipe,plain")
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print(json.dumps(point(args.point, args.n, args.dtype)))
        return
    names = args.models.split(",")
    unknown = sorted(set(names) - {"original", "recipe", "plain"})
    if unknown:
        raise SystemExit(f"--models: expected names from original, recipe, plain; got {', '.join(unknown)}")
    for name in names:
        cmd = [sys.executable, __file__, "--point", name, "--n", str(args.n), "--dtype", args.dtype]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(proc.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
