# The recipe's 1k fp32 prompt (after the reserve, 773b7f0) with its MLPs run three ways, against the original: each
# point its own process (oal.bench.decode.run_point, as switch_ab.py), rounds alternating the order.
#   pieces: the default (512-row pieces, the output allocated after the first piece)
#   out_first: the output allocated before the first piece
#   one_call: no pieces (the original's 1024-row call)
#   python mlp_ab.py ROUNDS N [STEPS]
import json, subprocess, sys

if sys.argv[1] == "--child":
    variant, method, n, steps = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    import contextlib
    import oal.models.prefill as prefill
    if variant == "one_call":
        prefill.mlp_in_pieces = lambda model, rows: contextlib.nullcontext()
    if variant == "out_first":
        def _in_pieces(forward, rows, x, *args, **kwargs):
            n = x.shape[-2] if x.dim() >= 2 else 0
            if n <= rows or args or kwargs:
                return forward(x, *args, **kwargs)
            out = x.new_empty(*x.shape[:-2], n, forward(x[..., :0, :]).shape[-1])
            for start in range(0, n, rows):
                out[..., start : start + rows, :] = forward(x[..., start : start + rows, :])
            return out
        prefill._in_pieces = _in_pieces
    from oal.bench.decode import DecodeConfig, run_point
    cfg = DecodeConfig(converted="docs/results/conversion/model", steps=steps, warmup=2, threads=2)
    print(json.dumps(run_point(method, n, cfg)))
    sys.exit(0)

rounds, n = int(sys.argv[1]), int(sys.argv[2])
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 16
variants = [("original", "pieces"), ("converted", "pieces"), ("converted", "out_first"), ("converted", "one_call")]
keep = ("peak_rss_mb", "heap_kept_mb", "prefill_s", "ms_per_token")
for r in range(rounds):
    for method, variant in (variants if r % 2 == 0 else variants[::-1]):
        cmd = [sys.executable, __file__, "--child", variant, method, str(n), str(steps)]
        p = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        name = "original" if method == "original" else f"converted {variant}"
        print(json.dumps({"round": r, "n": n, "model": name, **{k: round(p[k], 2) for k in keep}}), flush=True)
