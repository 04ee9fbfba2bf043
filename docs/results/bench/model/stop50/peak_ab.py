import json, sys
from dataclasses import replace
from oal.bench.decode import DecodeConfig, run_point_subprocess
base = DecodeConfig(converted="docs/results/conversion/model", steps=2, warmup=1, threads=2)
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for pw in (0, 64):
        for m in ("original", "converted"):
            p = run_point_subprocess(m, 1024, replace(base, prompt_warmup=pw))
            print(json.dumps({"round": r, "prompt_warmup": pw, "method": m, **{k: round(p[k], 1) for k in ("peak_rss_mb", "heap_kept_mb", "load_peak_rss_mb", "prefill_s")}}), flush=True)
