"""benchmarks/generate_ab.py: its stamps time every generated token of a real ``generate``, its summary pairs each
round's generations, and bad arguments are refused before any model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_causal_lm

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_stamps_once_per_generated_token(load_benchmark):
    ab = load_benchmark("generate_ab")
    model = tiny_causal_lm(
        vocab_size=64, num_heads=4, num_kv_heads=2, head_dim=8, layers=2, max_position_embeddings=64, seed=0
    ).eval()
    ids = torch.randint(64, (1, 12), generator=torch.Generator().manual_seed(0))
    stamps = ab.Stamps()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=5,
        min_new_tokens=5,
        do_sample=False,
        logits_processor=[stamps],
        pad_token_id=0,
    )
    assert out.shape == (1, 17) and len(stamps.times) == 5
    assert stamps.times == sorted(stamps.times)


def test_timings_and_summary(load_benchmark):
    ab = load_benchmark("generate_ab")
    first, step = ab.timings(10.0, [12.0, 12.1, 12.4, 12.6])
    assert first == 2.0 and step == pytest.approx(200.0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        ab.timings(0.0, [1.0])
    runs = {("a", 8): [(4.0, 100.0), (6.0, 120.0)], ("b", 8): [(2.0, 50.0), (3.0, 80.0)]}
    rows = ab.summarize(runs, ["a", "b"], [8])
    assert {"model": "a", "n": 8, "first_token_s": 5.0, "step_ms": 110.0} in rows
    ratio = rows[-1]
    assert ratio["first_token_speedup"] == 2.0 and ratio["step_speedup"] == round(110 / 65, 3)
    assert ratio["first_token_rounds"] == [2.0, 2.0] and ratio["step_rounds"] == [2.0, 1.5]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["smollm2-135m", "plain", "--n", "1024,x"], "--n: expected positive prompt lengths, got '1024,x'"),
        (["smollm2-135m", "plain", "--new", "2"], "--new: expected at least 3 new tokens"),
        (["smollm2-135m", "plain", "--rounds", "0"], "--rounds: expected a positive number of rounds, got 0"),
        (["smollm2-135m", "plain", "--warmup", "-1"], "--warmup: expected a number of tokens ≥ 0, got -1"),
        (["plain", "plain"], "models: expected two different models, got 'plain' twice"),
    ],
)
def test_refuses_bad_arguments(args, message):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "generate_ab.py"), *args], capture_output=True, text=True)
    assert proc.returncode != 0
    assert message in proc.stderr
