"""The model card of a saved converted model and the folder that would be shared (oal.conversion.card)."""

from __future__ import annotations

import pytest
import torch
from tiny import byte_tokenizer

from oal.conversion import convert_model, save_converted
from oal.conversion.card import CARD_FILE, check_shareable, model_card, push_converted
from oal.conversion.heads import add_exact_heads
from oal.io import read_json


def saved(make_model, tmp_path, **kw):
    model = make_model("llama", num_heads=6, num_kv_heads=2, layers=4)
    g = torch.Generator().manual_seed(0)
    convert_model(model, "oal", layers="1-3", groups={i: torch.randint(0, 3, (6, 8), generator=g) for i in range(4)})
    add_exact_heads(model, {2: [1]})
    return save_converted(model, tmp_path / "m", tokenizer=byte_tokenizer(), **kw)


def test_card_states_the_conversion_and_the_measurements(make_model, tmp_path):
    rows = [{"what": "passkey 1k", "original": "100 %", "converted": "90 %", "command": "oal eval --tasks passkey"}]
    out = saved(make_model, tmp_path, measurements=rows)
    card = (out / CARD_FILE).read_text()
    assert "| converted layers | 3 of 4: 1–3 |" in card
    assert "`oal` × 2" in card and "`oal+exact` × 1" in card
    assert "| exact softmax KV heads | 1 of 3 × 2 (layer: heads) 2: 1 |" in card
    assert "| passkey 1k | 100 % | 90 % | `oal eval --tasks passkey` |" in card
    assert "AutoModelForCausalLM.from_pretrained" in card


def test_card_without_measurements_says_so_and_needs_a_record():
    config = {
        "model_type": "oal_llama",
        "num_hidden_layers": 2,
        "oal_conversion": {"layers": [0], "kernel_configs": {}},
    }
    assert "No measurements were recorded" in model_card(config)
    with pytest.raises(ValueError, match="oal_conversion"):
        model_card({"model_type": "llama"})


def test_shared_folder_is_safetensors_config_card_and_loader_only(make_model, tmp_path, monkeypatch):
    out = saved(make_model, tmp_path)
    files = check_shareable(out)
    assert files == sorted(
        [
            "README.md",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "modeling_oal.py",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert "oal_conversion" in read_json(out / "config.json")
    uploaded = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=False, exist_ok=False):
            uploaded["repo"] = repo_id

        def upload_folder(self, folder_path, repo_id, commit_message):
            uploaded["files"] = sorted(p.name for p in __import__("pathlib").Path(folder_path).iterdir())

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    push_converted(out, "me/converted")
    assert uploaded == {"repo": "me/converted", "files": files}
    (out / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="pickled weights"):
        check_shareable(out)
