"""Exact heads with a decode budget (ExactHeadsKernel decode_budget / decode_page; oal.ops.page_select): the fused
CPU step (decode.cpp) against the kernel's own one-token torch path, whose selection is the naive one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_decode import make_kernel, make_qkv

from oal.kernels import ExactHeadsKernel
from oal.kernels.decode import decode_step
from oal.kernels.hybrid import dequantize_int8
from oal.kernels.registry import kernel_config, kernel_from_config
from oal.ops.page_select import page_bounds, page_keys, select_pages
from oal.ops.quadratic import cpu as cpu_kernel

fused = pytest.mark.skipif(
    cpu_kernel.load("decode") is None, reason="the fused CPU decode kernel did not build (no C++ compiler?)"
)


def budgeted(kind, Hq, Hkv, d, *, exact, kv_dtype=None, products=None, budget=64, page=8, seed=0):
    base = make_kernel(kind, Hq, Hkv, d, exact=exact, seed=seed)
    return ExactHeadsKernel(base.inner, base.exact_kv_heads, kv_dtype, products, budget, page)


def steps(kernel, q, k, v, n_prefill, *, use_fused):
    """Prefill n_prefill tokens, then one-token steps: the fused step (use_fused) or the kernel's torch path."""
    outs, states = [], []
    with torch.no_grad():
        o, state = kernel(q[:, :, :n_prefill], k[:, :, :n_prefill], v[:, :, :n_prefill], output_final_state=True)
        for t in range(n_prefill, q.shape[2]):
            x = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            if use_fused:
                step = decode_step(kernel, *x, state, t)
                assert step is not None, "the fused path should apply to CPU fp32 without autograd"
            else:
                step = kernel(*x, mode="recurrent", initial_state=state, output_final_state=True)
            o, state = step
            outs.append(o)
            states.append(state)
    return torch.cat(outs, 2), state


def stored_keys(kernel, state):
    """The exact keys below the state's offset as the cache holds them, as fp32 numbers."""
    k = state.k[:, :, : state.offset]
    return dequantize_int8(k, state.k_scale[:, :, : state.offset]) if state.k_scale is not None else k.float()


def tolerance(kernel, v):
    return 2**-8 * float(v.abs().max()) if kernel.product_dtype is not None else 2e-5


@fused
@pytest.mark.parametrize("Hq, Hkv, exact", [(3, 3, (0, 2)), (9, 3, (1,)), (6, 2, (0, 1))])
@pytest.mark.parametrize(
    "kv_dtype, products", [(None, None), (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16), (torch.int8, None)]
)
@pytest.mark.parametrize("n_prefill", [1, 63, 1000])
def test_fused_budgeted_steps_equal_the_reference(Hq, Hkv, exact, kv_dtype, products, n_prefill):
    """Steps across page boundaries, past the budget from the first (1000) or a later step (1, 63), batch 2, G 1 and
    3: the same outputs as the kernel's one-token torch path (naive selection) and the same bounds, bit for bit,
    as page_bounds of the stored keys."""
    d = 32
    kernel = budgeted("exact+sink_window", Hq, Hkv, d, exact=exact, kv_dtype=kv_dtype, products=products)
    n = n_prefill + 80
    q, k, v = (x.float() for x in make_qkv(2, Hq, Hkv, n, d, seed=n_prefill))
    got, state = steps(kernel, q, k, v, n_prefill, use_fused=True)
    want, ref_state = steps(kernel, q, k, v, n_prefill, use_fused=False)
    assert float((got - want).abs().max()) <= tolerance(kernel, v)
    pages = -(-state.offset // 8)
    for s in (state, ref_state):
        assert torch.equal(s.k_bounds[:, :, :pages], page_bounds(stored_keys(kernel, s), 8))


@fused
def test_budget_selects_and_finds_a_needle():
    """Past the budget a step attends to fewer keys than it has (the output differs from the full one), yet a
    key far back that the query strongly matches is found (its page is selected) by both paths."""
    d, n = 32, 700
    kernel = budgeted("exact+oal", 3, 3, d, exact=(0, 1, 2), budget=64, page=8)
    full = ExactHeadsKernel(kernel.inner, kernel.exact_kv_heads)
    q, k, v = (x.float() * 0.3 for x in make_qkv(1, 3, 3, n + 1, d, seed=5))
    k[:, :, 333] = q[:, :, n] * 40  # the needle: the last query's best key by far, its value a marker
    v[:, :, 333] = 7.0
    for use_fused in (True, False):
        got, _ = steps(kernel, q, k, v, n, use_fused=use_fused)
        assert torch.allclose(got[:, :, -1], torch.full_like(got[:, :, -1], 7.0), atol=1e-2)
    q, k, v = (x.float() for x in make_qkv(1, 3, 3, n + 1, d, seed=5))  # no needle: the mass is spread
    with torch.no_grad():
        _, state = full(q[:, :, :n], k[:, :, :n], v[:, :, :n], output_final_state=True)
        want, _ = full(q[:, :, n:], k[:, :, n:], v[:, :, n:], initial_state=state)
    got, _ = steps(kernel, q, k, v, n, use_fused=True)
    assert float((got - want).abs().max()) > 1e-3  # not every key was read


@fused
@pytest.mark.parametrize("budget", [64, 4096])
def test_within_the_budget_the_step_is_exact(budget):
    kernel = budgeted("exact+sink_window", 6, 2, 32, exact=(1,), budget=budget, page=16)
    full = ExactHeadsKernel(kernel.inner, kernel.exact_kv_heads)
    q, k, v = (x.float() for x in make_qkv(1, 6, 2, 64, 32, seed=2))
    got, state = steps(kernel, q, k, v, 10, use_fused=True)
    want, _ = steps(full, q, k, v, 10, use_fused=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert state.k_bounds is not None


@fused
def test_reference_selection_is_the_naive_one():
    """The torch path's one-token step with the budget equals softmax over page_keys(select_pages(...)) computed
    here by hand from the stored keys."""
    d, n, page, budget = 16, 300, 8, 48
    kernel = budgeted("exact+oal", 2, 1, d, exact=(0,), budget=budget, page=page)
    q, k, v = (x.float() for x in make_qkv(1, 2, 1, n + 1, d, seed=9))
    got, _ = steps(kernel, q, k, v, n, use_fused=False)
    keys = k[:, :, : n + 1]
    pages = select_pages(q[:, :, n].view(1, 1, 2, d), page_bounds(keys, page), n + 1, budget, page, kernel.scale)
    idx = page_keys(pages, n + 1, page)[0, 0]
    assert len(idx) == 5 * page + (n + 1) % page and idx[0] == 0 and idx[-1] == n
    s = (q[0, :, n] @ keys[0, 0, idx].T) * kernel.scale
    want = torch.softmax(s, -1) @ v[0, 0, idx]
    torch.testing.assert_close(got[0, :, 0], want, atol=2e-6, rtol=1e-5)


@fused
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    Hkv=st.integers(1, 3),
    ratio=st.sampled_from([1, 2, 3, 5]),
    d=st.sampled_from([8, 12, 32, 64]),
    page=st.sampled_from([4, 16, 64]),
    pages=st.integers(4, 9),
    n_prefill=st.integers(1, 400),
    B=st.integers(1, 2),
    dtype=st.sampled_from([None, torch.bfloat16, torch.int8]),
)
def test_fused_budgeted_steps_any_shape(Hkv, ratio, d, page, pages, n_prefill, B, dtype):
    kernel = budgeted(
        "exact+sink_window", Hkv * ratio, Hkv, d, exact=(Hkv - 1,), kv_dtype=dtype, budget=pages * page, page=page
    )
    q, k, v = (x.float() for x in make_qkv(B, Hkv * ratio, Hkv, n_prefill + 20, d, seed=n_prefill))
    got, _ = steps(kernel, q, k, v, n_prefill, use_fused=True)
    want, _ = steps(kernel, q, k, v, n_prefill, use_fused=False)
    assert float((got - want).abs().max()) <= 2e-5


@fused
def test_bounds_follow_growing_buffers_and_a_state_without_them():
    """A state without bounds (made before the budget was set) gets them at its first step; buffers that grow
    (GROWTH slots) take their bounds along."""
    kernel = budgeted("exact+oal", 6, 2, 16, exact=(0,), budget=32, page=8)
    plain = ExactHeadsKernel(kernel.inner, kernel.exact_kv_heads, torch.bfloat16)
    kernel.kv_dtype = torch.bfloat16
    q, k, v = (x.float() for x in make_qkv(1, 6, 2, 300, 16, seed=4))
    with torch.no_grad():
        _, state = plain(q[:, :, :100], k[:, :, :100], v[:, :, :100], output_final_state=True)
    assert state.k_bounds is None
    outs = []
    with torch.no_grad():
        for t in range(100, 300):
            o, state = decode_step(kernel, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, t)
            outs.append(o)
    assert state.k.shape[2] >= 300 and state.k_bounds.shape[2] * 8 >= state.k.shape[2]
    assert torch.equal(state.k_bounds[:, :, : 300 // 8 + 1], page_bounds(stored_keys(kernel, state), 8))
    want, _ = steps(kernel, q, k, v, 100, use_fused=False)
    assert float((torch.cat(outs, 2) - want).abs().max()) <= 2e-5


def test_budget_is_in_the_config_and_validated():
    kernel = budgeted("exact+sink_window", 6, 2, 16, exact=(1,), kv_dtype=torch.bfloat16, budget=256, page=16)
    cfg = kernel_config(kernel)
    assert cfg["decode_budget"] == 256 and cfg["decode_page"] == 16
    again = kernel_from_config(cfg)
    assert (again.decode_budget, again.decode_page, again.kv_dtype) == (256, 16, torch.bfloat16)
    assert "decode_budget" not in kernel_config(ExactHeadsKernel(kernel.inner, (1,)))
    assert "decode_budget=256" in repr(kernel)
    with pytest.raises(ValueError, match="decode_budget"):
        ExactHeadsKernel(kernel.inner, (1,), decode_budget=100, decode_page=16)


def test_prompts_stay_exact_with_a_budget():
    kernel = budgeted("exact+sink_window", 6, 2, 16, exact=(1,), budget=32, page=8)
    full = ExactHeadsKernel(kernel.inner, kernel.exact_kv_heads)
    q, k, v = (x.float() for x in make_qkv(1, 6, 2, 200, 16, seed=6))
    with torch.no_grad():
        got, state = kernel(q, k, v, output_final_state=True)
        want, _ = full(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(state.k_bounds[:, :, :25], page_bounds(k[:, 1:2], 8))
