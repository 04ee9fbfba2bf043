"""`oal convert`, `oal generate` and `oal bench decode` on tiny models saved in temporary directories."""

import json

import pytest
import typer
from transformers import GPT2Config, GPT2LMHeadModel
from typer.testing import CliRunner

from oal.cli import app
from oal.grouping import group_heads
from oal.models import attached_kernels, load_model

RUNNER = CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1"})


def make_app() -> typer.Typer:
    return app


def invoke(*args):
    return RUNNER.invoke(make_app(), [str(a) for a in args])


@pytest.fixture
def base_dir(tmp_path, make_model, tokenizer):
    path = tmp_path / "tiny"
    make_model().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_groups(path, num_heads=6, layers=(1, 2)):
    import torch

    chi = torch.rand(len(layers), 4, num_heads, 8, generator=torch.Generator().manual_seed(0))
    group_heads(chi, model_id="tiny", alpha=0.5, gamma=0.0, n_boot=10, layers=list(layers)).save(path)
    return path


def test_convert_then_generate(base_dir, tmp_path):
    out = tmp_path / "converted"
    groups = write_groups(tmp_path / "groups.json")
    result = invoke(
        "convert", "--model", base_dir, "--kernel", "oal", "--layers", "1-2", "--groups", groups, "--out", out
    )
    assert result.exit_code == 0, result.output
    assert "converted 2 layers (1–2)" in result.output
    model = load_model(out)
    assert sorted(attached_kernels(model)) == [1, 2]
    result = invoke("generate", "--model", out, "--prompt", "Hello", "--max-new-tokens", "5")
    assert result.exit_code == 0, result.output
    assert "\nHello" in result.output and "5 tokens in" in result.output and "tokens/s" in result.output


@pytest.mark.parametrize(
    ("args", "option", "message"),
    [
        (["--kernel", "mamba"], "--kernel", "expected one of softmax, global, oal"),
        (["--kernel", "taylorshift", "--layers", "2-9"], "--layers", "expected indices in [0, 4)"),
        (["--kernel", "oal", "--layers", "1", "--calibrated", "missing.safetensors"], "--calibrated", "no such file"),
        (["--kernel", "oal", "--layers", "1"], "--groups", "needs dimension groups"),
        (["--kernel", "performer", "--layers", "1", "--groups", "GROUPS4"], "--groups", "only the 'oal' kernel"),
        (["--kernel", "oal", "--layers", "1", "--groups", "GROUPS4"], "--groups", "made for num_heads=4"),
    ],
)
def test_convert_usage_errors(base_dir, tmp_path, args, option, message):
    groups4 = write_groups(tmp_path / "g4.json", num_heads=4)
    args = [str(groups4) if a == "GROUPS4" else str(tmp_path / a) if a.endswith(".safetensors") else a for a in args]
    result = invoke("convert", "--model", base_dir, *args, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert option in result.output and message in result.output
    assert not (tmp_path / "out").exists()


def test_convert_refuses_unsupported_models_and_busy_dirs(tmp_path, tokenizer, base_dir):
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=256, n_positions=32)).save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)
    result = invoke("convert", "--model", gpt2, "--kernel", "taylorshift", "--layers", "0", "--out", tmp_path / "o")
    assert result.exit_code == 2 and "model type 'gpt2'" in result.output
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    result = invoke(
        "convert", "--model", base_dir, "--kernel", "taylorshift", "--layers", "1", "--out", tmp_path / "busy"
    )
    assert result.exit_code == 2 and "not an empty directory" in result.output


def test_generate_usage_errors(base_dir, tmp_path):
    result = invoke("generate", "--model", tmp_path / "nowhere", "--prompt", "x")
    assert result.exit_code == 2 and "no such model directory" in result.output
    result = invoke("generate", "--model", base_dir, "--prompt", "x", "--max-new-tokens", "0")
    assert result.exit_code == 2 and "--max-new-tokens" in result.output


@pytest.mark.slow
def test_bench_decode_runs_points_in_subprocesses(base_dir, tmp_path):
    out = tmp_path / "bench"
    result = invoke(
        "bench", "decode", "--model", base_dir, "--kernel", "taylorshift", "--layers", "1-2", "--sizes", "16,32",
        "--steps", "2", "--warmup", "0", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "decode.json").read_text())
    assert [(p["method"], p["n"]) for p in doc["points"]] == [
        ("original", 16), ("converted", 16), ("original", 32), ("converted", 32)
    ]  # fmt: skip
    assert all("error" not in p for p in doc["points"]), doc["points"]
    assert "| 32 | converted |" in (out / "decode.md").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--recipe", "fastest"],
            "expected one of retrieval, retrieval-fulldecode, retrieval-fp32products, retrieval-int8kv, "
            "retrieval-fp32kv, retrieval-copy, retrieval-bf16kv, kernel-only, got 'fastest'",
        ),
        (["--recipe", "retrieval", "--kernel", "global"], "--recipe fixes the kernel"),
        (["--recipe", "retrieval", "--layers", "1-2"], "--recipe fixes the kernel"),
    ],
)
def test_convert_recipe_usage_errors(base_dir, tmp_path, args, message, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the recipe must not run")

    monkeypatch.setattr("oal.conversion.recipe.run_recipe", fail)
    result = invoke("convert", "--model", base_dir, *args, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "--recipe" in result.output and message in result.output


def test_convert_exact_kv_dtype_restores_a_converted_model(base_dir, tmp_path):
    """`oal convert --model CONVERTED --exact-kv-dtype int8`: the same kernels, the exact keys and values in int8;
    refused for a model that is not converted, with conversion options, or for an unknown dtype."""
    import torch

    from oal.conversion.convert import save_converted
    from oal.conversion.heads import add_exact_heads
    from oal.kernels import ExactHeadsKernel
    from oal.models import load_tokenizer

    out = tmp_path / "converted"
    groups = write_groups(tmp_path / "groups.json")
    assert invoke("convert", "--model", base_dir, "--layers", "1-2", "--groups", groups, "--out", out).exit_code == 0
    model = load_model(out)
    add_exact_heads(model, {1: [0]}, kv_dtype=torch.bfloat16)
    save_converted(model, out, tokenizer=load_tokenizer(out), overwrite=True)
    int8 = tmp_path / "int8"
    result = invoke("convert", "--model", out, "--exact-kv-dtype", "int8", "--out", int8)
    assert result.exit_code == 0, result.output
    assert "exact heads of 1 layers" in result.output
    kernels = attached_kernels(load_model(int8))
    assert isinstance(kernels[1], ExactHeadsKernel) and kernels[1].kv_dtype == torch.int8
    before = attached_kernels(load_model(out))
    for layer in (1, 2):
        for (name, a), (_, b) in zip(
            before[layer].state_dict().items(), kernels[layer].state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), name
    for args, message in (
        (["--model", base_dir, "--exact-kv-dtype", "int8"], "not a converted model"),
        (["--model", out, "--exact-kv-dtype", "int4"], "expected one of bfloat16, int8, model"),
        (["--model", out, "--exact-kv-dtype", "int8", "--layers", "1"], "re-saves a converted model as it is"),
        (["--model", out, "--exact-decode-budget", "100"], "decode_budget"),
        (["--model", out, "--exact-decode-budget", "64", "--exact-decode-page", "32"], "decode_budget"),
    ):
        result = invoke("convert", *args, "--out", tmp_path / "x")
        assert result.exit_code != 0 and message in result.output, result.output
    # a decode budget (with the int8 dtype in the same call), then none again
    paged = tmp_path / "paged"
    result = invoke(
        "convert",
        "--model",
        out,
        "--exact-kv-dtype",
        "int8",
        "--exact-decode-budget",
        "256",
        "--exact-decode-page",
        "16",
        "--out",
        paged,
    )
    assert result.exit_code == 0 and "decode budget 256 (pages of 16)" in result.output, result.output
    k = attached_kernels(load_model(paged))[1]
    assert (k.kv_dtype, k.decode_budget, k.decode_page) == (torch.int8, 256, 16)
    assert invoke("convert", "--model", paged, "--exact-decode-budget", "0", "--out", tmp_path / "full").exit_code == 0
    assert attached_kernels(load_model(tmp_path / "full"))[1].decode_budget is None


def test_restore_in_place_keeps_and_renames_the_recipe_record(base_dir, tmp_path):
    """`restore_converted(model, model, overwrite=True)` (what benchmarks/write_model_card.py does to the committed
    model) reads recipe.json before the directory is rewritten: the record survives, with the new fields and the
    recipe name they make; a re-store elsewhere also names where it came from."""
    import json
    from dataclasses import asdict

    import torch

    from oal.conversion.convert import save_converted
    from oal.conversion.heads import add_exact_heads
    from oal.conversion.recipe import RECIPES, restore_converted
    from oal.models import load_tokenizer

    out = tmp_path / "converted"
    groups = write_groups(tmp_path / "groups.json")
    assert invoke("convert", "--model", base_dir, "--layers", "1-2", "--groups", groups, "--out", out).exit_code == 0
    model = load_model(out)
    add_exact_heads(model, {1: [0]}, kv_dtype=torch.bfloat16)
    save_converted(model, out, tokenizer=load_tokenizer(out), overwrite=True)
    record = {"recipe": asdict(RECIPES["retrieval-fulldecode"]), "model": "tiny"}
    (out / "recipe.json").write_text(json.dumps(record))
    full = RECIPES["retrieval"]
    assert (
        restore_converted(
            str(out), out, decode_budget=full.exact_decode_budget, decode_page=full.exact_decode_page, overwrite=True
        )
        == 1
    )
    kept = json.loads((out / "recipe.json").read_text())
    assert kept["recipe"]["name"] == "retrieval" and kept["recipe"]["exact_decode_budget"] == full.exact_decode_budget
    assert kept["model"] == "tiny" and "restored_from" not in kept
    assert attached_kernels(load_model(out))[1].decode_budget == full.exact_decode_budget
    other = tmp_path / "other"
    restore_converted(str(out), other, decode_budget=None)
    moved = json.loads((other / "recipe.json").read_text())
    assert moved["recipe"]["name"] == "retrieval-fulldecode" and moved["restored_from"] == str(out)
