"""Stop 56: goal 6 at short contexts: the peak RSS of `oal bench decode`'s point (a prompt of N tokens into a fresh
cache after a 64-token one, 2 decode steps; each point its own process) for the original as users run it, the recipe
and plain OAL, round after round. From the root:

    python docs/results/bench/model/stop56/scratch/peak_short.py 64,256 3 > docs/results/bench/model/stop56/peak_short_zen5.jsonl
"""
import json, sys
from dataclasses import replace
from oal.bench.decode import DecodeConfig, run_point_subprocess
sizes, rounds = [int(s) for s in sys.argv[1].split(",")], int(sys.argv[2])
base = DecodeConfig(steps=2, warmup=1, threads=2)
configs = {"original": ("original", base), "recipe": ("converted", replace(base, converted="docs/results/conversion/model")),
           "plain": ("converted", replace(base, kernel="oal", layers="3-26"))}
for r in range(rounds):
    for n in sizes:
        for name, (method, config) in configs.items():
            p = run_point_subprocess(method, n, config)
            print(json.dumps({"round": r, "n": n, "model": name, **{k: round(p[k], 1) for k in ("peak_rss_mb", "heap_kept_mb", "load_peak_rss_mb", "prefill_s")}}), flush=True)
