"""Stop 56: resident pages per mapped file (and anonymous memory) after a 64-token prompt and 2 decode steps, each
model in a fresh process (the original, the recipe, plain OAL): VmHWM, the differences above 0.05 MB against the
original, the top-level modules only the converted process imported. From the root:

    python docs/results/bench/model/stop56/scratch/smaps_short.py [N]
"""
import collections, json, subprocess, sys

def point(name, n):
    import torch
    sys.path.insert(0, "benchmarks")
    from prefill_peak import build
    from oal.models import KernelCache
    torch.set_num_threads(2)
    model = build(name, "fp32")
    ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = KernelCache(model)
        tok = model(ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        for _ in range(2):
            tok = model(tok, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    files, cur = collections.Counter(), None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:
            cur = parts[5] if len(parts) > 5 else "[anon]"
        elif parts[0] == "Rss:":
            files[cur] += int(parts[1])
    hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
    print(json.dumps({"files": files, "hwm": hwm, "modules": sorted(sys.modules)}))

if len(sys.argv) > 1 and sys.argv[1] == "--point":
    point(sys.argv[2], int(sys.argv[3])); sys.exit()
n = sys.argv[1] if len(sys.argv) > 1 else "64"
res = {}
for name in ("original", "recipe", "plain"):
    out = subprocess.run([sys.executable, __file__, "--point", name, n], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    res[name] = json.loads(out)
o = res["original"]
for name in ("recipe", "plain"):
    p = res[name]
    print(f"== {name}: VmHWM {p['hwm'] / 1024:.1f} against {o['hwm'] / 1024:.1f} MB")
    keys = set(o["files"]) | set(p["files"])
    diffs = sorted(((p["files"].get(k, 0) - o["files"].get(k, 0)) / 1024, k) for k in keys)
    for d, k in diffs:
        if abs(d) > 0.05:
            print(f"{d:+8.2f} MB  {k}  (original {o['files'].get(k, 0) / 1024:.1f})")
    print(f"total {sum(d for d, _ in diffs):+.2f} MB")
    extra = sorted(set(p["modules"]) - set(o["modules"]))
    print(len(extra), "modules only here:", sorted({m.split('.')[0] + ('.' + m.split('.')[1] if m.count('.') else '') for m in extra})[:60])
