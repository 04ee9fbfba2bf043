"""`oal finetune` on a tiny Llama saved to disk, with a byte tokenizer and the shared WikiText-2 valid split."""

from __future__ import annotations

import json

import pytest
import torch
import typer
from tiny import tiny_causal_lm
from typer.testing import CliRunner

from oal.cli import app


def make_app() -> typer.Typer:
    return app


@pytest.fixture
def model_dir(tmp_path, byte_tokenizer, monkeypatch):
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)  # the global generator, not a forked one
    model = tiny_causal_lm(
        vocab_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        layers=3,
        hidden_size=32,
        intermediate_size=48,
        max_position_embeddings=2048,  # LlamaConfig's default
    )
    path = tmp_path / "tiny"
    model.save_pretrained(path)
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


def test_eval_and_generate_load_a_finetune_run(tmp_path, model_dir, data_dir):
    """`oal eval --model RUN` and `oal generate --model RUN` load the recorded backbone, kernels and merged adapter."""
    from oal.evaluation import evaluate, load_model_and_tokenizer
    from oal.models import load_model, load_tokenizer
    from oal.training import load_finetuned

    out = tmp_path / "run"
    args = ["finetune", "--model", str(model_dir), "--preset", "smoke", "--out", str(out), "--kernel", "oal"]
    args += ["--layers", "1-2", "--random-groups", "3", "--updates", "2", "--block-len", "32", "--threads", "1"]
    result = CliRunner().invoke(make_app(), [*args, "--data-dir", str(data_dir)])
    assert result.exit_code == 0, result.output
    info = json.loads((out / "best" / "info.json").read_text())
    assert info["base_model"] == str(model_dir)

    net, _ = load_model_and_tokenizer(out, device="cpu")
    reference = load_finetuned(load_model(model_dir), out, merge=True)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(net(input_ids=ids).logits, reference(input_ids=ids).logits)
        plain = load_model(model_dir)(input_ids=ids).logits
    assert not torch.allclose(net(input_ids=ids).logits, plain)  # the adapter and kernels were applied

    report = tmp_path / "eval.json"
    eval_args = ["eval", "--model", str(out / "best"), "--tasks", "wikitext", "--block-len", "32"]
    eval_args += ["--max-blocks", "2", "--data", str(data_dir), "--device", "cpu", "--out", str(report)]
    result = CliRunner().invoke(make_app(), eval_args)
    assert result.exit_code == 0, result.output
    ppl = json.loads(report.read_text())["results"]["wikitext"]["perplexity,none"]
    expected = evaluate(
        reference,
        load_tokenizer(model_dir),
        ["wikitext"],
        block_len=32,
        max_blocks=2,
        data_dir=data_dir,
        progress=False,
    )
    assert ppl == pytest.approx(expected["results"]["wikitext"]["perplexity,none"], rel=1e-6)

    result = CliRunner().invoke(
        make_app(), ["generate", "--model", str(out), "--prompt", "the", "--max-new-tokens", "3", "--threads", "1"]
    )
    assert result.exit_code == 0, result.output

    result = CliRunner().invoke(
        make_app(), ["eval", "--model", str(model_dir), "--base-model", "x", "--tasks", "wikitext"]
    )
    assert result.exit_code != 0 and "base_model" in result.output


def test_export_writes_a_converted_model_that_auto_classes_load(tmp_path, model_dir, data_dir):
    """`oal finetune --export DIR` (on-the-fly conversion: the merged backbone gets a conversion record) writes a
    directory that AutoModelForCausalLM loads as the converted model, with the merged run's logits."""
    from transformers import AutoModelForCausalLM

    from oal.models import load_model
    from oal.models.hf import oal_classes
    from oal.training import load_finetuned

    out, export = tmp_path / "run", tmp_path / "export"
    args = ["finetune", "--model", str(model_dir), "--preset", "smoke", "--out", str(out), "--kernel", "oal"]
    args += ["--layers", "1-2", "--random-groups", "3", "--updates", "2", "--block-len", "32", "--threads", "1"]
    result = CliRunner().invoke(make_app(), [*args, "--data-dir", str(data_dir), "--export", str(export)])
    assert result.exit_code == 0, result.output
    loaded = AutoModelForCausalLM.from_pretrained(export)
    assert type(loaded) is oal_classes("llama")[1]
    reference = load_finetuned(load_model(model_dir), out, merge=True)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-6)
    assert (export / "README.md").is_file() and (export / "model.safetensors").is_file()
    again = CliRunner().invoke(make_app(), [*args, "--data-dir", str(data_dir), "--export", str(export)])
    assert again.exit_code == 2 and "--export" in again.output
