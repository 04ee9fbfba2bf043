from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from oal.evaluation import load_model_and_tokenizer, load_task
from oal.evaluation import loading as loading_module


def test_prefers_oal_models_load_model(monkeypatch):
    calls = []
    fake = SimpleNamespace(
        load_model=lambda name, *, dtype, device: calls.append(("model", name, dtype, device)) or "M",
        load_tokenizer=lambda name: calls.append(("tokenizer", name)) or "T",
    )
    monkeypatch.setattr(loading_module, "_oal_models", lambda: fake)
    assert load_model_and_tokenizer("some/dir", dtype="bf16", device="cpu") == ("M", "T")
    assert calls == [("model", "some/dir", torch.bfloat16, torch.device("cpu")), ("tokenizer", "some/dir")]


def test_falls_back_only_when_oal_models_is_missing(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib, "import_module", missing)
    assert loading_module._oal_models() is None

    def broken(name):
        raise ModuleNotFoundError("No module named 'somedep'", name="somedep")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="somedep"):
        loading_module._oal_models()


def test_transformers_fallback_loads_a_directory(model, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(loading_module, "_oal_models", lambda: None)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    net, tok = load_model_and_tokenizer(tmp_path, dtype="float32", device="cpu")
    ids = torch.tensor([tokenizer("the cat sat", add_special_tokens=False)["input_ids"]])
    assert not net.training and tok("the cat sat", add_special_tokens=False)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(net(input_ids=ids).logits, model(input_ids=ids).logits)


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        load_model_and_tokenizer("x", dtype="int8")
    with pytest.raises(ValueError, match="name_or_path"):
        load_model_and_tokenizer("")


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_tokenizer_context_is_a_prefix(data_dir):
    """On SmolLM2's tokenizer the lm-eval split is exact: encode(context) is a prefix of encode(context + option)."""
    from transformers import AutoTokenizer

    try:
        source, kwargs = loading_module._transformers_source("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = AutoTokenizer.from_pretrained(source, **kwargs)
    for task in ("piqa", "hellaswag", "arc_easy"):
        for item in load_task(task, data_dir=data_dir, limit=300).items:
            ctx = tok(item.context, add_special_tokens=False)["input_ids"]
            for choice in item.choices:
                whole = tok(item.context + " " + choice, add_special_tokens=False)["input_ids"]
                assert whole[: len(ctx)] == ctx, (task, item.id, choice)
