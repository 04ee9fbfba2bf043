"""SpectraFormer OPRF–FastFoodL: FastFood structure, the OPRF coefficient, the explicit kernel, gradients."""

from __future__ import annotations

import math

import pytest
import scipy.linalg
import torch

from oal.kernels import SpectraFormerKernel
from oal.kernels.baselines import fastfood, hadamard_matrix, oprf_coefficient


def explicit_features(kern: SpectraFormerKernel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Upstream's OPRF feature of x (one token, already scaled by d^{-1/4}) whose OPRF statistic uses the pair
    (x, y), written out with dense matrices and every per-token term upstream keeps (A‖ω‖², C‖x‖²)."""
    d = x.shape[-1]
    H = torch.tensor(scipy.linalg.hadamard(d), dtype=torch.float64)
    Pm = torch.zeros(d, d, dtype=torch.float64)
    Pm[torch.arange(d), kern.perm] = 1.0
    Bv, Gv, Sv = (p.detach().double() for p in (kern.ff_B, kern.ff_G, kern.ff_S))
    M = torch.diag(Sv) @ H @ torch.diag(Gv) @ Pm @ H @ torch.diag(Bv)
    proj = torch.cat([(M @ (x * d**-0.25)) / math.sqrt(d), torch.ones(1, dtype=torch.float64)])
    # optimize_opt_pos_params_torch at batch size 1: a = 2φ, b = 2φ + d, c = -d
    phi = (x @ x + y @ y + 2 * x @ y).item()
    a, b, c = 2 * phi, 2 * phi + d, -d
    rho = (math.sqrt(b * b - 4 * a * c) - b) / (2 * a)
    A = (1 - 1 / rho) / 8
    Bc, C = math.sqrt(1 - 4 * A), -1.0
    z = A * (Sv * Gv * Bv).norm() ** 2 + Bc * proj + C * (x @ x)
    return torch.exp(z - z.max()) + kern.eps


@pytest.mark.parametrize("hq,hkv", [(2, 2), (3, 1)])
def test_matches_explicit_formula(hq, hkv):
    kern = SpectraFormerKernel(hq, hkv, 8, seed=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in kern.parameters():
            p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
    q = torch.randn(2, hq, 9, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, 9, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, 9, 3, generator=g, dtype=torch.float64)
    s = 8**-0.25
    kernel = torch.zeros(2, hq, 9, 9, dtype=torch.float64)
    for b in range(2):
        for h in range(hq):
            kk = k[b, h // (hq // hkv)]
            for i in range(9):
                fq = explicit_features(kern, q[b, h, i] * s, kk[i] * s)
                for j in range(i + 1):
                    kernel[b, h, i, j] = fq @ explicit_features(kern, kk[j] * s, q[b, h, j] * s)
    pos = torch.arange(9)
    torch.testing.assert_close(kern.weights(q, k, pos), kernel, rtol=1e-12, atol=0)
    ref = kernel @ torch.repeat_interleave(v, hq // hkv, dim=1) / kernel.sum(-1, keepdim=True)
    for mode in ("naive", "chunk", "recurrent"):
        torch.testing.assert_close(kern(q, k, v, mode=mode, chunk_size=4)[0], ref, rtol=1e-12, atol=1e-12)


def test_65_features_for_head_dim_64_and_3d_parameters_per_layer():
    kern = SpectraFormerKernel(14, 2, 64)
    assert kern.num_features == 65
    assert {n: tuple(p.shape) for n, p in kern.named_parameters()} == {"ff_B": (64,), "ff_G": (64,), "ff_S": (64,)}
    assert sum(p.numel() for p in kern.parameters()) == 192  # shared by all 14 query heads
    assert all(p.dtype == torch.float32 for p in kern.parameters())
    assert kern.dtype == torch.float64


def test_fixed_branch_initialisation():
    kern = SpectraFormerKernel(2, 1, 64, seed=5)
    B, G, S = (p.detach().double() for p in (kern.ff_B, kern.ff_G, kern.ff_S))
    assert set(B.tolist()) == {-1.0, 1.0}
    assert abs(G.mean()) < 0.5 and abs(G.std() - 1) < 0.3
    chi = S * G.norm()  # S = χ_64 samples / ‖G‖
    chi_mean = math.sqrt(2) * math.exp(math.lgamma(32.5) - math.lgamma(32))
    assert abs(chi.mean() - chi_mean) < 0.4 and chi.std() > 0.3
    assert sorted(kern.perm.tolist()) == list(range(64)) and kern.perm.tolist() != list(range(64))
    # the implied projection rows have χ_64 norms: V behaves like a Gaussian projection of q/√d
    H = hadamard_matrix(64, torch.float64)
    M = torch.diag(S) @ H @ torch.diag(G) @ torch.eye(64, dtype=torch.float64)[kern.perm] @ H @ torch.diag(B)
    torch.testing.assert_close(M.norm(dim=1) / math.sqrt(64), chi)


def test_hadamard_and_fastfood():
    for d in (1, 2, 8, 64):
        H = hadamard_matrix(d, torch.float64)
        assert torch.equal(H, torch.tensor(scipy.linalg.hadamard(d), dtype=torch.float64))
        torch.testing.assert_close(H @ H.T, d * torch.eye(d, dtype=torch.float64))
    with pytest.raises(ValueError, match="d"):
        hadamard_matrix(12, torch.float64)
    g = torch.Generator().manual_seed(0)
    x, B, G, S = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, 8), (8,), (8,), (8,)))
    perm = torch.randperm(8, generator=g)
    H = torch.tensor(scipy.linalg.hadamard(8), dtype=torch.float64)
    P = torch.eye(8, dtype=torch.float64)[perm]  # (P y)_i = y_perm[i]
    dense = torch.diag(S) @ H @ torch.diag(G) @ P @ H @ torch.diag(B)
    torch.testing.assert_close(fastfood(x, B, G, S, perm), x @ dense.T)


def test_oprf_coefficient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 16, generator=g, dtype=torch.float64)
    y = torch.randn(50, 16, generator=g, dtype=torch.float64)
    d = 16
    phi = ((x + y) ** 2).sum(-1)
    rho = (torch.sqrt((2 * phi + d) ** 2 + 8 * phi * d) - (2 * phi + d)) / (4 * phi)
    A = (1 - 1 / rho) / 8
    torch.testing.assert_close(oprf_coefficient(x, y), torch.sqrt(1 - 4 * A))
    assert (A < 0).all()  # ρ ∈ (0, 1), so the GERF D factor is positive and B_c > 1
    # φ = 0 (x = -y) is the removable singularity ρ → 1: A = 0, B_c = 1, no 0/0
    torch.testing.assert_close(oprf_coefficient(x, -x), torch.ones(50, dtype=torch.float64))


def test_gradcheck_fp64():
    kern = SpectraFormerKernel(2, 1, 4, seed=0).double()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, 5, 2, generator=g, dtype=torch.float64)
    params = {n: p.detach().clone().requires_grad_(True) for n, p in kern.named_parameters()}

    def fn(B, G, S, q, k, v, mode):
        out, _ = torch.func.functional_call(kern, {"ff_B": B, "ff_G": G, "ff_S": S}, (q, k, v), {"mode": mode})
        return out

    args = (params["ff_B"], params["ff_G"], params["ff_S"], q.requires_grad_(), k.requires_grad_(), v.requires_grad_())
    for mode in ("chunk", "naive"):
        assert torch.autograd.gradcheck(lambda *a, mode=mode: fn(*a, mode), args)


def test_bad_arguments():
    with pytest.raises(ValueError, match="head_dim"):
        SpectraFormerKernel(2, 1, 12)
    with pytest.raises(ValueError, match="eps"):
        SpectraFormerKernel(2, 1, 8, eps=-1.0)
    with pytest.raises(ValueError, match="dtype"):
        SpectraFormerKernel(2, 1, 8, dtype="int32")
    assert SpectraFormerKernel(2, 1, 8, dtype="float32").dtype == torch.float32
