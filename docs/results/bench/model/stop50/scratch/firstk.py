import sys, time
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
torch.set_num_threads(2)
m = build(sys.argv[1], "fp32")
ids = torch.randint(49152, (1, 1024), generator=torch.Generator().manual_seed(0))
ts = []
with torch.no_grad():
    m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
    for _ in range(3):
        t = time.perf_counter(); m(ids, cache=KernelCache(m), logits_to_keep=1); ts.append(round(time.perf_counter() - t, 3))
print(sys.argv[1], ts)
