"""Stop 55: a model's prefill of N seeded random tokens into a fresh cache, 3 untimed then 20 timed (median, min ms);
with a third argument also cProfile of 20 more (the oal functions by cumulative time, the callers of the small ops).
From the repository root:

    python docs/results/bench/model/stop55/scratch/pf64.py recipe 64 prof
"""
import cProfile, pstats, sys, time, torch
sys.path.insert(0, "benchmarks")
from prefill_peak import build
from oal.models import KernelCache
torch.set_num_threads(2)
name = sys.argv[1]; n = int(sys.argv[2])
model = build(name, "fp32")
ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
def once():
    with torch.no_grad():
        model(ids, cache=KernelCache(model), logits_to_keep=1)
for _ in range(3): once()
ts = []
for _ in range(20):
    t = time.perf_counter(); once(); ts.append(time.perf_counter() - t)
ts.sort(); print(name, "median ms", 1000 * ts[10], "min", 1000 * ts[0])
if len(sys.argv) > 3:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(20): once()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(35)
    st = pstats.Stats(pr); st.sort_stats("cumtime").print_stats("oal", 45)
    st.print_callers("isfinite|amax|amin|torch.cat|gather|new_zeros")
