"""Stop 54: the recipe's N-token prompt and its first decode steps with and without the prompt's heap release,
in one process, the order reversed every round (sums of steps 1-8, 9-16, the rest).

    python docs/results/bench/model/stop54/scratch/relab.py 8192 3 24
"""
import torch, time, sys, gc, json, statistics
from oal.models import load_model, KernelCache
torch.set_num_threads(2)
m = load_model("docs/results/conversion/model").eval()
n, rounds, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ids = torch.randint(m.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    for r in range(rounds):
        for rel in ((True, False) if r % 2 == 0 else (False, True)):
            m.config.oal_release_prompt_heap = rel
            gc.collect()
            cache = KernelCache(m)
            t = time.perf_counter(); tok = m(ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1); pf = time.perf_counter()-t
            ts = []
            for i in range(steps):
                t = time.perf_counter(); tok = m(tok, cache=cache).logits[:, -1:].argmax(-1); ts.append(1e3*(time.perf_counter()-t))
            print(json.dumps({"round": r, "release": rel, "prefill_s": round(pf, 2), "first8_ms": round(sum(ts[:8]), 1), "next8_ms": round(sum(ts[8:16]), 1), "last_ms": round(sum(ts[16:]), 1), "steps": [round(x) for x in ts]}), flush=True)
            del cache
