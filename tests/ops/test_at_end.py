"""Queries at the end of the keys (a prompt's later chunk over the keys kept before it): the quadratic operator's
parallel form with Nq ≤ N (``oal.ops.quadratic.chunk.parallel_at_end``, the fused ``chunk_parallel_forward``) and
the sink/window operator on top of it (``oal.ops.sink_window.utils.evaluate_at_end``), against the fp64 naive
reference's last rows: odd lengths, GQA 1 and 3, fp32 and bf16, key weights and the floor, sinks and windows longer
than what came before, hypothesis shapes; where they do not apply they return None."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_quadratic import make_inputs, random_oal

from oal.ops import quadratic_attention
from oal.ops.quadratic import KernelFactor
from oal.ops.quadratic import cpu as cpu_kernel
from oal.ops.quadratic.chunk import parallel_at_end
from oal.ops.sink_window import sink_window_attention
from oal.ops.sink_window.utils import evaluate_at_end

pytestmark = pytest.mark.skipif(
    cpu_kernel.load() is None or cpu_kernel.load("window") is None,
    reason="the fused CPU kernels did not build (no C++ compiler?)",
)
EPS = 1e-3


def problem(B, Hq, Hkv, N, d, seed=0):
    torch.manual_seed(seed)
    q, k, v = make_inputs(B, Hq, Hkv, N, d, d)
    _, _, (a, b, C), factor = random_oal(Hq, d, eps=EPS)
    return q, k, v, (a, b, C), factor


def fp32(coef, factor):
    return tuple(x.float() for x in coef), KernelFactor(*(x.float() for x in factor))


@pytest.mark.parametrize(
    "B, Hq, Hkv, N, n, d",
    [(2, 3, 3, 1, 1, 16), (1, 3, 1, 63, 1, 16), (2, 6, 2, 63, 62, 16), (1, 9, 3, 1000, 256, 64),
     (1, 3, 3, 1000, 1000, 64), (1, 4, 2, 77, 13, 15)],
)  # fmt: skip
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("weighted", [False, True])
def test_parallel_at_end_is_the_full_calls_last_rows(B, Hq, Hkv, N, n, d, dtype, tol, weighted):
    q, k, v, coef, factor = problem(B, Hq, Hkv, N, d)
    q, k, v = (x.to(dtype).double() for x in (q, k, v))  # the reference sees the numbers the kernel reads
    kw = (torch.arange(N) >= 3).double().expand(B, Hkv, N) if weighted else None
    ref = quadratic_attention(q, k, v, *coef, mode="naive", kernel_floor=EPS, key_weight=kw, return_denominator=True)
    (a, b, C), f = fp32(coef, factor)
    x = (t.to(dtype) for t in (q[:, :, N - n :], k, v))
    with torch.no_grad():
        o, dens = parallel_at_end(*x, a, b, C, d**-0.5, f, EPS, None if kw is None else kw.float())
    assert o.shape == (B, Hq, n, d) and o.dtype == dtype and dens.shape == (B, Hkv, Hq // Hkv, n)
    torch.testing.assert_close(o.double(), ref[0][:, :, N - n :], atol=tol, rtol=tol)
    want = ref[1][:, :, N - n :].reshape(dens.shape)
    torch.testing.assert_close(dens.double(), want, atol=0, rtol=1e-4)


@pytest.mark.parametrize("B, Hq, Hkv, N, n", [(1, 9, 3, 300, 100), (2, 6, 2, 63, 63), (2, 3, 1, 40, 1)])
@pytest.mark.parametrize("threads", [1, 3])
def test_parallel_at_end_reads_views_of_longer_heads_in_place(B, Hq, Hkv, N, n, threads):
    """Keys and values that are the first N rows of longer heads (a kept buffer with spare slots, the kernel part's
    delayed keys) are read where they are, not copied, and give the contiguous inputs' outputs; the queries are
    packed a slab of heads at a time, as many slabs as the thread count makes (one head per slab up to all)."""
    d = 16
    q, k, v, coef, factor = problem(B, Hq, Hkv, N + 7, d)
    (a, b, C), f = fp32(coef, factor)
    q, k, v = (x.float() for x in (q[:, :, :N], k, v))
    kv, vv = k[:, :, :N], v[:, :, :N]
    assert not kv.is_contiguous()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            o, dens = parallel_at_end(q[:, :, N - n :], kv, vv, a, b, C, d**-0.5, f, EPS)
            want, want_dens = parallel_at_end(
                q[:, :, N - n :], kv.contiguous(), vv.contiguous(), a, b, C, d**-0.5, f, EPS
            )
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(o, want, atol=0, rtol=0)
    torch.testing.assert_close(dens, want_dens, atol=0, rtol=0)
    ref, _ = quadratic_attention(q.double(), kv.double(), vv.double(), *coef, mode="naive", kernel_floor=EPS)
    torch.testing.assert_close(o.double(), ref[:, :, N - n :], atol=2e-5, rtol=2e-5)


def test_parallel_at_end_refuses_what_it_cannot_take():
    q, k, v, coef, factor = problem(1, 3, 1, 20, 16)
    (a, b, C), f = fp32(coef, factor)
    args = (a, b, C, 0.25, f, EPS)
    assert parallel_at_end(q, k, v, *args) is None  # fp64: the fused kernel computes in fp32
    assert parallel_at_end(q.float(), k.float()[:, :, :5], v.float()[:, :, :5], *args) is None  # more queries than keys
    with cpu_kernel.disabled():
        assert parallel_at_end(q.float(), k.float(), v.float(), *args) is None
    qg = q.float().requires_grad_()
    assert parallel_at_end(qg, k.float(), v.float(), *args) is None  # autograd: not this path
    with torch.no_grad():  # a call without a factor derives one from the coefficients
        o, _ = parallel_at_end(q.float()[:, :, 15:], k.float(), v.float(), a, b, C, 0.25, None, EPS)
        full, _ = quadratic_attention(q.float(), k.float(), v.float(), a, b, C, factor=f, kernel_floor=EPS)
    torch.testing.assert_close(o, full[:, :, 15:], atol=2e-5, rtol=2e-5)


def sink_window_reference(q, k, v, coef, beta, n_sink, window):
    return sink_window_attention(q, k, v, *coef, beta, n_sink=n_sink, window=window, mode="naive", kernel_floor=EPS)[0]


def last_rows(B, Hq, Hkv, N, n, d, n_sink, window, seed):
    """(evaluate_at_end's fp32 rows for the last n queries, the fp64 naive reference's same rows)."""
    q, k, v, coef, factor = problem(B, Hq, Hkv, N, d, seed=seed)
    beta = torch.randn(Hq, dtype=torch.float64)
    ref = sink_window_reference(q, k, v, coef, beta, n_sink, window)
    (a, b, C), f = fp32(coef, factor)
    with torch.no_grad():
        o = evaluate_at_end(
            q.float()[:, :, N - n :], k.float(), v.float(), a, b, C, beta.float(), n_sink=n_sink, window=window,
            scale=d**-0.5, factor=f, kernel_floor=EPS,
        )  # fmt: skip
    return o, ref[:, :, N - n :]


@pytest.mark.parametrize("N, n", [(1, 1), (40, 1), (40, 5), (40, 30), (40, 40), (300, 256), (1000, 256)])
@pytest.mark.parametrize("n_sink, window", [(4, 8), (4, 256), (0, 16), (2, 0), (0, 0)])
@pytest.mark.parametrize("Hq, Hkv", [(3, 3), (9, 3)])
def test_sink_window_at_end_is_the_full_calls_last_rows(N, n, n_sink, window, Hq, Hkv):
    """Windows longer than the keys before the chunk (its first rows have no kernel keys), sinks the chunk itself
    fills, no exact set at all."""
    o, ref = last_rows(2, Hq, Hkv, N, n, 16, n_sink, window, seed=N + n)
    assert o.shape == (2, Hq, n, 16) and o.dtype == torch.float32
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=2e-5)


def test_sink_window_at_end_bf16_inputs_and_refusals():
    d, N, n = 16, 90, 20
    q, k, v, coef, factor = problem(1, 6, 2, N, d)
    q, k, v = (x.bfloat16().double() for x in (q, k, v))  # the bf16 numbers, exactly
    beta = torch.randn(6, dtype=torch.float64)
    ref = sink_window_reference(q, k, v, coef, beta, 4, 8)
    (a, b, C), f = fp32(coef, factor)
    args = (a, b, C, beta.float())
    kw = {"n_sink": 4, "window": 8, "scale": d**-0.5, "factor": f, "kernel_floor": EPS}
    with torch.no_grad():
        o = evaluate_at_end(*(x.bfloat16() for x in (q[:, :, N - n :], k, v)), *args, **kw)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.double(), ref[:, :, N - n :], atol=1e-2, rtol=1e-2)
    qg = q.float()[:, :, N - n :].requires_grad_()
    assert evaluate_at_end(qg, k.float(), v.float(), *args, **kw) is None  # autograd: not this path
    with cpu_kernel.disabled():
        assert evaluate_at_end(q.float()[:, :, N - n :], k.float(), v.float(), *args, **kw) is None


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    Hkv=st.sampled_from([1, 2, 3]),
    ratio=st.sampled_from([1, 3]),
    N=st.integers(1, 120),
    frac=st.floats(0.0, 1.0),
    d=st.sampled_from([8, 15, 16, 32]),
    n_sink=st.integers(0, 5),
    window=st.integers(0, 40),
)
def test_at_end_any_shape(Hkv, ratio, N, frac, d, n_sink, window):
    o, ref = last_rows(1, Hkv * ratio, Hkv, N, max(1, round(N * frac)), d, n_sink, window, seed=N * 7 + d)
    torch.testing.assert_close(o.double(), ref, atol=5e-5, rtol=5e-5)
