"""Stop 53: an fp32 prompt past two chunks, in chunks against one call (MLP pieces of 256 rows, as a prompt of at most
ONE_CALL_CHUNKS chunks runs), side by side with the original's one call, alternating within each round.

    python docs/results/bench/model/stop53/scratch/onecall_ab.py plain 2048 4 > ...jsonl
"""

import json
import sys
import time

import torch

import oal.models.prefill as prefill_mod
from oal.bench.decode import DecodeConfig, build_model
from oal.models import KernelCache


def run(model, ids, one_call: bool) -> float:
    if hasattr(model.config, "oal_prefill_chunk"):
        del model.config.oal_prefill_chunk
    saved = prefill_mod.ONE_CALL_CHUNKS
    if one_call:
        prefill_mod.ONE_CALL_CHUNKS = 10**6
    try:
        start = time.perf_counter()
        with torch.no_grad():
            model(ids, cache=KernelCache(model), logits_to_keep=1)
        return time.perf_counter() - start
    finally:
        prefill_mod.ONE_CALL_CHUNKS = saved


def main() -> None:
    which, sizes, rounds = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
    torch.set_num_threads(2)
    original = build_model("original", DecodeConfig())
    config = DecodeConfig(converted=None if which == "plain" else which, kernel="oal", layers="3-26")
    converted = build_model("converted", config)
    for n in sizes:
        ids = torch.randint(converted.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            original(ids[:, :256])
        run(converted, ids[:, :256], False)
        for r in range(rounds):
            row = {"n": n, "round": r, "model": which}
            row["original"] = run(original, ids, False)
            row["chunks"] = run(converted, ids, False)
            row["one_call"] = run(converted, ids, True)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
