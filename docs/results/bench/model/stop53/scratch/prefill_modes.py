"""Stop 53: the recipe's 1k fp32 prompt, 8 times in a row, then 8 times alternating with the original's (the
original first in each pair), in one process: does the converted prompt slow down after the original's?

    python docs/results/bench/model/stop53/scratch/prefill_modes.py docs/results/conversion/model 1024 8
"""

import json
import sys
import time

import torch

from oal.bench.decode import DecodeConfig, build_model
from oal.models import KernelCache


def prefill(model, ids, kernel_cache: bool) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model(ids, cache=KernelCache(model) if kernel_cache else None, logits_to_keep=1)
    return round(time.perf_counter() - start, 3)


def main() -> None:
    which, n, times = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(2)
    original = build_model("original", DecodeConfig())
    converted = build_model("converted", DecodeConfig(converted=None if which == "plain" else which, layers="3-26"))
    ids = torch.randint(converted.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    prefill(original, ids[:, :64], False)
    prefill(converted, ids[:, :64], True)
    print(json.dumps({"alone": [prefill(converted, ids, True) for _ in range(times)]}), flush=True)
    print(json.dumps({"original_alone": [prefill(original, ids, False) for _ in range(times)]}), flush=True)
    pairs = [(prefill(original, ids, False), prefill(converted, ids, True)) for _ in range(times)]
    print(json.dumps({"after_original": [c for _, c in pairs], "original": [o for o, _ in pairs]}), flush=True)


if __name__ == "__main__":
    main()
