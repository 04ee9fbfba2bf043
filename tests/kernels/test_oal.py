"""The OAL kernel (§4.3, Eq. 7) and its global special case (App. D)."""

from __future__ import annotations

import math

import pytest
import torch

from oal.kernels import (
    GlobalQuadraticKernel,
    OALKernel,
    SoftmaxKernel,
    embed_global,
    oal_attention,
    oal_coefficients,
    oal_factor,
    taylor_global_L,
    taylor_L,
)
from oal.ops.quadratic import factored_kernel, naive_kernel_matrix


def test_coefficients_follow_section_4_3():
    groups = torch.tensor([[0, 1, 0, 2], [1, 1, 0, 0]])
    L = torch.randn(2, 4, 4, dtype=torch.float64)
    a, b, C = oal_coefficients(groups, L, 0.25)
    M = L.tril() @ L.tril().mT
    for h in range(2):
        assert torch.isclose(a[h], 0.25 + M[h, 0, 0])
        for r in range(4):
            assert torch.isclose(b[h, r], 2 * M[h, 0, groups[h, r] + 1])
            for t in range(4):
                assert torch.isclose(C[h, r, t], M[h, groups[h, r] + 1, groups[h, t] + 1])
    assert torch.equal(C, C.mT)


def test_upper_triangle_of_L_is_ignored():
    groups = torch.randint(0, 3, (2, 6))
    L = torch.randn(2, 4, 4)
    assert all(
        torch.equal(x, y)
        for x, y in zip(oal_coefficients(groups, L, 1e-3), oal_coefficients(groups, L.tril(), 1e-3), strict=True)
    )


def test_kernel_is_eps_plus_quadratic_form_and_factor_matches():
    """κ = ε + s̄ᵀ L Lᵀ s̄ (Eq. 7); the coefficient form (Eq. 3) and the sum-of-squares factor agree."""
    d, G = 8, 3
    groups = torch.randint(0, G, (2, d))
    L = torch.randn(2, G + 1, G + 1, dtype=torch.float64)
    q, k = torch.randn(5, d, dtype=torch.float64), torch.randn(7, d, dtype=torch.float64)
    a, b, C = oal_coefficients(groups, L, 1e-2)
    fac = oal_factor(groups, L, 1e-2)
    scale = 1 / math.sqrt(d)
    got = factored_kernel(q[None, None].expand(1, 2, 5, d), k[None, None], fac, scale)[0]
    for h in range(2):
        x = q[:, None, :] * k[None, :, :] * scale  # (5, 7, d)
        s = torch.stack([x[..., groups[h] == g].sum(-1) for g in range(G)], -1)
        sbar = torch.cat([torch.ones(5, 7, 1, dtype=s.dtype), s], -1)
        M = L[h].tril() @ L[h].tril().T
        expected = 1e-2 + torch.einsum("ijg,gh,ijh->ij", sbar, M, sbar)
        assert torch.allclose(got[h], expected)
        assert torch.allclose(naive_kernel_matrix(q, k, a[h], b[h], C[h], scale), expected)
        assert (expected >= 1e-2).all()


def test_heads_with_fewer_groups_than_G():
    """A head whose ids only reach 1 of G = 4 groups: rows 2.. of its L are unused and don't change κ."""
    groups = torch.tensor([[0, 0, 1, 1], [0, 1, 2, 3]])
    L = torch.randn(2, 5, 5, dtype=torch.float64)
    L2 = L.clone()
    L2[0, 3:, :] = torch.randn(2, 5, dtype=torch.float64)
    assert all(
        torch.equal(x[0], y[0])
        for x, y in zip(oal_coefficients(groups, L, 1e-3), oal_coefficients(groups, L2, 1e-3), strict=True)
    )


def test_taylor_global_is_exp_second_order():
    Lg = taylor_global_L(torch.float64)
    M = Lg @ Lg.T
    assert torch.allclose(M, torch.tensor([[1.0, 0.5], [0.5, 0.5]], dtype=torch.float64))


@pytest.mark.parametrize("G", [1, 2, 5])
def test_embed_global_preserves_the_kernel(G):
    d = 6
    Lg = torch.randn(3, 2, 2, dtype=torch.float64).tril()
    glob = oal_coefficients(torch.zeros(3, d, dtype=torch.long), Lg, 1e-3)
    groups = torch.randint(0, G, (3, d))
    emb = oal_coefficients(groups, embed_global(Lg, G), 1e-3)
    assert all(torch.allclose(x, y) for x, y in zip(glob, emb, strict=True))
    assert torch.equal(embed_global(Lg, G), embed_global(Lg, G).tril())


def test_taylor_L_kernel():
    groups = torch.randint(0, 4, (2, 8))
    a, b, C = oal_coefficients(groups, taylor_L(2, 4, torch.float64), 1e-300)
    assert torch.allclose(a, torch.ones(2, dtype=torch.float64))
    assert torch.allclose(b, torch.ones(2, 8, dtype=torch.float64))
    assert torch.allclose(C, torch.full((2, 8, 8), 0.5, dtype=torch.float64))


@pytest.mark.parametrize("kernel_cls", ["oal", "global", "softmax"])
def test_at_positions_matches_forward(kernel_cls):
    B, Hq, Hkv, N, d = 2, 6, 2, 40, 16
    q, k, v = torch.randn(B, Hq, N, d), torch.randn(B, Hkv, N, d), torch.randn(B, Hkv, N, 8)
    if kernel_cls == "oal":
        m = OALKernel(torch.randint(0, 3, (Hq, d)), Hkv, L=torch.randn(Hq, 4, 4) * 0.5)
    elif kernel_cls == "global":
        m = GlobalQuadraticKernel(Hq, Hkv, d)
    else:
        m = SoftmaxKernel(Hq, Hkv, d)
    o, _ = m(q, k, v)
    pos = torch.tensor([0, 7, 39, 20])
    assert torch.allclose(m.at_positions(q, k, v, pos), o[:, :, pos], atol=1e-5)


def test_oal_kernel_module_trains_L_only():
    m = OALKernel(torch.randint(0, 3, (3, 8)), 1)
    assert [n for n, p in m.named_parameters()] == ["L"]
    q, k, v = torch.randn(1, 3, 20, 8), torch.randn(1, 1, 20, 8), torch.randn(1, 1, 20, 8)
    m(q, k, v)[0].sum().backward()
    assert m.L.grad is not None and torch.isfinite(m.L.grad).all()


def test_oal_attention_decoding_path():
    groups = torch.randint(0, 3, (3, 8))
    L = torch.randn(3, 4, 4)
    q, k, v = torch.randn(1, 3, 30, 8), torch.randn(1, 1, 30, 8), torch.randn(1, 1, 30, 8)
    full, _ = oal_attention(q, k, v, groups, L)
    pre, state = oal_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], groups, L, output_final_state=True)
    rest, _ = oal_attention(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], groups, L, mode="recurrent", initial_state=state)
    assert torch.allclose(torch.cat([pre, rest], 2), full, atol=1e-5)


@pytest.mark.parametrize(
    "groups,L,eps,match",
    [
        (torch.zeros(2, 4), torch.zeros(2, 2, 2), 1e-3, "groups: expected an integer tensor"),
        (torch.zeros(2, 4, dtype=torch.long), torch.zeros(3, 2, 2), 1e-3, "L: expected 2 heads"),
        (torch.full((2, 4), 2, dtype=torch.long), torch.zeros(2, 2, 2), 1e-3, r"group ids in \[0, 1\)"),
        (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 2, 3), 1e-3, "L: expected shape"),
        (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 2, 2), 0.0, "eps: expected a positive"),
    ],
)
def test_bad_inputs(groups, L, eps, match):
    with pytest.raises(ValueError, match=match):
        oal_coefficients(groups, L, eps)
