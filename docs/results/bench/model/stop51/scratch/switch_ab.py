# The converted model with one of this stop's memory changes on or off, against the original: each point its own
# process (oal.bench.decode.run_point: untimed 64-token first prompt, VmHWM reset, the timed prompt, 2 + STEPS greedy
# steps), rounds alternating the order. Run from the repository root.
#   python switch_ab.py reserve ROUNDS N[,N] [STEPS]   the prompt's cache buffers reserved before its first layer
#                                                      (oal.models.state_cache.reserved_for_prompt, 46ce94b) or not
#   python switch_ab.py mapped ROUNDS N[,N] [STEPS]    every cache buffer in its own anonymous mapping or in malloc's
#                                                      heap (needs cache_buffer.diff applied to eab47d8: not kept)
#   python switch_ab.py --child SWITCH METHOD N STEPS ON   (one point; prints its JSON)
import json, subprocess, sys

if sys.argv[1] == "--child":
    switch, method, n, steps, on = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
    if not on and switch == "reserve":
        import contextlib
        import oal.models.prefill as prefill
        prefill.reserved_for_prompt = lambda *a: contextlib.nullcontext()
    if not on and switch == "mapped":
        from oal.kernels import base
        base.MAPPED_MIN_BYTES = 1 << 62
    from oal.bench.decode import DecodeConfig, run_point
    cfg = DecodeConfig(converted="docs/results/conversion/model", steps=steps, warmup=2, threads=2)
    print(json.dumps(run_point(method, n, cfg)))
    sys.exit(0)

switch, rounds, sizes = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 16
variants = [("original", "0"), ("converted", "0"), ("converted", "1")]
keep = ("peak_rss_mb", "run_peak_rss_mb", "heap_kept_mb", "decode_peak_mb", "prefill_s", "ms_per_token", "cache_mb")
for r in range(rounds):
    for n in sizes:
        for method, on in (variants if r % 2 == 0 else variants[::-1]):
            cmd = [sys.executable, __file__, "--child", switch, method, str(n), str(steps), on]
            p = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            print(json.dumps({"round": r, "n": n, "model": method + (f"+{switch}" if on == "1" else ""),
                              **{k: round(p[k], 2) for k in keep if p.get(k) is not None}}), flush=True)
