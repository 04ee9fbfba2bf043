"""The fused one-token softmax step of softmax layers (oal.kernels.decode.softmax_decode_step) against SDPA and
an fp64 explicit softmax: GQA 1 and 3, lengths 1 / 63 / 1000 / past the split-K block, batches, head dims."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oal.kernels.decode import softmax_decode_step
from oal.ops.quadratic import cpu as cpu_kernel

pytestmark = pytest.mark.skipif(
    cpu_kernel.load("decode") is None, reason="the fused CPU decode kernel did not build (no C++ compiler?)"
)


def buffers(B, Hq, Hkv, n, d, dv, spare=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, d, generator=gen)
    kb = torch.randn(B, Hkv, n + spare, d, generator=gen) * 2
    vb = torch.randn(B, Hkv, n + spare, dv, generator=gen)
    return q, kb, vb


def explicit(q, k, v, scale):
    """fp64 softmax of one query per head over all keys, query head h on KV head h // (Hq / Hkv)."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(g, dim=1) for x in (k, v))
    w = torch.softmax((q.double() @ k.mT) * scale, dim=-1)
    return w @ v


@pytest.mark.parametrize(("Hq", "Hkv"), [(3, 3), (9, 3), (4, 1)])
@pytest.mark.parametrize("n", [1, 63, 1000, 2049])
def test_matches_sdpa_and_explicit_softmax(Hq, Hkv, n):
    q, kb, vb = buffers(2, Hq, Hkv, n, 64, 64)
    scale = 64**-0.5
    k, v = kb[:, :, :n], vb[:, :, :n]
    with torch.no_grad():
        got = softmax_decode_step(q, kb, vb, n, scale)
        want = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=Hq != Hkv)
    assert got is not None and got.shape == (2, Hq, 1, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), explicit(q, k, v, scale), rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 3),
    Hkv=st.integers(1, 3),
    ratio=st.sampled_from([1, 2, 3, 5]),
    d=st.sampled_from([8, 32, 63, 64, 128]),
    n=st.integers(1, 300),
    spare=st.integers(0, 70),
)
def test_any_shape(B, Hkv, ratio, d, n, spare):
    q, kb, vb = buffers(B, Hkv * ratio, Hkv, n, d, d, spare=spare, seed=n)
    with torch.no_grad():
        got = softmax_decode_step(q, kb, vb, n, 0.3)
    torch.testing.assert_close(got.double(), explicit(q, kb[:, :, :n], vb[:, :, :n], 0.3), rtol=1e-5, atol=1e-5)


def test_rewrites_only_the_new_slot_from_itself():
    q, kb, vb = buffers(1, 6, 2, 40, 64, 64)
    before_k, before_v = kb.clone(), vb.clone()
    with torch.no_grad():
        softmax_decode_step(q, kb, vb, 40, 0.125)
    assert torch.equal(kb, before_k) and torch.equal(vb, before_v)


def test_not_applicable_calls_return_none():
    q, kb, vb = buffers(1, 6, 2, 10, 64, 64)
    assert softmax_decode_step(q.double(), kb.double(), vb.double(), 10, 0.1) is None  # fp32 only
    assert softmax_decode_step(q, kb, vb, 100, 0.1) is None  # more keys than the buffer holds
    assert softmax_decode_step(q.expand(1, 6, 2, 64), kb, vb, 10, 0.1) is None  # one query only
    assert softmax_decode_step(q, kb.mT.contiguous().mT, vb, 10, 0.1) is None  # buffers must be contiguous
    assert softmax_decode_step(q, kb[:, :1], vb, 10, 0.1) is None  # key and value heads differ
    with torch.enable_grad():
        assert softmax_decode_step(q.requires_grad_(), kb, vb, 10, 0.1) is None
