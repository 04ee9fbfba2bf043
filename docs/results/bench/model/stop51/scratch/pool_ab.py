# Every layer's cache buffers allocated at the start of the prompt (before any layer's transients), in layer order,
# against the default (each layer's buffers allocated amid its own transients) and the original: each point its own
# process (oal.bench.decode.run_point), rounds alternating the order. The buffers' shapes come from a recording run.
#   python pool_ab.py ROUNDS N [STEPS]            (parent; records the shapes first)
#   python pool_ab.py --record N FILE             (child: a prompt of N tokens, the shapes in allocation order)
#   python pool_ab.py --child METHOD N STEPS POOLFILE|-
import collections, json, subprocess, sys
import torch
import oal.kernels.decode as decode_mod
import oal.kernels.hybrid as hybrid
import oal.kernels.kept as kept
from oal.ops import page_select

pool = collections.defaultdict(collections.deque)
log = []


def take(shape, dtype, like):
    q = pool.get((tuple(shape), dtype))
    if q:
        return q.popleft()
    log.append((list(shape), str(dtype).removeprefix("torch.")))
    return like.new_empty(*shape, dtype=dtype)


def _buffer(x, capacity, dtype):
    out = take((x.shape[0], x.shape[1], capacity, x.shape[3]), dtype, x)
    out[:, :, : x.shape[2]] = x
    return out


def _exact_buffers(self, k, v, dtype, capacity):
    assert dtype != torch.int8
    E = len(self.exact_kv_heads)
    return (take((k.shape[0], E, capacity, k.shape[-1]), dtype, k), take((v.shape[0], E, capacity, v.shape[-1]), dtype, v))


def bounds_buffer(old, k, page):
    pages = page_select.num_pages(k.shape[2], page)
    if old is not None and old.shape[2] >= pages and old.is_contiguous():
        return old
    new = take((k.shape[0], k.shape[1], pages, 2, k.shape[3]), torch.bfloat16, k)
    if old is not None:
        new[:, :, : old.shape[2]] = old[:, :, :pages]
    return new


kept._buffer = _buffer
hybrid.ExactHeadsKernel._exact_buffers = _exact_buffers
hybrid.bounds_buffer = decode_mod.bounds_buffer = bounds_buffer

if sys.argv[1] == "--record":
    sys.path.insert(0, "benchmarks")
    from prefill_peak import build
    from oal.models import KernelCache
    n = int(sys.argv[2])
    m = build("recipe", "fp32")
    with torch.no_grad():
        m(torch.randint(49152, (1, n)), cache=KernelCache(m), logits_to_keep=1)
    json.dump(log, open(sys.argv[3], "w"))
    sys.exit(0)

if sys.argv[1] == "--child":
    method, n, steps, poolfile = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    import oal.bench.decode as bd
    shapes = json.load(open(poolfile)) if poolfile != "-" else None
    build = bd.build_model

    def build_model(method, config):
        model = build(method, config)
        if shapes is not None:
            def fill(module, args, kwargs):
                ids = kwargs.get("input_ids")
                if ids is not None and ids.shape[1] == n:
                    for shape, dtype in shapes:
                        pool[(tuple(shape), getattr(torch, dtype))].append(torch.empty(shape, dtype=getattr(torch, dtype)))
            model.model.register_forward_pre_hook(fill, with_kwargs=True)
        return model

    bd.build_model = build_model
    cfg = bd.DecodeConfig(converted="docs/results/conversion/model", steps=steps, warmup=2, threads=2)
    p = bd.run_point(method, n, cfg)
    p["pool_left"] = sum(len(q) for q in pool.values())
    print(json.dumps(p))
    sys.exit(0)

rounds, n = int(sys.argv[1]), int(sys.argv[2])
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 16
poolfile = f"/tmp/pool_shapes_{n}.json"
subprocess.run([sys.executable, __file__, "--record", str(n), poolfile], check=True, capture_output=True)
print(json.dumps({"recorded_buffers": len(json.load(open(poolfile)))}), flush=True)
variants = [("original", "-"), ("converted", "-"), ("converted", poolfile)]
for r in range(rounds):
    for method, pf in (variants if r % 2 == 0 else variants[::-1]):
        out = subprocess.run([sys.executable, __file__, "--child", method, str(n), str(steps), pf],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        p = json.loads(out)
        keep = ("peak_rss_mb", "run_peak_rss_mb", "heap_kept_mb", "decode_peak_mb", "prefill_s", "ms_per_token", "cache_mb", "pool_left")
        print(json.dumps({"round": r, "n": n, "model": method + ("+pool" if pf != "-" else ""),
                          **{k: round(p[k], 2) for k in keep if p.get(k) is not None}}), flush=True)
