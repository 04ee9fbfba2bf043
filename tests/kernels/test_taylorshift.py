"""TaylorShift: the explicit 1 + s + s²/2 kernel, its Eq. 3 coefficients and factor, invariances, gradients."""

from __future__ import annotations

import pytest
import torch

from oal.kernels import TaylorShiftKernel
from oal.ops.quadratic import factored_kernel, naive_kernel_matrix


def make(hq, hkv, d=8):
    kern = TaylorShiftKernel(hq, hkv, d, dtype=torch.float64)
    with torch.no_grad():
        kern.temperature.copy_(torch.linspace(0.5, 2.5, hq))
    return kern


@pytest.mark.parametrize("hq,hkv", [(2, 2), (3, 1)])
def test_matches_explicit_formula(hq, hkv):
    kern = make(hq, hkv)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, 12, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, 12, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, 12, 3, generator=g, dtype=torch.float64)
    kernel = torch.zeros(2, hq, 12, 12, dtype=torch.float64)
    for b in range(2):
        for h in range(hq):
            for i in range(12):
                for j in range(i + 1):
                    qi, kj = q[b, h, i], k[b, h // (hq // hkv), j]
                    s = kern.temperature[h].item() * (qi @ kj) / (qi.norm() * kj.norm())
                    kernel[b, h, i, j] = 1 + s + s * s / 2
    torch.testing.assert_close(kern.weights(q, k, torch.arange(12)), kernel, rtol=1e-12, atol=0)
    ref = kernel @ torch.repeat_interleave(v, hq // hkv, dim=1) / kernel.sum(-1, keepdim=True)
    for mode in ("naive", "chunk", "recurrent"):
        torch.testing.assert_close(kern(q, k, v, mode=mode, chunk_size=5)[0], ref, rtol=1e-12, atol=1e-12)


def test_coefficients_and_factor_are_the_same_kernel():
    kern = make(3, 1)
    g = torch.Generator().manual_seed(1)
    qn = torch.nn.functional.normalize(torch.randn(3, 7, 8, generator=g, dtype=torch.float64), dim=-1)
    kn = torch.nn.functional.normalize(torch.randn(1, 9, 8, generator=g, dtype=torch.float64), dim=-1)
    a, b, C = kern.coefficients(torch.float64)
    f = kern.factor(torch.float64)
    from_factor = factored_kernel(qn[None], kn[None], f, 1.0)[0]
    for h in range(3):
        s = kern.temperature[h].item() * qn[h] @ kn[0].T
        torch.testing.assert_close(naive_kernel_matrix(qn[h], kn[0], a[h], b[h], C[h], 1.0), 1 + s + s**2 / 2)
        torch.testing.assert_close(from_factor[h], 1 + s + s**2 / 2)
    assert (from_factor >= 0.5).all()


def test_invariant_to_query_and_key_norms():
    kern = make(3, 1)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 3, 20, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 20, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, 20, 4, generator=g, dtype=torch.float64)
    scale_q = torch.rand(1, 3, 20, 1, generator=g, dtype=torch.float64) * 10 + 0.1
    scale_k = torch.rand(1, 1, 20, 1, generator=g, dtype=torch.float64) * 10 + 0.1
    torch.testing.assert_close(kern(q, k, v)[0], kern(q * scale_q, k * scale_k, v)[0])


def test_parameters_and_state():
    kern = TaylorShiftKernel(14, 2, 64)
    assert {n: tuple(p.shape) for n, p in kern.named_parameters()} == {"temperature": (14,)}
    assert (kern.temperature == 1).all()
    assert kern.state_shape(1, 64) == (1, 2, 1 + 64 + 64 * 65 // 2, 65)


def test_gradcheck_fp64():
    kern = TaylorShiftKernel(2, 1, 3, dtype=torch.float64).double()
    g = torch.Generator().manual_seed(0)
    tau = torch.tensor([0.7, 1.6], dtype=torch.float64, requires_grad=True)
    q = torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    for mode in ("chunk", "naive"):

        def fn(tau, q, k, v, mode=mode):
            params = {"temperature": tau}
            return torch.func.functional_call(kern, params, (q, k, v), {"mode": mode, "chunk_size": 2})[0]

        assert torch.autograd.gradcheck(fn, (tau, q, k, v))
