"""The fused exact causal softmax over a prompt (window.cpp's exact_prefill, the exact heads' prefill of
ExactHeadsKernel) against an fp64 explicit softmax: lengths 1 / 63 / 1000, GQA 1 and 3, cached keys before the
prompt, fp32 and bf16 keys/values, odd head dims, hypothesis shapes; and the kernel's no-grad call reaching it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import oal.kernels.hybrid as hybrid
from oal.kernels import ExactHeadsKernel, OALKernel
from oal.ops.quadratic import cpu as cpu_kernel

pytestmark = pytest.mark.skipif(
    cpu_kernel.load("window") is None, reason="the fused CPU window kernel did not build (no C++ compiler?)"
)


def inputs(B, E, G, N, past, d, dv, kv_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, E, G, N, d, generator=gen)
    k = (torch.randn(B, E, past + N, d, generator=gen) * 2).to(kv_dtype)
    v = torch.randn(B, E, past + N, dv, generator=gen).to(kv_dtype)
    return q, k, v


def explicit(q, k, v, past, scale):
    """fp64: query i of head (h, g) over keys j ≤ past + i of KV head h."""
    B, E, G, N, d = q.shape
    s = torch.einsum("begnc,bejc->begnj", q.double(), k.double()) * scale
    mask = torch.arange(past + N)[None, :] <= (past + torch.arange(N))[:, None]
    w = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("begnj,bejc->begnc", w, v.double())


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("N", [1, 63, 1000])
@pytest.mark.parametrize("past", [0, 37])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_matches_explicit_softmax(G, N, past, kv_dtype):
    q, k, v = inputs(2, 2, G, N, past, 64, 64, kv_dtype)
    out = cpu_kernel.load("window").exact_prefill(q, k, v, past, 0.125)
    assert out.shape == (2, 2, G, N, 64) and out.dtype == torch.float32
    # bf16 keys/values are used as stored: the reference sees the same rounded numbers
    torch.testing.assert_close(out.double(), explicit(q, k, v, past, 0.125), rtol=2e-5, atol=2e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 2),
    E=st.integers(1, 3),
    G=st.sampled_from([1, 2, 3, 5]),
    N=st.integers(1, 300),
    past=st.integers(0, 140),
    d=st.sampled_from([8, 17, 64, 128]),
    dv=st.sampled_from([8, 9, 64]),
)
def test_any_shape(B, E, G, N, past, d, dv):
    q, k, v = inputs(B, E, G, N, past, d, dv, seed=N + past)
    out = cpu_kernel.load("window").exact_prefill(q, k, v, past, d**-0.5)
    torch.testing.assert_close(out.double(), explicit(q, k, v, past, d**-0.5), rtol=2e-5, atol=2e-5)


def test_bad_inputs_are_named():
    ext = cpu_kernel.load("window")
    q, k, v = inputs(1, 2, 3, 10, 0, 8, 8)
    with pytest.raises(RuntimeError, match="k, v: expected"):
        ext.exact_prefill(q, k, v, 4, 0.1)  # 10 keys for past 4 + 10 queries
    with pytest.raises(RuntimeError, match="k, v: expected CPU float32, bfloat16 or int8"):
        ext.exact_prefill(q, k.double(), v.double(), 0, 0.1)
    with pytest.raises(RuntimeError, match="rows contiguous"):
        ext.exact_prefill(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, 0, 0.1)


@pytest.mark.parametrize("bf16_products", [False, True])
def test_heads_apart_in_a_buffer_give_the_contiguous_result(bf16_products):
    # the first past + N slots of a cache buffer with room for more: each head's rows contiguous, the heads apart
    q, k, v = inputs(2, 3, 3, 63, 37, 64, 64, torch.bfloat16)
    kb = torch.zeros(2, 3, 200, 64, dtype=torch.bfloat16)
    vb = torch.zeros(2, 3, 200, 64, dtype=torch.bfloat16)
    kb[:, :, :100], vb[:, :, :100] = k, v
    ext = cpu_kernel.load("window")
    apart = ext.exact_prefill(q, kb[:, :, :100], vb[:, :, :100], 37, 0.125, bf16_products)
    assert torch.equal(apart, ext.exact_prefill(q, k, v, 37, 0.125, bf16_products))


@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16])
def test_exact_heads_kernel_no_grad_call_takes_it_and_equals_the_sdpa_path(spy_fast_path, kv_dtype):
    calls = spy_fast_path(hybrid, "_fused_exact")
    gen = torch.Generator().manual_seed(0)
    inner = OALKernel(torch.randint(0, 3, (9, 64), generator=gen), 3, L=torch.randn(9, 4, 4, generator=gen) * 0.3)
    m = ExactHeadsKernel(inner, [0, 2], kv_dtype=kv_dtype)
    q, k, v = (torch.randn(1, h, 150, 64, generator=gen) for h in (9, 3, 3))
    with torch.no_grad():
        o1, state = m(q[:, :, :90], k[:, :, :90], v[:, :, :90], output_final_state=True)
        o2, _ = m(q[:, :, 90:], k[:, :, 90:], v[:, :, 90:], initial_state=state, output_final_state=True)
    assert calls == [True, True]
    q.requires_grad_()
    o_ref, _ = m(q, k, v)  # autograd: SDPA
    assert calls[-1] is False
    torch.testing.assert_close(torch.cat([o1, o2], 2), o_ref.detach(), rtol=1e-5, atol=1e-5)


def bf16_reference(q, k, v, past, scale):
    B, E, G, N, d = q.shape
    out = hybrid.bf16_product_attention(q.reshape(B, E * G, N, d), k, v, past, scale)
    return out.reshape(B, E, G, N, v.shape[-1])


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("N", [1, 63, 1000])
@pytest.mark.parametrize("past", [0, 37])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_bf16_products_match_their_reference(native, G, N, past, kv_dtype):
    """bf16 products (AVX512_BF16's pair products where built, native; the fp32 tiles on the rounded numbers
    otherwise): within 2^-8 · max |v| of bf16_product_attention, whose weights round at the row's maximum where the
    kernel's round at a running one; native and emulated nearly equal (the summation order can round a weight the
    other way)."""
    q, k, v = inputs(2, 2, G, N, past, 64, 64, kv_dtype)
    ext = cpu_kernel.load("window")
    out = ext.exact_prefill(q, k, v, past, 0.125, True, native)
    ref = bf16_reference(q, k, v, past, 0.125)
    assert out.shape == ref.shape and out.dtype == torch.float32
    bound = 2**-8 * float(v.float().abs().max())
    assert float((out - ref).abs().max()) <= bound
    other = ext.exact_prefill(q, k, v, past, 0.125, True, not native)
    torch.testing.assert_close(out, other, rtol=0, atol=bound / 2)  # a weight rounding the other way, rarely
    if N + past > 1:  # the rounding is real: fp32 products give other numbers
        assert float((ext.exact_prefill(q, k, v, past, 0.125) - out).abs().max()) > 1e-5


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 2),
    E=st.integers(1, 3),
    G=st.sampled_from([1, 2, 3, 5]),
    N=st.integers(1, 300),
    past=st.integers(0, 140),
    d=st.sampled_from([8, 17, 64, 128]),
    dv=st.sampled_from([8, 9, 64]),
    native=st.booleans(),
)
def test_bf16_products_any_shape(B, E, G, N, past, d, dv, native):
    q, k, v = inputs(B, E, G, N, past, d, dv, kv_dtype=torch.bfloat16, seed=N + past)
    out = cpu_kernel.load("window").exact_prefill(q, k, v, past, d**-0.5, True, native)
    bound = 2**-8 * float(v.float().abs().max())
    assert float((out - bf16_reference(q, k, v, past, d**-0.5)).abs().max()) <= bound


def test_bf16_product_reference_rounds_queries_and_weights():
    """The reference itself: with one key per query the weight is 1 (exact in bf16) and the output the value; over
    many keys it is not the fp32 softmax, but within bf16 rounding of it."""
    q, k, v = inputs(1, 1, 1, 200, 0, 64, 64, torch.bfloat16)
    ref = bf16_reference(q, k, v, 0, 0.125)
    torch.testing.assert_close(ref[:, :, 0, 0], v[:, :, 0].float())
    exact = explicit(q, k, v, 0, 0.125)
    gap = float((ref.double() - exact).abs().max())
    assert 1e-5 < gap < 0.05
    with pytest.raises(ValueError, match="inference-only"):
        hybrid.bf16_product_attention(q[0].requires_grad_(), k[0], v[0], 0, 0.125)


@pytest.mark.parametrize("bf16_products", [False, True])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("N, past, G", [(1, 0, 3), (63, 37, 1), (1000, 0, 3), (130, 200, 3)])
def test_int8_keys_and_values_fold_their_scales(bf16_products, native, N, past, G):
    """int8 keys and values with per-token scales (an 8-bit exact cache): the key scales folded into the scores, the
    values dequantised. fp32 products: the softmax of the dequantised numbers (fp64 reference); bf16 products:
    within 2^-8 · max |v| of bf16_product_attention(round_kv=False); scales lying apart in a buffer with room, as
    the cache holds them, give the same numbers."""
    q, k, v = inputs(2, 2, G, N, past, 64, 64)
    (qk, sk), (qv, sv) = hybrid.quantize_int8(k), hybrid.quantize_int8(v)
    kd, vd = hybrid.dequantize_int8(qk, sk), hybrid.dequantize_int8(qv, sv)
    ext = cpu_kernel.load("window")
    got = ext.exact_prefill(q, qk, qv, past, 0.125, bf16_products, native, k_scale=sk, v_scale=sv)
    if bf16_products:
        B, E = q.shape[:2]
        ref = hybrid.bf16_product_attention(q.reshape(B, E * G, N, 64), kd, vd, past, 0.125, round_kv=False)
        assert float((got - ref.reshape(got.shape)).abs().max()) <= 2**-8 * float(vd.abs().max())
    else:
        torch.testing.assert_close(got.double(), explicit(q, kd, vd, past, 0.125), rtol=2e-5, atol=2e-5)
    room = torch.zeros(2, 2, past + N + 9)
    ks, vs = room.clone(), room.clone()
    ks[:, :, : past + N], vs[:, :, : past + N] = sk, sv
    apart = ext.exact_prefill(
        q, qk, qv, past, 0.125, bf16_products, native, k_scale=ks[:, :, : past + N], v_scale=vs[:, :, : past + N]
    )
    assert torch.equal(apart, got)


def test_int8_needs_scales_and_only_int8_takes_them():
    ext = cpu_kernel.load("window")
    q, k, v = inputs(1, 2, 3, 10, 0, 8, 8)
    (qk, sk), (qv, sv) = hybrid.quantize_int8(k), hybrid.quantize_int8(v)
    with pytest.raises(RuntimeError, match="k_scale, v_scale: int8 keys and values need"):
        ext.exact_prefill(q, qk, qv, 0, 0.1)
    with pytest.raises(RuntimeError, match="k_scale, v_scale: int8 keys and values need"):
        ext.exact_prefill(q, qk, qv, 0, 0.1, k_scale=sk[:, :, :5], v_scale=sv)
    with pytest.raises(RuntimeError, match="only for int8"):
        ext.exact_prefill(q, k, v, 0, 0.1, k_scale=sk, v_scale=sv)
