import sys, time
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
torch.set_num_threads(2)
m = build(sys.argv[1], sys.argv[3])
n = int(sys.argv[2])
ids = torch.randint(m.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
    ts = []
    for _ in range(int(sys.argv[4]) if len(sys.argv) > 4 else 3):
        t = time.perf_counter(); m(ids, cache=KernelCache(m), logits_to_keep=1); ts.append(round(time.perf_counter() - t, 3))
print(sys.argv[1:], ts)
