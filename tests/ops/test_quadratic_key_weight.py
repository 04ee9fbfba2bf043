"""The quadratic operator's ``key_weight`` and ``return_denominator`` extensions (used by the sink/window op)."""

from __future__ import annotations

import pytest
import torch

from oal.kernels import oal_coefficients, oal_factor
from oal.ops import quadratic_attention
from oal.ops.quadratic import QuadraticAttentionOutput, naive_kernel_matrix


def make_inputs(B, Hq, Hkv, N, d, dv, dtype=torch.float64):
    q = torch.randn(B, Hq, N, d, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, d, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, dv, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_oal(Hq, d, G=3, dtype=torch.float64, eps=1e-3):
    groups = torch.randint(0, G, (Hq, d))
    L = torch.randn(Hq, G + 1, G + 1, dtype=dtype) * 0.5
    return oal_coefficients(groups, L, eps), oal_factor(groups, L, eps)


def random_weights(B, Hkv, N, kind, dtype=torch.float64):
    if kind == "binary":
        return (torch.rand(B, Hkv, N) < 0.6).to(dtype)
    if kind == "fractional":
        w = torch.rand(B, Hkv, N, dtype=dtype) * 2
        w[torch.rand(B, Hkv, N) < 0.2] = 0
        return w
    raise AssertionError(kind)


def rel_rms(x, ref):
    return ((x.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()


def explicit(q, k, v, a, b, C, w):
    """``o_i = Σ_{j≤i} ω_j κ_ij v_j / Σ_{j≤i} ω_j κ_ij`` and its denominator, straight from Eq. 3."""
    B, Hq, N, d = q.shape
    G = Hq // k.shape[1]
    o = torch.zeros(B, Hq, N, v.shape[-1], dtype=q.dtype)
    den = torch.zeros(B, Hq, N, dtype=q.dtype)
    for bi in range(B):
        for h in range(Hq):
            kap = naive_kernel_matrix(q[bi, h], k[bi, h // G], a[h], b[h], C[h], d**-0.5)
            kap = kap.tril() * w[bi, h // G][None, :]
            den[bi, h] = kap.sum(-1)
            safe = torch.where(den[bi, h] > 0, den[bi, h], 1.0)
            o[bi, h] = (kap @ v[bi, h // G]) / safe[:, None]
    return o, den


@pytest.mark.parametrize("kind", ["binary", "fractional"])
@pytest.mark.parametrize(
    "B,Hq,Hkv,N,d,dv,chunk", [(2, 3, 3, 1, 8, 4, 64), (1, 6, 2, 63, 8, 5, 16), (2, 3, 1, 70, 16, 8, 9)]
)
def test_modes_match_explicit_fp64(kind, B, Hq, Hkv, N, d, dv, chunk):
    q, k, v = make_inputs(B, Hq, Hkv, N, d, dv)
    (a, b, C), factor = random_oal(Hq, d)
    w = random_weights(B, Hkv, N, kind)
    w[..., 0] = 1.0  # keep every denominator positive so the explicit reference needs no special case
    exp_o, exp_den = explicit(q, k, v, a, b, C, w)
    ref = quadratic_attention(q, k, v, a, b, C, mode="naive", key_weight=w, return_denominator=True)
    assert isinstance(ref, QuadraticAttentionOutput)
    assert rel_rms(ref.o, exp_o) < 1e-12 and rel_rms(ref.denominator, exp_den) < 1e-12
    naive_state = quadratic_attention(q, k, v, a, b, C, mode="naive", key_weight=w, output_final_state=True)[1]
    for mode, f in (("chunk", None), ("chunk", factor), ("recurrent", None)):
        out = quadratic_attention(
            q,
            k,
            v,
            a,
            b,
            C,
            mode=mode,
            chunk_size=chunk,
            factor=f,
            key_weight=w,
            return_denominator=True,
            output_final_state=True,
        )
        assert rel_rms(out.o, exp_o) < 1e-10
        assert rel_rms(out.denominator, exp_den) < 1e-10
        assert rel_rms(out.final_state, naive_state) < 1e-12


def test_unit_weights_equal_no_weights_and_default_contract():
    q, k, v = make_inputs(1, 6, 2, 40, 8, 4)
    (a, b, C), factor = random_oal(6, 8)
    plain = quadratic_attention(q, k, v, a, b, C, factor=factor, chunk_size=16, output_final_state=True)
    assert isinstance(plain, tuple) and len(plain) == 2
    ones = torch.ones(1, 2, 40, dtype=torch.float64)
    for mode in ("naive", "chunk", "recurrent"):
        weighted = quadratic_attention(
            q, k, v, a, b, C, mode=mode, chunk_size=16, key_weight=ones, output_final_state=True, kernel_floor=1e-3
        )
        assert len(weighted) == 2
        assert rel_rms(weighted[0], plain[0]) < 1e-12 and rel_rms(weighted[1], plain[1]) < 1e-12


def test_zero_weight_prefix_gives_zero_not_nan():
    """Queries that have seen only weight-0 keys output exactly 0 with denominator 0, in every mode, with and
    without a floor; the later queries are unaffected by the removed keys."""
    q, k, v = make_inputs(2, 6, 2, 30, 8, 4, dtype=torch.float32)
    (a, b, C), factor = random_oal(6, 8, dtype=torch.float32)
    w = torch.ones(2, 2, 30)
    w[:, :, :7] = 0
    w[1, 0, :12] = 0
    ref, _ = quadratic_attention(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], a, b, C, mode="naive")
    for mode, f in (("naive", None), ("chunk", factor), ("chunk", None), ("recurrent", None)):
        for floor in (None, 1e-3):
            o, den, _ = quadratic_attention(
                q, k, v, a, b, C, mode=mode, factor=f, chunk_size=5, key_weight=w, return_denominator=True,
                kernel_floor=floor,
            )  # fmt: skip
            assert torch.isfinite(o).all() and torch.isfinite(den).all()
            assert (o[:, :, :7] == 0).all() and (den[:, :, :7] == 0).all()
            assert (o[1, :3, :12] == 0).all() and (den[1, :3, :12] == 0).all()
            assert (den[0, :, 7:] > 0).all()
            assert torch.allclose(o[0, :, 7:], ref[0], atol=1e-5)


def test_floor_uses_weighted_key_count():
    """A constant kernel κ = 1 with a (deliberately too high) floor of 2: every denominator is then
    2 · Σ_{j≤i} ω_j, including the count carried in by an initial state."""
    q, k, v = make_inputs(1, 3, 1, 25, 4, 3)
    a = torch.ones(3, dtype=torch.float64)
    b = torch.zeros(3, 4, dtype=torch.float64)
    C = torch.zeros(3, 4, 4, dtype=torch.float64)
    w = torch.rand(1, 1, 25, dtype=torch.float64)
    _, state = quadratic_attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], a, b, C, output_final_state=True)
    count = w[0, 0, 10:].cumsum(0) + 10  # the prefix state carries 10 unit-weight keys
    for mode in ("chunk", "recurrent"):
        o, den, _ = quadratic_attention(
            q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], a, b, C, mode=mode, chunk_size=4, kernel_floor=2.0,
            key_weight=w[:, :, 10:], initial_state=state, return_denominator=True,
        )  # fmt: skip
        assert torch.allclose(den[0], 2 * count.expand(3, 15))
        # without weights the count carried in by the state is read correctly too
        _, den_plain, _ = quadratic_attention(
            q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], a, b, C, mode=mode, chunk_size=4, kernel_floor=2.0,
            initial_state=state, return_denominator=True,
        )  # fmt: skip
        assert torch.allclose(den_plain[0], 2 * torch.arange(11, 26, dtype=torch.float64).expand(3, 15))


@pytest.mark.parametrize("split", [1, 17, 32])
def test_prefill_then_decode_with_weights(split):
    q, k, v = make_inputs(2, 6, 2, 45, 8, 4)
    (a, b, C), factor = random_oal(6, 8)
    w = random_weights(2, 2, 45, "fractional")
    w[..., :3] = 0
    full = quadratic_attention(q, k, v, a, b, C, mode="naive", key_weight=w, return_denominator=True)
    pre = quadratic_attention(
        q[:, :, :split], k[:, :, :split], v[:, :, :split], a, b, C, factor=factor, chunk_size=16,
        key_weight=w[:, :, :split], output_final_state=True, return_denominator=True, kernel_floor=1e-3,
    )  # fmt: skip
    rest = quadratic_attention(
        q[:, :, split:], k[:, :, split:], v[:, :, split:], a, b, C, mode="recurrent",
        key_weight=w[:, :, split:], initial_state=pre.final_state, return_denominator=True, kernel_floor=1e-3,
    )  # fmt: skip
    assert rel_rms(torch.cat([pre.o, rest.o], 2), full.o) < 1e-10
    assert rel_rms(torch.cat([pre.denominator, rest.denominator], 2), full.denominator) < 1e-10


def test_gradcheck_chunk_with_weights():
    q, k, v = make_inputs(1, 3, 1, 9, 3, 2)
    (a, b, C), _ = random_oal(3, 3, G=2, eps=0.5)
    w_tail = torch.rand(1, 1, 7, dtype=torch.float64) + 0.1
    args = [x.clone().requires_grad_() for x in (q, k, v, w_tail)]

    def f(q, k, v, w_tail):
        # a zero-weight prefix (held at 0: finite differences there would leave the domain) must not poison the
        # gradients of anything
        w = torch.cat([torch.zeros(1, 1, 2, dtype=w_tail.dtype), w_tail], -1)
        o, den, _ = quadratic_attention(q, k, v, a, b, C, chunk_size=4, key_weight=w, return_denominator=True)
        return o, den

    assert torch.autograd.gradcheck(f, args)


def test_chunk_grads_match_naive_with_zero_prefix():
    q, k, v = make_inputs(2, 6, 2, 40, 8, 4)
    groups = torch.randint(0, 3, (6, 8))
    L0 = torch.randn(6, 4, 4, dtype=torch.float64) * 0.5
    w = random_weights(2, 2, 40, "binary")
    w[..., :5] = 0
    grads = {}
    for mode in ("naive", "chunk"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, L0)]
        a, b, C = oal_coefficients(groups, xs[3], 0.01)
        f = oal_factor(groups, xs[3], 0.01) if mode == "chunk" else None
        o, den, _ = quadratic_attention(
            *xs[:3], a, b, C, mode=mode, chunk_size=16, factor=f, key_weight=w, return_denominator=True
        )
        (o.sum(-1) * torch.linspace(-1, 1, den.numel(), dtype=o.dtype).view_as(den) + 0.1 * den).sum().backward()
        grads[mode] = [x.grad for x in xs]
    for g_chunk, g_naive in zip(grads["chunk"], grads["naive"], strict=True):
        assert torch.isfinite(g_chunk).all()
        assert rel_rms(g_chunk, g_naive) < 1e-9


@pytest.mark.parametrize(
    "w,match",
    [
        (torch.ones(1, 2, 7, dtype=torch.float64), r"key_weight: expected shape \(1, 2, 8\)"),
        (torch.ones(1, 4, 8, dtype=torch.float64), r"key_weight: expected shape \(1, 2, 8\)"),
        (-torch.ones(1, 2, 8, dtype=torch.float64), "key_weight: expected non-negative"),
        (torch.full((1, 2, 8), float("nan"), dtype=torch.float64), "key_weight: contains NaN"),
        (torch.ones(1, 2, 8, dtype=torch.long), "key_weight: expected a floating-point tensor"),
    ],
)
@pytest.mark.parametrize("mode", ["naive", "chunk", "recurrent"])
def test_bad_key_weight(w, match, mode):
    q, k, v = make_inputs(1, 4, 2, 8, 4, 3)
    (a, b, C), _ = random_oal(4, 4)
    with pytest.raises(ValueError, match=match):
        quadratic_attention(q, k, v, a, b, C, mode=mode, key_weight=w)
