"""Peak resident memory of one prefill with and without chunks: each point a fresh process that builds the model,
prefills N seeded random tokens into a fresh cache with ``config.oal_prefill_chunk`` set (0: one call), then
reports VmHWM, the freed heap glibc keeps (``mallinfo2().fordblks``) and the prefill time. The original, the
committed converted model (``recipe``) and plain OAL (layers 3–26, synthetic groups), round after round.
``--release 0,1``: each model without and with the release of the freed heap before the output layer
(:mod:`oal.models.prefill`; ``config.oal_release_prompt_heap`` for the converted models, the same hook put on the
original by :func:`oal.models.prefill.heap_released_before_output`: the control). ``--dtype bf16``: the models in
bf16; the peak is then measured from the prefill's start (VmHWM reset after the load, whose cast of the weights
is above any prefill's), as ``oal bench decode`` measures it (``peak_from_prefill`` says whether it could).

    python benchmarks/prefill_peak.py --n 2048 --chunks 0,512 --release 0,1 --rounds 3 --out prefill_peak.jsonl
    python benchmarks/prefill_peak.py --n 1024 --chunks 0,512 --models original,recipe --dtype bf16 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time

import torch


def build(model_name: str, dtype: str) -> torch.nn.Module:
    """``original``, ``recipe`` (the committed converted model) or ``plain`` (OAL on layers 3–26, synthetic groups)."""
    from oal.bench.decode import DecodeConfig, build_model

    config = DecodeConfig(
        converted="docs/results/conversion/model" if model_name == "recipe" else None,
        kernel="oal",
        layers="3-26",
        dtype=dtype,
    )
    return build_model("original" if model_name == "original" else "converted", config)


def point(model_name: str, n: int, chunk: int, release: bool, dtype: str) -> dict[str, object]:
    from oal.bench.devices import get_device, heap_kept_bytes
    from oal.models import KernelCache
    from oal.models.prefill import heap_released_before_output

    torch.set_num_threads(2)
    model = build(model_name, dtype)
    model.config.oal_prefill_chunk = chunk
    model.config.oal_release_prompt_heap = release
    control = heap_released_before_output(model) if release and model_name == "original" else contextlib.nullcontext()
    ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    cache = KernelCache(model)
    from_prefill = dtype != "fp32" and get_device("cpu").reset_peak()
    with torch.no_grad(), control:
        start = time.perf_counter()
        model(ids, cache=cache, logits_to_keep=1)
        seconds = time.perf_counter() - start
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    kept = heap_kept_bytes() / 2**20
    return {
        "model": model_name,
        "n": n,
        "chunk": chunk,
        "release": release,
        "dtype": dtype,
        "peak_from_prefill": from_prefill,
        "peak_rss_mb": round(peak, 1),
        "heap_kept_mb": round(kept, 1),
        "peak_minus_kept_mb": round(peak - kept, 1),
        "prefill_s": round(seconds, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--chunks", default="0,512", help="chunk lengths of the converted models (0: one call)")
    ap.add_argument("--models", default="original,recipe,plain")
    ap.add_argument("--release", default="1", help="0: without the heap release, 1: with it, 0,1: both")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSONL file the points are appended to")
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print(json.dumps(point(args.point, args.n, args.chunk, args.release == "1", args.dtype)))
        return
    chunks = [int(c) for c in args.chunks.split(",")]
    releases = args.release.split(",")
    for r in range(args.rounds):
        for name in args.models.split(","):
            for chunk, release in [(c, x) for c in ([0] if name == "original" else chunks) for x in releases]:
                cmd = [sys.executable, __file__, "--point", name, "--n", str(args.n), "--chunk", str(chunk)]
                cmd += ["--release", release, "--dtype", args.dtype]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row = {"round": r, **json.loads(proc.stdout.strip().splitlines()[-1])}
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
