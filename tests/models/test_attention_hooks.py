import pytest
import torch
from transformers import DynamicCache

from oal.kernels import AttentionKernel, OALKernel, SoftmaxKernel
from oal.models import (
    apply_output_projection,
    attach_kernel,
    attached_kernels,
    capture_qkv,
    detach_kernel,
    exact_attention,
)

ARCH_GQA = [("llama", 6, 2), ("llama", 4, 4), ("qwen2", 6, 2), ("mistral", 6, 3)]


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE at positions 0..N-1, computed in float64 from the definition."""
    d, n = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : d // 2].double(), x[..., d // 2 :].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


@pytest.mark.parametrize(("arch", "heads", "kv"), ARCH_GQA)
def test_capture_leaves_logits_unchanged(make_model, arch, heads, kv):
    model = make_model(arch, num_heads=heads, num_kv_heads=kv)
    ids = torch.randint(0, 101, (2, 23))
    ref = logits(model, ids)
    with capture_qkv(model, layers=[0, 2], outputs=True) as rec:
        assert model.config._attn_implementation == "oal"
        out = logits(model, ids)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(out, ref)
    assert list(rec) == [0, 2]
    q, k, v, o, scale = rec[2]
    assert q.shape == (2, heads, 23, 8) and k.shape == v.shape == (2, kv, 23, 8) and o.shape == (2, heads, 23, 8)
    assert scale == pytest.approx(8**-0.5)
    assert not q.requires_grad and q.device.type == "cpu"
    with pytest.raises(KeyError, match="not captured"):
        rec[1]


@pytest.mark.parametrize(("arch", "heads", "kv"), ARCH_GQA)
def test_captured_qkv_match_independent_recomputation(make_model, arch, heads, kv):
    model = make_model(arch, num_heads=heads, num_kv_heads=kv)
    ids = torch.randint(0, 101, (1, 19))
    layer = 1
    with torch.no_grad(), capture_qkv(model, layers=[layer]) as rec:
        hidden = model(ids, output_hidden_states=True).hidden_states[layer]
    attn = model.model.layers[layer].self_attn
    with torch.no_grad():
        x = model.model.layers[layer].input_layernorm(hidden)
        q = attn.q_proj(x).view(1, 19, heads, 8).transpose(1, 2)
        k = attn.k_proj(x).view(1, 19, kv, 8).transpose(1, 2)
        v = attn.v_proj(x).view(1, 19, kv, 8).transpose(1, 2)
    theta = model.config.rope_parameters["rope_theta"]
    torch.testing.assert_close(rec[layer].q.double(), rope(q, theta), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rec[layer].k.double(), rope(k, theta), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rec[layer].v, v)


def test_captured_output_is_exact_attention_and_feeds_o_proj(make_model):
    model = make_model("llama", num_heads=6, num_kv_heads=2, attention_bias=True)
    ids = torch.randint(0, 101, (2, 17))
    seen = {}
    handle = model.model.layers[1].self_attn.register_forward_hook(lambda m, a, out: seen.setdefault("y", out[0]))
    with torch.no_grad(), capture_qkv(model, layers=[1], outputs=True) as rec:
        model(ids)
    handle.remove()
    q, k, v, o, scale = rec[1]
    assert torch.equal(exact_attention(q, k, v, scale=scale), o)
    torch.testing.assert_close(apply_output_projection(model, 1, o), seen["y"], rtol=1e-6, atol=1e-6)


def test_capture_keep_all_and_latest(make_model):
    model = make_model()
    a, b = torch.randint(0, 101, (1, 5)), torch.randint(0, 101, (1, 9))
    with torch.no_grad(), capture_qkv(model, layers=[0], keep_all=True) as rec_all:
        model(a)
        model(b)
    assert [c.q.shape[2] for c in rec_all.history(0)] == [5, 9]
    with torch.no_grad(), capture_qkv(model, layers=[0]) as rec:
        assert len(rec) == 0
        with pytest.raises(KeyError, match="has not run yet"):
            rec[0]
        model(a)
        model(b)
    assert rec[0].q.shape[2] == 9 and len(rec.history(0)) == 1 and rec[0].o is None


def test_capture_restores_on_exception_and_rejects_bad_layers(make_model):
    model = make_model()
    with pytest.raises(RuntimeError, match="boom"), capture_qkv(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m.self_attn, "_oal_recorder") for m in model.model.layers)
    with pytest.raises(ValueError, match="layers: expected a layer index"), capture_qkv(model, layers=[3]):
        pass
    with pytest.raises(ValueError, match="distinct"), capture_qkv(model, layers=[1, 1]):
        pass
    with (
        capture_qkv(model, layers=[1]),
        pytest.raises(ValueError, match="already being captured"),
        capture_qkv(model, layers=[0, 1]),
    ):
        pass
    assert model.config._attn_implementation == "sdpa"


def test_capture_restores_eager(make_model):
    model = make_model()
    model.set_attn_implementation("eager")
    with capture_qkv(model, layers=[0]):
        assert model.config._attn_implementation == "oal"
    assert model.config._attn_implementation == "eager"


def test_capture_with_padding_matches_sdpa(make_model):
    model = make_model()
    ids = torch.randint(0, 101, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, :4] = 0
    ref = logits(model, ids, attention_mask=mask)
    with capture_qkv(model, layers=[0]):
        assert torch.equal(logits(model, ids, attention_mask=mask), ref)


@pytest.mark.parametrize(("arch", "heads", "kv"), ARCH_GQA)
def test_softmax_kernel_reproduces_logits(make_model, arch, heads, kv):
    model = make_model(arch, num_heads=heads, num_kv_heads=kv, qk_gain=4.0)
    ids = torch.randint(0, 101, (2, 29))
    ref = logits(model, ids)
    for layer in range(3):
        attach_kernel(model, layer, SoftmaxKernel(heads, kv, 8))
    assert model.config._attn_implementation == "oal"
    torch.testing.assert_close(logits(model, ids), ref, rtol=0, atol=1e-6)
    for layer in range(3):
        assert isinstance(detach_kernel(model, layer), SoftmaxKernel)
    assert model.config._attn_implementation == "sdpa"


def test_oal_kernel_changes_logits_and_detaches(make_model):
    model = make_model("llama", num_heads=6, num_kv_heads=2, qk_gain=6.0)
    ids = torch.randint(0, 101, (2, 33))
    ref = logits(model, ids)
    groups = torch.randint(0, 3, (6, 8))
    kernel = OALKernel(groups, num_kv_heads=2)
    attach_kernel(model, 1, kernel)
    assert attached_kernels(model) == {1: kernel}
    assert "model.layers.1.self_attn.oal_kernel.L" in model.state_dict()
    with capture_qkv(model, layers=[1], outputs=True) as rec:
        out = logits(model, ids)
    assert model.config._attn_implementation == "oal"  # the kernel is still attached
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() > 1e-3
    # The recorded output is the kernel's, computed from the recorded q, k, v.
    q, k, v, o, _ = rec[1]
    torch.testing.assert_close(o, kernel(q, k, v)[0].detach(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(o, exact_attention(q, k, v), atol=1e-3)
    detach_kernel(model, 1)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model, ids), ref)


def test_kernel_gradients_flow(make_model):
    model = make_model(qk_gain=3.0)
    kernel = OALKernel(torch.randint(0, 2, (6, 8)), num_kv_heads=2)
    attach_kernel(model, 0, kernel)
    model(torch.randint(0, 101, (1, 12))).logits.square().mean().backward()
    assert kernel.L.grad is not None and kernel.L.grad.abs().sum() > 0


def test_attach_kernel_validation(make_model):
    model = make_model("llama", num_heads=6, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"kernel: expected \(num_heads, num_kv_heads, head_dim\) = \(6, 2, 8\)"):
        attach_kernel(model, 0, SoftmaxKernel(6, 3, 8))
    with pytest.raises(ValueError, match="AttentionKernel"):
        attach_kernel(model, 0, torch.nn.Identity())
    with pytest.raises(ValueError, match="layer: expected a layer index"):
        attach_kernel(model, 5, SoftmaxKernel(6, 2, 8))
    odd = SoftmaxKernel(6, 2, 8)
    odd.scale = 0.5
    with pytest.raises(ValueError, match="scale"):
        attach_kernel(model, 0, odd)
    with pytest.raises(ValueError, match="no kernel is attached to layer 0"):
        detach_kernel(model, 0)
    assert model.config._attn_implementation == "sdpa"


def test_padded_rows_are_evaluated_on_their_real_tokens(make_model):
    model = make_model()
    ids = torch.randint(0, 101, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    ref = logits(model, ids, attention_mask=mask)  # transformers' own SDPA with the padding mask
    attach_kernel(model, 2, SoftmaxKernel(6, 2, 8))
    got = logits(model, ids, attention_mask=mask)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, 3:], ref[1, 3:], rtol=1e-5, atol=1e-5)
    # An all-ones padding mask is plain causal attention and is accepted.
    torch.testing.assert_close(logits(model, ids, attention_mask=torch.ones_like(mask)), logits(model, ids))


def test_softmax_kernel_decodes_from_its_kv_cache(make_model):
    model = make_model(qk_gain=3.0)
    ids = torch.randint(0, 101, (2, 10))
    ref_cache = DynamicCache(config=model.config)
    ref = [logits(model, ids[:, :7], cache=ref_cache), logits(model, ids[:, 7:], cache=ref_cache)]
    attach_kernel(model, 2, SoftmaxKernel(6, 2, 8))
    cache = DynamicCache(config=model.config)
    out = [logits(model, ids[:, :7], cache=cache), logits(model, ids[:, 7:], cache=cache)]
    assert cache.layers[2].keys.shape[2] == 10  # exact softmax keeps keys and values
    for got, want in zip(out, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_cache_filled_before_attaching_is_refused(make_model):
    model = make_model()
    ids = torch.randint(0, 101, (1, 6))
    cache = DynamicCache(config=model.config)
    logits(model, ids, cache=cache)
    attach_kernel(model, 1, OALKernel(torch.zeros(6, 8, dtype=torch.long), num_kv_heads=2))
    with pytest.raises(ValueError, match="layer 1 has a kernel.*holds keys and values"):
        logits(model, ids[:, :1], cache=cache)


def test_kernel_dtype_and_custom_kernel_is_called(make_model):
    calls = []

    class Zero(AttentionKernel):
        def forward(self, q, k, v, *, mode="chunk", initial_state=None, output_final_state=False):
            calls.append((q.shape, k.shape))
            return torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64), None

    model = make_model().to(torch.bfloat16)
    attach_kernel(model, 0, Zero(6, 2, 8))
    with capture_qkv(model, layers=[0], outputs=True) as rec:
        out = logits(model, torch.randint(0, 101, (1, 7)))
    assert calls == [((1, 6, 7, 8), (1, 2, 7, 8))]
    assert out.dtype == torch.bfloat16 and rec[0].o.dtype == torch.bfloat16 and not rec[0].o.any()


@pytest.mark.parametrize(
    ("window", "exact", "want"),
    [
        (None, None, {"chunk", "decode"}),
        (4, None, {"chunk", "decode", "window"}),
        (None, {1: [0]}, {"chunk", "decode", "window"}),
    ],
)
def test_attaching_loads_the_fused_extensions_the_kernel_calls(make_model, monkeypatch, window, exact, want):
    from tiny import convert_tiny

    from oal.ops.quadratic import cpu as cpu_kernels

    loaded = set()
    monkeypatch.setattr(cpu_kernels, "load", lambda kind="chunk": loaded.add(kind))
    convert_tiny(make_model("llama", num_heads=6, num_kv_heads=2), window=window, exact=exact)
    assert loaded == want  # plain OAL never maps the window kernel's library


def test_preload_names_known_extensions():
    from oal.ops.quadratic import cpu as cpu_kernels

    with pytest.raises(ValueError, match="kinds"):
        cpu_kernels.preload(["chunk", "flash"])


def test_key_validity_is_checked_once_per_mask_and_again_when_it_changes(monkeypatch):
    """Every layer of a forward gets the same mask: it is checked once, and again when it is another tensor, was
    modified in place, or the call's lengths differ; a bad mask still raises."""
    from oal.models import hooks

    calls = []
    real = hooks._check_key_validity
    monkeypatch.setattr(hooks, "_check_key_validity", lambda *args: calls.append(1) or real(*args))
    n, past = 4, 3
    causal = torch.arange(past + n)[None, :] <= torch.arange(past, past + n)[:, None]
    mask = causal[None, None].clone()
    assert hooks._key_validity("x", mask, n, past) is None
    assert hooks._key_validity("x", mask, n, past) is None
    assert len(calls) == 1
    mask[0, 0, :, 0] = False  # the first token padding, in place
    assert hooks._key_validity("x", mask, n, past).tolist() == [[False] + [True] * 6]
    assert len(calls) == 2
    assert hooks._key_validity("x", mask.clone(), n, past).tolist() == [[False] + [True] * 6]
    assert len(calls) == 3
    bad = causal[None, None].clone()
    bad[0, 0, 0, -1] = True  # a query sees a later key
    for _ in range(2):
        with pytest.raises(ValueError, match="neither causal nor causal with padding"):
            hooks._key_validity("x", bad, n, past)
    assert len(calls) == 5


def test_key_validity_of_an_inference_tensor_is_checked_every_time():
    from oal.models import hooks

    n, past = 4, 3
    with torch.inference_mode():
        mask = (torch.arange(past + n)[None, :] <= torch.arange(past, past + n)[:, None])[None, None].clone()
        assert hooks._key_validity("x", mask, n, past) is None
        mask[0, 0, 0, -1] = True  # changed in place: no version counter, yet it is checked again
        with pytest.raises(ValueError, match="neither causal nor causal with padding"):
            hooks._key_validity("x", mask, n, past)
