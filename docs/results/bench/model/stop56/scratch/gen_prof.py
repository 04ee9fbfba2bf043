"""Stop 56: cProfile of transformers' generate (greedy, M new tokens after an N-token seeded random prompt, with an
attention mask, as benchmarks/generate_ab.py calls it) for one model, after one untimed generate; prints the total
and the functions by own time. From the root:

    python docs/results/bench/model/stop56/scratch/gen_prof.py recipe 64 41
"""
import cProfile, pstats, sys, time, torch
sys.path.insert(0, "benchmarks")
from prefill_peak import build
torch.set_num_threads(2)
name, n, M = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = build(name, "fp32")
ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
def gen():
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=M, min_new_tokens=M, do_sample=False)
with torch.no_grad():
    gen()
    t = time.perf_counter(); gen(); print(name, "generate s", round(time.perf_counter() - t, 3))
    pr = cProfile.Profile(); pr.enable(); gen(); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(60)
