"""One-shot GPU check of the Triton quadratic-kernel operator (GPU issue §1): correctness, speed, memory, decode.

Run from a plain checkout on a machine with a CUDA GPU, torch and triton:

    PYTHONPATH=src python benchmarks/gpu_check.py            # results in $OUT (or ./gpu_out)

Parts, each timed, caught and recorded on failure (the script always continues and always writes its JSON):

1. ``env``          device, versions.
2. ``pytest``       tests/ops/test_triton.py compiled on CUDA (fp32 and bf16 against the torch references).
3. ``check``        the benchmark shape itself: Triton bf16/fp32 forward against the torch chunked path in fp32.
4. ``matmul``       measured dense bf16 matmul TFLOP/s (8192³): the ceiling the GEMM targets refer to.
5. ``tune``         a few launch configurations of the forward at N = 16384; the fastest is used below.
6. ``forward``      causal forward latency (median) and peak memory (torch.cuda.max_memory_allocated, resident
                    inputs included, as in App. E) for B=1, d=dv=64, (Hq, Hkv) ∈ {(14, 2), (9, 3)},
                    N = 2^10 … 2^15: OAL (G=5), learned global (G=1), SDPA FlashAttention, SDPA math (memory
                    guard: skipped when its estimated peak exceeds 80% of free memory).
7. ``inter_gemm``   the state-passing and readout kernels alone (no within-chunk part): achieved TFLOP/s of the
                    inter-chunk GEMMs against the measured matmul rate.
8. ``memory``       peak memory at N = 32768 for smaller snapshot budgets (the memory/speed trade-off).
9. ``decode``       per-token latency against context length 1k … 32k: the recurrent state (in place) against an
                    SDPA KV cache (append + attend).
10. ``backward``    forward+backward latency against FlashAttention at N = 4096 and 16384 (if time is left).

Writes ``gpu_results.json`` and ``gpu_check.log`` to ``$OUT`` and prints a summary with the four targets:
OAL faster than FlashAttention at N ≥ 16384 (bf16); inter-chunk GEMMs ≥ 40% of measured matmul throughput;
peak memory below FlashAttention's at N = 32768; decode latency flat (≤ +10%) from 1k to 32k.
Everything is sized to finish in about 6 minutes including Triton compilation.

``GPU_CHECK_DRY=1`` runs the same plumbing on CPU under TRITON_INTERPRET=1 with tiny sizes (no timings worth
reading): a check that the script itself works before a GPU is spent on it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DRY = os.environ.get("GPU_CHECK_DRY") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
DEV = "cpu" if DRY else "cuda"
D_HEAD = 16 if DRY else 64
HEADS = ((3, 1),) if DRY else ((14, 2), (9, 3))
HEADS_MAIN = HEADS[0]  # the paper's configuration (App. E)
NS = (32, 64) if DRY else tuple(2**e for e in range(10, 16))
N_CHECK, N_TUNE, N_BIG, N_BWD = (48, 64, (32, 64), (32,)) if DRY else (2048, 16384, (16384, 32768), (4096, 16384))
MATMUL_N = 256 if DRY else 8192
DECODE_STEPS = 3 if DRY else 50

START = time.monotonic()
# no part starts unless its estimate fits before this (a device lease is 10 minutes a call)
DEADLINE_S = float(os.environ.get("GPU_CHECK_DEADLINE_S") or (3000.0 if DRY else 400.0))
OUT = Path(os.environ.get("OUT") or REPO / "gpu_out")
OUT.mkdir(parents=True, exist_ok=True)
LOG = open(OUT / "gpu_check.log", "w", buffering=1)  # noqa: SIM115 - lives for the whole script
RESULTS: dict = {"parts": {}}


def log(*args) -> None:
    line = " ".join(str(a) for a in args)
    stamp = f"[{time.monotonic() - START:7.1f}s] "
    print(stamp + line, flush=True)
    LOG.write(stamp + line + "\n")


def left() -> float:
    return DEADLINE_S - (time.monotonic() - START)


def save() -> None:
    (OUT / "gpu_results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


PARTS: list[tuple[str, float, object]] = []


def part(name: str, need_s: float = 0.0):
    """Register the decorated function as a part: run in order by :func:`main`, recorded, failure-isolated, and
    skipped when less than ``need_s`` seconds are left before the deadline."""

    def wrap(fn):
        PARTS.append((name, need_s, fn))
        return fn

    return wrap


def run_part(name: str, need_s: float, fn) -> None:
    if left() < need_s:
        RESULTS["parts"][name] = {"status": "skipped", "reason": f"{left():.0f}s left, needs ~{need_s:.0f}s"}
        log(f"== {name}: skipped (time)")
        save()
        return
    log(f"== {name}")
    t = time.monotonic()
    try:
        out = fn()
        RESULTS["parts"][name] = {"status": "ok", "seconds": round(time.monotonic() - t, 1), "result": out}
    except Exception as e:  # recorded, and the script goes on
        RESULTS["parts"][name] = {
            "status": "error",
            "seconds": round(time.monotonic() - t, 1),
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-4000:],
        }
        log(f"!! {name} failed: {type(e).__name__}: {e}")
    finally:
        if not DRY:
            torch.cuda.empty_cache()
    save()


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def bench(fn, reps: int = 5, warmup: int = 1, max_s: float = 4.0) -> float:
    """Median wall-clock seconds of ``fn()`` with CUDA synchronisation around each call."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    t_all = time.perf_counter()
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
        if time.perf_counter() - t_all > max_s and len(times) >= 2:
            break
    return statistics.median(times)


def peak_memory(fn) -> tuple[int, int]:
    """(peak allocated bytes during ``fn()``, bytes allocated before it): peak includes resident inputs."""
    if DRY:
        fn()
        return 0, 0
    sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync()
    return torch.cuda.max_memory_allocated(), base


# ------------------------------------------------------------------------------------------------ problems


def oal_problem(N: int, Hq: int, Hkv: int, G: int, dtype=torch.bfloat16, seed: int = 0):
    """Inputs (B = 1, d = dv = D_HEAD) and a G-group OAL kernel (Taylor initialisation plus noise)."""
    from oal.kernels.oal import oal_coefficients, oal_factor, taylor_L

    d = D_HEAD
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, Hq, N, d, device=DEV, generator=gen).to(dtype)
    k = torch.randn(1, Hkv, N, d, device=DEV, generator=gen).to(dtype)
    v = torch.randn(1, Hkv, N, d, device=DEV, generator=gen).to(dtype)
    groups = torch.randint(0, G, (Hq, d), device=DEV, generator=gen)
    L = taylor_L(Hq, G).to(DEV) + 0.05 * torch.randn(Hq, G + 1, G + 1, device=DEV, generator=gen)
    eps = 1e-3
    a, b, C = oal_coefficients(groups, L, eps)
    return q, k, v, (a, b, C), oal_factor(groups, L, eps), eps


def oal_call(q, k, v, coef, factor, eps, chunk, validate=False, **kw):
    from oal.ops.quadratic.triton import chunk_quadratic_attention_triton

    return chunk_quadratic_attention_triton(
        q, k, v, *coef, chunk_size=chunk, factor=factor, kernel_floor=eps, validate=validate, **kw
    )


def sdpa(q, k, v, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[backend]
    with sdpa_kernel(b):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


TUNED = {"chunk": 64}
LAUNCH_KEYS = ("fwd_o_warps", "fwd_o_stages", "fwd_h_warps", "fwd_h_stages", "overlap")


# ------------------------------------------------------------------------------------------------ parts


@part("env")
def _env():
    import triton

    from oal.ops.quadratic.triton.utils import fp32_dot_precision

    info = {"dry_run": DRY, "torch": torch.__version__, "fp32_dot": fp32_dot_precision()}
    if not DRY:
        p = torch.cuda.get_device_properties(0)
        info.update(
            device=p.name,
            sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
        )
    info.update(
        {
            "triton": triton.__version__,
            "python": sys.version.split()[0],
        }
    )
    log(info)
    return info


@part("pytest", need_s=120)
def _pytest():
    if DRY:
        return {"skipped": "dry run"}
    cmd = [sys.executable, "-m", "pytest", "tests/ops/test_triton.py", "-q", "-rfE", "-p", "no:cacheprovider"]
    try:
        import xdist  # noqa: F401

        cmd += ["-n", "4"]  # compiles in parallel processes
    except ImportError:
        pass
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("TRITON_INTERPRET", None)
    budget = max(60.0, min(180.0, left() - 220))
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=budget)
        tail = (r.stdout + r.stderr)[-6000:]
        code = r.returncode
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))[-6000:]
        code = "timeout"
    (OUT / "pytest.log").write_text(tail)
    summary = [ln for ln in tail.splitlines() if " passed" in ln or " failed" in ln or "error" in ln.lower()][-5:]
    log("pytest exit", code, "|", " / ".join(summary))
    return {"exit_code": code, "summary": summary}


@part("check", need_s=30)
def _check():
    """Triton vs the torch chunked path (fp32 math) on the benchmark shape: max abs error of o, rel. of state."""
    from oal.ops.quadratic import chunk_quadratic_attention

    out = {}
    for Hq, Hkv in HEADS:
        q, k, v, coef, factor, eps = oal_problem(N_CHECK, Hq, Hkv, 5)
        ref, ref_state = chunk_quadratic_attention(
            q.float(), k.float(), v.float(), *coef, factor=factor, kernel_floor=eps, output_final_state=True
        )
        for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            for chunk in (64, 128):
                o, st = oal_call(
                    q.to(dt), k.to(dt), v.to(dt), coef, factor, eps, chunk, validate=True, output_final_state=True
                )
                err = (o.float() - ref).abs().max().item()
                serr = ((st - ref_state).abs().max() / ref_state.abs().max()).item()
                out[f"H{Hq}/{Hkv} {name} chunk{chunk}"] = {"o_max_abs_err": err, "state_rel_err": serr}
                log(f"check Hq={Hq} Hkv={Hkv} {name} chunk={chunk}: o max|err| {err:.2e}, state rel {serr:.2e}")
        # several windows (1 MiB of snapshots), with and without the second stream: results must be identical
        from oal.ops.quadratic.triton.chunk import LAUNCH

        outs = []
        for overlap in (True, False):
            LAUNCH.overlap = overlap
            outs.append(oal_call(q, k, v, coef, factor, eps, 64, snapshot_budget=2**20, output_final_state=True))
        LAUNCH.overlap = True
        diff = max((a - b).abs().max().item() for a, b in zip(outs[0], outs[1], strict=True))
        err = (outs[0][0].float() - ref).abs().max().item()
        out[f"H{Hq}/{Hkv} windows overlap-vs-serial"] = {"max_diff": diff, "o_max_abs_err": err}
        log(f"check Hq={Hq} Hkv={Hkv} 1 MiB windows: overlap vs serial max diff {diff:.2e}, o max|err| {err:.2e}")
    return out


@part("matmul", need_s=15)
def _matmul():
    n = MATMUL_N
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    tflops = 2 * n**3 * 10 / (time.perf_counter() - t) / 1e12
    log(f"bf16 matmul {n}^3: {tflops:.0f} TFLOP/s")
    RESULTS["matmul_tflops"] = tflops
    return {"tflops": tflops}


@part("tune", need_s=60)
def _tune():
    from oal.ops.quadratic.triton.chunk import LAUNCH, LaunchConfig

    q, k, v, coef, factor, eps = oal_problem(N_TUNE, *HEADS_MAIN, 5)
    base = dict(chunk=64, fwd_o_warps=4, fwd_o_stages=2, fwd_h_warps=4, fwd_h_stages=3, overlap=True)
    configs = [
        base,
        {**base, "overlap": False},
        {**base, "fwd_o_warps": 8},
        {**base, "fwd_o_stages": 3, "fwd_h_stages": 2},
        {**base, "chunk": 128, "fwd_o_warps": 8},
        {**base, "chunk": 128, "fwd_o_warps": 8, "fwd_o_stages": 3, "fwd_h_warps": 8},
    ]
    rows = []
    for cfg in configs:
        if left() < 200:
            break
        chunk = cfg["chunk"]
        for key in LAUNCH_KEYS:
            setattr(LAUNCH, key, cfg[key])
        try:
            t_compile = time.perf_counter()
            oal_call(q, k, v, coef, factor, eps, chunk)
            sync()
            t_compile = time.perf_counter() - t_compile
            t = bench(lambda chunk=chunk: oal_call(q, k, v, coef, factor, eps, chunk), reps=5)
            rows.append({**cfg, "ms": t * 1e3, "first_call_s": t_compile})
            log(f"tune {cfg}: {t * 1e3:.3f} ms (first call {t_compile:.1f}s)")
        except Exception as e:
            rows.append({**cfg, "error": f"{type(e).__name__}: {e}"})
            log(f"tune {cfg} failed: {e}")
    ok = [r for r in rows if "ms" in r]
    if ok:
        best = min(ok, key=lambda r: r["ms"])
        TUNED.update(best)
        for key in LAUNCH_KEYS:
            setattr(LAUNCH, key, best[key])
    else:
        for key, val in vars(LaunchConfig()).items():
            setattr(LAUNCH, key, val)
    log("tuned:", TUNED)
    return {"configs": rows, "best": TUNED}


@part("forward", need_s=60)
def _forward():
    from oal.ops.quadratic.triton.chunk import DEFAULT_SNAPSHOT_BUDGET

    chunk = TUNED["chunk"]
    rows = []
    for Hq, Hkv in HEADS:
        for N in NS:
            if left() < 40:
                rows.append({"Hq": Hq, "Hkv": Hkv, "N": N, "skipped": "time"})
                continue
            entry = {"Hq": Hq, "Hkv": Hkv, "N": N}
            for method, G in (("oal_g5", 5), ("global_g1", 1)):
                try:
                    fn = partial(oal_call, *oal_problem(N, Hq, Hkv, G), chunk)
                    entry[method + "_ms"] = bench(fn, reps=5) * 1e3
                    entry[method + "_peak_mib"] = peak_memory(fn)[0] / 2**20
                    del fn
                except Exception as ex:
                    entry[method + "_error"] = f"{type(ex).__name__}: {ex}"
            qkv = oal_problem(N, Hq, Hkv, 1)[:3]
            for backend in ("flash", "math"):
                try:
                    if backend == "math":
                        est = 3 * Hq * N * N * 4 + 4 * qkv[0].numel() * 2
                        free = torch.cuda.mem_get_info()[0] if not DRY else 2**40
                        if est > 0.8 * free:
                            entry["sdpa_math_skipped"] = f"memory guard: ~{est / 2**30:.1f} GiB > 80% of free"
                            continue
                    fn = partial(sdpa, *qkv, backend)
                    entry[f"sdpa_{backend}_ms"] = bench(fn, reps=5) * 1e3
                    entry[f"sdpa_{backend}_peak_mib"] = peak_memory(fn)[0] / 2**20
                except Exception as ex:
                    entry[f"sdpa_{backend}_error"] = f"{type(ex).__name__}: {ex}"
            del qkv
            rows.append(entry)
            log(
                "fwd",
                " ".join(f"{k_}={v_:.3f}" if isinstance(v_, float) else f"{k_}={v_}" for k_, v_ in entry.items()),
            )
    return {"chunk": chunk, "snapshot_budget": DEFAULT_SNAPSHOT_BUDGET, "rows": rows}


@part("inter_gemm", need_s=30)
def _inter_gemm():
    """Time the state-passing kernel (all windows) and the readout with the within-chunk part left out."""
    from oal.ops.quadratic.triton import chunk as tc
    from oal.ops.quadratic.triton.utils import block_table, block_weights, consts
    from oal.ops.quadratic.utils import feature_dim, query_weights

    chunk = TUNED["chunk"]
    peak = RESULTS.get("matmul_tflops")
    rows = []
    for N in N_BIG:
        q, k, v, coef, factor, eps = oal_problem(N, *HEADS_MAIN, 5)
        B, Hq, _, d = q.shape
        Hkv, dv = k.shape[1], v.shape[-1]
        cst = consts(d, dv, q.dtype)
        qwb = block_weights(query_weights(*(x.float() for x in coef), 1 / math.sqrt(d)), d).contiguous()
        wc = tc.window_chunks(B, Hkv, d, dv, math.ceil(N / chunk), q.dtype, tc.DEFAULT_SNAPSHOT_BUDGET, False)
        h, hden = tc._snapshots(B, Hkv, wc, cst, q.dtype, q.device)
        tab = block_table(d, q.device)
        o = torch.empty_like(q)
        state = torch.zeros(B, Hkv, cst.D_FEAT, dv + 1, device=DEV)
        windows = tc._windows(N, chunk, wc)

        launches_h = [partial(tc._launch_fwd_h, k, v, tab, state, h, hden, t0, N, nc, chunk, cst) for t0, nc in windows]
        launches_o = [
            partial(tc._launch_fwd_o, q, k, v, qwb, None, h, hden, o, None, t0, N, nc, chunk, eps, cst, intra=False)
            for t0, nc in windows
        ]
        t_h = bench(partial(_run_all, launches_h), reps=5)
        t_o = bench(partial(_run_all, launches_o), reps=5)
        D = feature_dim(d)
        flop_h = 2 * B * Hkv * N * D * dv  # useful FLOPs: canonical rows only
        flop_o = 2 * B * Hq * N * D * (dv + 1)
        row = {
            "N": N,
            "windows": len(windows),
            "state_ms": t_h * 1e3,
            "readout_ms": t_o * 1e3,
            "state_tflops": flop_h / t_h / 1e12,
            "readout_tflops": flop_o / t_o / 1e12,
            "inter_tflops": (flop_h + flop_o) / (t_h + t_o) / 1e12,
        }
        if peak:
            row["inter_fraction_of_matmul"] = row["inter_tflops"] / peak
        rows.append(row)
        log("inter", {k_: round(v_, 3) if isinstance(v_, float) else v_ for k_, v_ in row.items()})
    return rows


def _run_all(fns) -> None:
    for fn in fns:
        fn()


@part("memory", need_s=25)
def _memory():
    chunk = TUNED["chunk"]
    prob = oal_problem(N_BIG[-1], *HEADS_MAIN, 5)
    rows = []
    for budget in (4 * 2**20, 16 * 2**20, 64 * 2**20):
        fn = partial(oal_call, *prob, chunk, snapshot_budget=budget)
        ms = bench(fn, reps=3) * 1e3
        peak, base = peak_memory(fn)
        rows.append({"budget_mib": budget / 2**20, "ms": ms, "peak_mib": peak / 2**20, "inputs_mib": base / 2**20})
        log("memory", rows[-1])
    peak, base = peak_memory(partial(sdpa, *prob[:3], "flash"))
    rows.append({"sdpa_flash_peak_mib": peak / 2**20, "inputs_mib": base / 2**20})
    log("memory", rows[-1])
    return rows


@part("decode", need_s=30)
def _decode():
    from oal.ops.quadratic.triton import chunk_quadratic_attention_triton, recurrent_quadratic_attention_triton

    (Hq, Hkv), d = HEADS_MAIN, D_HEAD
    steps = DECODE_STEPS
    rows = []
    for L in NS:
        q, k, v, coef, factor, eps = oal_problem(L + 1, Hq, Hkv, 5)
        _, state = chunk_quadratic_attention_triton(
            q[:, :, :L], k[:, :, :L], v[:, :, :L], *coef, factor=factor, output_final_state=True, validate=False
        )
        qt, kt, vt = (x[:, :, L:].contiguous() for x in (q, k, v))
        cache_k = torch.zeros(1, Hkv, L + 8, d, device=DEV, dtype=torch.bfloat16)
        cache_v = torch.zeros_like(cache_k)
        cache_k[:, :, :L] = k[:, :, :L]
        cache_v[:, :, :L] = v[:, :, :L]
        oal_step = partial(
            recurrent_quadratic_attention_triton, qt, kt, vt, *coef, initial_state=state, kernel_floor=eps, inplace=True
        )
        row = {
            "context": L,
            "oal_us": _per_call(partial(oal_step, validate=False), steps) * 1e6,
            "oal_validated_us": _per_call(partial(oal_step, validate=True), steps) * 1e6,
            "sdpa_kv_cache_us": _per_call(partial(_sdpa_decode_step, qt, kt, vt, cache_k, cache_v, L), steps) * 1e6,
            "oal_state_mib": state.numel() * 4 / 2**20,
            "kv_cache_mib": 2 * (L + 1) * Hkv * d * 2 / 2**20,
        }
        rows.append(row)
        log("decode", {k_: round(v_, 2) if isinstance(v_, float) else v_ for k_, v_ in row.items()})
    return rows


def _per_call(fn, steps: int) -> float:
    """Seconds per call of ``fn`` over ``steps`` back-to-back calls (3 warm-up calls; one sync at the end)."""
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t) / steps


def _sdpa_decode_step(qt, kt, vt, cache_k, cache_v, L: int) -> None:
    """One decode step on a KV cache: append the new key/value at position L, attend over L + 1 keys."""
    cache_k[:, :, L : L + 1] = kt
    cache_v[:, :, L : L + 1] = vt
    F.scaled_dot_product_attention(qt, cache_k[:, :, : L + 1], cache_v[:, :, : L + 1], enable_gqa=True)


@part("backward", need_s=60)
def _backward():
    chunk = TUNED["chunk"]
    rows = []
    for N in N_BWD:
        if left() < 30:
            break
        q, k, v, coef, factor, eps = oal_problem(N, *HEADS_MAIN, 5)
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
        do = torch.randn_like(q)
        row = {"N": N}
        fns = (
            ("oal", partial(_oal_fwd_bwd, q, k, v, coef, factor, eps, chunk, do)),
            ("sdpa_flash", partial(_flash_fwd_bwd, q, k, v, do)),
        )
        for name, fn in fns:
            try:
                row[name + "_fwd_bwd_ms"] = bench(fn, reps=3) * 1e3
                row[name + "_peak_mib"] = peak_memory(fn)[0] / 2**20
            except Exception as ex:
                row[name + "_error"] = f"{type(ex).__name__}: {ex}"
        rows.append(row)
        log("fwd+bwd", row)
    return rows


def _oal_fwd_bwd(q, k, v, coef, factor, eps, chunk, do) -> None:
    oal_call(q, k, v, coef, factor, eps, chunk)[0].backward(do)


def _flash_fwd_bwd(q, k, v, do) -> None:
    sdpa(q, k, v, "flash").backward(do)


# ------------------------------------------------------------------------------------------------ summary


def summary() -> None:
    targets = {}
    fwd = (RESULTS["parts"].get("forward") or {}).get("result") or {}
    lines = []
    for r in fwd.get("rows", []):
        if "oal_g5_ms" in r and "sdpa_flash_ms" in r:
            lines.append(
                f"Hq={r['Hq']:>2} Hkv={r['Hkv']} N={r['N']:>6}:"
                f" OAL {r['oal_g5_ms']:8.3f} ms {r['oal_g5_peak_mib']:8.0f} MiB"
                f" | G1 {r.get('global_g1_ms', float('nan')):8.3f} ms"
                f" | flash {r['sdpa_flash_ms']:8.3f} ms {r['sdpa_flash_peak_mib']:8.0f} MiB"
                f" | math {r.get('sdpa_math_ms', float('nan')):8.3f} ms"
            )
    big = [r for r in fwd.get("rows", []) if r.get("N", 0) >= 16384 and "oal_g5_ms" in r and "sdpa_flash_ms" in r]
    if big:
        targets["oal_faster_than_flash_N>=16384"] = all(r["oal_g5_ms"] < r["sdpa_flash_ms"] for r in big)
        n32 = [r for r in big if r["N"] == 32768]
        if n32:
            targets["peak_memory_below_flash_N=32768"] = all(
                r["oal_g5_peak_mib"] < r["sdpa_flash_peak_mib"] for r in n32
            )
    inter = (RESULTS["parts"].get("inter_gemm") or {}).get("result") or []
    fr = [r.get("inter_fraction_of_matmul") for r in inter if r.get("inter_fraction_of_matmul")]
    if fr:
        targets["inter_gemm_>=40%_of_matmul"] = min(fr) >= 0.4
        targets["inter_gemm_fraction"] = [round(x, 3) for x in fr]
    dec = (RESULTS["parts"].get("decode") or {}).get("result") or []
    if len(dec) >= 2:
        growth = dec[-1]["oal_us"] / dec[0]["oal_us"] - 1
        targets["decode_flat_<=10%"] = growth <= 0.10
        targets["decode_growth_1k_to_32k"] = round(growth, 3)
    RESULTS["targets"] = targets
    RESULTS["total_seconds"] = round(time.monotonic() - START, 1)
    log("===== summary")
    for ln in lines:
        log(ln)
    for k_, v_ in targets.items():
        log(f"target {k_}: {v_}")
    log("parts:", {k_: v_["status"] for k_, v_ in RESULTS["parts"].items()})
    save()


def main() -> int:
    if not DRY and not torch.cuda.is_available():
        RESULTS["error"] = "no CUDA device"
        log("no CUDA device: nothing to check")
        save()
        return 1
    for name, need_s, fn in PARTS:
        run_part(name, need_s, fn)
    summary()
    log(f"results: {OUT / 'gpu_results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
