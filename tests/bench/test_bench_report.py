"""The report (targets, Markdown, plot) on synthetic results, and a real quick run end to end."""

from __future__ import annotations

import json

import matplotlib.image
import pytest

from oal.bench.op import quick_config, run_sweep
from oal.bench.report import markdown, plot, target_checks, write_report


def point(method, n, dtype, ms, mb, **kw):
    return {"method": method, "n": n, "dtype": dtype, "device": "cpu", "ms": ms, "peak_mb": mb, "inputs_mb": 1.0,
            "peak_total_mb": mb + 1.0, "repeats": 3, "gflop_s": 5.0, "blind_mb": 0.0, **kw}  # fmt: skip


def make_doc(points):
    config = {"batch": 1, "heads_q": 9, "heads_kv": 3, "head_dim": 64, "value_dim": 64, "device": "cpu",
              "threads": 2, "seed": 0, "warmup": 1, "min_repeats": 3, "max_repeats": 50, "budget_s": 10.0,
              "host": "h", "torch": "t"}  # fmt: skip
    return {
        "schema": 1,
        "config": config,
        "definitions": {"peak_mb": "peak RSS above resident inputs", "gflop": "analytical"},
        "machine": {
            "host": "h",
            "torch": "t",
            "blas": "mkl",
            "device": {"kind": "cpu", "name": "Test CPU"},
            "matmul": {"fp32": {"size": 2048, "ms": 1.0, "gflop_s": 50.0}},
            "copy_gb_s": 10.0,
        },  # fmt: skip
        "runs": [{"command": "oal bench op --dtypes fp32", "date": "2026-01-01T00:00:00+00:00"}],
        "points": points,
    }


def full_doc():
    # SDPA quadratic, OAL linear: ratios 4096 → 1.0, 8192 → 2.0, 16384 → 4.0, 32768 → 8.0; OAL memory above SDPA
    # at 1024 only
    pts = []
    for n in (1024, 2048, 4096, 8192, 16384, 32768):
        pts.append(point("sdpa", n, "fp32", ms=(n / 4096) ** 2 * 100, mb=10.0))
        pts.append(point("oal", n, "fp32", ms=n / 4096 * 100, mb=12.0 if n == 1024 else 9.0))
    skipped = {"method": "sdpa_math", "n": 8192, "dtype": "fp32", "device": "cpu", "ms": None, "peak_mb": None}
    pts.append({**skipped, "skipped": "memory guard: estimated peak 99 MB"})
    return make_doc(pts)


def test_target_checks_pass_and_miss():
    lines = {c.text.split(":")[0]: c.status for c in target_checks(full_doc())}
    assert lines["SDPA/OAL time at N=4096 ≥ 1 (parity)"] == "PASS"
    assert lines["SDPA/OAL time at N=8192 ≥ 2"] == "PASS"
    assert lines["SDPA/OAL time at N=16384 ≥ 4"] == "PASS"
    assert lines["SDPA/OAL time at N=32768 ≥ 6"] == "PASS"
    assert lines["OAL time growth N=8192→32768 ≤ 4.4×"] == "PASS"  # 4.0×
    memory = next(c for c in target_checks(full_doc()) if "memory" in c.text)
    assert memory.status == "MISS" and "N=1024: 12.0 > 10.0 MB" in memory.text


def test_target_checks_miss_and_not_measured():
    doc = make_doc([point("sdpa", 4096, "bf16", ms=90.0, mb=5.0), point("oal", 4096, "bf16", ms=100.0, mb=5.0)])
    checks = target_checks(doc)
    status = {c.text.split(":")[0]: c.status for c in checks}
    assert status["SDPA/OAL time at N=4096 ≥ 1 (parity)"] == "MISS"
    assert status["SDPA/OAL time at N=8192 ≥ 2"] == "n/a"
    assert status["OAL time growth N=8192→32768 ≤ 4.4×"] == "n/a"
    assert status["OAL peak memory ≤ SDPA's at every measured N"] == "PASS"
    assert all(c.dtype == "bf16" for c in checks)


def test_markdown_has_header_ratios_and_skips():
    text = markdown(full_doc())
    assert "Command: `oal bench op --dtypes fp32`" in text and "2026-01-01" in text and "Test CPU" in text
    assert "| 32768 | 6,400.0 | 800.0 | 8.00 | 10.0 | 9.0 |" in text  # summary row: SDPA/OAL = 8
    assert "| 8192 | SDPA math | – | – | – | – | – | memory guard: estimated peak 99 MB |" in text
    assert "| 4096 | OAL (G=5) | 100.0 | 1.00 | 5.0 (10%) | 9.0 | 1.0 | 3 timed |" in text
    assert "**MISS** fp32: OAL peak memory" in text


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "op.png"
    plot(full_doc(), path)
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[1] > image.shape[0] > 200


def test_quick_run_end_to_end_in_subprocesses(tmp_path):
    """Real points in fresh processes at tiny sizes: valid JSON, Markdown and PNG; a rerun reuses every point."""
    config = quick_config(heads_q=4, heads_kv=2, head_dim=16, value_dim=16, threads=1)
    args = {"methods": ["sdpa", "oal"], "sizes": [64, 128], "dtypes": ["fp32"], "out_dir": tmp_path}
    doc = run_sweep(config, command="pytest quick", **args)
    md, png = write_report(doc, tmp_path)

    stored = json.loads((tmp_path / "op.json").read_text())
    assert len(stored["points"]) == 4
    for p in stored["points"]:
        assert p["ms"] > 0 and p["peak_mb"] >= 0 and p["repeats"] == 1 and p["threads"] == 1, p
        assert p["device"] == "cpu" and p["gflop_s"] > 0 and p["inputs_mb"] > 0
    machine = stored["machine"]
    assert machine["threads"] == 1 and machine["matmul"]["fp32"]["gflop_s"] > 0 and machine["torch"]
    assert "| 128 | SDPA flash |" in md.read_text() and "pytest quick" in md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    seen = []
    again = run_sweep(config, on_point=lambda p, i, t: seen.append(p.get("reused")), **args)
    assert seen == [True] * 4
    assert again["points"] == stored["points"] and again["machine"] == stored["machine"]


@pytest.mark.parametrize("dtype", ["fp32"])
def test_report_of_points_without_reference(dtype):
    doc = make_doc([point("oal", 64, dtype, ms=1.0, mb=1.0)])
    text = markdown(doc)
    assert "| 64 | OAL (G=5) | 1.0 | – |" in text and "SDPA ms" not in text
