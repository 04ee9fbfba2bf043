"""`oal demo` end to end on tiny saved models: the report's numbers come from the stages, stages resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tiny import byte_tokenizer, tiny_causal_lm

from oal.conversion import convert_model, save_converted
from oal.demo import DemoConfig, run_demo
from oal.demo.report import rows
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
    res = report["results"]
    # the converted model keeps a constant-size state in its converted layers: its cache grows less
    grow = {m: res[m]["decode"]["96"]["cache_mb"] - res[m]["decode"]["32"]["cache_mb"] for m in res}
    assert grow["converted"] < grow["original"]
    assert res["original"]["perplexity"]["wikitext-2 test"]["n_tokens"] == 2 * 63
    md = (out / "report.md").read_text()
    assert "| perplexity, wikitext-2 test (2 × 64 tokens) |" in md and "**Hello**" in md
    # resume: the same config reuses every stage file; a changed one recomputes only what it changes
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/*.json")}
    assert len(stamps) == 8
    again = run_demo(out, config)
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/*.json")} == stamps
    assert again["results"] == json.loads(json.dumps(report["results"]))
    run_demo(out, DemoConfig(**{**config.__dict__, "trials": 3}))
    changed = {p.relative_to(out).as_posix() for p in out.glob("*/*.json") if p.stat().st_mtime_ns != stamps[p]}
    assert changed == {"original/passkey.json", "converted/passkey.json"}


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="trials: expected a positive integer"):
        DemoConfig(trials=0)
    with pytest.raises(ValueError, match="decode_lengths: expected context lengths"):
        DemoConfig(decode_lengths=())
