"""SinkWindowKernel: names, parameters, weights/at_positions vs forward, reductions, decoding, β matching."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from oal.kernels import (
    GlobalQuadraticKernel,
    OALKernel,
    SinkWindowKernel,
    SoftmaxKernel,
    sink_window_name,
    split_sink_window_name,
)


def make_qkv(B, Hq, Hkv, N, d, dv, dtype=torch.float32):
    return (
        torch.randn(B, Hq, N, d, dtype=dtype),
        torch.randn(B, Hkv, N, d, dtype=dtype),
        torch.randn(B, Hkv, N, dv, dtype=dtype),
    )


def make_inner(kind, Hq, Hkv, d):
    if kind == "oal":
        return OALKernel(torch.randint(0, 3, (Hq, d)), Hkv, L=torch.randn(Hq, 4, 4) * 0.5)
    return GlobalQuadraticKernel(Hq, Hkv, d, L=torch.randn(Hq, 2, 2) * 0.5)


@pytest.mark.parametrize(
    "inner,n_sink,window,name",
    [
        ("oal", 4, 64, "oal+sink+window"),
        ("oal", 4, 0, "oal+sink"),
        ("oal", 0, 64, "oal+window"),
        ("oal", 0, 0, "oal"),
        ("global", 1, 16, "global+sink+window"),
        ("global", 0, 16, "global+window"),
    ],
)
def test_names(inner, n_sink, window, name):
    m = SinkWindowKernel(make_inner(inner, 3, 1, 8), n_sink=n_sink, window=window)
    assert m.name == name == sink_window_name(inner, n_sink, window)
    base, sink, win = split_sink_window_name(name)
    assert (base, sink, win) == (inner, n_sink > 0, window > 0)


@pytest.mark.parametrize("name", ["oal+window+sink", "+sink", "oal+sinks", "oal+sink+sink"])
def test_bad_names(name):
    with pytest.raises(ValueError, match="name: expected"):
        split_sink_window_name(name)


def test_parameters_are_L_and_beta_and_both_get_gradients():
    m = SinkWindowKernel(make_inner("oal", 6, 2, 8), n_sink=2, window=5)
    assert sorted(n for n, _ in m.named_parameters()) == ["beta", "inner.L"]
    assert torch.equal(m.beta, torch.zeros(6))
    q, k, v = make_qkv(1, 6, 2, 30, 8, 4)
    m(q, k, v)[0].square().sum().backward()
    assert torch.isfinite(m.inner.L.grad).all() and m.inner.L.grad.abs().sum() > 0
    assert torch.isfinite(m.beta.grad).all() and (m.beta.grad != 0).all()


@pytest.mark.parametrize("inner", ["oal", "global"])
@pytest.mark.parametrize("n_sink,window,group", [(4, 16, 3), (1, 1, 1), (0, 8, 3), (3, 0, 1), (0, 0, 3)])
def test_at_positions_matches_forward(inner, n_sink, window, group):
    B, Hkv, N, d = 2, 2, 45, 16
    Hq = Hkv * group
    q, k, v = make_qkv(B, Hq, Hkv, N, d, 8)
    m = SinkWindowKernel(make_inner(inner, Hq, Hkv, d), n_sink=n_sink, window=window, beta=torch.randn(Hq))
    o, _ = m(q, k, v, chunk_size=16)
    pos = torch.tensor([0, 2, 7, 44, 20, 16])
    assert torch.allclose(m.at_positions(q, k, v, pos), o[:, :, pos], atol=1e-5)
    o_rec, _ = m(q, k, v, mode="recurrent")
    assert torch.allclose(o_rec, o, atol=1e-5)


def test_no_sinks_no_window_is_the_inner_kernel():
    q, k, v = make_qkv(2, 6, 2, 50, 16, 8)
    for kind in ("oal", "global"):
        inner = make_inner(kind, 6, 2, 16)
        m = SinkWindowKernel(inner, n_sink=0, window=0, beta=torch.full((6,), 3.0))
        assert m.name == inner.name
        for mode in ("chunk", "recurrent"):
            assert torch.equal(m(q, k, v, mode=mode)[0], inner(q, k, v, mode=mode)[0])
        pos = torch.tensor([0, 13, 49])
        assert torch.allclose(m.at_positions(q, k, v, pos), inner.at_positions(q, k, v, pos), rtol=1e-5, atol=1e-6)


def test_full_window_is_softmax():
    q, k, v = make_qkv(1, 6, 2, 40, 16, 8, dtype=torch.float64)
    m = SinkWindowKernel(make_inner("oal", 6, 2, 16), n_sink=4, window=40).double()
    soft = SoftmaxKernel(6, 2, 16)
    pos = torch.tensor([0, 5, 39])
    assert torch.allclose(m(q, k, v)[0], soft(q, k, v)[0], atol=1e-12)
    assert torch.allclose(m.at_positions(q, k, v, pos), soft.at_positions(q, k, v, pos).double(), atol=1e-6)


def test_prefill_then_decode_through_the_module():
    q, k, v = make_qkv(1, 6, 2, 60, 8, 4)
    m = SinkWindowKernel(make_inner("oal", 6, 2, 8), n_sink=4, window=16, beta=torch.randn(6))
    full, _ = m(q, k, v)
    pre, state = m(q[:, :, :25], k[:, :, :25], v[:, :, :25], output_final_state=True)
    outs = [pre]
    for t in range(25, 60):
        o, state = m(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mode="recurrent",
                     initial_state=state, output_final_state=True)  # fmt: skip
        outs.append(o)
    assert state.offset == 60
    assert torch.allclose(torch.cat(outs, 2), full, atol=1e-5)


class _AtPositions(torch.nn.Module):
    """``at_positions`` as a module's forward, so functional_call can swap the parameters."""

    def __init__(self, m: SinkWindowKernel) -> None:
        super().__init__()
        self.m = m

    def forward(self, q, k, v):
        return self.m.at_positions(q, k, v, torch.tensor([1, 6, 9]))


def test_gradcheck_module_fp64():
    """Gradients in q, k, v, L and β, of the chunked forward and of at_positions."""
    q, k, v = make_qkv(1, 3, 1, 10, 3, 2, dtype=torch.float64)
    inner = OALKernel(torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 1]]), 1, eps=0.1, L=torch.randn(3, 3, 3) * 0.5)
    m = SinkWindowKernel(inner, n_sink=2, window=3, beta=torch.randn(3)).double()
    wrapper = _AtPositions(m)
    args = [x.clone().requires_grad_() for x in (q, k, v, m.inner.L.detach(), m.beta.detach())]

    def forward(q, k, v, L, beta):
        return functional_call(m, {"inner.L": L, "beta": beta}, (q, k, v), {"chunk_size": 4})[0]

    def at_positions(q, k, v, L, beta):
        return functional_call(wrapper, {"m.inner.L": L, "m.beta": beta}, (q, k, v))

    assert torch.autograd.gradcheck(forward, args)
    assert torch.autograd.gradcheck(at_positions, args)


def test_match_beta_closed_form_for_a_constant_kernel():
    """κ ≡ c (L with only L_00): β_h = mean_i [logsumexp_{K_i} s_ij - log(|K_i| c)]."""
    Hq, d, N = 3, 8, 30
    L = torch.zeros(Hq, 2, 2)
    L[:, 0, 0] = torch.tensor([0.5, 1.0, 2.0])
    inner = GlobalQuadraticKernel(Hq, 1, d, eps=1e-6, L=L)
    m = SinkWindowKernel(inner, n_sink=2, window=5)
    q, k, _ = make_qkv(2, Hq, 1, N, d, 1, dtype=torch.float64)
    pos = torch.tensor([3, 6, 7, 20, 29])  # 3 and 6 have empty kernel sets (2 ≤ j ≤ i - 5)
    beta = m.match_beta_(q, k, pos)
    s = (q @ k.mT) / math.sqrt(d)
    c = L[:, 0, 0].double() ** 2 + 1e-6
    expected = torch.zeros(Hq, dtype=torch.float64)
    for h in range(Hq):
        vals = [
            torch.logsumexp(s[b, h, i, 2 : i - 5 + 1], 0) - math.log((i - 5 + 1 - 2) * c[h])
            for b in range(2)
            for i in (7, 20, 29)
        ]
        expected[h] = torch.stack(vals).mean()
    assert torch.allclose(beta.double(), expected, rtol=1e-5)
    assert torch.equal(m.beta.detach(), beta)


def test_bad_construction():
    with pytest.raises(ValueError, match="inner: expected an OALKernel"):
        SinkWindowKernel(SoftmaxKernel(3, 1, 8))
    with pytest.raises(ValueError, match="beta: expected shape"):
        SinkWindowKernel(make_inner("oal", 3, 1, 8), beta=torch.zeros(4))
    with pytest.raises(ValueError, match="window: expected a non-negative integer"):
        SinkWindowKernel(make_inner("oal", 3, 1, 8), window=-1)


def _no_coefficients(*args, **kwargs):
    raise AssertionError("the kernel's coefficients were computed")


@pytest.mark.parametrize("N,n_sink,window", [(1, 4, 16), (20, 4, 16), (9, 0, 9)])
def test_a_short_prompt_is_softmax_without_the_kernels_coefficients(N, n_sink, window, monkeypatch):
    """A fresh prompt of at most n_sink + window tokens: the module returns causal softmax and the blockwise state
    without computing its inner kernel's coefficients (the model's prompts up to 260 tokens); with β recording a
    gradient, and from a state, it evaluates blockwise."""
    import oal.kernels.sink_window as module

    m = SinkWindowKernel(make_inner("oal", 6, 2, 8), n_sink=n_sink, window=window, beta=torch.randn(6))
    q, k, v = make_qkv(1, 6, 2, n_sink + window + 1, 8, 4)
    prompt = [x[:, :, :N] for x in (q, k, v)]
    with torch.enable_grad():
        want, want_state = m(*prompt, output_final_state=True)
    monkeypatch.setattr(module, "oal_coefficients", _no_coefficients)
    monkeypatch.setattr(module, "oal_factor", _no_coefficients)
    with torch.no_grad():
        got, state = m(*prompt, output_final_state=True)
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=2e-6)
        torch.testing.assert_close(got, SoftmaxKernel(6, 2, 8)(*prompt)[0], rtol=0, atol=2e-6)
        assert state.offset == want_state.offset == N
        for x, y in zip(state[:5], want_state[:5], strict=True):
            assert torch.equal(x, y)
        with pytest.raises(AssertionError, match="coefficients"):
            m(q, k, v)  # n_sink + window + 1 tokens: key n_sink is in the last query's kernel set
        with pytest.raises(AssertionError, match="coefficients"):
            m(q[:, :, N : N + 1], k[:, :, N : N + 1], v[:, :, N : N + 1], initial_state=state)
    with pytest.raises(AssertionError, match="coefficients"):
        m(*prompt)  # β records a gradient
