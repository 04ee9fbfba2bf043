"""benchmarks/cpu_peak.py: the FMA-peak loop builds, and the script writes consistent JSON and checks its input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oal.ops.quadratic import cpu as cpu_kernel

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_peak.py"
ENV = {"PYTHONPATH": str(SCRIPT.parents[1] / "src"), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
ENV |= {key: os.environ[key] for key in ("HOME", "TORCH_EXTENSIONS_DIR") if key in os.environ}

pytestmark = pytest.mark.skipif(
    # torch names the best instruction set it dispatches to: an AVX-512 CPU ("AVX512") has AVX2 and FMA too
    cpu_kernel.load() is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="needs a C++ compiler and an AVX2 + FMA CPU",
)


def test_script_writes_json(tmp_path):
    out = tmp_path / "peak.json"
    cmd = [sys.executable, str(SCRIPT), "--threads", "1", "--size", "64", "--iters", "100000", "--repeats", "2",
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["threads"] == 1
    assert row["fma_peak_gflop_s"] > 0 and row["matmul_gflop_s"] > 0
    assert row["matmul_over_peak"] == pytest.approx(row["matmul_gflop_s"] / row["fma_peak_gflop_s"])
    assert doc["command"]["size"] == 64 and "date" in doc


def test_script_rejects_a_non_positive_count():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "0"], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert done.returncode == 2
    assert "--repeats: expected a positive integer, got 0" in done.stderr
