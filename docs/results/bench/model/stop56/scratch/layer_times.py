"""Stop 56: per-layer time of the attention and the MLP in a prompt of N seeded random tokens into a fresh cache, for
the original and a converted model (prefill_peak.build's names: recipe or plain) side by side (forward pre/post hooks; 2 untimed prompts, then R timed per model,
alternating). Prints per layer the medians in ms and the totals. From the root:

    python docs/results/bench/model/stop56/scratch/layer_times.py recipe 1024 6
"""
import statistics, sys, time, torch
sys.path.insert(0, "benchmarks")
from prefill_peak import build
from oal.models import KernelCache
torch.set_num_threads(2)
path, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
models = {"original": build("original", "fp32").eval(), "converted": build(path, "fp32").eval()}
times = {}
def hook(key):
    def pre(m, a, *kw):
        times.setdefault(key, []).append(-time.perf_counter())
    def post(m, a, o, *kw):
        times[key][-1] += time.perf_counter()
    return pre, post
for name, model in models.items():
    for i, layer in enumerate(model.model.layers):
        for part in ("self_attn", "mlp"):
            pre, post = hook((name, part, i))
            getattr(layer, part).register_forward_pre_hook(pre); getattr(layer, part).register_forward_hook(post)
ids = torch.randint(49152, (1, n), generator=torch.Generator().manual_seed(0))
total = {k: [] for k in models}
for r in range(rounds + 2):
    for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
        with torch.no_grad():
            t = time.perf_counter(); models[name](ids, cache=KernelCache(models[name]), logits_to_keep=1)
            if r >= 2: total[name].append(time.perf_counter() - t)
        if r < 2:
            for k in [k for k in times if k[0] == name]: times[k].clear()
med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
L = len(models["original"].model.layers)
print("layer  attn_orig attn_conv  mlp_orig mlp_conv")
for i in range(L):
    print(f"{i:5d} {med['original','self_attn',i]:9.1f} {med['converted','self_attn',i]:9.1f} {med['original','mlp',i]:9.1f} {med['converted','mlp',i]:8.1f}")
for part in ("self_attn", "mlp"):
    print(part, "sum ms", {name: round(sum(med[name, part, i] for i in range(L)), 1) for name in models})
print("prompt s median", {k: round(statistics.median(v), 3) for k, v in total.items()})
