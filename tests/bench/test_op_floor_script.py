"""benchmarks/op_floor.py: its GEMM loop does the operator's state-GEMM work and the script writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oal.bench.flops import AttnShape
from oal.ops.quadratic.utils import feature_dim

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "op_floor.py"


@pytest.fixture(scope="module")
def floor_module(load_benchmark):
    return load_benchmark("op_floor")


@pytest.mark.parametrize("n, chunk", [(1, 64), (63, 16), (100, 32), (128, 64)])
def test_floor_counts_the_readout_and_update_gemms(floor_module, n, chunk):
    shape = AttnShape(1, 6, 2, n, 16, 8)
    fn, flops = floor_module.gemm_floor(shape, chunk)
    fn()
    # readout (Eq. 6) for every query head and token, update (Eq. 5) for every KV head and token
    assert flops == 2 * (6 + 2) * n * feature_dim(16) * (8 + 1)


def test_script_writes_json(tmp_path):
    out = tmp_path / "floor.json"
    cmd = [sys.executable, str(SCRIPT), "--n", "40", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
           "--chunk", "16", "--repeats", "1", "--threads", "1", "--json", str(out)]  # fmt: skip
    env = {"PYTHONPATH": str(SCRIPT.parents[1] / "src"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["n"] == 40
    assert row["sdpa_over_gemm_floor"] == pytest.approx(row["sdpa_ms"] / row["gemm_floor_ms"])
    assert row["gemm_floor_ms"] > 0 and torch.isfinite(torch.tensor(row["oal_ms"]))
