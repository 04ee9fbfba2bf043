import sys, time, collections
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
torch.set_num_threads(2)
n = int(sys.argv[1]); rounds = int(sys.argv[2])
models = {name: build(name, "fp32") for name in ("original", "recipe")}
acc = collections.defaultdict(float); t0 = {}
for m in models.values():
    for i, layer in enumerate(m.model.layers):
        for part in ("self_attn", "mlp"):
            mod = getattr(layer, part)
            mod.register_forward_pre_hook(lambda mm, a, k=part: t0.__setitem__(k, time.perf_counter()))
            mod.register_forward_hook(lambda mm, a, o, k=part: acc.__setitem__(k, acc[k] + time.perf_counter() - t0[k]))
ids = torch.randint(49152, (1, n), generator=torch.Generator().manual_seed(0))
res = collections.defaultdict(list)
with torch.no_grad():
    for m in models.values():
        m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
    for r in range(rounds):
        for name in (("original", "recipe") if r % 2 == 0 else ("recipe", "original")):
            m = models[name]; acc.clear()
            t = time.perf_counter(); m(ids, cache=KernelCache(m), logits_to_keep=1); w = time.perf_counter() - t
            res[name].append((round(w, 3), round(acc["self_attn"], 3), round(acc["mlp"], 3)))
med = lambda xs: sorted(xs)[len(xs) // 2]
for name, rs in res.items():
    print(name, "median wall %.3f attn %.3f mlp %.3f" % tuple(med([r[j] for r in rs]) for j in range(3)), rs)
