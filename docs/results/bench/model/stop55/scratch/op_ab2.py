"""Stop 55: causal softmax of a fresh segment, SmolLM2's shapes, four ways: SDPA with enable_gqa, SDPA on repeated
KV heads, torch's CPU flash kernel, window.cpp's exact_prefill (fp32 products); median µs of 100 calls.

    python docs/results/bench/model/stop55/scratch/op_ab2.py
"""
import time, torch, torch.nn.functional as F
from oal.ops.quadratic import cpu as cpu_kernels
torch.set_num_threads(2); torch.manual_seed(0)
ext = cpu_kernels.load("window")
for N in (16, 64, 256):
    q = torch.randn(1, 9, N, 64); k = torch.randn(1, 3, N, 64); v = torch.randn(1, 3, N, 64)
    s = 0.125
    fns = {
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s, enable_gqa=True),
        "sdpa_rep": lambda: F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True, scale=s),
        "flash": lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), 0.0, True, scale=s)[0],
        "fused": lambda: ext.exact_prefill(q.reshape(1, 3, 3, N, 64), k, v, 0, s, False).view(1, 9, N, 64),
    }
    ref = fns["sdpa_gqa"]()
    for name, fn in fns.items():
        out = fn()
        for _ in range(5): fn()
        ts = []
        for _ in range(100):
            t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
        ts.sort(); print(N, name, "median us", round(1e6 * ts[50]), "diff", (out - ref).abs().max().item())
