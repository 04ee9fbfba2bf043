"""Stop 56: per decode step after an N-token prompt, the time of the attention modules, the MLPs and the whole step
for the original and a converted model (forward pre/post hooks on every layer's self_attn and mlp; each model its
own prompt and cache, 5 untimed steps, then S steps taken in turn, the order reversed every step). From the root:

    python docs/results/bench/model/stop56/scratch/dec_layer_times.py recipe 64 100
"""
import statistics, sys, time, torch
sys.path.insert(0, "benchmarks")
from prefill_peak import build
from oal.models import KernelCache
torch.set_num_threads(2)
path, n, S = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
models = {"original": build("original", "fp32").eval(), "converted": build(path, "fp32").eval()}
acc = {}
def hooks(key):
    t0 = [0.0]
    def pre(m, a): t0[0] = time.perf_counter()
    def post(m, a, o): acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0[0]
    return pre, post
for name, model in models.items():
    for layer in model.model.layers:
        for part in ("self_attn", "mlp"):
            pre, post = hooks((name, part))
            getattr(layer, part).register_forward_pre_hook(pre); getattr(layer, part).register_forward_hook(post)
ids = torch.randint(49152, (1, n), generator=torch.Generator().manual_seed(0))
state, per = {}, {name: {"step": [], "self_attn": [], "mlp": []} for name in models}
with torch.no_grad():
    for name, model in models.items():
        cache = KernelCache(model)
        tok = model(ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        state[name] = (cache, tok)
    for i in range(5 + S):
        for name in (list(models) if i % 2 == 0 else list(models)[::-1]):
            cache, tok = state[name]
            acc.clear(); t = time.perf_counter()
            tok = models[name](tok, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
            dt = time.perf_counter() - t
            state[name] = (cache, tok)
            if i >= 5:
                per[name]["step"].append(1e3 * dt)
                for part in ("self_attn", "mlp"):
                    per[name][part].append(1e3 * acc[name, part])
for name in models:
    print(name, n, {k: round(statistics.median(v), 2) for k, v in per[name].items()})
