# cProfile of three 1k prompts after a warm one: python cprof.py original|recipe N   (run from the repository root)
import sys, cProfile, pstats
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
torch.set_num_threads(2)
m = build(sys.argv[1], "fp32")
n = int(sys.argv[2])
ids = torch.randint(49152, (1, n), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
    m(ids, cache=KernelCache(m), logits_to_keep=1)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(3):
        m(ids, cache=KernelCache(m), logits_to_keep=1)
    pr.disable()
st = pstats.Stats(pr); st.sort_stats("cumulative").print_stats(45)
