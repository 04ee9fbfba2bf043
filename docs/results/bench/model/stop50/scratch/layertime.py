import sys, time, collections
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
torch.set_num_threads(2)
m = build(sys.argv[1], sys.argv[3] if len(sys.argv) > 3 else "fp32")
n = int(sys.argv[2])
ids = torch.randint(m.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
acc = collections.defaultdict(list); t0 = {}
for i, layer in enumerate(m.model.layers):
    for part in ("self_attn", "mlp"):
        mod = getattr(layer, part)
        mod.register_forward_pre_hook(lambda mm, a, k=(i, part): t0.__setitem__(k, time.perf_counter()))
        mod.register_forward_hook(lambda mm, a, o, k=(i, part): acc[k].append(time.perf_counter() - t0[k]))
with torch.no_grad():
    m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
    acc.clear()
    walls = []
    for _ in range(2):
        t = time.perf_counter(); m(ids, cache=KernelCache(m), logits_to_keep=1); walls.append(time.perf_counter() - t)
attn = [sum(acc[(i, "self_attn")]) / 2 * 1e3 for i in range(30)]
mlp = [sum(acc[(i, "mlp")]) / 2 * 1e3 for i in range(30)]
print(sys.argv[1], "walls", [round(w, 3) for w in walls], "attn sum %.1f mlp sum %.1f" % (sum(attn), sum(mlp)))
print("attn", " ".join(f"{x:.1f}" for x in attn))
print("mlp ", " ".join(f"{x:.1f}" for x in mlp))
