"""Stop 56: cProfile of S greedy decode steps after an N-token prompt (5 untimed first): the oal functions by own
time and by cumulative time. From the root:

    python docs/results/bench/model/stop56/scratch/dec_prof.py recipe 64 60
"""
import cProfile, pstats, sys, time, torch
sys.path.insert(0, "benchmarks")
from prefill_peak import build
from oal.models import KernelCache
torch.set_num_threads(2)
name, n, S = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = build(name, "fp32")
ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    cache = KernelCache(model)
    tok = model(ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    for _ in range(5):
        tok = model(tok, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(S):
        tok = model(tok, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    pr.disable()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(40)
st.sort_stats("cumtime").print_stats("oal/", 50)
