"""`oal finetune` on a tiny Llama saved to disk, with a byte tokenizer and the shared WikiText-2 valid split."""

from __future__ import annotations

import json

import pytest
import torch
import typer
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from oal.cli import app


def make_app() -> typer.Typer:
    return app


@pytest.fixture
def model_dir(tmp_path, byte_tokenizer, monkeypatch):
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    path = tmp_path / "tiny"
    LlamaForCausalLM(config).save_pretrained(path)
    byte_tokenizer.save_pretrained(path)
    return path


def test_finetune_command_runs_and_resumes(tmp_path, model_dir, data_dir):
    out = tmp_path / "run"
    args = ["finetune", "--model", str(model_dir), "--preset", "smoke", "--out", str(out), "--kernel", "oal"]
    args += ["--layers", "1-2", "--random-groups", "3", "--updates", "3", "--block-len", "32", "--threads", "1"]
    args += ["--data-dir", str(data_dir)]
    result = CliRunner().invoke(make_app(), args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"]["converted_layers"] == [1, 2] and summary["updates"] == 3
    assert summary["config"]["preset"] == "smoke" and summary["config"]["block_len"] == 32
    assert summary["data"]["source"].endswith("wiki.valid.raw")
    again = CliRunner().invoke(make_app(), args)
    assert again.exit_code == 0, again.output
    assert json.loads((out / "summary.json").read_text())["best"] == summary["best"]
    # another protocol in the same directory is refused, not silently mixed
    other = CliRunner().invoke(make_app(), [*args, "--seed", "1"])
    assert other.exit_code == 1 and "different run" in other.output


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--layers", "1"], "need --kernel"),
        (["--kernel", "oal", "--layers", "1"], "needs dimension groups"),
        (["--kernel", "global", "--layers", "1", "--random-groups", "2"], "only for --kernel oal"),
        (["--kernel", "global", "--layers", "99"], "layers"),
        (["--preset", "huge"], "preset"),
    ],
)
def test_usage_errors(tmp_path, model_dir, extra, message):
    result = CliRunner().invoke(make_app(), ["finetune", "--model", str(model_dir), "--out", str(tmp_path), *extra])
    assert result.exit_code == 2 and message in result.output, result.output
