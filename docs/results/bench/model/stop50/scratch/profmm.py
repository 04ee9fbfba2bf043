import sys, collections
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
torch.set_num_threads(2)
m = build(sys.argv[1], sys.argv[3])
n = int(sys.argv[2])
ids = torch.randint(m.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
from torch.profiler import profile, ProfilerActivity
with torch.no_grad():
    m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        m(ids, cache=KernelCache(m), logits_to_keep=1)
agg = collections.defaultdict(lambda: [0, 0.0])
for e in prof.events():
    if e.name in ("aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::copy_", "aten::mul"):
        key = (e.name, str(e.input_shapes)[:90], str(getattr(e, "input_dtypes", ""))[:40] if hasattr(e, "input_dtypes") else "")
        agg[key][0] += 1; agg[key][1] += e.self_cpu_time_total / 1e3
for k, (c, t) in sorted(agg.items(), key=lambda x: -x[1][1])[:25]:
    print(f"{t:8.1f} ms {c:5d} {k}")
