"""Stop 56: stop 50's peak_ab.py for plain OAL (layers 3-26, synthetic groups) instead of the committed recipe: each
point its own process (`oal bench decode`'s point: a 1k prompt, 2 decode steps), fresh and after a 64-token prompt,
the original as users run it. From the root:

    python docs/results/bench/model/stop56/scratch/peak_ab_plain.py 4 > docs/results/bench/model/stop56/peak_ab_plain_zen5.jsonl
"""
import json, sys
from dataclasses import replace
from oal.bench.decode import DecodeConfig, run_point_subprocess
base = DecodeConfig(kernel="oal", layers="3-26", steps=2, warmup=1, threads=2)
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for pw in (0, 64):
        for m in ("original", "converted"):
            p = run_point_subprocess(m, 1024, replace(base, prompt_warmup=pw))
            print(json.dumps({"round": r, "prompt_warmup": pw, "method": m, **{k: round(p[k], 1) for k in ("peak_rss_mb", "heap_kept_mb", "load_peak_rss_mb", "prefill_s")}}), flush=True)
