"""Eq. 21–22 against hand-computed values, and the fidelity loop on frozen tensors."""

from __future__ import annotations

import pytest
import torch

from oal.fidelity.capture import LayerStates
from oal.fidelity.evaluate import evaluate_fidelity, markdown_table, sink_mass
from oal.fidelity.metrics import FidelityAccumulator, error_sums, reduce_sequences
from oal.kernels import GlobalQuadraticKernel, SoftmaxKernel
from oal.models import exact_attention


def test_reduce_sequences_by_hand():
    # sequence 1: err 4 over 2 elements, energy 8; sequence 2: err 1 over 4 elements, energy 2
    r = reduce_sequences([(4.0, 8.0, 2), (1.0, 2.0, 4)])
    assert r["mse"] == pytest.approx((4 / 2 + 1 / 4) / 2)
    assert r["relmse"] == pytest.approx((4 / 8 + 1 / 2) / 2)
    with pytest.raises(ValueError, match="positive"):
        reduce_sequences([(1.0, 0.0, 2)])
    with pytest.raises(ValueError, match="at least one"):
        reduce_sequences([])


def test_accumulator_pools_layers_per_sequence():
    acc = FidelityAccumulator()
    exact = torch.tensor([[[[1.0, 2.0]]]])  # (1, 1, 1, 2): energy 5
    approx = torch.tensor([[[[1.0, 0.0]]]])  # err 4
    acc.add("m", "before_wo", 0, 4, approx, exact)
    acc.add("m", "before_wo", 0, 12, exact * 2, exact)  # err 5, energy 5
    acc.add("m", "before_wo", 1, 4, exact, exact)  # err 0, energy 5
    acc.add("m", "before_wo", 1, 12, exact, exact)
    for b in (0, 1):  # after-W_o stage: identical values, so only shapes matter
        for layer in (4, 12):
            acc.add("m", "after_wo", b, layer, exact[0], exact[0])
    m = acc.metrics("m")
    # sequence 0 pools both layers: (4 + 5) / (5 + 5) and (4 + 5) / 4 elements; sequence 1: 0
    assert m["relmse_before_wo"] == pytest.approx((9 / 10 + 0) / 2)
    assert m["mse_before_wo"] == pytest.approx((9 / 4 + 0) / 2)
    assert m["per_layer"]["4"]["relmse_before_wo"] == pytest.approx((4 / 5 + 0) / 2)
    assert m["per_layer"]["12"]["mse_before_wo"] == pytest.approx((5 / 2 + 0) / 2)
    assert m["relmse_after_wo"] == 0 and m["sequences"] == 2
    assert m["per_head"]["4"]["relmse_before_wo"] == pytest.approx([(4 / 5 + 0) / 2])


def test_error_sums_checks_shapes():
    with pytest.raises(ValueError, match="approx"):
        error_sums(torch.zeros(2, 3), torch.zeros(3, 2))


def _states(gen, Hq=6, Hkv=2, N=40, d=8, S=1):
    q = torch.randn(S, Hq, N, d, generator=gen) * 2
    k = torch.randn(S, Hkv, N, d, generator=gen) * 2
    v = torch.randn(S, Hkv, N, d, generator=gen)
    return LayerStates(q, k, v, exact_attention(q, k, v), d**-0.5)


@pytest.mark.parametrize("Hkv", [6, 2])
def test_evaluate_fidelity_reference_and_after_wo(Hkv):
    gen = torch.Generator().manual_seed(0)
    Hq, d, hidden = 6, 8, 10
    data = {(layer, b): _states(gen, Hkv=Hkv) for layer in (1, 3) for b in (0, 1)}
    W = {layer: torch.randn(hidden, Hq * d, generator=gen) for layer in (1, 3)}
    bias = {1: torch.randn(hidden, generator=gen), 3: None}
    glob = GlobalQuadraticKernel(Hq, Hkv, d)
    kernels = {"softmax": {i: SoftmaxKernel(Hq, Hkv, d) for i in (1, 3)}, "global": {i: glob for i in (1, 3)}}
    run = evaluate_fidelity(
        lambda layer, b: data[(layer, b)], kernels, {i: (W[i], bias[i]) for i in (1, 3)}, [1, 3], [0, 1]
    )
    soft = run.acc.metrics("softmax")
    assert all(soft[k] == 0 for k in ("mse_before_wo", "relmse_before_wo", "mse_after_wo", "relmse_after_wo"))
    # global by hand: per sequence, both layers pooled; after W_o with the bias in both outputs
    rel_b, rel_a, mse_a = [], [], []
    for b in (0, 1):
        eb = ab = ea = aa = 0.0
        n_a = 0
        for layer in (1, 3):
            st = data[(layer, b)]
            with torch.no_grad():
                y = glob(st.q, st.k, st.v)[0]
            eb += float((y - st.o).double().square().sum())
            ab += float(st.o.double().square().sum())

            def proj(o, layer=layer):
                out = o.transpose(1, 2).reshape(1, o.shape[2], -1) @ W[layer].T
                return out if bias[layer] is None else out + bias[layer]

            ea += float((proj(y) - proj(st.o)).double().square().sum())
            aa += float(proj(st.o).double().square().sum())
            n_a += proj(st.o).numel()
        rel_b.append(eb / ab)
        rel_a.append(ea / aa)
        mse_a.append(ea / n_a)
    g = run.acc.metrics("global")
    assert g["relmse_before_wo"] == pytest.approx(sum(rel_b) / 2, rel=1e-5)
    assert g["relmse_after_wo"] == pytest.approx(sum(rel_a) / 2, rel=1e-5)
    assert g["mse_after_wo"] == pytest.approx(sum(mse_a) / 2, rel=1e-5)
    assert g["relmse_before_wo"] > 0.01
    assert run.capture_check[1] < 1e-5
    assert "| global |" in markdown_table({"global": g})


def test_sink_mass_equals_softmax_weights():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 30, 8, generator=gen) * 3, torch.randn(1, 2, 30, 8, generator=gen) * 3
    w = SoftmaxKernel(4, 2, 8).weights(q, k, torch.arange(30))
    w = w / w.sum(-1, keepdim=True)
    m = sink_mass(q, k, 8**-0.5)
    torch.testing.assert_close(m[..., 0], w[..., 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m[..., 1], w[..., :4].sum(-1), rtol=1e-5, atol=1e-6)
