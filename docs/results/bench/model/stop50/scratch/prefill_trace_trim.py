# Scratch copy of benchmarks/prefill_trace.py with malloc_trim before the decoder layers listed in TRIM_AT (e.g. TRIM_AT=8,16,24);
# copy it into benchmarks/ to run (it imports prefill_peak and prefill_rss from its own folder):
#   TRIM_AT=20 python benchmarks/prefill_trace_trim.py recipe --n 1024 --dtype fp32 --first-prompt 64
"""Resident memory and malloc's heap at every attention and MLP boundary of one prefill (VmHWM reset after the
load): where the peak RSS is reached and what it holds there — live heap (``mallinfo2().uordblks``), freed heap
glibc keeps (``fordblks``), the arenas' size and mmapped blocks. One model per process: the original, the committed
converted model (``recipe``) or plain OAL (layers 3–26), prefilled with N seeded random tokens as ``prefill_peak.py``
does (default chunks unless ``--chunk``). Prints a summary line, then one line per boundary.

``--without`` takes back what stop 47 added to a prompt in chunks, to measure it: ``chunk_release`` (the freed heap
returned before every chunk after the first, :mod:`oal.models.prefill`), ``prompt_room`` (the softmax layers'
buffers sized for the whole prompt at its first chunk, :class:`oal.models.state_cache.ExactKVLayer`),
``softmax_chunk`` (the softmax layers' later chunks without a mask, :mod:`oal.ops.softmax`: SDPA with
transformers' mask instead); and what stop 48 added: ``exact_chunk`` (the exact heads' later chunks without a mask
where the fused prompt kernel does not run them, on AMX tiles, which ``OAL_CPU_AMX=1`` forces, or without the fused
kernels: SDPA with its own mask instead).

    python benchmarks/prefill_trace.py recipe --n 1024 --dtype bf16 > trace_recipe.jsonl
    python benchmarks/prefill_trace.py plain --n 1024 --dtype fp32 --without chunk_release,prompt_room
    python benchmarks/prefill_trace.py recipe --n 1024 --dtype fp32 --first-prompt 64

``--first-prompt T``: a T-token prompt into a cache thrown away before the traced one (its freed heap returned, then
VmHWM reset), as ``oal bench decode`` runs one since stop 49: the weights are resident before the traced prompt.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_peak import build  # noqa: E402
from prefill_rss import status  # noqa: E402


@functools.cache
def _mallinfo2():
    """glibc's mallinfo2, typed once (every hook of a trace calls it)."""
    from oal.bench.devices import _MallInfo2

    fn = ctypes.CDLL(None).mallinfo2
    fn.restype = _MallInfo2
    return fn


def snapshot(tag: str) -> dict[str, object]:
    """VmRSS, VmHWM and mallinfo2's totals (MB) now."""
    now, info = status(), _mallinfo2()()
    mb = {k: round(getattr(info, f) / 2**20, 1) for k, f in (("arena", "arena"), ("mmap", "hblkhd"))}
    mb.update(live=round(info.uordblks / 2**20, 1), free=round(info.fordblks / 2**20, 1))
    return {"tag": tag, "rss": round(now["VmRSS"], 1), "hwm": round(now["VmHWM"], 1), **mb}


ABLATIONS = ("chunk_release", "prompt_room", "softmax_chunk", "exact_chunk")


def ablations(text: str) -> tuple[str, ...]:
    """``--without``'s comma-separated names, each one of :data:`ABLATIONS`."""
    names = tuple(x for x in text.split(",") if x)
    unknown = [x for x in names if x not in ABLATIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"expected names among {', '.join(ABLATIONS)}, got {text!r}")
    return names


def take_back(names: tuple[str, ...]) -> None:
    """Undo stop 47's and 48's additions named in ``names`` in this process (see the module docstring)."""
    from oal.kernels import hybrid
    from oal.models import hooks, prefill, state_cache

    if "chunk_release" in names:
        forward = prefill._forward
        prefill._forward = lambda *args, release=False, **kwargs: forward(*args, **kwargs)
    if "prompt_room" in names:
        state_cache.context_end = lambda end: end
    if "softmax_chunk" in names:
        hooks._softmax_chunk = lambda *args: None
    if "exact_chunk" in names:
        hybrid.softmax_at_end = lambda *args: None


def main() -> None:
    from oal.bench.devices import get_device
    from oal.models import KernelCache
    from oal.models.prefill import release_freed_heap

    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=("original", "recipe", "plain"))
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--chunk", type=int, default=None, help="config.oal_prefill_chunk (default: the model's own)")
    ap.add_argument("--without", type=ablations, default=(), help=f"comma-separated, among {', '.join(ABLATIONS)}")
    ap.add_argument("--first-prompt", type=int, default=0, help="tokens of an untraced prompt first, ≤ --n (0: none)")
    args = ap.parse_args()
    if not 0 <= args.first_prompt <= args.n:
        raise SystemExit(f"--first-prompt: expected 0 … --n ({args.n}) tokens, got {args.first_prompt}")
    take_back(args.without)
    torch.set_num_threads(2)
    model = build(args.model, args.dtype)
    import os
    from oal.models.prefill import release_freed_heap as _rel
    for i in [int(x) for x in os.environ.get("TRIM_AT", "").split(",") if x]:
        model.model.layers[i].register_forward_pre_hook(lambda m, a: (_rel(), None)[1])
    if args.chunk is not None:
        model.config.oal_prefill_chunk = args.chunk
    events: list[dict[str, object]] = []
    for i, layer in enumerate(model.model.layers):
        for part in ("self_attn", "mlp"):
            module = getattr(layer, part)
            module.register_forward_pre_hook(lambda m, a, tag=f"{i}.{part}<": events.append(snapshot(tag)))
            module.register_forward_hook(lambda m, a, o, tag=f"{i}.{part}>": events.append(snapshot(tag)))
    ids = torch.randint(model.config.vocab_size, (1, args.n), generator=torch.Generator().manual_seed(0))
    if args.first_prompt:  # the prompt's first tokens
        with torch.no_grad():
            model(ids[:, : args.first_prompt], cache=KernelCache(model), logits_to_keep=1)
        events.clear()
        gc.collect()
        release_freed_heap()
    cache = KernelCache(model)
    if not get_device("cpu").reset_peak():
        raise SystemExit("this system refuses the VmHWM reset (/proc/self/clear_refs): no peak from the prefill")
    events.append(snapshot("start"))
    start = time.perf_counter()
    with torch.no_grad():
        model(ids, cache=cache, logits_to_keep=1)
    seconds = time.perf_counter() - start  # with the hooks' snapshots (~60 per chunk)
    events.append(snapshot("end"))
    peak = events[-1]["hwm"]
    at = next(e for e in events if e["hwm"] >= peak)
    summary = {"model": args.model, "n": args.n, "dtype": args.dtype, "without": list(args.without)}
    summary["first_prompt"] = args.first_prompt
    summary.update(start_rss=events[0]["rss"], peak=peak, prefill_s=round(seconds, 3))
    summary.update(reached_at=at["tag"], at_peak={k: at[k] for k in ("rss", "arena", "mmap", "live", "free")})
    print(json.dumps(summary))
    for event in events:
        print(json.dumps(event))


if __name__ == "__main__":
    main()
