import sys, gc, json
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
from oal.models.prefill import release_freed_heap
torch.set_num_threads(2)
def maps():
    cur=None; tot={}
    for line in open("/proc/self/smaps"):
        parts=line.split()
        if "-" in parts[0] and len(parts)>=5 and not parts[0].endswith(":"):
            cur = parts[5] if len(parts)>5 else "[anon]"
        elif parts[0]=="Rss:":
            tot[cur]=tot.get(cur,0)+int(parts[1])
    return tot
out={}
m = build(sys.argv[1], "fp32")
gc.collect(); release_freed_heap(); out["load"]=maps()
ids = torch.randint(m.config.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
gc.collect(); release_freed_heap(); out["first"]=maps()
json.dump(out, open(f"/tmp/s50/maps_{sys.argv[1]}.json","w"))
