# The converted model with its prompt's cache buffers reserved before the first layer (reserved_for_prompt) or not, against the original:
# each point its own process (oal.bench.decode.run_point: untimed 64-token first prompt, VmHWM reset, the timed prompt,
# 2 + STEPS greedy steps), rounds alternating the order.
#   python reserve_ab.py ROUNDS N[,N] [STEPS]        (parent)
#   python reserve_ab.py --child METHOD N STEPS  RESERVE   (one point; prints its JSON)
import json, subprocess, sys
from dataclasses import replace

if sys.argv[1] == "--child":
    method, n, steps, on = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
    import contextlib
    import oal.models.prefill as prefill
    if not on:
        prefill.reserved_for_prompt = lambda *a: contextlib.nullcontext()
    from oal.bench.decode import DecodeConfig, run_point
    cfg = DecodeConfig(converted="docs/results/conversion/model", steps=steps, warmup=2, threads=2)
    print(json.dumps(run_point(method, n, cfg)))
    sys.exit(0)

rounds, sizes = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 16
variants = [("original", "0"), ("converted", "0"), ("converted", "1")]
for r in range(rounds):
    for n in sizes:
        for method, on in (variants if r % 2 == 0 else variants[::-1]):
            out = subprocess.run([sys.executable, __file__, "--child", method, str(n), str(steps), on],
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            p = json.loads(out)
            keep = ("peak_rss_mb", "run_peak_rss_mb", "heap_kept_mb", "decode_peak_mb", "prefill_s", "ms_per_token", "cache_mb")
            print(json.dumps({"round": r, "n": n, "model": method + ("+reserve" if on == "1" else ""),
                              **{k: round(p[k], 2) for k in keep if p.get(k) is not None}}), flush=True)
