"""benchmarks/prefill_ab.py: its summary pairs each round's prefills, and bad arguments are refused before any model
loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_summary_takes_medians_and_pairs_the_rounds(load_benchmark):
    ab = load_benchmark("prefill_ab")
    times = {("a", 8): [4.0, 6.0, 5.0], ("b", 8): [2.0, 4.0, 2.0], ("a", 2): [1.0, 1.0, 3.0], ("b", 2): [1.0, 2.0, 1.0]}
    rows = ab.summarize(times, ["a", "b"], [2, 8])
    per_model = {(r["model"], r["n"]): (r["median_s"], r["min_s"]) for r in rows if "model" in r}
    assert per_model == {("a", 8): (5.0, 4.0), ("b", 8): (2.0, 2.0), ("a", 2): (1.0, 1.0), ("b", 2): (1.0, 1.0)}
    ratios = [r for r in rows if "ratio" in r]
    assert [r["n"] for r in ratios] == [2, 8]
    assert ratios[1] == {"ratio": "a / b", "n": 8, "speedup": 2.5, "rounds": [2.0, 1.5, 2.5]}
    assert ratios[0]["speedup"] == 1.0 and ratios[0]["rounds"] == [1.0, 0.5, 3.0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["smollm2-135m", "plain", "--n", "1024,x"], "--n: expected positive prompt lengths, got '1024,x'"),
        (["smollm2-135m", "plain", "--rounds", "0"], "--rounds: expected a positive number of rounds, got 0"),
        (["smollm2-135m", "plain", "--batch", "0"], "--batch: expected a positive batch size, got 0"),
        (["smollm2-135m", "plain", "--warmup", "-1"], "--warmup: expected a number of tokens ≥ 0, got -1"),
        (["plain", "plain"], "models: expected two different models, got 'plain' twice"),
    ],
)
def test_refuses_bad_arguments(args, message):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "prefill_ab.py"), *args], capture_output=True, text=True)
    assert proc.returncode != 0
    assert message in proc.stderr
