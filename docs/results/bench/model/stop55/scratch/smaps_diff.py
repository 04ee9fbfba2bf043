"""Stop 55: resident pages per mapped file after a 1k prefill (fresh process per model, original then plain OAL):
the differences above 0.05 MB, VmHWM of each, the modules only the converted process imported.

    python docs/results/bench/model/stop55/scratch/smaps_diff.py
"""
"""Per-file resident pages after a 1k prefill, original vs plain, each in a fresh process."""
import json, subprocess, sys, collections

def point(name):
    import torch
    sys.path.insert(0, "benchmarks")
    from prefill_peak import build
    from oal.models import KernelCache
    from oal.models.prefill import heap_released_before_output
    torch.set_num_threads(2)
    model = build(name, "fp32")
    ids = torch.randint(model.config.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(0))
    ctl = heap_released_before_output(model) if name == "original" else None
    with torch.no_grad():
        if ctl is not None:
            with ctl:
                model(ids, cache=KernelCache(model), logits_to_keep=1)
        else:
            model(ids, cache=KernelCache(model), logits_to_keep=1)
    files = collections.Counter()
    cur = None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:
            cur = parts[5] if len(parts) > 5 else "[anon]"
        elif parts[0] == "Rss:":
            files[cur] += int(parts[1])
    hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
    print(json.dumps({"files": files, "hwm": hwm, "modules": sorted(sys.modules)}))

if len(sys.argv) > 1 and sys.argv[1] == "--point":
    point(sys.argv[2]); sys.exit()
res = {}
for name in ("original", "plain"):
    out = subprocess.run([sys.executable, __file__, "--point", name], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    res[name] = json.loads(out)
o, p = res["original"], res["plain"]
print("hwm", o["hwm"]/1024, p["hwm"]/1024)
keys = set(o["files"]) | set(p["files"])
diffs = sorted(((p["files"].get(k,0)-o["files"].get(k,0))/1024, k) for k in keys)
tot = 0
for d, k in diffs:
    if abs(d) > 0.05:
        print(f"{d:+8.2f} MB  {k}  (orig {o['files'].get(k,0)/1024:.1f})")
    tot += d
print("total", tot)
extra = sorted(set(p["modules"]) - set(o["modules"]))
print(len(extra), "modules only in plain:", [m for m in extra if "." not in m or m.count(".") < 2][:80])
