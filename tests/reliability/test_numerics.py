"""Numerics at the edges: the chunked quadratic operator at N = 32768 with bf16 inputs and outlier dimensions 100x
the others, and calibration on adversarial Q/K/V never producing a kernel value below ε or a non-positive
denominator."""

from __future__ import annotations

import pytest
import torch

from oal.calibration import QKV, CalibrationConfig, calibrate_layer
from oal.kernels import GlobalQuadraticKernel, OALKernel
from oal.kernels.oal import oal_coefficients, oal_factor
from oal.ops import quadratic_attention

EPS = 1e-6


def _oal_inputs(N: int, *, Hq=2, Hkv=1, d=16, dv=16, G=3, outliers=(3, 11), seed=0):
    """q, k ~ N(0, 1) with the ``outliers`` dimensions 100x larger, rounded to bf16; OAL coefficients of random
    groups (outlier dimensions in their own group) and a random factor L."""
    g = torch.Generator().manual_seed(seed)
    size = torch.ones(d)
    size[list(outliers)] = 100.0
    q = (torch.randn(1, Hq, N, d, generator=g) * size).bfloat16()
    k = (torch.randn(1, Hkv, N, d, generator=g) * size).bfloat16()
    v = torch.randn(1, Hkv, N, dv, generator=g).bfloat16()
    groups = torch.randint(0, G - 1, (Hq, d), generator=g)
    groups[:, list(outliers)] = G - 1
    L = torch.randn(Hq, G + 1, G + 1, generator=g) * 0.5
    return q, k, v, groups, L


def _chunk(q, k, v, groups, L, dtype):
    """OAL's chunked path (oal_attention's call) with the coefficients in ``dtype``, denominators returned."""
    L = L.to(dtype)
    a, b, C = oal_coefficients(groups, L, EPS)
    return quadratic_attention(
        q, k, v, a, b, C, mode="chunk", factor=oal_factor(groups, L, EPS), kernel_floor=EPS, return_denominator=True
    )


def test_chunk_bf16_long_sequence_with_outliers():
    """N = 32768, bf16 q/k/v with two outlier dimensions 100x the others (scores up to ~10^4).

    Reference: the fp64 chunked operator on the same (bf16-rounded) values, itself checked against the
    explicit Eq. 3 sum in fp64 at 8 query positions (agreement ~1e-16). Tolerances (measured errors are 10-100x
    smaller): fp32 inputs (fp32 accumulation) within 1e-5 of the largest output and denominators within 1e-5
    relative; bf16 inputs within one bf16 rounding of the output, |o - ref| <= 2^-8 |ref| + 1e-5 max|ref|.
    """
    N = 32768
    q, k, v, groups, L = _oal_inputs(N)
    ref = _chunk(q.double(), k.double(), v.double(), groups, L, torch.float64)
    # the reference against Eq. 3 written out, at a few query positions (first, chunk edges, middle, last)
    a, b, C = oal_coefficients(groups, L.double(), EPS)
    qd, kd, vd = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5
    for h in range(q.shape[1]):
        for i in (0, 1, 63, 64, 1000, 16383, 32766, 32767):
            x = qd[0, h, i] * kd[0, 0, : i + 1] * scale
            kappa = a[h] + x @ b[h] + torch.einsum("nr,rt,nt->n", x, C[h], x)
            assert kappa.min() >= EPS * (1 - 1e-9)
            o = (kappa[:, None] * vd[0, 0, : i + 1]).sum(0) / kappa.sum()
            torch.testing.assert_close(ref.o[0, h, i], o, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(ref.denominator[0, h, i], kappa.sum(), rtol=1e-10, atol=0)
    top = ref.o.abs().max()

    fp32 = _chunk(q.float(), k.float(), v.float(), groups, L, torch.float32)
    assert torch.isfinite(fp32.o).all() and (fp32.denominator > 0).all()
    assert (fp32.o.double() - ref.o).abs().max() <= 1e-5 * top
    assert ((fp32.denominator.double() - ref.denominator).abs() / ref.denominator).max() <= 1e-5

    bf16 = _chunk(q, k, v, groups, L, torch.float32)
    assert bf16.o.dtype == torch.bfloat16
    assert torch.isfinite(bf16.o).all() and (bf16.denominator > 0).all()
    err = (bf16.o.double() - ref.o).abs()
    assert (err <= 2**-8 * ref.o.abs() + 1e-5 * top).all(), float(err.max())


def _adversarial(S: int, g: torch.Generator, *, Hq=4, Hkv=2, N=48, d=8, outliers=(1, 6)) -> QKV:
    size = torch.ones(d)
    size[list(outliers)] = 100.0
    q = torch.randn(S, Hq, N, d, generator=g) * size
    k = torch.randn(S, Hkv, N, d, generator=g) * size
    v = torch.randn(S, Hkv, N, d, generator=g)
    k[0, :, 5:20] = 0.0  # zero keys: κ is the constant term for every query
    k[S - 1] = k[S - 1, :, :1].clone()  # one key repeated over the whole sequence
    q[S - 1, :, ::2] *= -1  # alternating query signs: linear terms cancel in sums
    v[S - 1, :, :, 0] = 1e4  # a huge value channel
    return QKV(q, k, v)


@pytest.mark.parametrize("fast_path", [True, False])
def test_calibration_on_adversarial_data_keeps_kernel_positive(fast_path):
    """OAL (and the global quadratic calibrated on the way) fitted with a large learning rate on adversarial
    Q/K/V: the factor stays finite, κ ≥ ε at every causal (query, key) pair, and every denominator of the
    chunked, recurrent and unfloored chunked evaluations is > 0."""
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, d, G = 4, 2, 8, 3
    groups = torch.randint(0, G - 1, (Hq, d), generator=g)
    groups[:, [1, 6]] = G - 1
    config = CalibrationConfig(
        max_updates=40, val_every=10, patience=20, train_pool=32, val_positions=16, lr=0.5, fast_path=fast_path
    )
    result = calibrate_layer(
        OALKernel(groups, Hkv, num_groups=G, eps=EPS), _adversarial(3, g), _adversarial(2, g), config=config
    )
    assert torch.isfinite(result.val_mse).all()
    test = _adversarial(2, g)
    N = test.q.shape[2]
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    for state, kernel in (
        (result.state, OALKernel(groups, Hkv, num_groups=G, eps=EPS)),
        (result.global_stage.state, GlobalQuadraticKernel(Hq, Hkv, d, eps=EPS)),
    ):
        kernel.load_state_dict(state)
        assert torch.isfinite(kernel.L).all()
        kappa = kernel.weights(test.q, test.k, torch.arange(N)).detach()
        assert kappa[..., causal].min() >= EPS
        a, b, C = oal_coefficients(kernel.groups, kernel.L.detach(), EPS)
        factor = oal_factor(kernel.groups, kernel.L.detach(), EPS)
        for kw in ({"mode": "chunk", "factor": factor, "kernel_floor": EPS}, {"mode": "chunk", "factor": factor},
                   {"mode": "recurrent", "kernel_floor": EPS}):  # fmt: skip
            out = quadratic_attention(test.q, test.k, test.v, a, b, C, return_denominator=True, **kw)
            assert (out.denominator > 0).all(), kw
            assert torch.isfinite(out.o).all(), kw
