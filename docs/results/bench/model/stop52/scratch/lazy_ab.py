# Plain OAL (layers 3-26) or the recipe with the state's query weights built only where a state is (stop 52, lazy)
# or by every prompt as before (eager), against the original: each point its own process
# (oal.bench.decode.run_point: untimed 64-token first prompt, VmHWM reset, the timed prompt, 2 + STEPS greedy
# steps), rounds alternating the order. Run from the repository root.
#   python lazy_ab.py plain|recipe ROUNDS N[,N] [STEPS]
#   python lazy_ab.py --child MODEL METHOD N STEPS LAZY   (one point; prints its JSON)
import json, subprocess, sys

if sys.argv[1] == "--child":
    model, method, n, steps, lazy = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
    if not lazy:
        from oal.kernels import decode
        prepare = decode.prepare_decode

        def eager(kernel, q, k, v, state=None):
            prepare(kernel, q, k, v, state)
            if decode._usable(kernel, q, k, v, any_length=True):
                decode._state_weights(kernel)

        decode.prepare_decode = eager
        import oal.models.hooks as hooks
        hooks.prepare_decode = eager
    from oal.bench.decode import DecodeConfig, run_point
    conv = "docs/results/conversion/model" if model == "recipe" else None
    cfg = DecodeConfig(converted=conv, kernel="oal", layers="3-26", steps=steps, warmup=2, threads=2)
    print(json.dumps(run_point(method, n, cfg)))
    sys.exit(0)

model, rounds, sizes = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 16
variants = [("original", "1"), ("converted", "0"), ("converted", "1")]
keep = ("peak_rss_mb", "run_peak_rss_mb", "heap_kept_mb", "decode_peak_mb", "prefill_s", "ms_per_token", "cache_mb")
for r in range(rounds):
    for n in sizes:
        for method, lazy in (variants if r % 2 == 0 else variants[::-1]):
            cmd = [sys.executable, __file__, "--child", model, method, str(n), str(steps), lazy]
            p = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            name = method if method == "original" else f"{model}+{'lazy' if lazy == '1' else 'eager'}"
            print(json.dumps({"round": r, "n": n, "model": name, **{k: round(p[k], 2) for k in keep if p.get(k) is not None}}), flush=True)
