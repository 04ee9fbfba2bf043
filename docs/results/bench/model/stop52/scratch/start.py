# Resident memory after the load and a 64-token first prompt, original or plain OAL (python start.py original|plain):
# mallinfo2 snapshots, parameter / buffer / all-tensor bytes, then per-mapping RSS from /proc/self/smaps into smaps_{name}.json
import sys, gc, json, torch
sys.path.insert(0, "benchmarks")
from prefill_peak import build
from prefill_trace import snapshot
from oal.models import KernelCache
from oal.models.prefill import release_freed_heap
torch.set_num_threads(2)
name = sys.argv[1]
s0 = snapshot("before")
model = build(name, "fp32")
s1 = snapshot("built")
def tensors():
    seen = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                st = o.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:
            pass
    return sum(seen.values()) / 2**20, len(seen)
p = sum(t.numel() * t.element_size() for t in model.parameters()) / 2**20
b = sum(t.numel() * t.element_size() for t in model.buffers()) / 2**20
ids = torch.randint(model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    model(ids, cache=KernelCache(model), logits_to_keep=1)
gc.collect(); release_freed_heap()
s2 = snapshot("after_first")
print(json.dumps({"name": name, "params_mb": round(p, 2), "buffers_mb": round(b, 2), "tensors": tensors(), "s": [s0, s1, s2]}))
import collections
mods = collections.Counter(type(m).__name__ for m in model.modules())
print(dict(mods))
print(len(sys.modules))
import re, collections
rss = collections.Counter()
cur = None
for line in open("/proc/self/smaps"):
    if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
        parts = line.split()
        cur = parts[5] if len(parts) > 5 else "[anon]"
    elif line.startswith("Rss:"):
        rss[cur] += int(line.split()[1])
json.dump({k: v for k, v in rss.items()}, open(f"docs/results/bench/model/stop52/scratch/smaps_{name}.json", "w"))
