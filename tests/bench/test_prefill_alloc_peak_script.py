"""benchmarks/prefill_alloc_peak.py: the running total of allocation events, the span holding its peak and each
span's transient; bad --models are refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_alloc_peak.py"
MB = 2**20


@pytest.fixture(scope="module")
def alloc_module(load_benchmark):
    return load_benchmark("prefill_alloc_peak")


def test_peak_its_span_and_transients(alloc_module):
    # a cache of 4 MB kept from span "a" (which also frees a 2 MB temporary), then span "b" nested in "outer"
    # peaks 3 MB above its start
    memory = [(1, 4 * MB), (2, 2 * MB), (3, -2 * MB), (6, 3 * MB), (7, -3 * MB), (9, 1 * MB)]
    spans = [("a", 0, 4), ("outer", 5, 8), ("b", 5, 7)]
    got = alloc_module.attribute(memory, spans)
    assert got["peak_mb"] == 7 and got["end_mb"] == 5
    assert got["peak_in"] == "b"  # the innermost span holding the peak
    assert got["transients_mb"] == {"a": 6, "outer": 3, "b": 3}


def test_no_span_holds_a_peak_outside_them(alloc_module):
    got = alloc_module.attribute([(10, MB), (11, -MB)], [("a", 0, 5)])
    assert got["peak_in"] is None and got["peak_mb"] == 1 and got["transients_mb"] == {"a": 0}


def test_unknown_models_are_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "original,nope"], capture_output=True, text=True)
    assert proc.returncode != 0 and "--models: expected names from original, recipe, plain; got nope" in proc.stderr
