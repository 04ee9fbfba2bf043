"""oal.ops.softmax: a prompt's later chunk of softmax attention without a mask (two flash calls merged by their
log-sum-exps) against the masked reference, and the reference against SDPA with an explicit mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oal.ops.softmax import causal_softmax, naive_softmax_at_end, softmax_at_end

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def inputs(B, Hq, Hkv, n, N, d=16, dv=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_reference_equals_sdpa_with_the_mask_aligned_at_the_end():
    q, k, v = inputs(2, 6, 2, 5, 12, dtype=torch.float64)
    past = 12 - 5
    mask = torch.arange(12)[None, :] <= torch.arange(past, 12)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask
    )
    torch.testing.assert_close(naive_softmax_at_end(q, k, v), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(("n", "N"), [(1, 2), (2, 3), (63, 100), (63, 64), (1000, 1063)])
def test_chunk_equals_the_reference(dtype, group, n, N):
    q, k, v = inputs(2, 2 * group, 2, n, N, dtype=dtype)
    got = softmax_at_end(q, k, v, 0.3)
    assert got is not None and got.dtype == dtype and got.shape == (2, 2 * group, n, 16)
    want = naive_softmax_at_end(q, k, v, 0.3)
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=TOL[dtype])


def test_keys_may_be_views_of_longer_buffers():
    """A cache's keys are the first N slots of buffers with spare room (oal.models.state_cache.ExactKVLayer)."""
    q, k, v = inputs(1, 6, 2, 40, 90)
    kbuf, vbuf = torch.zeros(1, 2, 128, 16), torch.zeros(1, 2, 128, 16)
    kbuf[:, :, :90], vbuf[:, :, :90] = k, v
    got = softmax_at_end(q, kbuf[:, :, :90], vbuf[:, :, :90])
    torch.testing.assert_close(got, naive_softmax_at_end(q, k, v), rtol=0, atol=2e-5)


def test_none_where_it_does_not_apply():
    q, k, v = inputs(1, 4, 2, 8, 8)
    assert softmax_at_end(q, k, v) is None  # no keys before the queries: one causal SDPA call
    q, k, v = inputs(1, 4, 2, 8, 20)
    assert softmax_at_end(q, k.double(), v) is None  # dtypes that differ
    assert softmax_at_end(q.requires_grad_(), k, v) is None  # autograd
    assert softmax_at_end(q[:, :3].detach(), k, v) is None  # 3 query heads over 2 KV heads
    assert softmax_at_end(q.detach(), k, v[..., :8]) is None  # values of another head size (the flash kernel's)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2),
    Hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    n=st.integers(1, 40),
    past=st.integers(1, 70),
    d=st.sampled_from([8, 16, 64]),
)
def test_chunk_equals_the_reference_on_any_shape(B, Hkv, group, n, past, d):
    q, k, v = inputs(B, Hkv * group, Hkv, n, n + past, d, d)
    torch.testing.assert_close(softmax_at_end(q, k, v), naive_softmax_at_end(q, k, v), rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("N", [1, 63, 1000])
def test_causal_softmax_equals_the_reference(dtype, group, N):
    """A whole causal segment (n = N): the fused call for CPU fp32, SDPA for the other dtypes."""
    q, k, v = inputs(2, 2 * group, 2, N, N, dv=8, dtype=dtype)
    got = causal_softmax(q, k, v, 0.3)
    assert got.dtype == dtype and got.shape == (2, 2 * group, N, 8)
    torch.testing.assert_close(got.double(), naive_softmax_at_end(q, k, v, 0.3).double(), rtol=0, atol=TOL[dtype])


def test_causal_softmax_fp32_is_one_fused_call(monkeypatch):
    from oal.ops.quadratic import cpu as cpu_kernels

    ext = cpu_kernels.load("window")
    if ext is None:
        pytest.skip("the fused CPU window kernel did not build (no C++ compiler?)")
    calls = []
    fused = ext.exact_prefill
    monkeypatch.setattr(ext, "exact_prefill", lambda *a: calls.append(a[0].shape) or fused(*a))
    q, k, v = inputs(1, 6, 2, 20, 20)
    buf = torch.zeros(1, 2, 32, 16)  # keys in the first slots of a buffer with room: read in place
    buf[:, :, :20] = k
    got = causal_softmax(q, buf[:, :, :20], v, 0.25)
    assert calls == [(1, 2, 3, 20, 16)]
    torch.testing.assert_close(got, naive_softmax_at_end(q, k, v, 0.25), rtol=0, atol=2e-5)


@pytest.mark.parametrize("group", [1, 3])
def test_causal_softmax_gradients_equal_the_reference(group):
    """Under autograd it is SDPA (differentiable); its gradients in q, k, v are the masked reference's."""
    q, k, v = (x.requires_grad_() for x in inputs(2, 2 * group, 2, 17, 17, dtype=torch.float64))
    w = torch.randn(2, 2 * group, 17, 16, dtype=torch.float64)
    got = torch.autograd.grad((causal_softmax(q, k, v, 0.4) * w).sum(), (q, k, v))
    want = torch.autograd.grad((naive_softmax_at_end(q, k, v, 0.4) * w).sum(), (q, k, v))
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-10)
