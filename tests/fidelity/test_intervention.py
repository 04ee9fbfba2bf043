"""The A.2 intervention: the hybrid kernel's limits (S = all dims is the full method, S = ∅ exact softmax),
matched controls, the Eq. 15 p-value, the aggregation and determinism."""

from __future__ import annotations

import pytest
import torch

from oal.fidelity.capture import LayerStates
from oal.fidelity.intervention import (
    InterventionErrors,
    evaluate_intervention,
    exact_outputs,
    expand_kv_heads,
    gaussian_groups,
    hybrid_outputs,
    matched_controls,
    output_mse,
    p_value,
    retained_ratio,
    sample_positions,
    subset_mask,
)
from oal.grouping import GroupAssignment
from oal.kernels import build_kernel

BASELINES = ("performer", "spectraformer", "dijiang", "taylorshift")


def _seq(gen, Hq, Hkv, N=37, d=16):
    return (
        torch.randn(Hq, N, d, generator=gen) * 2,
        torch.randn(Hkv, N, d, generator=gen) * 2,
        torch.randn(Hkv, N, d, generator=gen),
    )


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("Hkv", [6, 2])
def test_hybrid_limits(name, Hkv):
    gen = torch.Generator().manual_seed(0)
    Hq, d = 6, 16
    q, k, v = _seq(gen, Hq, Hkv)
    pos = torch.tensor([0, 5, 21, 36])
    kern = build_kernel(name, num_heads=Hq, num_kv_heads=Hkv, head_dim=d, layer_idx=2, seed=1)
    masks = torch.stack([torch.ones(Hq, d, dtype=torch.bool), torch.zeros(Hq, d, dtype=torch.bool)])
    y = hybrid_outputs(expand_kv_heads(kern), q, k, v, pos, masks, d**-0.5)
    full = kern.at_positions(q[None].double(), k[None].double(), v[None].double(), pos)[0]
    torch.testing.assert_close(y[0], full.double(), rtol=1e-5, atol=1e-5)
    ref = exact_outputs(q, k, v, pos, d**-0.5)
    torch.testing.assert_close(y[1], ref, rtol=1e-10, atol=1e-10)  # S = ∅: exact softmax, R_S = 0
    assert float(output_mse(y[0], ref)) > 1e-4
    assert kern.num_kv_heads == Hkv  # the caller's kernel is untouched


def test_hybrid_partial_subset_by_hand():
    """κ̃ = κ̂(q⊙1_S, k⊙1_S) · exp(q_S̄·k_S̄ /√d) with TaylorShift (τ = 1) on one head, computed explicitly."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = _seq(gen, 1, 1, N=9, d=4)
    S = torch.tensor([[True, False, True, False]])
    kern = build_kernel("taylorshift", num_heads=1, num_kv_heads=1, head_dim=4)
    pos = torch.tensor([3, 8])
    y = hybrid_outputs(kern, q, k, v, pos, S[None], 0.5)[0, 0]
    for r, i in enumerate(pos.tolist()):
        qs, ks = q[0, i] * S[0], k[0, : i + 1] * S[0]
        s = (ks / ks.norm(dim=-1, keepdim=True)) @ (qs / qs.norm())
        kap = 1 + s + s**2 / 2
        ex = torch.exp((k[0, : i + 1] * ~S[0]) @ (q[0, i] * ~S[0]) * 0.5)
        w = (kap * ex).double()
        torch.testing.assert_close(y[r], (w @ v[0, : i + 1].double()) / w.sum(), rtol=1e-5, atol=1e-6)


def test_exact_outputs_match_softmax_attention():
    gen = torch.Generator().manual_seed(3)
    q, k, v = _seq(gen, 6, 2)
    pos = torch.tensor([1, 30])
    full = torch.nn.functional.scaled_dot_product_attention(
        q[None].double(), k[None].double(), v[None].double(), is_causal=True, scale=0.25, enable_gqa=True
    )[0]
    torch.testing.assert_close(exact_outputs(q, k, v, pos, 0.25), full[:, pos])


def test_p_value_formula():
    assert p_value(0.5, [0.1, 0.2, 0.3]) == pytest.approx(1 / 4)
    assert p_value(0.2, [0.1, 0.2, 0.3]) == pytest.approx(3 / 4)  # ties count as exceeding
    assert p_value(0.9, torch.zeros(1000)) == pytest.approx(1 / 1001)
    with pytest.raises(ValueError, match="controls"):
        p_value(0.1, [])


def test_matched_controls():
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, [1, 4]] = True
    mask[1, 9] = True
    gen = torch.Generator().manual_seed(0)
    c = matched_controls(mask, ~mask, 50, gen)
    assert c.shape == (50, 3, 10)
    assert torch.equal(c.sum(-1), mask.sum(-1).expand(50, 3))
    assert not bool((c & mask).any())  # drawn from the bulk only
    assert len({tuple(x.flatten().tolist()) for x in c}) > 10
    again = matched_controls(mask, ~mask, 50, torch.Generator().manual_seed(0))
    assert torch.equal(c, again)


def test_retained_ratio_aggregation():
    # (L=1, B=2, seeds=2): seed means first, ratio per (layer, block), then the mean
    e_s = torch.tensor([[[1.0, 3.0], [2.0, 2.0]]], dtype=torch.float64)
    e_f = torch.tensor([[[4.0, 4.0], [1.0, 3.0]]], dtype=torch.float64)
    assert float(retained_ratio(e_s, e_f)) == pytest.approx((2 / 4 + 2 / 2) / 2)
    ctrl = torch.stack([e_s, 2 * e_s], dim=-1)  # two controls
    torch.testing.assert_close(retained_ratio(ctrl, e_f), torch.tensor([0.75, 1.5], dtype=torch.float64))


def test_sample_positions_deterministic():
    a = sample_positions(100, 32, 0, 4, 3)
    assert torch.equal(a, sample_positions(100, 32, 0, 4, 3))
    assert not torch.equal(a, sample_positions(100, 32, 0, 4, 2))
    assert a.unique().numel() == 32 and int(a.max()) < 100
    with pytest.raises(ValueError, match="positions"):
        sample_positions(10, 11, 0, 0, 0)


def _groups(H=6, d=16):
    from oal.grouping import group_heads

    chi = torch.rand(2, 10, H, d, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    chi[..., 3] *= 10
    return group_heads(chi, model_id="t", alpha=0.5, gamma=0.5, n_boot=30, layers=[1, 2])


def test_evaluate_intervention_deterministic_and_consistent():
    gen = torch.Generator().manual_seed(4)
    Hq, Hkv, d = 6, 2, 16
    data = {(layer, b): _seq(gen, Hq, Hkv, N=48) for layer in (1, 2) for b in (0, 1)}

    def states(layer, b):
        q, k, v = data[(layer, b)]
        return LayerStates(q[None], k[None], v[None], None, d**-0.5)

    groups = _groups()
    masks = {layer: subset_mask(groups, layer) for layer in (1, 2)}
    assert all(bool(m[:, 3].all()) for m in masks.values())  # the outlier dimension is selected

    def make(s, layer):
        return build_kernel("performer", num_heads=Hq, num_kv_heads=Hkv, head_dim=d, layer_idx=layer, seed=s)

    kw = dict(positions=8, seed=0, gaussian_masks=masks, controls=5, control_blocks=1, batch=2)
    a = evaluate_intervention(states, make, [0, 1], masks, [1, 2], [0, 1], **kw)
    b = evaluate_intervention(states, make, [0, 1], masks, [1, 2], [0, 1], **kw)
    for name in ("full", "subset", "gauss_full", "gauss_subset", "controls"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.controls.shape == (2, 1, 2, 5)
    assert not torch.equal(a.full[..., 0], a.full[..., 1])  # kernel seeds differ
    s = a.summary([1, 2])
    assert s["R_S"] == pytest.approx(float(retained_ratio(a.subset, a.full)))
    assert s["controls"]["p_value"] == pytest.approx(
        p_value(s["controls"]["R_S_on_control_blocks"], retained_ratio(a.controls, a.full[:, :1]))
    )
    # a control batch equals evaluating its subsets one at a time (vectorisation is exact)
    q, k, v = data[(1, 0)]
    pos = sample_positions(48, 8, 0, 1, 0)
    cm = matched_controls(masks[1], ~masks[1], 3, torch.Generator().manual_seed(9))
    kern = expand_kv_heads(make(0, 1))
    batched = hybrid_outputs(kern, q, k, v, pos, cm, d**-0.5)
    single = torch.cat([hybrid_outputs(kern, q, k, v, pos, cm[i : i + 1], d**-0.5) for i in range(3)])
    torch.testing.assert_close(batched, single)


def test_gaussian_groups_use_template_procedure():
    groups = _groups()
    g = gaussian_groups(groups, [1, 2], 2, [16] * 10, seed=0)
    again = gaussian_groups(groups, [1, 2], 2, [16] * 10, seed=0)
    assert isinstance(g, GroupAssignment) and g.params["alpha"] == groups.params["alpha"]
    assert torch.equal(g.group_ids(1), again.group_ids(1))
    assert all(r.num_groups >= groups.params["g_min"] for r in g.layers[1])
    assert not torch.equal(g.group_ids(1), g.group_ids(2))  # independent draws per layer


def test_summary_without_controls():
    e = InterventionErrors(torch.ones(1, 2, 1), torch.full((1, 2, 1), 0.5))
    s = e.summary([4])
    assert s["R_S"] == pytest.approx(0.5) and "controls" not in s and "R_S_gaussian" not in s
