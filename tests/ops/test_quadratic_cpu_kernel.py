"""The fused C++ CPU kernel (oal.ops.quadratic.cpu) against the torch chunk loop and the naive reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_quadratic import make_inputs, random_oal, rel_rms

from oal.ops import quadratic_attention
from oal.ops.quadratic import KernelFactor, chunk
from oal.ops.quadratic import cpu as cpu_kernel

EXT = cpu_kernel.load()
PARALLEL_PREFIX = chunk.parallel_prefix
pytestmark = pytest.mark.skipif(EXT is None, reason="the fused CPU kernel did not build (no C++ compiler?)")


@pytest.fixture(autouse=True, params=["parallel", "chunked", "prefix"])
def fresh_segment_path(request, monkeypatch):
    """Every test runs three times: fresh segments (no initial state) in parallel form, in the chunked loop, and as
    a prefix of 37 tokens in parallel form with the rest in the loop from the prefix's state;
    ``chunk.parallel_pays`` and ``chunk.parallel_prefix`` choose among them in use."""
    monkeypatch.setattr(chunk, "PARALLEL_COST", 0.0 if request.param == "parallel" else math.inf)
    if request.param == "prefix":
        monkeypatch.setattr(chunk, "parallel_prefix", lambda *shape: 37)
    return request.param


def problem(B, Hq, Hkv, N, d, dv, dtype, G=5):
    q, k, v = make_inputs(B, Hq, Hkv, N, d, dv)
    _, _, (a, b, C), factor = random_oal(Hq, d, G=G)
    f32 = KernelFactor(*(x.float() for x in factor))
    return (q.to(dtype), k.to(dtype), v.to(dtype), a.float(), b.float(), C.float()), f32, (q, k, v, a, b, C)


def both(args, factor, **kw):
    """(fused, torch loop) outputs of the same call."""
    fused = quadratic_attention(*args, factor=factor, **kw)
    with cpu_kernel.disabled():
        loop = quadratic_attention(*args, factor=factor, **kw)
    return fused, loop


SHAPES = [
    # B, Hq, Hkv, N, d, dv, chunk
    (2, 3, 3, 1, 16, 16, 64),
    (1, 3, 1, 63, 16, 8, 16),
    (2, 6, 2, 128, 16, 16, 64),
    (1, 9, 3, 1000, 64, 64, 64),
    (1, 3, 1, 130, 64, 32, 50),
    (1, 2, 1, 77, 15, 7, 32),  # odd d: the cyclic layout lists some pairs twice
    (1, 4, 2, 100, 32, 33, 40),  # dv = 2 panels of 16 + 1 column; 80 rows per chunk, not a multiple of 6
]


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_matches_torch_loop_and_naive_fp32(shape):
    B, Hq, Hkv, N, d, dv, cs = shape
    args, factor, exact = problem(B, Hq, Hkv, N, d, dv, torch.float32)
    (o, state), (o_loop, state_loop) = both(args, factor, chunk_size=cs, output_final_state=True)
    ref, ref_state = quadratic_attention(*exact, mode="naive", output_final_state=True)
    assert o.dtype == torch.float32 and o.shape == (B, Hq, N, dv)
    assert rel_rms(o, o_loop) < 1e-6
    assert rel_rms(o, ref) < 1e-4
    assert rel_rms(state, state_loop) < 1e-6
    assert rel_rms(state, ref_state) < 1e-4


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_fused_half_inputs_accumulate_in_fp32(dtype, tol):
    args, factor, exact = problem(1, 6, 2, 200, 64, 64, dtype)
    (o, _), (o_loop, _) = both(args, factor, chunk_size=64)
    ref, _ = quadratic_attention(*(x.to(dtype).double() if x.dim() == 4 else x for x in exact), mode="naive")
    assert o.dtype == dtype
    assert rel_rms(o, o_loop) < 1e-2  # both round the same fp32 result to dtype; ties may differ by one ulp
    assert rel_rms(o, ref) < tol


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_feature_ranges_per_thread_give_the_same_result(threads):
    """Each thread owns a slice of the state's features; the split must not change the result."""
    args, factor, exact = problem(1, 6, 2, 150, 16, 20, torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o, state = quadratic_attention(*args, factor=factor, chunk_size=32, output_final_state=True)
    finally:
        torch.set_num_threads(before)
    with cpu_kernel.disabled():
        o_loop, state_loop = quadratic_attention(*args, factor=factor, chunk_size=32, output_final_state=True)
    assert rel_rms(o, o_loop) < 1e-6
    assert rel_rms(state, state_loop) < 1e-6


def test_prefill_then_continue_equals_full():
    args, factor, _ = problem(2, 6, 2, 150, 32, 16, torch.float32)
    q, k, v, a, b, C = args
    full, full_state = quadratic_attention(*args, factor=factor, chunk_size=32, output_final_state=True)
    head, state = quadratic_attention(
        q[:, :, :97], k[:, :, :97], v[:, :, :97], a, b, C, factor=factor, chunk_size=32, output_final_state=True
    )
    tail, tail_state = quadratic_attention(
        q[:, :, 97:], k[:, :, 97:], v[:, :, 97:], a, b, C, factor=factor, chunk_size=32,
        initial_state=state, output_final_state=True,
    )  # fmt: skip
    assert rel_rms(torch.cat([head, tail], dim=2), full) < 1e-6
    assert rel_rms(tail_state, full_state) < 1e-6


@pytest.mark.parametrize("floor", [None, 1e-3, 10.0])
def test_denominator_and_floor(floor):
    args, factor, _ = problem(1, 3, 1, 90, 16, 16, torch.float32)
    fused, loop = both(args, factor, chunk_size=32, kernel_floor=floor, return_denominator=True)
    assert rel_rms(fused.o, loop.o) < 1e-6
    assert rel_rms(fused.denominator, loop.denominator) < 1e-6
    if floor:
        count = torch.arange(1, 91, dtype=torch.float32)
        assert (fused.denominator >= floor * count * (1 - 1e-6)).all()


@pytest.mark.parametrize("floor", [None, 1e-3])
def test_key_weights(floor):
    """Weighted keys (the sink/window wrapper's kernel part): zero weights first, so early rows see no key."""
    B, Hkv, N = 2, 2, 150
    args, factor, exact = problem(B, 6, Hkv, N, 16, 20, torch.float32)
    gen = torch.Generator().manual_seed(3)
    weight = torch.rand(B, Hkv, N, generator=gen) * (torch.rand(B, Hkv, N, generator=gen) > 0.3)
    weight[:, :, :5] = 0
    kw = dict(chunk_size=32, kernel_floor=floor, key_weight=weight, return_denominator=True)
    fused, loop = both(args, factor, output_final_state=True, **kw)
    ref = quadratic_attention(*exact, mode="naive", key_weight=weight.double(), kernel_floor=floor,
                              return_denominator=True)  # fmt: skip
    assert torch.isfinite(fused.o).all()
    assert (fused.o[:, :, :5] == 0).all()  # no weighted key yet: output 0, not 0/0
    assert rel_rms(fused.o, loop.o) < 1e-6
    assert rel_rms(fused.denominator, loop.denominator) < 1e-6
    assert rel_rms(fused.final_state, loop.final_state) < 1e-6
    assert rel_rms(fused.o, ref.o) < 1e-4
    # prefill with weights, then continue from the state
    q, k, v, a, b, C = args
    head = quadratic_attention(q[:, :, :70], k[:, :, :70], v[:, :, :70], a, b, C, factor=factor, chunk_size=32,
                               kernel_floor=floor, key_weight=weight[:, :, :70], output_final_state=True)  # fmt: skip
    tail = quadratic_attention(q[:, :, 70:], k[:, :, 70:], v[:, :, 70:], a, b, C, factor=factor, chunk_size=32,
                               kernel_floor=floor, key_weight=weight[:, :, 70:], initial_state=head[1])  # fmt: skip
    assert rel_rms(torch.cat([head[0], tail[0]], dim=2), fused.o) < 1e-6


def test_gradients_of_the_fused_path_equal_the_torch_loop():
    """With gradients the fused forward runs too (its backward: test_quadratic_cpu_backward.py)."""
    args, factor, _ = problem(1, 3, 1, 40, 16, 16, torch.float32)
    q = args[0].clone().requires_grad_()
    o, _ = quadratic_attention(q, *args[1:], factor=factor, chunk_size=16)
    o.sum().backward()
    q_loop = args[0].clone().requires_grad_()
    with cpu_kernel.disabled():
        o_loop, _ = quadratic_attention(q_loop, *args[1:], factor=factor, chunk_size=16)
    o_loop.sum().backward()
    assert rel_rms(o.detach(), o_loop.detach()) < 1e-6
    assert rel_rms(q.grad, q_loop.grad) < 1e-5


def test_disabled_and_unsupported_calls_use_torch_loop():
    with cpu_kernel.disabled():
        assert not cpu_kernel.usable(torch.zeros(1), object())
        assert cpu_kernel.load() is None
    assert cpu_kernel.usable(torch.zeros(1), object())
    assert not cpu_kernel.usable(torch.zeros(1, dtype=torch.float64), object())
    assert not cpu_kernel.usable(torch.zeros(1), None)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 2),
    Hkv=st.integers(1, 2),
    ratio=st.sampled_from([1, 3]),
    N=st.integers(1, 90),
    d=st.sampled_from([4, 7, 16]),
    dv=st.integers(1, 9),
    cs=st.integers(1, 40),
)
def test_fused_matches_torch_loop_any_shape(B, Hkv, ratio, N, d, dv, cs):
    args, factor, _ = problem(B, Hkv * ratio, Hkv, N, d, dv, torch.float32, G=2)
    (o, state), (o_loop, state_loop) = both(args, factor, chunk_size=cs, output_final_state=True)
    assert rel_rms(o, o_loop) < 1e-5
    assert rel_rms(state, state_loop) < 1e-5


def test_factor_from_coefficients_reproduces_the_kernel():
    from oal.ops.quadratic import factored_kernel, naive_kernel_matrix
    from oal.ops.quadratic.utils import factor_from_coefficients

    q, k, _ = make_inputs(1, 3, 3, 20, 16, 16)
    _, _, (a, b, C), _ = random_oal(3, 16, G=4)
    # a full-rank positive definite M as well: R = d + 1 squares
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(3, 17, 17, generator=gen, dtype=torch.float64)
    M = A @ A.mT / 17
    full = (M[:, 0, 0], 2 * M[:, 0, 1:], M[:, 1:, 1:])
    for coeffs, rank in (((a, b, C), 5), (full, 17)):
        f = factor_from_coefficients(*coeffs)
        assert f is not None and f.c.shape == (3, rank) and f.W.shape == (3, rank, 16)
        got = factored_kernel(q, k, f, 0.25)
        want = torch.stack([naive_kernel_matrix(q[0, h], k[0, h], *(x[h] for x in coeffs), 0.25) for h in range(3)])
        torch.testing.assert_close(got[0], want, rtol=1e-9, atol=1e-12)


def test_call_without_factor_reaches_the_fused_kernel(monkeypatch, fresh_segment_path):
    import oal.ops.quadratic.chunk as chunk

    calls = []
    real = chunk._forward_fused
    monkeypatch.setattr(chunk, "_forward_fused", lambda *a: calls.append(1) or real(*a))
    args, _, exact = problem(1, 9, 3, 300, 64, 64, torch.float32)
    o, state = quadratic_attention(*args, chunk_size=64, kernel_floor=1e-6, output_final_state=True)
    assert calls == ([1, 1] if fresh_segment_path == "prefix" else [1])  # a prefix: the rest from its state
    ref, ref_state = quadratic_attention(*exact, mode="naive", output_final_state=True)
    assert rel_rms(o, ref) < 1e-5 and rel_rms(state, ref_state) < 1e-5


def test_indefinite_kernel_without_factor_stays_on_the_torch_loop(monkeypatch):
    import oal.ops.quadratic.chunk as chunk
    from oal.ops.quadratic.utils import factor_from_coefficients

    monkeypatch.setattr(chunk, "_forward_fused", lambda *a: pytest.fail("an indefinite kernel has no factor"))
    q, k, v = make_inputs(1, 3, 1, 50, 8, 8)
    gen = torch.Generator().manual_seed(1)
    C = torch.randn(3, 8, 8, generator=gen, dtype=torch.float64)
    C = (C + C.mT) / 2
    a, b = torch.full((3,), 5.0, dtype=torch.float64), torch.zeros(3, 8, dtype=torch.float64)
    assert factor_from_coefficients(a, b, C) is None
    o, _ = quadratic_attention(q.float(), k.float(), v.float(), a.float(), b.float(), C.float(), chunk_size=16)
    ref, _ = quadratic_attention(q, k, v, a, b, C, mode="naive")
    assert rel_rms(o, ref) < 1e-4


def test_parallel_form_is_chosen_by_its_cost_and_reached_by_the_documented_call(monkeypatch):
    """With the measured cost, a SmolLM2-shaped fresh segment of 1000 tokens runs in parallel form and one of 3000
    its first ``parallel_prefix`` tokens (a multiple of 16 below 1000) in parallel form, the rest in the chunked loop
    from their state (not so a segment of ``PREFIX_SPAN`` prefixes); a segment with an initial state always in the
    loop. Outputs agree either way."""
    monkeypatch.setattr(chunk, "PARALLEL_COST", 1.0)
    monkeypatch.setattr(chunk, "parallel_prefix", PARALLEL_PREFIX)  # the fixture's may stand in
    calls = []
    real = EXT.chunk_parallel_forward

    def spy(*args):
        calls.append(args[0].shape[2])
        return real(*args)

    monkeypatch.setattr(EXT, "chunk_parallel_forward", spy)
    for n, parallel in ((1000, True), (3000, False)):
        args, factor, _ = problem(1, 9, 3, n, 64, 64, torch.float32, G=3)
        calls.clear()
        (o, state), (o_loop, state_loop) = both(args, factor, output_final_state=True)
        R, (_, P) = factor.c.shape[-1], chunk.channel_classes(factor.W)
        prefix = PARALLEL_PREFIX(n, 64, 64, R, P)
        assert 0 < prefix < 1000 and prefix % 16 == 0
        assert PARALLEL_PREFIX(chunk.PREFIX_SPAN * prefix, 64, 64, R, P) == 0  # long segments: no prefix
        assert calls == ([n] if parallel else [prefix])
        assert rel_rms(o, o_loop) < 1e-6 and rel_rms(state, state_loop) < 1e-6
        calls.clear()
        quadratic_attention(*args, factor=factor, initial_state=state)
        assert calls == []


def test_channel_classes_are_the_oal_groups():
    """For OAL's factor the classes of equal columns are the groups of Eq. 7; each channel's representative is the
    first channel of its group, and P the most groups a head uses."""
    groups, _, _, factor = random_oal(4, 16, G=3)
    rep, P = chunk.channel_classes(factor.W)
    first = torch.stack([torch.stack([(g == g[r]).int().argmax() for r in range(16)]) for g in groups])
    assert torch.equal(rep, first)
    assert max(len(set(g.tolist())) for g in groups) == P


@pytest.mark.parametrize("G", [1, 2, 3, 4, 6])
def test_every_class_count_matches_the_naive_reference(G):
    """The parallel form holds 1–4 classes' scores in registers and reads more from memory: each count (and the
    chunked loop, by the fixture) against the explicit N×N kernel."""
    args, factor, exact = problem(1, 6, 2, 97, 32, 16, torch.float32, G=G)
    (o, state), _ = both(args, factor, output_final_state=True)
    ref, ref_state = quadratic_attention(*exact, mode="naive", output_final_state=True)
    assert rel_rms(o, ref) < 1e-4 and rel_rms(state, ref_state) < 1e-4
