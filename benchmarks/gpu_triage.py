"""Which fp32 tensor-core lowering of the Triton kernels runs correctly on this GPU and Triton build.

The fp32 products of the chunked kernels (``kernels._mm``) take ``OAL_TRITON_FP32_DOT``
(:data:`oal.ops.quadratic.triton.utils.FP32_DOT_CHOICES`; default "ieee"). On the first GPU run (H200,
Triton 3.6.0, 2026-12-04, docs/results/gpu) Triton's "tf32x3" at the default 8-warp programs hit an illegal
memory access in the fp32 chunked forward while bf16 ran; tf32x3 at 4 warps, "split" and "ieee" passed the
d = 64 cases, and split then faulted in the d = 16 model test. Each choice (and the 4-warp rows) runs here in
its own process (an illegal access poisons the CUDA context), all side by side, with ``CUDA_LAUNCH_BLOCKING=1``
so a fault names its launch. Cases: fp32 forward with and without a factor, backward and decode at d = 64, the
d = 16 shapes of tests/models/test_hooks_gpu.py, and bf16 forwards as a control, each against the torch
chunked path.

    PYTHONPATH=src python benchmarks/gpu_triage.py     # $OUT/triage.json; last line CHOICE=<fastest that passed>

``GPU_CHECK_DRY=1`` runs the same on CPU under ``TRITON_INTERPRET=1`` with tiny shapes (plumbing check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DRY = os.environ.get("GPU_CHECK_DRY") == "1"
VARIANTS = (("ieee", None), ("tf32x3", None), ("tf32x3", 4), ("split", None), ("split", 4))
PREFERENCE = ("tf32x3", "split", "ieee")  # fastest first; the 4-warp row is information only


def _child(warps: int | None) -> dict:
    if DRY:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from oal.kernels.oal import oal_coefficients, oal_factor
    from oal.ops.quadratic import chunk_quadratic_attention, recurrent_quadratic_attention
    from oal.ops.quadratic.triton import chunk_quadratic_attention_triton, recurrent_quadratic_attention_triton
    from oal.ops.quadratic.triton.chunk import LAUNCH

    if warps is not None:
        LAUNCH.fwd_o_warps = LAUNCH.fwd_h_warps = LAUNCH.bwd_warps = warps
    dev = "cpu" if DRY else "cuda"

    def problem(B, Hq, Hkv, N, d):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, h, N, d, generator=gen).to(dev) for h in (Hq, Hkv, Hkv))
        groups = torch.randint(0, 5, (Hq, d), generator=gen).to(dev)
        L = (torch.randn(Hq, 6, 6, generator=gen) * 0.3).to(dev)
        return q, k, v, oal_coefficients(groups, L, 1e-3), oal_factor(groups, L, 1e-3)

    def rel(x, ref):
        return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()

    def forward(prob, dtype, chunk, factor):
        q, k, v, coef, fac = prob
        ref, ref_s = chunk_quadratic_attention(q, k, v, *coef, factor=fac, output_final_state=True)
        o, s = chunk_quadratic_attention_triton(
            *(x.to(dtype) for x in (q, k, v)),
            *coef,
            chunk_size=chunk,
            factor=fac if factor else None,
            output_final_state=True,
        )
        return {"o_rel": rel(o.float(), ref), "state_rel": rel(s, ref_s)}

    def backward(prob, n):
        q, k, v, coef, fac = prob
        grads = []
        for impl in (chunk_quadratic_attention, chunk_quadratic_attention_triton):
            leaves = [x[:, :, :n].clone().requires_grad_(True) for x in (q, k, v)]
            o, _ = impl(*leaves, *coef, factor=fac, kernel_floor=1e-3)
            (o * torch.linspace(-1, 1, o.numel(), device=dev).view_as(o)).sum().backward()
            grads.append([x.grad for x in leaves])
        return {f"d{name}_rel": rel(a, b) for name, a, b in zip("qkv", grads[1], grads[0], strict=True)}

    def decode(prob):
        q, k, v, coef, _ = prob
        _, state = chunk_quadratic_attention(*(x[:, :, :-1] for x in (q, k, v)), *coef, output_final_state=True)
        tail = tuple(x[:, :, -1:] for x in (q, k, v))
        o_ref, s_ref = recurrent_quadratic_attention(*tail, *coef, initial_state=state, output_final_state=True)
        o, s = recurrent_quadratic_attention_triton(*tail, *coef, initial_state=state, output_final_state=True)
        return {"o_rel": rel(o, o_ref), "state_rel": rel(s, s_ref)}

    # the benchmark's head shape, and the small one of tests/models/test_hooks_gpu.py (which faulted with split)
    big = problem(1, 3, 1, 40, 16) if DRY else problem(1, 9, 3, 1000, 64)
    small = problem(2, 6, 2, 70, 16)
    f32 = torch.float32
    cases = [
        ("bf16 forward d64 chunk64 factor", lambda: forward(big, torch.bfloat16, 64, True), 5e-2),
        ("fp32 forward d64 chunk64 factor", lambda: forward(big, f32, 64, True), 1e-4),
        ("fp32 forward d64 chunk128 factor", lambda: forward(big, f32, 128, True), 1e-4),
        ("fp32 forward d64 chunk64 general", lambda: forward(big, f32, 64, False), 1e-4),
        ("fp32 backward d64 chunk64", lambda: backward(big, 300), 1e-3),
        ("fp32 decode d64", lambda: decode(big), 1e-5),
        ("bf16 forward d16 chunk64 general", lambda: forward(small, torch.bfloat16, 64, False), 5e-2),
        ("fp32 forward d16 chunk64 general", lambda: forward(small, f32, 64, False), 1e-4),
        ("fp32 forward d16 chunk16 factor", lambda: forward(small, f32, 16, True), 1e-4),
        ("fp32 backward d16 chunk64", lambda: backward(small, 70), 1e-3),
    ]
    out = {"cases": {}}
    for name, fn, tol in cases:
        t = time.monotonic()
        try:
            res = fn()
            if not DRY:
                torch.cuda.synchronize()
            res["ok"] = all(val < tol for val in res.values())
            res["tol"] = tol
        except Exception as e:  # an illegal access poisons the context: later cases would only repeat it
            out["cases"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
            out["traceback"] = traceback.format_exc()[-2500:]
            break
        res["seconds"] = round(time.monotonic() - t, 1)
        out["cases"][name] = res
    out["all_ok"] = len(out["cases"]) == len(cases) and all(c["ok"] for c in out["cases"].values())
    return out


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        warps = None if sys.argv[2] == "default" else int(sys.argv[2])
        print("RESULT=" + json.dumps(_child(warps)), flush=True)
        return 0
    out_dir = Path(os.environ.get("OUT") or REPO / "gpu_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for dot, warps in VARIANTS:
        env = dict(os.environ, OAL_TRITON_FP32_DOT=dot, CUDA_LAUNCH_BLOCKING="1", PYTHONPATH=str(REPO / "src"))
        cmd = [sys.executable, __file__, "--child", "default" if warps is None else str(warps)]
        procs.append(((dot, warps), subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    results = []
    for (dot, warps), proc in procs:
        try:
            text = proc.communicate(timeout=float(os.environ.get("GPU_TRIAGE_TIMEOUT_S", "150")))[0].decode()
        except subprocess.TimeoutExpired:
            proc.kill()
            text = "timeout"
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT=")]
        res = json.loads(lines[-1][len("RESULT=") :]) if lines else {"all_ok": False, "output": text[-2500:]}
        res.update(fp32_dot=dot, warps=warps or "default", exit_code=proc.returncode)
        results.append(res)
        print(f"{dot:7s} warps={warps or 'default'}: all_ok={res['all_ok']}", flush=True)
        for name, case in res.get("cases", {}).items():
            print(f"   {name}: {case}", flush=True)
    (out_dir / "triage.json").write_text(json.dumps(results, indent=1))
    passed = {r["fp32_dot"] for r in results if r["all_ok"] and r["warps"] == "default"}  # what a user gets
    choice = next((c for c in PREFERENCE if c in passed), "")
    print(f"CHOICE={choice}", flush=True)
    return 0 if choice else 1


if __name__ == "__main__":
    sys.exit(main())
