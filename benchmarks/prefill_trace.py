"""Resident memory and malloc's heap at every attention and MLP boundary of one prefill (VmHWM reset after the
load): where the peak RSS is reached and what it holds there — live heap (``mallinfo2().uordblks``), freed heap
glibc keeps (``fordblks``), the arenas' size and mmapped blocks. One model per process: the original, the committed
converted model (``recipe``) or plain OAL (layers 3–26), prefilled with N seeded random tokens as ``prefill_peak.py``
does (default chunks unless ``--chunk``). Prints a summary line, then one line per boundary.

    python benchmarks/prefill_trace.py recipe --n 1024 --dtype bf16 > trace_recipe.jsonl
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import sys
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


def main() -> None:
    from oal.bench.devices import get_device
    from oal.models import KernelCache

    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=("original", "recipe", "plain"))
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--chunk", type=int, default=None, help="config.oal_prefill_chunk (default: the model's own)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = build(args.model, args.dtype)
    if args.chunk is not None:
        model.config.oal_prefill_chunk = args.chunk
    events: list[dict[str, object]] = []
    for i, layer in enumerate(model.model.layers):
        for part in ("self_attn", "mlp"):
            module = getattr(layer, part)
            module.register_forward_pre_hook(lambda m, a, tag=f"{i}.{part}<": events.append(snapshot(tag)))
            module.register_forward_hook(lambda m, a, o, tag=f"{i}.{part}>": events.append(snapshot(tag)))
    ids = torch.randint(model.config.vocab_size, (1, args.n), generator=torch.Generator().manual_seed(0))
    cache = KernelCache(model)
    if not get_device("cpu").reset_peak():
        raise SystemExit("this system refuses the VmHWM reset (/proc/self/clear_refs): no peak from the prefill")
    events.append(snapshot("start"))
    with torch.no_grad():
        model(ids, cache=cache, logits_to_keep=1)
    events.append(snapshot("end"))
    peak = events[-1]["hwm"]
    at = next(e for e in events if e["hwm"] >= peak)
    summary = {"model": args.model, "n": args.n, "dtype": args.dtype, "start_rss": events[0]["rss"], "peak": peak}
    summary.update(reached_at=at["tag"], at_peak={k: at[k] for k in ("rss", "arena", "mmap", "live", "free")})
    print(json.dumps(summary))
    for event in events:
        print(json.dumps(event))


if __name__ == "__main__":
    main()
