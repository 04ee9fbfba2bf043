import math

import pytest
import torch
from torch import nn

from oal.models import (
    apply_output_projection,
    attention_spec,
    exact_attention,
    get_attention_modules,
    num_layers,
    output_projection,
)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize(("heads", "kv"), [(4, 4), (6, 2)])
def test_spec_and_modules(make_model, arch, heads, kv):
    model = make_model(arch, num_heads=heads, num_kv_heads=kv, head_dim=10, layers=3)
    spec = attention_spec(model)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (3, heads, kv, 10)
    assert spec.num_kv_groups == heads // kv
    assert spec.hidden_size == 48
    assert math.isclose(spec.scaling, 10**-0.5)
    mods = get_attention_modules(model)
    assert num_layers(model) == 3
    assert [m.layer_idx for m in mods] == [0, 1, 2]
    assert mods[1] is model.model.layers[1].self_attn
    # The base model works too.
    assert get_attention_modules(model.model) == mods


def test_unsupported_model_raises():
    with pytest.raises(ValueError, match="model: expected a decoder"):
        get_attention_modules(nn.Linear(2, 2))


def test_output_projection(make_model):
    model = make_model("qwen2")  # Qwen2 has no o_proj bias but q/k/v biases
    w, b = output_projection(model, 2)
    assert w is model.model.layers[2].self_attn.o_proj.weight and b is None
    with pytest.raises(ValueError, match=r"layer: expected a layer index in \[0, 3\), got 3"):
        output_projection(model, 3)
    with pytest.raises(ValueError, match="layer"):
        output_projection(model, True)


def test_apply_output_projection_matches_hand_computation(make_model):
    model = make_model("llama", num_heads=6, num_kv_heads=2, head_dim=8, attention_bias=True)
    o = torch.randn(2, 6, 5, 8)
    w, b = output_projection(model, 0)
    expected = torch.einsum("bhnd,ohd->bno", o, w.view(48, 6, 8)) + b
    torch.testing.assert_close(apply_output_projection(model, 0, o), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="o: expected shape"):
        apply_output_projection(model, 0, torch.randn(2, 5, 8, 6))


@pytest.mark.parametrize(("hq", "hkv"), [(3, 3), (6, 2)])
def test_exact_attention_against_naive_softmax(hq, hkv):
    B, N, d, dv = 2, 13, 7, 5
    q, k, v = torch.randn(B, hq, N, d), torch.randn(B, hkv, N, d), torch.randn(B, hkv, N, dv)
    out = exact_attention(q, k, v)
    kk = k.repeat_interleave(hq // hkv, dim=1)
    vv = v.repeat_interleave(hq // hkv, dim=1)
    logits = q @ kk.mT / math.sqrt(d)
    logits = logits.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, logits.softmax(-1) @ vv, rtol=1e-5, atol=1e-6)
    # First position attends to itself only; a custom scale is honoured.
    torch.testing.assert_close(out[:, :, 0], vv[:, :, 0])
    scaled = exact_attention(q, k, v, scale=0.0)
    torch.testing.assert_close(scaled[:, :, -1], vv.mean(2), rtol=1e-5, atol=1e-6)


def test_exact_attention_shape_errors():
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match="Hkv dividing"):
        exact_attention(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8))
    with pytest.raises(ValueError, match="one sequence length"):
        exact_attention(q, torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))
    with pytest.raises(ValueError, match="4-D"):
        exact_attention(q[0], q[0], q[0])
