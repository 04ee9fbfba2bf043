"""Stop 56: the demo's 1k prefill rounds (oal.demo.run.speed, 8 rounds, both models) in one process before and after
the demo's quality stages (perplexity, passkey, continuations of both models, loaded and freed as run_demo does),
with the time of every malloc_trim the prompts call and glibc's heap (mallinfo2) before each phase. From the root:

    python docs/results/bench/model/stop56/scratch/demo_proc.py [quality|none] [release|norelease] [quiet|bar]

(bar: the speed phases with the demo's rich progress bar, whose refresh thread shares the 2 cores)
"""
import ctypes, gc, json, statistics, sys, time, torch
import oal.models.prefill as prefill
from oal.demo import run as demo

torch.set_num_threads(2)
mode = sys.argv[1] if len(sys.argv) > 1 else "quality"
release = (sys.argv[2] if len(sys.argv) > 2 else "release") == "release"
progress = (sys.argv[3] if len(sys.argv) > 3 else "quiet") == "bar"
trims = []
_orig = prefill.release_freed_heap
def timed():
    t = time.perf_counter(); r = _orig(); trims.append(1e3 * (time.perf_counter() - t)); return r
prefill.release_freed_heap = timed

class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None); libc.mallinfo2.restype = MI
def heap(label):
    m = libc.mallinfo2(); rss = int(open("/proc/self/statm").read().split()[1]) * 4096
    print(json.dumps({"at": label, "arena_mb": m.arena / 2**20, "free_mb": m.fordblks / 2**20, "free_chunks": m.ordblks,
                      "mmap_mb": m.hblkhd / 2**20, "rss_mb": rss / 2**20}), flush=True)

config = demo.DemoConfig(decode_lengths=(1024,), decode_steps=4, data_dir="/work/shared/data")
def load(name):
    model, tok = demo._load(name, config)
    if not release:
        model.config.oal_release_prompt_heap = False
    return model, tok

def speed(label):
    heap(f"before speed {label}")
    trims.clear()
    models = {name: load(name)[0] for name in demo.MODELS}
    r = demo.speed(models, config, progress=progress)["1024"]
    o, c = r["original"]["prefill_rounds"], r["converted"]["prefill_rounds"]
    print(json.dumps({"phase": label, "original": [round(x, 3) for x in o], "converted": [round(x, 3) for x in c],
                      "ratio_median": round(statistics.median(c) / statistics.median(o), 3),
                      "rounds": [round(x, 3) for x in r["ratios"]["prefill_rounds"]],
                      "trim_ms": [round(x, 1) for x in trims]}), flush=True)
    del models; gc.collect()

speed("first")
if mode == "quality":
    t = time.perf_counter()
    for name in demo.MODELS:
        model, tok = load(name)
        demo._perplexities(model, tok, config); demo._passkey(model, tok, config); demo._continuations(model, tok, config)
        del model, tok; gc.collect()
    print(json.dumps({"quality_s": round(time.perf_counter() - t, 1)}), flush=True)
speed("second")
heap("end")
