# Plain OAL (layers 3-26) or the recipe with an fp32 one-call prompt's MLP in pieces of ROWS rows (the default: a
# chunk's, 512) against the original: each point its own process (oal.bench.decode.run_point: untimed 64-token first
# prompt, VmHWM reset, the timed prompt, 2 + STEPS greedy steps), rounds alternating the order. From the repository root.
#   python rows_ab.py plain|recipe ROUNDS N[,N] ROWS[,ROWS] [STEPS]
#   python rows_ab.py --child MODEL METHOD N STEPS ROWS   (one point; prints its JSON)
import json, subprocess, sys

if sys.argv[1] == "--child":
    model, method, n, steps, rows = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    if rows:
        import oal.models.prefill as prefill
        pieces = prefill.mlp_in_pieces
        prefill.mlp_in_pieces = lambda model, chunk: pieces(model, rows)
    from oal.bench.decode import DecodeConfig, run_point
    conv = "docs/results/conversion/model" if model == "recipe" else None
    cfg = DecodeConfig(converted=conv, kernel="oal", layers="3-26", steps=steps, warmup=2, threads=2)
    print(json.dumps(run_point(method, n, cfg)))
    sys.exit(0)

model, rounds, sizes = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
rows = [int(x) for x in sys.argv[4].split(",")]
steps = int(sys.argv[5]) if len(sys.argv) > 5 else 16
variants = [("original", 0)] + [("converted", r) for r in rows]
keep = ("peak_rss_mb", "run_peak_rss_mb", "heap_kept_mb", "decode_peak_mb", "prefill_s", "ms_per_token", "cache_mb")
for r in range(rounds):
    for n in sizes:
        for method, piece in (variants if r % 2 == 0 else variants[::-1]):
            cmd = [sys.executable, __file__, "--child", model, method, str(n), str(steps), str(piece)]
            p = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            name = method if method == "original" else f"{model}+rows{piece}"
            print(json.dumps({"round": r, "n": n, "model": name, **{k: round(p[k], 2) for k in keep if p.get(k) is not None}}), flush=True)
