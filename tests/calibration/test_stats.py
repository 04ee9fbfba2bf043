"""The fast path's output statistics against the generic ``at_positions`` path (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from oal.calibration import factor_mse, grouped_output_stats, pair_map, pair_weights, stats_mse
from oal.kernels import OALKernel, SoftmaxKernel, embed_global


def _data(Hq, Hkv, N, d, dv, *, dtype=torch.float32, spread=1.5):
    q = torch.randn(1, Hq, N, d, dtype=dtype) * spread
    k = torch.randn(1, Hkv, N, d, dtype=dtype)
    v = torch.randn(1, Hkv, N, dv, dtype=dtype)
    return q, k, v


def _random_kernel(Hq, Hkv, d, G):
    groups = torch.randint(0, G, (Hq, d))
    groups[:, :G] = torch.arange(G)  # every group present
    kernel = OALKernel(groups, Hkv, num_groups=G)
    with torch.no_grad():
        kernel.L.add_(0.3 * torch.randn_like(kernel.L))
    return kernel


@pytest.mark.parametrize(
    ("Hq", "Hkv", "N", "d", "dv", "G"), [(2, 2, 37, 5, 3, 2), (6, 2, 50, 8, 5, 3), (3, 1, 19, 7, 4, 1)]
)
@pytest.mark.parametrize("block_bytes", [1, 1 << 26])
def test_stats_mse_equals_at_positions(Hq, Hkv, N, d, dv, G, block_bytes):
    q, k, v = _data(Hq, Hkv, N, d, dv)
    kernel = _random_kernel(Hq, Hkv, d, G)
    positions = torch.tensor([N - 1, 0, 3, 17 % N, 17 % N, N // 2])  # unsorted, duplicate, both ends
    st = grouped_output_stats(
        q[0], k[0], v[0], kernel.groups, G, positions, scale=kernel.scale, block_bytes=block_bytes
    )
    target = SoftmaxKernel(Hq, Hkv, d).at_positions(q, k, v, positions)[0]
    torch.testing.assert_close(st.y, target, atol=2e-6, rtol=1e-5)

    out = kernel.at_positions(q, k, v, positions)[0]
    ref = (out - target).square().mean((-2, -1))
    ref.sum().backward()
    Lt = kernel.L.detach().tril()
    mine = stats_mse(pair_weights(Lt @ Lt.mT, kernel.eps)[None], st.R, st.f, dv)[0]
    torch.testing.assert_close(mine.float(), ref.detach(), rtol=1e-4, atol=1e-9)

    mse, grad = factor_mse(kernel.L.detach()[None], pair_map(G, G + 1), kernel.eps, st.R, st.f, dv)
    torch.testing.assert_close(mse[0], mine)
    torch.testing.assert_close(grad[0].float(), kernel.L.grad.tril(), rtol=2e-3, atol=1e-6)


def test_stats_custom_target():
    Hq, Hkv, N, d, dv, G = 4, 2, 40, 6, 3, 2
    q, k, v = _data(Hq, Hkv, N, d, dv)
    kernel = _random_kernel(Hq, Hkv, d, G)
    other = _random_kernel(Hq, Hkv, d, G)
    positions = torch.tensor([5, 39, 12])
    target = other.at_positions(q, k, v, positions)[0].detach()
    st = grouped_output_stats(q[0], k[0], v[0], kernel.groups, G, positions, scale=kernel.scale, target=target)
    assert torch.equal(st.y, target)
    ref = (kernel.at_positions(q, k, v, positions)[0] - target).square().mean((-2, -1))
    Lt = kernel.L.detach().tril()
    mine = stats_mse(pair_weights(Lt @ Lt.mT, kernel.eps)[None], st.R, st.f, dv)[0]
    torch.testing.assert_close(mine.float(), ref.detach(), rtol=1e-4, atol=1e-9)
    with pytest.raises(ValueError, match="target"):
        grouped_output_stats(q[0], k[0], v[0], kernel.groups, G, positions, scale=kernel.scale, target=target[:, :2])


def _naive_outputs(q, k, v, groups, G, M, eps, positions, scale):
    """Hand-written reference in the inputs' dtype: ``(Hq, P, dv)`` OAL outputs (κ = ε + s̄ᵀ M s̄) and
    softmax outputs at the given positions, one head and one position at a time."""
    Hq, rep = q.shape[0], q.shape[0] // k.shape[0]
    oal, soft = [], []
    for h in range(Hq):
        kh, vh = k[h // rep], v[h // rep]
        o_h, s_h = [], []
        for i in positions.tolist():
            x = q[h, i] * kh[: i + 1] * scale  # (i+1, d)
            sbar = torch.stack([torch.ones(i + 1, dtype=q.dtype)] + [x[:, groups[h] == g].sum(-1) for g in range(G)])
            kappa = eps + torch.einsum("aj,ab,bj->j", sbar, M[h], sbar)
            o_h.append(kappa @ vh[: i + 1] / kappa.sum())
            w = torch.softmax(x.sum(-1), 0)
            s_h.append(w @ vh[: i + 1])
        oal.append(torch.stack(o_h))
        soft.append(torch.stack(s_h))
    return torch.stack(oal), torch.stack(soft)


def test_stats_fp64_exact():
    """In fp64 the identity is exact to rounding, against a hand-written loop reference."""
    Hq, Hkv, N, d, dv, G = 3, 3, 23, 6, 4, 3
    q, k, v = _data(Hq, Hkv, N, d, dv, dtype=torch.float64)
    kernel = _random_kernel(Hq, Hkv, d, G)
    positions = torch.tensor([22, 0, 7, 15])
    st = grouped_output_stats(q[0], k[0], v[0], kernel.groups, G, positions, scale=kernel.scale)
    Lt = kernel.L.detach().double().tril()
    M = Lt @ Lt.mT
    oal, soft = _naive_outputs(q[0], k[0], v[0], kernel.groups, G, M, kernel.eps, positions, kernel.scale)
    torch.testing.assert_close(st.y, soft, rtol=1e-12, atol=1e-14)
    ref = (oal - soft).square().mean((-2, -1))
    mine = stats_mse(pair_weights(M, kernel.eps)[None], st.R, st.f, dv)[0]
    torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-16)


def test_stats_group_layouts():
    """Bulk group not first, unused groups, singleton groups only, and a GQA group mixing them (fp64)."""
    d, G, dv, N = 6, 3, 3, 21
    groups = torch.tensor(
        [
            [2, 2, 0, 2, 2, 1],  # bulk is group 2
            [1, 1, 1, 1, 1, 1],  # a single group used, groups 0 and 2 empty
            [0, 1, 2, 0, 1, 2],  # no dominant group (tie → lowest id)
            [2, 0, 1, 1, 1, 1],
        ]
    )
    q, k, v = _data(4, 2, N, d, dv, dtype=torch.float64)
    L = torch.randn(4, G + 1, G + 1, dtype=torch.float64).tril()
    M = L @ L.mT
    positions = torch.tensor([20, 3, 11])
    st = grouped_output_stats(q[0], k[0], v[0], groups, G, positions, scale=0.4)
    oal, soft = _naive_outputs(q[0], k[0], v[0], groups, G, M, 1e-6, positions, 0.4)
    ref = (oal - soft).square().mean((-2, -1))
    mine = stats_mse(pair_weights(M, 1e-6)[None], st.R, st.f, dv)[0]
    torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-16)


@pytest.mark.parametrize("G", [1, 2, 4])
def test_factor_mse_gradient_matches_autograd(G):
    I, Hq, P, dv = 2, 3, 5, 7
    n = (G + 1) * (G + 2) // 2
    E = torch.randn(Hq, P, n, dv, dtype=torch.float64)
    R, f = E @ E.mT, torch.rand(Hq, P, n, dtype=torch.float64) + 0.5
    for r in {G + 1, 2}:
        L = torch.randn(I, Hq, r, r, dtype=torch.float64, requires_grad=True)
        Lg = L if r == G + 1 else embed_global(L.reshape(-1, 2, 2), G).view(I, Hq, G + 1, G + 1)
        Lt = Lg.tril()
        ref = stats_mse(pair_weights(Lt @ Lt.mT, 1e-3), R, f, dv)
        ref.sum().backward()
        mse, grad = factor_mse(L.detach(), pair_map(G, r), 1e-3, R, f, dv)
        torch.testing.assert_close(mse, ref.detach())
        torch.testing.assert_close(grad, L.grad, rtol=1e-9, atol=1e-9)


def test_pair_map_global_is_the_embedding():
    G = 3
    Lg = torch.randn(4, 2, 2, dtype=torch.float64)
    L = embed_global(Lg, G).tril()
    Mg = Lg.tril() @ Lg.tril().mT
    expected = pair_weights(L @ L.mT, 0.5)
    got = Mg.flatten(-2) @ pair_map(G, 2) + 0.5 * (torch.arange(expected.shape[-1]) == 0)
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="factor_size"):
        pair_map(G, 3)


def test_stats_rejects_bad_groups():
    q, k, v = _data(2, 1, 10, 4, 3)
    with pytest.raises(ValueError, match="groups"):
        grouped_output_stats(q[0], k[0], v[0], torch.zeros(3, 4, dtype=torch.long), 1, torch.tensor([1]), scale=0.5)
    with pytest.raises(ValueError, match="groups"):
        grouped_output_stats(q[0], k[0], v[0], torch.full((2, 4), 2), 2, torch.tensor([1]), scale=0.5)
