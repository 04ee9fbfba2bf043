"""Stop 55: per decode step after an N-token prompt, the time inside the "oal" attention function and inside the
fused C++ decode step (60 greedy steps after 5 untimed).

    python docs/results/bench/model/stop55/scratch/dec_attn.py recipe 64
"""
import sys, time, torch
sys.path.insert(0, "benchmarks")
from prefill_peak import build
from oal.models import KernelCache
import oal.models.hooks as hooks
from oal.ops.quadratic import cpu as cpu_kernel
from transformers import AttentionInterface
torch.set_num_threads(2)
name = sys.argv[1]; n = int(sys.argv[2])
model = build(name, "fp32")
T = {"attn": 0.0, "cpp": 0.0}
real = hooks.oal_attention_forward
def wrapped(*a, **k):
    t = time.perf_counter()
    try:
        return real(*a, **k)
    finally:
        T["attn"] += time.perf_counter() - t
AttentionInterface.register("oal", wrapped)
ext = cpu_kernel.load("decode")
real_step = ext.decode_step
def step_wrapped(*a, **k):
    t = time.perf_counter()
    try:
        return real_step(*a, **k)
    finally:
        T["cpp"] += time.perf_counter() - t
ext.decode_step = step_wrapped
ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    cache = KernelCache(model)
    tok = model(ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    for _ in range(5):
        tok = model(tok, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    T["attn"] = T["cpp"] = 0.0
    t0 = time.perf_counter()
    S = 60
    for _ in range(S):
        tok = model(tok, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    tot = time.perf_counter() - t0
print(name, n, f"step {1000*tot/S:.1f} ms, attention {1000*T['attn']/S:.2f} ms, of which C++ decode {1000*T['cpp']/S:.2f} ms")
