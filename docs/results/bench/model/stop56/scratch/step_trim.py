"""Stop 56: decode steps after an N-token prompt with the heap release after a step that regrew a cache buffer
(``every``: as committed), never (``never``: oal.models.prefill._releases_after_step patched to False) or the
original model (``original``); optionally after ``warm`` prompts of W tokens that leave a fragmented heap (as the
demo's quality stages do). Prints the median step ms, the trims' count and total ms, and VmHWM / VmRSS. From the root:

    python docs/results/bench/model/stop56/scratch/step_trim.py every 1024 200 [W K [quality]]
"""
import json, os, statistics, sys, time, torch
sys.path.insert(0, "benchmarks")
from prefill_peak import build
import oal.models.prefill as prefill
from oal.models import KernelCache
torch.set_num_threads(2)
variant, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
W, K = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (0, 0)
frag = len(sys.argv) > 6 and sys.argv[6] == "quality"  # the demo's quality stages, shortened, on this model first
model = build("original" if variant == "original" else "recipe", "fp32")
if variant == "never":
    prefill._releases_after_step = lambda model, source: False
import oal.kernels.kept as kept
if "STEP_BYTES" in os.environ:  # the release threshold (kept.STEP_RELEASE_BYTES; 1: after every step that regrew)
    kept.STEP_RELEASE_BYTES = int(os.environ["STEP_BYTES"])
regrown = [0]
real_note = kept.note_regrown
def note(nbytes):
    regrown[0] += nbytes; real_note(nbytes)
kept.note_regrown = note
trims = []
real = prefill.release_freed_heap
def timed():
    t = time.perf_counter(); real(); trims.append(1e3 * (time.perf_counter() - t)); return True
prefill.release_freed_heap = timed
def vm():
    d = dict(l.split(":", 1) for l in open("/proc/self/status"))
    return {k: int(d[k].split()[0]) / 1024 for k in ("VmHWM", "VmRSS")}
with torch.no_grad():
    for i in range(K):  # earlier prompts of other lengths, their caches dropped
        model(torch.randint(49152, (1, W), generator=torch.Generator().manual_seed(100 + i)), cache=KernelCache(model), logits_to_keep=0)
    if frag:
        from oal.demo import run as demo
        from oal.models import load_tokenizer
        cfg = demo.DemoConfig(ppl_blocks=2, trials=2, data_dir="/work/shared/data", max_new_tokens=20)
        tok = load_tokenizer("smollm2-135m")
        demo._perplexities(model, tok, cfg); demo._passkey(model, tok, cfg); demo._continuations(model, tok, cfg)
    ids = torch.randint(49152, (1, n), generator=torch.Generator().manual_seed(0))
    cache = KernelCache(model)
    tok = model(ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    after_prompt = vm(); trims.clear(); regrown[0] = 0
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        tok = model(tok, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        ts.append(1e3 * (time.perf_counter() - t))
print(json.dumps({"variant": variant, "n": n, "steps": steps, "warm": [W, K], "quality": frag, "step_ms": round(statistics.median(ts), 2),
                  "threshold": kept.STEP_RELEASE_BYTES, "regrown_mb_per_step": round(regrown[0] / steps / 2**20, 3), "trims": len(trims), "trim_ms_total": round(sum(trims), 1), "trim_ms_median": round(statistics.median(trims), 2) if trims else 0,
                  "after_prompt": after_prompt, "end": vm()}))
