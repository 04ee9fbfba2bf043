import sys
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
from torch.profiler import profile, ProfilerActivity, record_function
torch.set_num_threads(2)
m = build("recipe", sys.argv[2])
L = int(sys.argv[1]); n = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
ctx = {}
mod = m.model.layers[L].self_attn
def pre(mm, a, kw):
    ctx["r"] = record_function("LAYER"); ctx["r"].__enter__()
def post(mm, a, kw, o):
    ctx["r"].__exit__(None, None, None)
mod.register_forward_pre_hook(pre, with_kwargs=True); mod.register_forward_hook(post, with_kwargs=True)
ids = torch.randint(49152, (1, n), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
    m(ids, cache=KernelCache(m), logits_to_keep=1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(int(sys.argv[4]) if len(sys.argv) > 4 else 3):
            m(ids, cache=KernelCache(m), logits_to_keep=1)
ev = prof.events()
layers = [e for e in ev if e.name == "LAYER"]
print("LAYER calls", len(layers), "avg ms", sum(e.cpu_time_total for e in layers) / len(layers) / 1e3)
import collections
agg = collections.defaultdict(lambda: [0, 0.0])
for e in ev:
    # events inside a LAYER interval on the main thread
    for l in layers:
        if e.time_range.start >= l.time_range.start and e.time_range.end <= l.time_range.end and e.name != "LAYER":
            agg[e.name][0] += 1; agg[e.name][1] += e.self_cpu_time_total / 1e3
            break
for k, (c, t) in sorted(agg.items(), key=lambda x: -x[1][1])[:18]:
    print(f"{t / len(layers):7.3f} ms/call {c // len(layers):4d} {k}")
