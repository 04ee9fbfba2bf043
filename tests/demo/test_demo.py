"""`oal demo` end to end on tiny saved models: the report's numbers come from the stages, stages resume."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from tiny import byte_tokenizer, tiny_causal_lm

from oal.conversion import convert_model, save_converted
from oal.demo import DemoConfig, run_demo
from oal.demo.report import rows
from oal.demo.run import speed
from oal.kernels import SinkWindowKernel
from oal.models import attach_kernel, attached_kernels

DATA = Path(os.environ.get("OAL_DATA_DIR", Path(__file__).resolve().parents[3] / "shared" / "data"))
pytestmark = pytest.mark.skipif(not (DATA / "wikitext-2-raw").is_dir(), reason="needs ../shared/data (WikiText-2)")


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "cache"))
    tok = byte_tokenizer(pad=True)

    def base():
        return tiny_causal_lm(
            vocab_size=256, num_heads=6, num_kv_heads=2, head_dim=8, layers=3, max_position_embeddings=512, seed=0
        )

    original = base()
    original.save_pretrained(tmp_path / "original")
    tok.save_pretrained(tmp_path / "original")
    model = base()
    g = torch.Generator().manual_seed(0)
    convert_model(model, "oal", layers="1-2", groups={i: torch.randint(0, 3, (6, 8), generator=g) for i in range(3)})
    for i, k in attached_kernels(model).items():
        attach_kernel(model, i, SinkWindowKernel(k, n_sink=2, window=8))
    save_converted(model, tmp_path / "converted", tokenizer=tok)
    return str(tmp_path / "original"), str(tmp_path / "converted")


def test_demo_report_and_resume(models, tmp_path):
    original, converted = models
    config = DemoConfig(
        original=original,
        converted=converted,
        block_len=64,
        ppl_blocks=2,
        passkey_lengths=(320, 400),
        trials=2,
        decode_lengths=(32, 96),
        decode_steps=2,
        speed_rounds=3,
        prefill_tokens=100,
        max_new_tokens=4,
        prompts=("Hello",),
        threads=1,
        data_dir=str(DATA),
    )
    out = tmp_path / "demo"
    report = run_demo(out, config)
    for name in ("report.md", "report.json", "demo.png"):
        assert (out / name).is_file()
    table = rows(report)
    whats = [w for w, *_ in table]
    assert whats[:2] == ["perplexity, wikitext-2 test (2 × 64 tokens)", "perplexity, python docs (2 × 64 tokens)"]
    assert "passkey accuracy at 400 tokens (2 prompts)" in whats and "cache MB at 96 tokens" in whats
    res, fast = report["results"], report["speed"]
    # the converted model keeps a constant-size state in its converted layers: its cache grows less
    grow = {m: fast["96"][m]["cache_mb"] - fast["32"][m]["cache_mb"] for m in res}
    assert grow["converted"] < grow["original"]
    for n, rounds in (("32", 4), ("96", 3)):  # 100 prefill tokens: 4 rounds of 32, 3 (speed_rounds) of 96
        point = fast[n]
        for m in res:
            assert len(point[m]["prefill_rounds"]) == rounds and len(point[m]["step_ms"]) == 2
            assert point[m]["prefill_s"] == statistics.median(point[m]["prefill_rounds"])
        ratios = point["ratios"]["prefill_rounds"]
        assert ratios == [
            c / o
            for o, c in zip(point["original"]["prefill_rounds"], point["converted"]["prefill_rounds"], strict=True)
        ]
    assert "decode ms/token at 96 tokens (median of 2 steps, side by side)" in whats
    assert any(w == "prefill s at 32 tokens (median of 4 rounds, side by side)" and "rounds" in r for w, *_, r in table)
    assert res["original"]["perplexity"]["wikitext-2 test"]["n_tokens"] == 2 * 63
    md = (out / "report.md").read_text()
    assert "| perplexity, wikitext-2 test (2 × 64 tokens) |" in md and "**Hello**" in md
    # resume: the same config reuses every stage file and loads no model; a changed one recomputes only what it
    # changes
    stages = sorted(p for p in out.glob("**/*.json") if p.name != "report.json")
    assert [p.relative_to(out).as_posix() for p in stages] == [
        "converted/continuations.json",
        "converted/passkey.json",
        "converted/perplexity.json",
        "original/continuations.json",
        "original/passkey.json",
        "original/perplexity.json",
        "speed.json",
    ]
    stamps = {p: p.stat().st_mtime_ns for p in stages}
    with patch("oal.demo.run._load", side_effect=AssertionError("a model was loaded for reused stages")):
        again = run_demo(out, config)
    assert {p: p.stat().st_mtime_ns for p in stages} == stamps
    assert again["results"] == json.loads(json.dumps(report["results"]))
    assert again["speed"] == json.loads(json.dumps(report["speed"]))
    run_demo(out, DemoConfig(**{**config.__dict__, "trials": 3}))
    changed = {p.relative_to(out).as_posix() for p in stages if p.stat().st_mtime_ns != stamps[p]}
    assert changed == {"original/passkey.json", "converted/passkey.json"}
    run_demo(out, DemoConfig(**{**config.__dict__, "trials": 3, "speed_rounds": 1}))
    assert json.loads((out / "speed.json").read_text())["key"]["rounds"] == 1
    run_demo(out, DemoConfig(**{**config.__dict__, "trials": 3, "speed_rounds": 1, "prefill_tokens": 64}))
    again = json.loads((out / "speed.json").read_text())
    assert again["key"]["prefill_tokens"] == 64
    assert [len(again["result"][n]["original"]["prefill_rounds"]) for n in ("32", "96")] == [2, 1]


def test_speed_takes_models_in_turn(monkeypatch):
    """Prefill rounds and decode steps alternate which model goes first; every step of a model continues its own
    cache."""
    calls = []

    class Recorder(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name
            self.config = SimpleNamespace(vocab_size=11)

        def forward(self, ids, cache, logits_to_keep=0):
            calls.append((self.name, ids.shape[1]))
            cache.seen = getattr(cache, "seen", 0) + ids.shape[1]
            return SimpleNamespace(logits=torch.zeros(1, 1, 11))

    monkeypatch.setattr("oal.models.KernelCache", lambda model: SimpleNamespace())
    monkeypatch.setattr("oal.models.state_cache.cache_nbytes", lambda cache: cache.seen * 2**20)
    config = DemoConfig(decode_lengths=(20,), decode_steps=3, speed_rounds=3, prefill_tokens=20)
    out = speed({"a": Recorder("a"), "b": Recorder("b")}, config, progress=False)
    prefills = [name for name, n in calls if n > 1]
    # one untimed prompt per model, then the timed rounds
    assert prefills == ["a", "b", "a", "b", "b", "a", "a", "b"]
    steps = [name for name, n in calls if n == 1]
    assert steps == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    # the last round's caches: 20 prompt tokens, then 2 untimed and 3 timed steps
    assert out["20"]["a"]["cache_mb"] == out["20"]["b"]["cache_mb"] == 25
    assert len(out["20"]["a"]["step_ms"]) == 3 and len(out["20"]["ratios"]["decode_step_quartiles"]) == 3
    with pytest.raises(ValueError, match="one vocabulary size"):
        other = Recorder("c")
        other.config = SimpleNamespace(vocab_size=12)
        speed({"a": Recorder("a"), "c": other}, config, progress=False)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="trials: expected a positive integer"):
        DemoConfig(trials=0)
    with pytest.raises(ValueError, match="speed_rounds: expected a positive integer"):
        DemoConfig(speed_rounds=0)
    with pytest.raises(ValueError, match="prefill_tokens: expected a positive integer"):
        DemoConfig(prefill_tokens=-8)
    with pytest.raises(ValueError, match="decode_lengths: expected context lengths"):
        DemoConfig(decode_lengths=())


def test_prefill_rounds_cover_the_prefill_tokens():
    """The defaults: 8 rounds at 1k (one prompt's time swings most there), speed_rounds at 4k and 8k."""
    config = DemoConfig()
    assert [config.prefill_rounds(n) for n in (1024, 1000, 4096, 8192)] == [8, 9, 3, 3]
    assert DemoConfig(speed_rounds=5, prefill_tokens=100).prefill_rounds(30) == 5
