"""Synthetic `oal bench op` results shared by the report and CLI tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def load_benchmark():
    """A loader: ``load_benchmark(name)`` imports the script ``benchmarks/<name>.py`` as a module (``main`` not run)."""

    def load(name: str) -> ModuleType:
        if str(BENCHMARKS) not in sys.path:  # the scripts import each other, run from benchmarks/
            sys.path.insert(0, str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


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


@pytest.fixture
def full_result() -> dict:
    return full_doc()


@pytest.fixture
def make_result():
    return make_doc


@pytest.fixture
def make_point():
    return point
