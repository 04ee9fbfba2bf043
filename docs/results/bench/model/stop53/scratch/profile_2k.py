"""Stop 53: where a 2k fp32 prompt's time goes, original against converted (torch.profiler op totals, CPU).

    python docs/results/bench/model/stop53/scratch/profile_2k.py plain 2048
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from oal.bench.decode import DecodeConfig, build_model
from oal.models import KernelCache


def main() -> None:
    which, n = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(2)
    original = build_model("original", DecodeConfig())
    config = DecodeConfig(converted=None if which == "plain" else which, kernel="oal", layers="3-26")
    converted = build_model("converted", config)
    ids = torch.randint(converted.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    for name, model in (("original", original), ("converted", converted)):
        with torch.no_grad():
            model(ids[:, :256], cache=KernelCache(model) if name == "converted" else None)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model(ids, cache=KernelCache(model) if name == "converted" else None, logits_to_keep=1)
        print(f"== {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))


if __name__ == "__main__":
    main()
