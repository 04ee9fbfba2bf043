"""Where a converted model's prefill goes: the model's forward over N random tokens into a fresh cache, with the
time inside the exact heads' softmax (``ExactHeadsKernel._exact_forward``), the kernel part (the quadratic
operator as the sink/window operator calls it, ``chunk_checked``) and the sink/window exact part
(``_FusedWindow``) summed over the layers; the rest is the model's own linear layers, norms and the hooks. The
original's SDPA time beside it. ``--chunks 0,256``: the converted model once per prefill chunk length
(``config.oal_prefill_chunk``; unset without the option), with the time of the kept form's folds (``fold_s``: a
later chunk below the kept form's limit folds the kept keys into a transient state first). ``--dtype bf16``: both
models in bf16.

    python benchmarks/prefill_parts.py --converted docs/results/conversion/model --sizes 1024,8192 --threads 2
    python benchmarks/prefill_parts.py --sizes 1024 --chunks 0,256 --dtype bf16 --repeats 3
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from transformers import AttentionInterface

import oal.kernels.hybrid as hybrid
import oal.kernels.kept as kept_form
import oal.ops.sink_window.utils as sink_window
from oal.bench.decode import DecodeConfig
from oal.bench.machine import parse_dtype
from oal.models import KernelCache, load_model

SECONDS: dict[str, float] = collections.defaultdict(float)


def timed(fn, key: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[key] += time.perf_counter() - start

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--converted", default="docs/results/conversion/model")
    ap.add_argument("--sizes", default="1024,8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunks", default=None, help="prefill chunk lengths of the converted model (0: one call)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args()
    chunks = [None] if args.chunks is None else [int(x) for x in args.chunks.split(",")]
    if any(c is not None and c < 0 for c in chunks):
        raise SystemExit(f"--chunks: expected chunk lengths ≥ 0, got {args.chunks}")
    dtype = parse_dtype(args.dtype)
    torch.set_num_threads(args.threads)
    sink_window.chunk_checked = timed(sink_window.chunk_checked, "kernel_part_s")
    sink_window._FusedWindow.apply = timed(sink_window._FusedWindow.apply, "window_part_s")
    hybrid.ExactHeadsKernel._exact_forward = timed(hybrid.ExactHeadsKernel._exact_forward, "exact_heads_s")
    kept_form.fold = timed(kept_form.fold, "fold_s")
    AttentionInterface._global_mapping["sdpa"] = timed(AttentionInterface._global_mapping["sdpa"], "sdpa_s")
    models = {
        "original": load_model(DecodeConfig().model, dtype=dtype).eval(),
        "converted": load_model(args.converted, dtype=dtype).eval(),
    }
    runs = [("original", None)] + [("converted", c) for c in chunks]
    for n in (int(x) for x in args.sizes.split(",")):
        ids = torch.randint(models["original"].config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        for rep in range(args.repeats):
            for name, chunk in runs:
                model = models[name]
                if chunk is not None:
                    model.config.oal_prefill_chunk = chunk
                SECONDS.clear()
                with torch.no_grad():
                    start = time.perf_counter()
                    model(ids, cache=KernelCache(model), logits_to_keep=1)
                    total = time.perf_counter() - start
                row = {"model": name, "n": n, "dtype": args.dtype, "repeat": rep, "total_s": round(total, 3)}
                if chunk is not None:
                    row["chunk"] = chunk
                row.update({k: round(v, 3) for k, v in SECONDS.items()})
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
