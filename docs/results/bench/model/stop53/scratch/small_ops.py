"""Stop 53: the small torch operations of a converted model's prompt (everything but GEMMs, SDPA and the fused
kernels), with where they are called from: torch.profiler with Python stacks over one prompt into a KernelCache
after a warm-up prompt, op totals grouped by the innermost frames in src/oal.

    python docs/results/bench/model/stop53/scratch/small_ops.py plain 1024
"""

import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from oal.bench.decode import DecodeConfig, build_model
from oal.models import KernelCache

BIG = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::linear",
       "aten::matmul", "aten::scaled_dot_product_attention"}


def under_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def main() -> None:
    which, n = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(2)
    config = DecodeConfig(converted=None if which in ("plain", "original") else which, kernel="oal", layers="3-26")
    model = build_model("original" if which == "original" else "converted", config)
    ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    cache = (lambda: None) if which == "original" else (lambda: KernelCache(model))
    with torch.no_grad():
        model(ids[:, :256], cache=cache())
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            model(ids, cache=cache(), logits_to_keep=1)
    by_site: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    total = 0.0
    for event in prof.events():
        if event.name in BIG or not event.name.startswith("aten::") or under_aten(event):
            continue  # outermost small aten ops only (their children are inside their time)
        frames = [f for f in event.stack if "src/oal" in f or "transformers" in f]
        site = frames[0].split("site-packages/")[-1].split("src/")[-1] if frames else "?"
        by_site[f"{event.name} @ {site}"][0] += event.cpu_time_total / 1e3
        by_site[f"{event.name} @ {site}"][1] += 1
        total += event.cpu_time_total / 1e3
    print(f"{which} n={n}: top-level small aten ops {total:.1f} ms")
    for key, (ms, count) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"{ms:9.1f} ms {count:6d}  {key}")


if __name__ == "__main__":
    main()
