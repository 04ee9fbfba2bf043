"""A prompt in chunks below the kept form's limit, two ways, side by side in one process: each later chunk's queries
evaluated over the kept and the new keys without a state (``at_end``: the default where the fused CPU kernels load,
:func:`oal.kernels.kept.extend`) or over the kept keys folded into a transient state first (``fold``: the path
without them, forced here), against the original model's one call. Per prompt length and chunk length (``0``: one
call; ``default``: the model's own choice, :func:`oal.models.prefill.prefill_chunk`; ``--converted plain``: plain
OAL on layers 3–26 instead of the committed recipe): the prefill seconds of each
way, round after round (alternating), and the largest |difference| of the last logits from the converted model's
one call. Since stop 47 an fp32 model runs a prompt of at most ``ONE_CALL_CHUNKS`` chunks in one call with its MLPs
in pieces (:mod:`oal.models.prefill`), so there both ways time that one call.

    python benchmarks/chunk_ab.py --sizes 1024 --chunks 256 --dtype bf16 --repeats 3
    python benchmarks/chunk_ab.py --sizes 1536,2048 --chunks default --dtype bf16 --repeats 3
    python benchmarks/chunk_ab.py --sizes 1024 --chunks default --dtype fp32 --converted plain --repeats 5
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import torch


@contextmanager
def folding(enabled: bool):
    """Within it (when ``enabled``), chunks after a kept form take the fold path."""
    from oal.kernels import kept

    usable = kept._at_end_usable
    if enabled:
        kept._at_end_usable = lambda kernel: False
    try:
        yield
    finally:
        kept._at_end_usable = usable


def prefill(model, ids: torch.Tensor, chunk: int | None) -> tuple[float, torch.Tensor]:
    """Seconds of one prefill of ``ids`` into a fresh cache (chunk None: the model's default) and its last logits."""
    from oal.models import KernelCache

    if chunk is None:
        if hasattr(model.config, "oal_prefill_chunk"):
            del model.config.oal_prefill_chunk
    else:
        model.config.oal_prefill_chunk = chunk
    start = time.perf_counter()
    with torch.no_grad():
        out = model(ids, cache=KernelCache(model), logits_to_keep=1)
    return time.perf_counter() - start, out.logits


def main() -> None:
    from oal.bench.decode import DecodeConfig, build_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024")
    ap.add_argument("--chunks", default="256", help="chunk lengths, 'default' for the model's own choice")
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument(
        "--converted", default="docs/results/conversion/model", help="a converted model's directory, or plain"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ways", default="at_end,fold", help="the converted model's ways, in this order each round")
    args = ap.parse_args()
    ways = args.ways.split(",")
    if not set(ways) <= {"at_end", "fold"}:
        raise SystemExit(f"--ways: expected at_end, fold or both, got {args.ways!r}")
    torch.set_num_threads(2)
    original = build_model("original", DecodeConfig(dtype=args.dtype))
    plain = args.converted == "plain"  # OAL on layers 3–26, synthetic groups, as oal bench decode builds it
    config = DecodeConfig(converted=None if plain else args.converted, kernel="oal", layers="3-26", dtype=args.dtype)
    converted = build_model("converted", config)
    chunks = [None if c == "default" else int(c) for c in args.chunks.split(",")]
    for n in (int(x) for x in args.sizes.split(",")):
        ids = torch.randint(converted.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        prefill(original, ids[:, :256], 0)  # warm-up: the first call builds and loads what later ones reuse
        _, one_call = prefill(converted, ids, 0)
        for chunk in chunks:
            times: dict[str, list[float]] = {"original": [], **{way: [] for way in ways}}
            diffs: dict[str, float] = {}
            for _ in range(args.repeats):
                times["original"].append(prefill(original, ids, 0)[0])
                for way in ways:
                    with folding(way == "fold"):
                        seconds, logits = prefill(converted, ids, chunk)
                    times[way].append(seconds)
                    diffs[way] = float((logits.float() - one_call.float()).abs().max())
            row = {
                "n": n,
                "chunk": "default" if chunk is None else chunk,
                "dtype": args.dtype,
                "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
                "max_abs_logit_diff_vs_one_call": diffs,
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
