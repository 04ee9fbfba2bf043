"""The quadratic-kernel operator: chunk and recurrent against the naive reference, states, gradients, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oal.kernels import oal_coefficients, oal_factor
from oal.ops import quadratic_attention, split_state
from oal.ops.quadratic import KernelFactor, feature_dim, naive_kernel_matrix


def make_inputs(B, Hq, Hkv, N, d, dv, dtype=torch.float64, outlier=None):
    q = torch.randn(B, Hq, N, d, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, d, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, dv, dtype=torch.float64)
    if outlier is not None:
        q[..., :2] *= outlier
        k[..., :2] *= outlier
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_oal(Hq, d, G=3, dtype=torch.float64, eps=1e-3, scale=0.5):
    groups = torch.randint(0, G, (Hq, d))
    L = torch.randn(Hq, G + 1, G + 1, dtype=dtype) * scale
    a, b, C = oal_coefficients(groups, L, eps)
    return groups, L, (a, b, C), oal_factor(groups, L, eps)


def random_general(Hq, d, dtype=torch.float64):
    """An arbitrary (not necessarily positive) kernel of Eq. 3, kept away from zero denominators."""
    a = 5.0 + torch.rand(Hq, dtype=dtype)
    b = torch.randn(Hq, d, dtype=dtype) * 0.1
    C = torch.randn(Hq, d, d, dtype=dtype) * 0.02
    return a, b, (C + C.mT) / 2


def rel_rms(x, ref):
    return ((x.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()


SHAPES = [
    # B, Hq, Hkv, N, d, dv, chunk
    (2, 3, 3, 1, 16, 16, 64),
    (1, 3, 1, 63, 16, 8, 16),
    (2, 6, 2, 128, 16, 16, 64),
    (1, 3, 1, 128, 64, 64, 50),
    (1, 3, 3, 63, 64, 32, 64),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("use_factor", [False, True])
def test_chunk_and_recurrent_match_naive_fp64(shape, use_factor):
    B, Hq, Hkv, N, d, dv, cs = shape
    q, k, v = make_inputs(B, Hq, Hkv, N, d, dv)
    _, _, (a, b, C), factor = random_oal(Hq, d)
    ref, ref_state = quadratic_attention(q, k, v, a, b, C, mode="naive", output_final_state=True)
    out, state = quadratic_attention(
        q,
        k,
        v,
        a,
        b,
        C,
        mode="chunk",
        chunk_size=cs,
        output_final_state=True,
        factor=factor if use_factor else None,
    )
    rec, rec_state = quadratic_attention(q, k, v, a, b, C, mode="recurrent", output_final_state=True)
    assert rel_rms(out, ref) < 1e-10
    assert rel_rms(rec, ref) < 1e-10
    assert rel_rms(state, ref_state) < 1e-12
    assert rel_rms(rec_state, ref_state) < 1e-12


@pytest.mark.parametrize("N,chunk", [(1000, 64), (1000, 128), (1000, 333)])
def test_long_sequence_fp64_and_fp32(N, chunk):
    q, k, v = make_inputs(1, 3, 1, N, 64, 64)
    _, _, (a, b, C), factor = random_oal(3, 64, G=5)
    ref, _ = quadratic_attention(q, k, v, a, b, C, mode="naive")
    out, _ = quadratic_attention(q, k, v, a, b, C, chunk_size=chunk, factor=factor)
    assert rel_rms(out, ref) < 1e-10
    f32 = [x.float() for x in (q, k, v, a, b, C)]
    out32, _ = quadratic_attention(*f32, chunk_size=chunk, factor=KernelFactor(*(x.float() for x in factor)))
    assert out32.dtype == torch.float32
    assert rel_rms(out32, ref) < 1e-4


@pytest.mark.parametrize("chunk", [16, 37])
def test_general_symmetric_kernel(chunk):
    q, k, v = make_inputs(2, 6, 3, 90, 16, 8)
    a, b, C = random_general(6, 16)
    ref, _ = quadratic_attention(q, k, v, a, b, C, mode="naive")
    out, _ = quadratic_attention(q, k, v, a, b, C, chunk_size=chunk)
    rec, _ = quadratic_attention(q, k, v, a, b, C, mode="recurrent")
    assert rel_rms(out, ref) < 1e-10
    assert rel_rms(rec, ref) < 1e-10


@pytest.mark.parametrize("d", [1, 2, 5, 7])
def test_odd_and_tiny_head_dims(d):
    q, k, v = make_inputs(1, 2, 1, 40, d, 3)
    _, _, (a, b, C), factor = random_oal(2, d, G=2)
    ref, ref_state = quadratic_attention(q, k, v, a, b, C, mode="naive", output_final_state=True)
    for f in (None, factor):
        out, state = quadratic_attention(q, k, v, a, b, C, chunk_size=9, factor=f, output_final_state=True)
        assert rel_rms(out, ref) < 1e-10
        assert rel_rms(state, ref_state) < 1e-12


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_low_precision_inputs_accumulate_in_fp32(dtype, tol):
    q, k, v = make_inputs(1, 6, 2, 300, 64, 64, dtype=dtype)
    _, _, (a, b, C), factor = random_oal(6, 64, G=4, dtype=torch.float32, scale=0.3)
    out, state = quadratic_attention(q, k, v, a, b, C, factor=factor, output_final_state=True)
    assert out.dtype == dtype and state.dtype == torch.float32
    # reference on the same rounded inputs in fp64: the only extra error is the output rounding
    ref, _ = quadratic_attention(q.double(), k.double(), v.double(), a.double(), b.double(), C.double(), mode="naive")
    assert rel_rms(out, ref) < tol


def test_closed_form_taylor():
    """G = 1, M = [[1, 1/2], [1/2, 1/2]], ε → 0 gives κ = 1 + s + s²/2 (the Taylor/Based kernel)."""
    N, d = 70, 16
    q, k, v = make_inputs(1, 2, 2, N, d, 4)
    groups = torch.zeros(2, d, dtype=torch.long)
    L = torch.linalg.cholesky(torch.tensor([[1.0, 0.5], [0.5, 0.5]], dtype=torch.float64)).expand(2, 2, 2)
    a, b, C = oal_coefficients(groups, L, 1e-300)
    out, _ = quadratic_attention(q, k, v, a, b, C, chunk_size=16, factor=oal_factor(groups, L, 1e-300))
    s = (q @ k.mT) / math.sqrt(d)
    w = (1 + s + s**2 / 2).tril()
    expected = (w @ v) / w.sum(-1, keepdim=True)
    assert torch.allclose(out, expected, rtol=1e-11, atol=1e-12)


def test_naive_kernel_matrix_is_eq3():
    d = 5
    q, k = torch.randn(4, d, dtype=torch.float64), torch.randn(3, d, dtype=torch.float64)
    a, b, C = random_general(1, d)
    got = naive_kernel_matrix(q, k, a[0], b[0], C[0], 0.3)
    for i in range(4):
        for j in range(3):
            x = q[i] * k[j] * 0.3
            assert torch.allclose(got[i, j], a[0] + (b[0] * x).sum() + x @ C[0] @ x)


def test_positive_kernel_outputs_are_convex_combinations_with_huge_outliers():
    """κ ≥ ε > 0, so every output is a convex combination of the values seen so far; fp32 with outlier
    dimensions 100× the others must not break that (the denominator floor guards the state readout)."""
    q, k, v = make_inputs(1, 6, 2, 500, 64, 16, dtype=torch.float32, outlier=100.0)
    groups, L, (a, b, C), factor = random_oal(6, 64, G=3, dtype=torch.float32)
    for mode, f in (("chunk", factor), ("recurrent", None)):
        out, _ = quadratic_attention(q, k, v, a, b, C, mode=mode, factor=f, kernel_floor=1e-3)
        assert torch.isfinite(out).all()
        vv = v.repeat_interleave(3, dim=1)
        lo = torch.cummin(vv, dim=2).values
        hi = torch.cummax(vv, dim=2).values
        slack = 1e-3 * (hi - lo + 1)
        assert (out >= lo - slack).all() and (out <= hi + slack).all()


def test_denominators_respect_floor_in_state_readout():
    """A kernel that is ε almost everywhere: the exact denominators are ε·(i+1), and the floor holds them there
    even where fp32 cancellation in the packed readout would lose them."""
    q, k, v = make_inputs(1, 3, 1, 256, 16, 4, dtype=torch.float32, outlier=300.0)
    groups = torch.zeros(3, 16, dtype=torch.long)
    L = torch.zeros(3, 2, 2)
    L[:, 1, 1] = 1e-4  # κ = ε + 1e-8 s²: tiny weights, heavy cancellation in φ_q·S
    a, b, C = oal_coefficients(groups, L, 1e-2)
    out, _ = quadratic_attention(q, k, v, a, b, C, factor=oal_factor(groups, L, 1e-2), kernel_floor=1e-2)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("split", [1, 40, 64, 99])
def test_prefill_then_decode_equals_full(split):
    q, k, v = make_inputs(2, 6, 2, 100, 16, 8)
    _, _, (a, b, C), factor = random_oal(6, 16)
    full, full_state = quadratic_attention(q, k, v, a, b, C, mode="naive", output_final_state=True)
    pre, state = quadratic_attention(
        q[:, :, :split],
        k[:, :, :split],
        v[:, :, :split],
        a,
        b,
        C,
        factor=factor,
        chunk_size=32,
        output_final_state=True,
    )
    outs = [pre]
    for t in range(split, 100):
        o, state = quadratic_attention(
            q[:, :, t : t + 1],
            k[:, :, t : t + 1],
            v[:, :, t : t + 1],
            a,
            b,
            C,
            mode="recurrent",
            initial_state=state,
            output_final_state=True,
        )
        outs.append(o)
    assert rel_rms(torch.cat(outs, dim=2), full) < 1e-10
    assert rel_rms(state, full_state) < 1e-12
    # a chunked continuation from the naive prefix state, with the naive path's own prefix readout
    _, prefix = quadratic_attention(
        q[:, :, :split], k[:, :, :split], v[:, :, :split], a, b, C, mode="naive", output_final_state=True
    )
    for mode in ("chunk", "naive"):
        rest, _ = quadratic_attention(
            q[:, :, split:],
            k[:, :, split:],
            v[:, :, split:],
            a,
            b,
            C,
            mode=mode,
            initial_state=prefix,
            chunk_size=16,
        )
        assert rel_rms(rest, full[:, :, split:]) < 1e-10


def test_state_is_eq5():
    q, k, v = make_inputs(1, 2, 2, 20, 4, 3)
    a, b, C = random_general(2, 4)
    _, state = quadratic_attention(q, k, v, a, b, C, output_final_state=True, chunk_size=7)
    assert state.shape == (1, 2, feature_dim(4), 4)
    h0, h1, h2 = split_state(state, 4)
    u = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    assert torch.allclose(h0, u.sum(2))
    assert torch.allclose(h1, torch.einsum("bhnr,bhnc->bhrc", k, u))
    assert torch.allclose(h2, torch.einsum("bhnr,bhnt,bhnc->bhrtc", k, k, u))


def test_gradcheck_chunk_fp64():
    q, k, v = make_inputs(1, 2, 1, 9, 3, 2)
    a, b, C = random_general(2, 3)
    args = [x.clone().requires_grad_() for x in (q, k, v, a, b, C)]

    def f(q, k, v, a, b, C):
        C = (C + C.mT) / 2
        return quadratic_attention(q, k, v, a, b, C, chunk_size=4)[0]

    assert torch.autograd.gradcheck(f, args)


def test_gradcheck_factor_path_through_L():
    q, k, v = make_inputs(1, 3, 1, 6, 3, 2)
    groups = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 1]])
    L = (torch.randn(3, 3, 3, dtype=torch.float64) * 0.5).requires_grad_()
    qq = q.clone().requires_grad_()

    def f(q, L):
        a, b, C = oal_coefficients(groups, L, 0.1)
        return quadratic_attention(q, k, v, a, b, C, chunk_size=4, factor=oal_factor(groups, L, 0.1))[0]

    assert torch.autograd.gradcheck(f, (qq, L))


def test_chunk_grads_match_naive_grads():
    q, k, v = make_inputs(2, 6, 2, 50, 8, 4)
    groups = torch.randint(0, 3, (6, 8))
    L0 = torch.randn(6, 4, 4, dtype=torch.float64) * 0.5
    grads = {}
    for mode in ("naive", "chunk"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, L0)]
        a, b, C = oal_coefficients(groups, xs[3], 0.01)
        f = oal_factor(groups, xs[3], 0.01) if mode == "chunk" else None
        o, _ = quadratic_attention(*xs[:3], a, b, C, mode=mode, chunk_size=16, factor=f)
        (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum().backward()
        grads[mode] = [x.grad for x in xs]
    for g_chunk, g_naive in zip(grads["chunk"], grads["naive"], strict=True):
        assert rel_rms(g_chunk, g_naive) < 1e-9


def test_no_grad_and_grad_paths_agree():
    q, k, v = make_inputs(1, 6, 2, 77, 16, 8, dtype=torch.float32)
    _, _, (a, b, C), factor = random_oal(6, 16, dtype=torch.float32)
    with torch.no_grad():
        fast, s1 = quadratic_attention(q, k, v, a, b, C, factor=factor, output_final_state=True)
    slow, s2 = quadratic_attention(q.requires_grad_(), k, v, a, b, C, factor=factor, output_final_state=True)
    assert torch.allclose(fast, slow, rtol=1e-5, atol=1e-6)
    assert torch.allclose(s1, s2, rtol=1e-5, atol=1e-4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 2),
    Hkv=st.integers(1, 2),
    group=st.sampled_from([1, 3]),
    N=st.integers(1, 70),
    d=st.integers(1, 9),
    dv=st.integers(1, 5),
    chunk=st.integers(1, 40),
    factor=st.booleans(),
)
def test_property_shapes(B, Hkv, group, N, d, dv, chunk, factor):
    Hq = Hkv * group
    q, k, v = make_inputs(B, Hq, Hkv, N, d, dv)
    _, _, (a, b, C), f = random_oal(Hq, d, G=2)
    ref, ref_state = quadratic_attention(q, k, v, a, b, C, mode="naive", output_final_state=True)
    out, state = quadratic_attention(
        q, k, v, a, b, C, chunk_size=chunk, factor=f if factor else None, output_final_state=True
    )
    assert out.shape == (B, Hq, N, dv)
    assert rel_rms(out, ref) < 1e-9
    assert rel_rms(state, ref_state) < 1e-11


class TestErrors:
    def setup_method(self):
        self.q, self.k, self.v = make_inputs(1, 4, 2, 8, 4, 3)
        self.a, self.b, self.C = random_general(4, 4)

    def call(self, **kw):
        args = dict(q=self.q, k=self.k, v=self.v, a=self.a, b=self.b, C=self.C)
        args.update(kw)
        return quadratic_attention(**args)

    @pytest.mark.parametrize(
        "kw,match",
        [
            (dict(q=torch.randn(4, 8, 4, dtype=torch.float64)), "q: expected 4 dimensions"),
            (dict(k=torch.randn(1, 2, 9, 4, dtype=torch.float64)), r"k: expected shape \(1, Hkv, 8, 4\)"),
            (
                dict(k=torch.randn(1, 3, 8, 4, dtype=torch.float64), v=torch.randn(1, 3, 8, 3, dtype=torch.float64)),
                "multiple of the KV heads",
            ),
            (dict(v=torch.randn(1, 1, 8, 3, dtype=torch.float64)), r"v: expected shape \(1, 2, 8, dv\)"),
            (dict(a=torch.ones(3, dtype=torch.float64)), r"a: expected shape \(4,\)"),
            (dict(b=torch.ones(4, 5, dtype=torch.float64)), r"b: expected shape \(4, 4\)"),
            (dict(C=torch.randn(4, 4, 4, dtype=torch.float64)), "C: expected a symmetric"),
            (dict(mode="fast"), "mode: expected one of"),
            (dict(chunk_size=0), "chunk_size: expected a positive integer"),
            (dict(scale=-1.0), "scale: expected a positive"),
            (dict(initial_state=torch.zeros(1, 2, 3, 4, dtype=torch.float64)), "initial_state: expected shape"),
            (dict(kernel_floor=0.0), "kernel_floor"),
            (dict(k=torch.randn(1, 2, 8, 4, dtype=torch.float32)), "k: expected dtype torch.float64"),
            (dict(q=torch.randint(0, 3, (1, 4, 8, 4))), "q: expected a floating-point tensor"),
        ],
    )
    def test_bad_input(self, kw, match):
        with pytest.raises(ValueError, match=match):
            self.call(**kw)

    @pytest.mark.parametrize("name", ["q", "k", "v", "a", "b", "C"])
    def test_non_finite(self, name):
        x = getattr(self, name).clone()
        x.view(-1)[0] = float("nan")
        with pytest.raises(ValueError, match=f"{name}: contains NaN"):
            self.call(**{name: x})
