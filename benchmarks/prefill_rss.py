"""Resident memory through one prefill of N random tokens: VmRSS after every third decoder layer and the peak
(VmHWM) at the end, for the original, the committed converted model and plain OAL (layers 3–26, synthetic groups),
each in a fresh process. ``--trim`` calls glibc's ``malloc_trim(0)`` after every decoder layer (a diagnosis, not
what the models do): it shows how much of the peak is freed heap that glibc keeps (fragmentation), not data.

    python benchmarks/prefill_rss.py --n 1024 --repeats 2
    python benchmarks/prefill_rss.py --n 1024 --repeats 2 --trim
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys

import torch


def status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) / 1024
    return out


def point(model_name: str, n: int, trim: bool) -> dict[str, object]:
    from oal.bench.decode import DecodeConfig, build_model
    from oal.models import KernelCache, get_decoder_layers

    torch.set_num_threads(2)
    malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim if trim else None
    config = DecodeConfig(converted="docs/results/conversion/model" if model_name == "recipe" else None)
    model = build_model("original" if model_name == "original" else "converted", config)
    loaded = status()["VmRSS"]
    trace: list[float] = []
    for layer in get_decoder_layers(model):
        layer.register_forward_hook(lambda *_: (malloc_trim and malloc_trim(0), trace.append(status()["VmRSS"]))[1])
    ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, cache=KernelCache(model), logits_to_keep=1)
    end = status()
    return {
        "model": model_name,
        "n": n,
        "trim": trim,
        "loaded_mb": round(loaded),
        "every_third_layer_mb": [round(x) for x in trace[::3]],
        "end_mb": round(end["VmRSS"]),
        "peak_mb": round(end["VmHWM"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--trim", action="store_true")
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print(json.dumps(point(args.point, args.n, args.trim)))
        return
    for _ in range(args.repeats):
        for name in ("original", "recipe", "plain"):
            cmd = [sys.executable, __file__, "--point", name, "--n", str(args.n)]
            cmd += ["--trim"] if args.trim else []
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            print(proc.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
