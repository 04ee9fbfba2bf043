"""benchmarks/prefill_trace.py, decode_ab.py and chunk_ab.py: a trace snapshot reads what the process holds; bad
arguments are refused before any model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc/self/status")
def test_snapshot_sees_a_new_tensor(load_benchmark):
    trace = load_benchmark("prefill_trace")
    before = trace.snapshot("before")
    assert set(before) == {"tag", "rss", "hwm", "arena", "mmap", "live", "free"}
    assert 0 < before["rss"] <= before["hwm"]
    x = torch.ones(64 * 2**20 // 4)  # 64 MB, written: resident, and malloc's (mmapped or heap) until freed
    after = trace.snapshot("after")
    assert after["rss"] - before["rss"] > 60
    assert after["live"] + after["mmap"] - before["live"] - before["mmap"] > 60
    del x


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n", "1024,0"], "--n: expected positive prompt lengths, got '1024,0'"),
        (["--n", "1024,x"], "--n: expected positive prompt lengths, got '1024,x'"),
        (["--batch", "0"], "--batch: expected a positive batch size, got 0"),
    ],
)
def test_decode_ab_refuses_bad_arguments(args, message):
    cmd = [sys.executable, str(BENCHMARKS / "decode_ab.py"), "smollm2-135m", "plain", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_chunk_ab_refuses_unknown_ways():
    cmd = [sys.executable, str(BENCHMARKS / "chunk_ab.py"), "--ways", "at_end,other"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "--ways: expected at_end, fold or both, got 'at_end,other'" in proc.stderr


def test_prefill_trace_refuses_unknown_ablations():
    cmd = [sys.executable, str(BENCHMARKS / "prefill_trace.py"), "plain", "--without", "chunk_release,other"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0
    assert (
        "expected names among chunk_release, prompt_room, softmax_chunk, exact_chunk, got 'chunk_release,other'"
        in proc.stderr
    )


@pytest.mark.parametrize("tokens", ["-1", "2048"])
def test_prefill_trace_refuses_a_first_prompt_outside_the_prompt(tokens):
    cmd = [sys.executable, str(BENCHMARKS / "prefill_trace.py"), "plain", "--n", "1024", "--first-prompt", tokens]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"--first-prompt: expected 0 … --n (1024) tokens, got {tokens}" in proc.stderr


def test_prefill_trace_takes_back_what_it_is_told(load_benchmark, monkeypatch):
    from oal.kernels import hybrid
    from oal.models import hooks, prefill, state_cache

    trace = load_benchmark("prefill_trace")
    monkeypatch.setattr(state_cache, "context_end", state_cache.context_end)
    monkeypatch.setattr(hooks, "_softmax_chunk", hooks._softmax_chunk)
    monkeypatch.setattr(hybrid, "softmax_at_end", hybrid.softmax_at_end)
    calls = []
    monkeypatch.setattr(prefill, "_forward", lambda *a, release=False, **k: calls.append(release))
    trace.take_back(("chunk_release", "prompt_room", "softmax_chunk", "exact_chunk"))
    prefill._forward(None, None, None, {}, release=True)
    assert calls == [False]
    with state_cache.kept_form.prompt_end(100):
        assert state_cache.context_end(10) == 10
    q = torch.zeros(1, 2, 4, 8)
    assert hooks._softmax_chunk(q, torch.zeros(1, 2, 9, 8), torch.zeros(1, 2, 9, 8), None, 0.0, None, {}) is None
    assert hybrid.softmax_at_end(q, torch.zeros(1, 2, 9, 8), torch.zeros(1, 2, 9, 8), 1.0) is None
