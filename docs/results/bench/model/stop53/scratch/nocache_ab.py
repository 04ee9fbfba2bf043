"""Stop 53: a converted model's forward without a cache (``use_cache=False``: how ``oal eval`` scores perplexity
blocks; one call, fresh kernel segments) with the parallel prefix (``chunk.parallel_prefix``, stop 53) and
without it (patched to 0: the segment in the chunked loop, as before), alternating within each round, and the
largest |difference| of the logits.

    python docs/results/bench/model/stop53/scratch/nocache_ab.py docs/results/conversion/model 2048,4096 4
"""

import json
import sys
import time

import torch

import oal.ops.quadratic.chunk as chunk
from oal.bench.decode import DecodeConfig, build_model


def main() -> None:
    which, sizes, rounds = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
    torch.set_num_threads(2)
    model = build_model("converted", DecodeConfig(converted=None if which == "plain" else which, layers="3-26"))
    real = chunk.parallel_prefix
    for n in sizes:
        ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model(ids[:, :256], use_cache=False)
        for r in range(rounds):
            row, logits = {"n": n, "round": r, "model": which}, {}
            for name, prefix in (("without_prefix", lambda *shape: 0), ("with_prefix", real)):
                chunk.parallel_prefix = prefix
                start = time.perf_counter()
                with torch.no_grad():
                    logits[name] = model(ids, use_cache=False).logits
                row[name] = round(time.perf_counter() - start, 3)
            chunk.parallel_prefix = real
            row["max_abs_logit_diff"] = float((logits["with_prefix"] - logits["without_prefix"]).abs().max())
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
