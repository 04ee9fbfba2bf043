"""Stop 54: one model's decode steps right after an N-token prompt in a fresh process (ms per step, in order);
NOREL=1 turns the prompt's heap release off (config.oal_release_prompt_heap = False).

    python docs/results/bench/model/stop54/scratch/dec8k.py docs/results/conversion/model 8192 48
    NOREL=1 python docs/results/bench/model/stop54/scratch/dec8k.py docs/results/conversion/model 8192 40
"""
import torch, time, sys, gc
from oal.models import load_model, KernelCache
torch.set_num_threads(2)
m = load_model(sys.argv[1]).eval()
import os
if os.environ.get("NOREL"): m.config.oal_release_prompt_heap = False
n = int(sys.argv[2])
ids = torch.randint(m.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    cache = KernelCache(m)
    t = time.perf_counter(); tok = m(ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1); print("prefill", round(time.perf_counter()-t, 2))
    ts = []
    for i in range(int(sys.argv[3])):
        t = time.perf_counter(); tok = m(tok, cache=cache).logits[:, -1:].argmax(-1); ts.append(round(1e3*(time.perf_counter()-t), 1))
print(ts)
