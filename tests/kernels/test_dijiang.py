"""DiJiang: the DCT projection, the explicit weighted softmax-feature kernel, the query-side D², gradients."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.fft
import torch

from oal.kernels import DiJiangKernel
from oal.kernels.baselines import dct_matrix


def test_dct_matrix_is_scipy_orthonormal_dct():
    for d in (1, 5, 8, 64):
        C = dct_matrix(d)
        ref = torch.from_numpy(scipy.fft.dct(np.eye(d), axis=0, norm="ortho"))
        torch.testing.assert_close(C, ref)
        torch.testing.assert_close(C @ C.T, torch.eye(d, dtype=torch.float64))


def test_projection_is_dct_times_inverse_normal_diagonal():
    kern = DiJiangKernel(4, 2, 64, seed=3)
    P = kern.projection.double()
    w = dct_matrix(64).T @ P  # = diag(w) since the DCT is orthonormal
    torch.testing.assert_close(w, torch.diag(torch.diagonal(w)), atol=1e-6, rtol=0)
    w = torch.diagonal(w)
    assert torch.isfinite(w).all() and w.abs().max() < 5 and abs(w.mean()) < 0.5 and 0.6 < w.std() < 1.4
    assert {n: tuple(p.shape) for n, p in kern.named_parameters()} == {"theta": (4, 64)}
    assert (kern.theta == 0).all() and kern.num_features == 64 and kern.dtype == torch.float32


@pytest.mark.parametrize("hq,hkv", [(2, 2), (3, 1)])
def test_matches_explicit_formula(hq, hkv):
    """κ_h(q, k) = Σ_l softmax(x_q P)_l e^{θ_hl} · softmax(x_k P)_l e^{θ_hl}, x = · d^{-1/4} (App. F.1)."""
    d = 8
    kern = DiJiangKernel(hq, hkv, d, seed=0, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        kern.theta.copy_(0.5 * torch.randn(hq, d, generator=g))
    q = torch.randn(2, hq, 11, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, 11, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, 11, 3, generator=g, dtype=torch.float64)
    P = kern.projection.double()

    def feat(x, theta):
        z = (x / d**0.25) @ P
        e = torch.exp(z - z.max())
        return e / e.sum() * torch.exp(theta.double())

    kernel = torch.zeros(2, hq, 11, 11, dtype=torch.float64)
    for b in range(2):
        for h in range(hq):
            for i in range(11):
                for j in range(i + 1):
                    kernel[b, h, i, j] = feat(q[b, h, i], kern.theta[h]) @ feat(
                        k[b, h // (hq // hkv), j], kern.theta[h]
                    )
    torch.testing.assert_close(kern.weights(q, k, torch.arange(11)), kernel, rtol=1e-12, atol=0)
    ref = kernel @ torch.repeat_interleave(v, hq // hkv, dim=1) / kernel.sum(-1, keepdim=True)
    for mode in ("naive", "chunk", "recurrent"):
        torch.testing.assert_close(kern(q, k, v, mode=mode, chunk_size=4)[0], ref, rtol=1e-12, atol=1e-12)


def test_shared_key_state_equals_repeated_keys():
    """D² on the query side with one state per KV head is the same attention as repeating keys and values."""
    kern = DiJiangKernel(6, 2, 8, dtype=torch.float64)
    with torch.no_grad():
        kern.theta.normal_()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 20, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 20, 3, generator=g, dtype=torch.float64)
    mha = DiJiangKernel(6, 6, 8, dtype=torch.float64)
    mha.load_state_dict(kern.state_dict())
    o, state = kern(q, k, v, output_final_state=True)
    o_rep, state_rep = mha(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), output_final_state=True)
    torch.testing.assert_close(o, o_rep)
    assert state.kv.shape == (1, 2, 8, 4) and state_rep.kv.shape == (1, 6, 8, 4)


def test_gradcheck_fp64():
    kern = DiJiangKernel(2, 1, 4, dtype=torch.float64).double()
    g = torch.Generator().manual_seed(0)
    theta = (0.3 * torch.randn(2, 4, generator=g, dtype=torch.float64)).requires_grad_()
    q = torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    for mode in ("chunk", "naive"):

        def fn(theta, q, k, v, mode=mode):
            return torch.func.functional_call(kern, {"theta": theta}, (q, k, v), {"mode": mode, "chunk_size": 2})[0]

        assert torch.autograd.gradcheck(fn, (theta, q, k, v))
