"""Stop 56: VmHWM, VmRSS and glibc's heap (mallinfo2) after the imports, the model's build, a 64-token prompt and 2
decode steps, one model per process. From the root: [MIN_TOKENS=1] python docs/results/bench/model/stop56/scratch/load_stages.py recipe
(MIN_TOKENS: oal.models.prefill.RELEASE_MIN_TOKENS patched, 1: a 64-token prompt releases the freed heap too)
"""
import ctypes, json, sys, torch
sys.path.insert(0, "benchmarks")
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None); libc.mallinfo2.restype = MI
def st(label):
    d = dict(l.split(":", 1) for l in open("/proc/self/status"))
    m = libc.mallinfo2()
    return {"at": label, "hwm": int(d["VmHWM"].split()[0]) / 1024, "rss": int(d["VmRSS"].split()[0]) / 1024, "arena": round(m.arena / 2**20, 1), "live": round(m.uordblks / 2**20, 1), "free": round(m.fordblks / 2**20, 1), "mmap": round(m.hblkhd / 2**20, 1)}
from prefill_peak import build
from oal.models import KernelCache
import os, oal.models.prefill as _pf
if os.environ.get("MIN_TOKENS"): _pf.RELEASE_MIN_TOKENS = int(os.environ["MIN_TOKENS"])
torch.set_num_threads(2)
name = sys.argv[1]
out = [st("import")]
model = build(name, "fp32"); out.append(st("built"))
ids = torch.randint(model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    c = KernelCache(model); tok = model(ids, cache=c, logits_to_keep=1).logits[:, -1:].argmax(-1); out.append(st("prompt 64"))
    for _ in range(2): tok = model(tok, cache=c, logits_to_keep=1).logits[:, -1:].argmax(-1)
    out.append(st("2 steps"))
print(json.dumps({"model": name, "stages": out}))
