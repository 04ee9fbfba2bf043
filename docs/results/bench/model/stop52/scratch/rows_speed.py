# The 1k fp32 prompt's time with the MLP in 512- and 256-row pieces, side by side in one process: the original, plain
# OAL (layers 3-26) and the recipe, each prefilling the same seeded prompt into a fresh cache, the order reversed every
# round (after an untimed 64-token prompt per model). Run from the repository root:
#   python rows_speed.py ROUNDS [N]
import gc, json, statistics, sys, time
import torch
import oal.models.prefill as prefill
from oal.bench.decode import DecodeConfig, build_model
from oal.models import KernelCache

rounds, n = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1024
torch.set_num_threads(2)
pieces = prefill.mlp_in_pieces
rows = {"value": 512}
prefill.mlp_in_pieces = lambda model, chunk: pieces(model, rows["value"])
models = {
    "original": build_model("original", DecodeConfig()),
    "plain": build_model("converted", DecodeConfig(kernel="oal", layers="3-26")),
    "recipe": build_model("converted", DecodeConfig(converted="docs/results/conversion/model")),
}
gen = torch.Generator().manual_seed(0)
ids = torch.randint(49152, (1, n), generator=gen)
with torch.no_grad():
    for m in models.values():
        m(ids[:, :64], cache=KernelCache(m), logits_to_keep=1)
variants = [("original", 512), ("plain", 512), ("plain", 256), ("recipe", 512), ("recipe", 256)]
times = {}
for r in range(rounds):
    for name, piece in (variants if r % 2 == 0 else variants[::-1]):
        rows["value"] = piece
        m = models[name]
        cache = KernelCache(m)
        gc.collect()
        with torch.no_grad():
            t0 = time.perf_counter()
            m(ids, cache=cache, logits_to_keep=1)
            s = time.perf_counter() - t0
        del cache
        key = name if name == "original" else f"{name}+rows{piece}"
        times.setdefault(key, []).append(s)
        print(json.dumps({"round": r, "model": key, "n": n, "s": round(s, 3)}), flush=True)
orig = times["original"]
for key, secs in times.items():
    ratios = [o / s for o, s in zip(orig, secs)]
    print(json.dumps({"model": key, "median_s": round(statistics.median(secs), 3), "speedup": round(statistics.median(orig) / statistics.median(secs), 3),
                      "rounds": [round(x, 3) for x in (min(ratios), max(ratios))]}))
