# Tensors alive after the load and a 64-token first prompt that are neither parameters nor buffers, by shape
# (python extra.py original|plain)
import sys, gc, collections, torch, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")
from prefill_peak import build
from oal.models import KernelCache
from oal.models.prefill import release_freed_heap
torch.set_num_threads(2)
model = build(sys.argv[1], "fp32")
ids = torch.randint(model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    model(ids, cache=KernelCache(model), logits_to_keep=1)
gc.collect(); release_freed_heap()
known = {p.untyped_storage().data_ptr() for p in list(model.parameters()) + list(model.buffers())}
c = collections.Counter(); nb = collections.Counter(); ex = {}
for o in gc.get_objects():
    try:
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            st = o.untyped_storage()
            if st.data_ptr() in known: continue
            known.add(st.data_ptr())
            key = (tuple(o.shape), str(o.dtype))
            c[key] += 1; nb[key] += st.nbytes()
    except Exception: pass
tot = sum(nb.values())
print("extra MB", tot / 2**20)
for k, v in nb.most_common(15): print(k, c[k], round(v / 2**20, 3))
