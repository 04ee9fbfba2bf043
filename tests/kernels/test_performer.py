"""Performer (FAVOR+): projection structure, unbiasedness, the explicit kernel and the stabilisers."""

from __future__ import annotations

import math

import pytest
import torch

from oal.kernels import PerformerKernel, SoftmaxKernel
from oal.kernels.baselines import favor_log_features, orthogonal_gaussian_projection


def explicit_performer_output(kern: PerformerKernel, q, k, v):
    """App. F.1 written out: κ = (1/m) Σ_l exp(ω_lᵀx − ‖x‖²/2) exp(ω_lᵀy − ‖y‖²/2) with x = q d^{-1/4} and
    y = k d^{-1/4}, evaluated pair by pair without any stabiliser, then normalised causally."""
    B, Hq, N, d = q.shape
    group = Hq // k.shape[1]
    m = kern.omega.shape[1]
    out = torch.zeros(B, Hq, N, v.shape[-1], dtype=torch.float64)
    kernel = torch.zeros(B, Hq, N, N, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            om = kern.omega[h].double()
            x = q[b, h] / d**0.25
            y = k[b, h // group] / d**0.25
            fx = torch.exp(x @ om.T - (x * x).sum(1, keepdim=True) / 2)
            fy = torch.exp(y @ om.T - (y * y).sum(1, keepdim=True) / 2)
            for i in range(N):
                w = torch.stack([(fx[i] * fy[j]).sum() / m for j in range(i + 1)])
                kernel[b, h, i, : i + 1] = w
                out[b, h, i] = (w[:, None] * v[b, h // group, : i + 1]).sum(0) / w.sum()
    return out, kernel


@pytest.mark.parametrize("hq,hkv", [(2, 2), (3, 1)])
def test_matches_explicit_formula(hq, hkv):
    kern = PerformerKernel(hq, hkv, 8, num_features=19, seed=2)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, 13, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, 13, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, 13, 3, generator=g, dtype=torch.float64)
    ref, kernel = explicit_performer_output(kern, q, k, v)
    for mode in ("naive", "chunk", "recurrent"):
        o, _ = kern(q, k, v, mode=mode, chunk_size=5)
        torch.testing.assert_close(o, ref, rtol=1e-11, atol=1e-11)
    pos = torch.tensor([12, 0, 6])
    w = kern.weights(q, k, pos)
    # rows equal the explicit kernel up to the per-row stabiliser factor, which cancels in the normalisation
    torch.testing.assert_close(w / w.sum(-1, keepdim=True), kernel[:, :, pos] / kernel[:, :, pos].sum(-1, keepdim=True))


def test_unbiased_estimate_of_the_softmax_kernel():
    """E[φ(x)ᵀφ(y)] = exp(qᵀk/√d): with m = 16384 features and d = 4 the average over 16 independent heads is
    within a few percent for every pair, and the mean over all pairs and heads is within half a percent."""
    d, heads = 4, 16
    kern = PerformerKernel(heads, 1, d, num_features=16384, seed=0)
    g = torch.Generator().manual_seed(0)
    q = 0.5 * torch.randn(1, heads, 20, d, generator=g, dtype=torch.float64)
    k = 0.5 * torch.randn(1, heads, 20, d, generator=g, dtype=torch.float64)
    om = kern.omega.double()
    est = torch.exp(favor_log_features(q / d**0.25, om)) @ torch.exp(favor_log_features(k / d**0.25, om)).mT
    ratio = est / torch.exp(q @ k.mT / math.sqrt(d))
    assert (ratio.mean(1) - 1).abs().max() < 0.04
    assert abs(ratio.mean().item() - 1) < 5e-3


def test_orthogonal_blocks_with_chi_norms():
    d, m = 8, 4000
    omega = orthogonal_gaussian_projection(m, d, torch.Generator().manual_seed(0))
    assert omega.shape == (m, d) and omega.dtype == torch.float64
    norms = omega.norm(dim=1)
    unit = omega / norms[:, None]
    for start in range(0, m, d):  # full blocks of d rows, then a partial block of m mod d rows
        blk = unit[start : start + d]
        torch.testing.assert_close(blk @ blk.T, torch.eye(blk.shape[0], dtype=torch.float64))
    assert (unit[:d] @ unit[d : 2 * d].T).abs().max() > 0.1  # different blocks are independent
    chi_mean = math.sqrt(2) * math.exp(math.lgamma((d + 1) / 2) - math.lgamma(d / 2))
    assert abs(norms.mean().item() - chi_mean) < 0.03 * chi_mean
    assert abs(norms.square().mean().item() - d) < 0.05 * d  # E[χ_d²] = d
    # entries are marginally N(0, 1)
    assert abs(omega.mean().item()) < 0.05 and abs(omega.std().item() - 1) < 0.03


def test_partial_last_block_and_per_head_buffers():
    kern = PerformerKernel(3, 1, 64, seed=0)  # F.1: 250 = 3·64 + 58 features per query head
    assert kern.omega.shape == (3, 250, 64) and kern.num_features == 250
    unit = kern.omega[0, 192:].double()
    unit = unit / unit.norm(dim=1, keepdim=True)
    torch.testing.assert_close(unit @ unit.T, torch.eye(58, dtype=torch.float64), atol=1e-5, rtol=0)
    assert not torch.equal(kern.omega[0], kern.omega[1])
    assert list(kern.parameters()) == []  # nothing trainable (only LoRA is, in F.1)
    assert kern.dtype == torch.float64


def test_approaches_softmax_with_many_features():
    g = torch.Generator().manual_seed(1)
    q = 0.5 * torch.randn(1, 2, 40, 8, generator=g)
    k = 0.5 * torch.randn(1, 2, 40, 8, generator=g)
    v = torch.randn(1, 2, 40, 4, generator=g)
    ref, _ = SoftmaxKernel(2, 2, 8)(q, k, v)
    errs = []
    for m in (64, 4096):
        o, _ = PerformerKernel(2, 2, 8, num_features=m)(q, k, v)
        errs.append(((o - ref).square().mean() / ref.square().mean()).item())
    assert errs[1] < 0.01 and errs[1] < errs[0] / 10


def test_stabilisers_keep_large_logits_finite():
    """Large and growing norms: the plain FAVOR+ features of most queries and keys underflow to 0 in fp32 (0/0),
    while the per-token query shift and the causal shared key shift keep every fp32 mode finite and equal to
    the fp64 result."""
    g = torch.Generator().manual_seed(3)
    n = 70
    q = 12 * torch.randn(1, 2, n, 8, generator=g)
    k = torch.randn(1, 2, n, 8, generator=g) * torch.linspace(6, 16, n)[:, None]
    v = torch.randn(1, 2, n, 4, generator=g)
    kern32 = PerformerKernel(2, 2, 8, num_features=32, dtype=torch.float32)
    lq = favor_log_features(q / 8**0.25, kern32.omega)
    lk = favor_log_features(k / 8**0.25, kern32.omega)
    assert (lq.exp().sum(-1) == 0).float().mean() > 0.5 and (lk.exp().sum(-1) == 0).float().mean() > 0.5
    ref, _ = PerformerKernel(2, 2, 8, num_features=32, dtype=torch.float64)(q.double(), k.double(), v.double())
    for mode in ("naive", "chunk", "recurrent"):
        o, state = kern32(q, k, v, mode=mode, chunk_size=16, output_final_state=True)
        assert torch.isfinite(o).all(), mode
        torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-4)
        # the state's unit is the largest key log-feature seen, so every stored key feature is ≤ 1
        torch.testing.assert_close(state.shift, lk.amax(dim=(-2, -1)))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_features"):
        PerformerKernel(2, 1, 8, num_features=0)
    with pytest.raises(ValueError, match="dtype"):
        PerformerKernel(2, 1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="seed"):
        PerformerKernel(2, 1, 8, seed=-1)
    with pytest.raises(ValueError, match="num_heads"):
        PerformerKernel(3, 2, 8)
