import sys, time, gc, json
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
from oal.models.prefill import release_freed_heap
from oal.bench.devices import get_device
torch.set_num_threads(2)
dtype, n, chunks, rounds = sys.argv[1], int(sys.argv[2]), [int(c) for c in sys.argv[3].split(",")], int(sys.argv[4])
m = build("recipe", dtype)
ids = torch.randint(m.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
res = {c: [] for c in chunks}
with torch.no_grad():
    m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
    for r in range(rounds):
        for c in (chunks if r % 2 == 0 else chunks[::-1]):
            m.config.oal_prefill_chunk = c
            gc.collect(); release_freed_heap(); get_device("cpu").reset_peak()
            t = time.perf_counter(); m(ids, cache=KernelCache(m), logits_to_keep=1); dt = time.perf_counter() - t
            hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
            res[c].append((round(dt, 3), round(int(hwm) / 1024, 1)))
for c in chunks: print(json.dumps({"dtype": dtype, "n": n, "chunk": c, "runs": res[c]}))
