"""Stop 55: one oal+sink+window kernel call (SmolLM2's shapes: 9 query / 3 KV heads, d = 64, window 256) on a fresh
prompt of 64 and 256 tokens against SDPA with grouped heads: the largest difference and median µs of 50 calls.

    python docs/results/bench/model/stop55/scratch/op_ab.py
"""
import time, torch, torch.nn.functional as F
from oal.kernels import build_kernel
torch.set_num_threads(2); torch.manual_seed(0)
groups = torch.randint(0, 3, (9, 64))
kern = build_kernel("oal+sink+window", num_heads=9, num_kv_heads=3, head_dim=64, groups=groups, num_groups=3, window=256)
for N in (64, 256):
    q = torch.randn(1, 9, N, 64); k = torch.randn(1, 3, N, 64); v = torch.randn(1, 3, N, 64)
    with torch.no_grad():
        ref, _ = kern(q, k, v)
        fast = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=kern.scale, enable_gqa=True)
        print(N, "max diff", (ref - fast).abs().max().item())
        for name, fn in (("kernel", lambda: kern(q, k, v)), ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=kern.scale, enable_gqa=True))):
            for _ in range(5): fn()
            ts = []
            for _ in range(50):
                t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
            ts.sort(); print(N, name, "median us", round(1e6 * ts[25]))
