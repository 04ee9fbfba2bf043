import sys, gc, ctypes
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
from oal.models.prefill import release_freed_heap
lib = ctypes.CDLL(None)
torch.set_num_threads(2)
m = build(sys.argv[1], "fp32")
ids = torch.randint(m.config.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
gc.collect(); release_freed_heap()
for i, layer in enumerate(m.model.layers):
    for j, part in enumerate(("self_attn", "mlp")):
        mod = getattr(layer, part)
        mod.register_forward_pre_hook(lambda mm, a, t=i * 10 + j * 2: (lib.trace_mark(t), None)[1])
        mod.register_forward_hook(lambda mm, a, o, t=i * 10 + j * 2 + 1: (lib.trace_mark(t), None)[1])
cache = KernelCache(m)
lib.trace_on(1)
with torch.no_grad():
    m(ids, cache=cache, logits_to_keep=1)
lib.trace_mark(9999)
lib.trace_on(0)
