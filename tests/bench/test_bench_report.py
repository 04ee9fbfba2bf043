"""The report (targets, Markdown, plot) on synthetic results, and a real quick run end to end."""

from __future__ import annotations

import json

import matplotlib.image

from oal.bench.op import quick_config, run_sweep
from oal.bench.report import markdown, plot, target_checks, write_report


def test_target_checks_pass_and_miss(full_result):
    lines = {c.text.split(":")[0]: c.status for c in target_checks(full_result)}
    assert lines["SDPA/OAL time at N=4096 ≥ 1 (parity)"] == "PASS"
    assert lines["SDPA/OAL time at N=8192 ≥ 2"] == "PASS"
    assert lines["SDPA/OAL time at N=16384 ≥ 4"] == "PASS"
    assert lines["SDPA/OAL time at N=32768 ≥ 6"] == "PASS"
    assert lines["OAL time growth N=8192→32768 ≤ 4.4×"] == "PASS"  # 4.0×
    memory = next(c for c in target_checks(full_result) if "memory" in c.text)
    assert memory.status == "MISS" and "N=1024: 12.0 > 10.0 MB" in memory.text


def test_target_checks_miss_and_not_measured(make_result, make_point):
    doc = make_result(
        [make_point("sdpa", 4096, "bf16", ms=90.0, mb=5.0), make_point("oal", 4096, "bf16", ms=100.0, mb=5.0)]
    )
    checks = target_checks(doc)
    status = {c.text.split(":")[0]: c.status for c in checks}
    assert status["SDPA/OAL time at N=4096 ≥ 1 (parity)"] == "MISS"
    assert status["SDPA/OAL time at N=8192 ≥ 2"] == "n/a"
    assert status["OAL time growth N=8192→32768 ≤ 4.4×"] == "n/a"
    assert status["OAL peak memory ≤ SDPA's at every measured N"] == "PASS"
    assert all(c.dtype == "bf16" for c in checks)


def test_markdown_has_header_ratios_and_skips(full_result):
    text = markdown(full_result)
    assert "Command: `oal bench op --dtypes fp32`" in text and "2026-01-01" in text and "Test CPU" in text
    assert "| 32768 | 6,400.0 | 800.0 | 8.00 | 10.0 | 9.0 |" in text  # summary row: SDPA/OAL = 8
    assert "| 8192 | SDPA math | – | – | – | – | – | memory guard: estimated peak 99 MB |" in text
    assert "| 4096 | OAL (G=5) | 100.0 | 1.00 | 5.0 (10%) | 9.0 | 1.0 | 3 timed |" in text
    assert "**MISS** fp32: OAL peak memory" in text


def test_plot_writes_a_png(tmp_path, full_result):
    path = tmp_path / "op.png"
    plot(full_result, path)
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


def test_report_of_points_without_reference(make_result, make_point):
    doc = make_result([make_point("oal", 64, "fp32", ms=1.0, mb=1.0)])
    text = markdown(doc)
    assert "| 64 | OAL (G=5) | 1.0 | – |" in text and "SDPA ms" not in text
