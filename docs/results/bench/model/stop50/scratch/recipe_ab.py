# The recipe's fp32 prompt in one process, two settings alternating round by round: wall, attention and MLP seconds.
#   python recipe_ab.py amx 1024 8     exact heads' prompt on AMX tiles (OAL_CPU_AMX=1) or the fused AVX-512 kernel (0)
#   python recipe_ab.py chunk 1024 8   config.oal_prefill_chunk 512 (one call, MLP pieces of 512 rows) or 0 (no pieces)
import sys, time, collections, os
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
torch.set_num_threads(2)
toggle, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = build("recipe", "fp32")
values = {"amx": ("1", "0"), "chunk": ("512", "0")}[toggle]
def apply(v):
    if toggle == "amx":
        os.environ["OAL_CPU_AMX"] = v
    else:
        m.config.oal_prefill_chunk = int(v)
ids = torch.randint(m.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
acc = collections.defaultdict(float); t0 = {}
for i, layer in enumerate(m.model.layers):
    for part in ("self_attn", "mlp"):
        mod = getattr(layer, part)
        mod.register_forward_pre_hook(lambda mm, a, k=part: t0.__setitem__(k, time.perf_counter()))
        mod.register_forward_hook(lambda mm, a, o, k=part: acc.__setitem__(k, acc[k] + time.perf_counter() - t0[k]))
res = collections.defaultdict(list)
with torch.no_grad():
    for v in values:
        apply(v)
        m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
    for r in range(rounds):
        for v in (values if r % 2 == 0 else values[::-1]):
            apply(v)
            acc.clear()
            t = time.perf_counter(); m(ids, cache=KernelCache(m), logits_to_keep=1); w = time.perf_counter() - t
            res[v].append((round(w, 3), round(acc["self_attn"], 3), round(acc["mlp"], 3)))
med = lambda xs: sorted(xs)[len(xs) // 2]
for v, rs in res.items():
    print(toggle, v, "median wall %.3f attn %.3f mlp %.3f" % tuple(med([r[j] for r in rs]) for j in range(3)), rs)
