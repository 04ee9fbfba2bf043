"""Stop 54: prefill of the original and the recipe (heap release on and off) side by side in one process, one
untimed round first, the order reversed every round; medians and ratios.

    python docs/results/bench/model/stop54/scratch/pf1k.py 1024 8
"""
import torch, time, sys, gc, json, statistics
from oal.models import load_model, KernelCache
torch.set_num_threads(2)
o = load_model("smollm2-135m").eval(); c = load_model("docs/results/conversion/model").eval()
n, rounds = int(sys.argv[1]), int(sys.argv[2])
ids = torch.randint(c.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
arms = [("original", o, None), ("rel", c, True), ("norel", c, False)]
res = {a[0]: [] for a in arms}
with torch.no_grad():
    for r in range(rounds + 1):
        order = arms if r % 2 == 0 else arms[::-1]
        for name, m, rel in order:
            if rel is not None: m.config.oal_release_prompt_heap = rel
            gc.collect(); cache = KernelCache(m)
            t = time.perf_counter(); m(ids, cache=cache, logits_to_keep=1); dt = time.perf_counter() - t
            if r: res[name].append(dt)
            del cache
for k, v in res.items(): print(k, round(statistics.median(v), 3), [round(x, 2) for x in v])
print("rel/orig", round(statistics.median(res["rel"]) / statistics.median(res["original"]), 3), "norel/orig", round(statistics.median(res["norel"]) / statistics.median(res["original"]), 3))
