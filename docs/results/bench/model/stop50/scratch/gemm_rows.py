# SmolLM2's projection GEMMs alone (torch.nn.functional.linear, 2 threads), bf16 and fp32, at 1024 and 8192 rows:
# ms per call and per 1024 rows (what a 1024-token chunk pays against one 8192-token call), and GFLOP/s.
import time
import torch
torch.set_num_threads(2)
for dt in (torch.bfloat16, torch.float32):
    for k, nout in ((1536, 576), (576, 576), (576, 1536)):
        w = torch.randn(nout, k, dtype=dt)
        for rows in (1024, 8192):
            x = torch.randn(rows, k, dtype=dt)
            for _ in range(3):
                torch.nn.functional.linear(x, w)
            reps = 8192 // rows * 4
            t = time.perf_counter()
            for _ in range(reps):
                torch.nn.functional.linear(x, w)
            s = (time.perf_counter() - t) / reps
            print(dt, f"{k}->{nout}", rows, f"{s * 1e3:.3f} ms, {s * 1e3 * 1024 / rows:.3f} per 1024 rows",
                  f"{2 * rows * k * nout / s / 1e9:.0f} GFLOP/s")
