# The MLP of SmolLM2 (576 -> 1536 -> 576) on 1024 rows in one call or in pieces of 512 / 256 rows, 40 alternating rounds of 5
import time, torch, statistics
torch.set_num_threads(2)
H, I = 576, 1536
g = torch.nn.Linear(H, I, bias=False); u = torch.nn.Linear(H, I, bias=False); d = torch.nn.Linear(I, H, bias=False)
def mlp(x): return d(torch.nn.functional.silu(g(x)) * u(x))
x = torch.randn(1, 1024, H)
def pieces(x, rows):
    out = x.new_empty(1, 1024, H)
    for s in range(0, 1024, rows): out[:, s:s+rows] = mlp(x[:, s:s+rows])
    return out
res = {1024: [], 512: [], 256: []}
with torch.no_grad():
    for r in range(40):
        for rows in res:
            t = time.perf_counter()
            for _ in range(5): pieces(x, rows)
            res[rows].append((time.perf_counter() - t) / 5 * 1e3)
for k, v in res.items(): print(k, "median ms %.2f min %.2f" % (statistics.median(v), min(v)))
