"""The fused CPU backward of the chunked operator (``chunk_backward`` in oal.ops.quadratic.cpu, reached through
``_FusedChunk``) against autograd through the torch chunk loop and the naive reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_quadratic import make_inputs, rel_rms

from oal.kernels import oal_coefficients, oal_factor
from oal.ops import quadratic_attention
from oal.ops.quadratic import chunk, feature_dim
from oal.ops.quadratic import cpu as cpu_kernel

EXT = cpu_kernel.load()
pytestmark = pytest.mark.skipif(EXT is None, reason="the fused CPU kernel did not build (no C++ compiler?)")


def problem(B, Hq, Hkv, N, d, dv, seed=0, zero_prefix=5):
    """fp64 inputs: q, k, v, OAL groups and L (G = 3), binary key weights with a zero prefix, an initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, d, dtype=torch.float64, generator=gen)
    k = torch.randn(B, Hkv, N, d, dtype=torch.float64, generator=gen)
    v = torch.randn(B, Hkv, N, dv, dtype=torch.float64, generator=gen)
    groups = torch.randint(0, 3, (Hq, d), generator=gen)
    L = torch.randn(Hq, 4, 4, dtype=torch.float64, generator=gen) * 0.5
    w = (torch.rand(B, Hkv, N, dtype=torch.float64, generator=gen) > 0.3).double()
    w[..., :zero_prefix] = 0
    state = torch.rand(B, Hkv, feature_dim(d), dv + 1, dtype=torch.float64, generator=gen) * 0.1
    return q, k, v, groups, L, w, state


def grads(inputs, dtype, *, fused, cs=16, weights=False, floor=None, init=False, final=False, mode="chunk"):
    """Gradients of a loss over o, the denominator and (optionally) the final state with respect to q, k, v, L,
    the key weights and the initial state; ``fused`` selects the fused backward or autograd on the torch loop
    (``mode="naive"``: autograd on the explicit N×N reference)."""
    q, k, v, groups, L, w, state = inputs
    xs = [x.clone().to(dtype).requires_grad_() for x in (q, k, v, L, w, state)]
    calls = []
    real = chunk._FusedChunk.apply

    def spy(*args):
        calls.append(1)
        return real(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunk._FusedChunk, "apply", spy)
        ctx = cpu_kernel.disabled() if not fused else torch.enable_grad()
        with ctx:
            a, b, C = oal_coefficients(groups, xs[3], 0.01)
            factor = oal_factor(groups, xs[3], 0.01) if mode == "chunk" else None
            out = quadratic_attention(
                *xs[:3], a, b, C, mode=mode, chunk_size=cs, factor=factor,
                key_weight=xs[4] if weights else None, kernel_floor=floor, initial_state=xs[5] if init else None,
                output_final_state=final, return_denominator=True,
            )  # fmt: skip
            o, den, fin = out
            loss = (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum()
            loss = loss + 0.1 * (den * torch.linspace(0, 1, den.numel(), dtype=o.dtype).view_as(den)).sum()
            if final:
                loss = loss + 0.01 * (fin * torch.linspace(-1, 1, fin.numel(), dtype=o.dtype).view_as(fin)).sum()
            loss.backward()
    assert len(calls) == (1 if fused else 0)  # the documented call with gradients reaches the fused backward
    keep = [True, True, True, True, weights, init]
    return [x.grad for x, used in zip(xs, keep, strict=True) if used]


CASES = [
    # B, Hq, Hkv, N, d, dv, chunk, weights, floor, init, final
    (2, 6, 2, 50, 8, 4, 16, False, None, False, False),
    (2, 6, 2, 50, 8, 4, 16, True, 0.01, False, False),
    (1, 3, 1, 1, 8, 4, 16, False, 0.01, False, False),
    (1, 3, 3, 63, 16, 8, 64, True, None, True, True),
    (1, 3, 1, 1000, 16, 16, 64, True, 0.01, False, True),
    (1, 2, 2, 77, 7, 5, 32, False, 0.01, True, False),  # odd d: duplicated pairs in the cyclic layout
]


@pytest.mark.parametrize("case", CASES)
def test_fused_backward_matches_autograd(case):
    B, Hq, Hkv, N, d, dv, cs, weights, floor, init, final = case
    inputs = problem(B, Hq, Hkv, N, d, dv)
    kw = dict(cs=cs, weights=weights, floor=floor, init=init, final=final)
    ref = grads(inputs, torch.float64, fused=False, **kw)
    fused64 = grads(inputs, torch.float64, fused=True, **kw)
    fused32 = grads(inputs, torch.float32, fused=True, **kw)
    for g64, g32, r in zip(fused64, fused32, ref, strict=True):
        assert torch.isfinite(g32).all()
        assert rel_rms(g64, r) < 1e-10
        assert rel_rms(g32, r) < 2e-5
    # the naive reference takes no state and has no floor (κ ≥ ε never meets it, except at a query that has seen no
    # key, where the floor's max(0, 0) splits the denominator's gradient)
    if not init and not final and not (weights and floor is not None):
        naive = grads(inputs, torch.float64, fused=False, mode="naive", **kw)
        for g64, r in zip(fused64, naive, strict=True):
            assert rel_rms(g64, r) < 1e-9


def test_gradcheck_fp64_every_input():
    q, k, v, groups, L, w, state = problem(1, 3, 1, 11, 3, 2, zero_prefix=2)
    w_tail = (w[..., 2:] + 0.5).clone()

    def f(q, k, v, L, w_tail, state):
        a, b, C = oal_coefficients(groups, L, 0.1)
        weight = torch.cat([torch.zeros(1, 1, 2, dtype=w_tail.dtype), w_tail], -1)
        o, den, fin = quadratic_attention(
            q, k, v, a, b, C, chunk_size=4, factor=oal_factor(groups, L, 0.1), key_weight=weight, kernel_floor=0.1,
            initial_state=state, output_final_state=True, return_denominator=True,
        )  # fmt: skip
        return o, den, fin

    args = [x.clone().requires_grad_() for x in (q, k, v, L, w_tail, state)]
    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_does_not_change_gradients(threads):
    inputs = problem(1, 9, 3, 200, 16, 16)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = grads(inputs, torch.float32, fused=True, cs=64, weights=True, floor=0.01)
    finally:
        torch.set_num_threads(previous)
    ref = grads(inputs, torch.float64, fused=False, cs=64, weights=True, floor=0.01)
    for g, r in zip(got, ref, strict=True):
        assert rel_rms(g, r) < 2e-5


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_inputs_backward_accumulates_in_fp32(dtype, tol):
    inputs = problem(1, 6, 2, 90, 16, 8)
    ref = grads(inputs, torch.float64, fused=False, cs=32)
    got = grads(inputs, dtype, fused=True, cs=32)
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == dtype
        assert rel_rms(g, r) < tol


def test_without_factor_or_when_disabled_autograd_runs():
    q, k, v = make_inputs(1, 3, 1, 20, 8, 4, dtype=torch.float32)
    groups = torch.randint(0, 3, (3, 8))
    L = torch.randn(3, 4, 4) * 0.5
    a, b, C = oal_coefficients(groups, L, 0.01)
    qq = q.clone().requires_grad_()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunk._FusedChunk, "apply", lambda *a: pytest.fail("no factor: the autograd loop runs"))
        quadratic_attention(qq, k, v, a, b, C, chunk_size=8)[0].sum().backward()
    assert torch.isfinite(qq.grad).all()


def test_not_twice_differentiable():
    q, k, v = make_inputs(1, 3, 1, 10, 4, 2)
    groups = torch.randint(0, 3, (3, 4))
    L = torch.randn(3, 4, 4, dtype=torch.float64) * 0.5
    a, b, C = oal_coefficients(groups, L, 0.01)
    qq = q.clone().requires_grad_()
    o, _ = quadratic_attention(qq, k, v, a, b, C, chunk_size=4, factor=oal_factor(groups, L, 0.01))
    (g,) = torch.autograd.grad(o.sum(), qq, create_graph=True)
    # a second derivative is refused (the first is not a graph), never silently wrong
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        g.sum().backward()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 2),
    Hkv=st.integers(1, 2),
    ratio=st.sampled_from([1, 3]),
    N=st.integers(1, 70),
    d=st.sampled_from([3, 4, 8]),
    dv=st.integers(1, 6),
    cs=st.integers(1, 24),
    weights=st.booleans(),
)
def test_fused_backward_any_shape(B, Hkv, ratio, N, d, dv, cs, weights):
    inputs = problem(B, Hkv * ratio, Hkv, N, d, dv, zero_prefix=min(N, 3))
    ref = grads(inputs, torch.float64, fused=False, cs=cs, weights=weights, floor=0.01)
    got = grads(inputs, torch.float64, fused=True, cs=cs, weights=weights, floor=0.01)
    for g, r in zip(got, ref, strict=True):
        assert torch.allclose(g, r, rtol=1e-8, atol=1e-10)
