"""The fused in-place decode step (oal.kernels.decode) against the kernels' own recurrent mode and the fp64 naive
reference: every converted kind, GQA 1 and 3, odd prefill lengths, window longer than the context, batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oal.kernels import ExactHeadsKernel, GlobalQuadraticKernel, OALKernel, SinkWindowKernel
from oal.kernels.decode import GROWTH, decode_step
from oal.kernels.hybrid import ExactHeadsState
from oal.ops.quadratic import cpu as cpu_kernel

pytestmark = pytest.mark.skipif(
    cpu_kernel.load("decode") is None, reason="the fused CPU decode kernel did not build (no C++ compiler?)"
)


def make_kernel(kind: str, Hq: int, Hkv: int, d: int, *, n_sink=4, window=8, exact=(0,), seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, 3, (Hq, d), generator=gen)
    L = torch.randn(Hq, 4, 4, generator=gen) * 0.4
    base = OALKernel(groups, Hkv, num_groups=3, L=L)
    if kind == "global":
        return GlobalQuadraticKernel(Hq, Hkv, d, L=torch.randn(Hq, 2, 2, generator=gen) * 0.4)
    if kind == "oal":
        return base
    sw = SinkWindowKernel(base, n_sink=n_sink, window=window, beta=torch.randn(Hq, generator=gen))
    if kind == "sink_window":
        return sw
    inner = base if kind == "exact+oal" else sw
    return ExactHeadsKernel(inner, exact)


def make_qkv(B, Hq, Hkv, N, d, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, N, d, generator=gen, dtype=torch.float64) for h in (Hq, Hkv, Hkv))


def run_decode(kernel, q, k, v, n_prefill):
    """Prefill n_prefill tokens (chunk mode), then decode the rest with the fused step; outputs of every token."""
    with torch.no_grad():
        o, state = kernel(q[:, :, :n_prefill], k[:, :, :n_prefill], v[:, :, :n_prefill], output_final_state=True)
        outs = [o]
        for t in range(n_prefill, q.shape[2]):
            step = decode_step(kernel, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, t)
            assert step is not None, "the fused path should apply to CPU fp32 without autograd"
            o, state = step
            outs.append(o)
    return torch.cat(outs, dim=2), state


def reference(kernel, q, k, v):
    """fp64 naive one pass (exact heads: chunk mode, whose exact part is one SDPA and inner part naive-tested)."""
    with torch.no_grad():
        ref = kernel.double()
        mode = "chunk" if isinstance(kernel, ExactHeadsKernel) else "naive"
        out, _ = ref(q, k, v, mode=mode)
        kernel.float()
    return out


KINDS = ["oal", "global", "sink_window", "exact+oal", "exact+sink_window"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("Hq, Hkv", [(3, 3), (6, 2), (9, 3)])
@pytest.mark.parametrize("n_prefill", [1, 3, 63])
def test_fused_decode_matches_naive(kind, Hq, Hkv, n_prefill):
    d, B, steps = 16, 2, 12
    kernel = make_kernel(kind, Hq, Hkv, d, exact=(Hkv - 1,))
    q, k, v = make_qkv(B, Hq, Hkv, n_prefill + steps, d)
    got, _ = run_decode(kernel, q.float(), k.float(), v.float(), n_prefill)
    want = reference(kernel, q, k, v)
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_decode_equals_recurrent_mode_states_included(kind):
    """Outputs and every part of the state as the kernel's (non-mutating) recurrent mode gives them."""
    Hq, Hkv, d, B = 9, 3, 16, 2
    kernel = make_kernel(kind, Hq, Hkv, d, exact=(1,))
    q, k, v = (x.float() for x in make_qkv(B, Hq, Hkv, 30, d))
    with torch.no_grad():
        _, s_ref = kernel(q[:, :, :20], k[:, :, :20], v[:, :, :20], output_final_state=True)
        _, s_fused = kernel(q[:, :, :20], k[:, :, :20], v[:, :, :20], output_final_state=True)
        for t in range(20, 30):
            args = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            o_ref, s_ref = kernel(*args, mode="recurrent", initial_state=s_ref, output_final_state=True)
            o_fused, s_fused = decode_step(kernel, *args, s_fused, t)
            torch.testing.assert_close(o_fused, o_ref, atol=1e-5, rtol=1e-5)
    if isinstance(s_ref, ExactHeadsState):
        assert s_fused.offset == s_ref.offset == 30
        torch.testing.assert_close(s_fused.k[:, :, :30], s_ref.k)
        torch.testing.assert_close(s_fused.v[:, :, :30], s_ref.v)
        s_ref, s_fused = s_ref.inner, s_fused.inner
    for a, b in zip(
        s_fused if isinstance(s_fused, tuple) else (s_fused,),
        s_ref if isinstance(s_ref, tuple) else (s_ref,),
        strict=True,
    ):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
        else:
            assert a == b


def test_window_longer_than_context_is_exact_softmax():
    Hq, Hkv, d = 6, 2, 16
    kernel = make_kernel("sink_window", Hq, Hkv, d, n_sink=2, window=64)
    q, k, v = make_qkv(1, Hq, Hkv, 40, d)
    got, _ = run_decode(kernel, q.float(), k.float(), v.float(), 1)
    scores = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got.double(), scores, atol=2e-5, rtol=1e-4)


def test_all_heads_exact_layer():
    Hq, Hkv, d = 6, 2, 16
    kernel = make_kernel("exact+sink_window", Hq, Hkv, d, exact=(0, 1))
    q, k, v = make_qkv(1, Hq, Hkv, 25, d)
    got, state = run_decode(kernel, q.float(), k.float(), v.float(), 5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    assert state.inner is None


def test_exact_buffers_grow_by_whole_blocks_and_are_written_in_place():
    Hq, Hkv, d = 3, 3, 8
    kernel = make_kernel("exact+sink_window", Hq, Hkv, d, exact=(2,))
    n0 = 10
    q, k, v = (x.float() for x in make_qkv(1, Hq, Hkv, n0 + GROWTH + 2, d))
    with torch.no_grad():
        _, state = kernel(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], output_final_state=True)
        assert state.k.shape[2] == n0
        buffers = []
        for t in range(n0, q.shape[2]):
            _, state = decode_step(kernel, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, t)
            buffers.append(state.k.data_ptr())
    # one allocation at the first step (n0 + GROWTH slots), the next when those are full
    assert len(set(buffers)) == 2
    assert state.k.shape[2] == n0 + GROWTH + GROWTH
    torch.testing.assert_close(state.k[:, :, : q.shape[2]], k[:, 2:3])


def test_constants_follow_parameter_updates():
    Hq, Hkv, d = 6, 2, 16
    kernel = make_kernel("sink_window", Hq, Hkv, d, window=4)
    q, k, v = (x.float() for x in make_qkv(1, Hq, Hkv, 20, d))
    run_decode(kernel, q, k, v, 10)
    with torch.no_grad():
        kernel.inner.L.mul_(1.3)
        kernel.beta.add_(0.5)
    got, _ = run_decode(kernel, q, k, v, 10)
    torch.testing.assert_close(got.double(), reference(kernel, *make_qkv(1, Hq, Hkv, 20, d)), atol=2e-5, rtol=1e-4)
    # parameters replaced by new ones (other storages, the same version counters), in the wrapper and the inner kernel
    fresh = make_kernel("sink_window", Hq, Hkv, d, window=4)
    run_decode(fresh, q, k, v, 10)
    fresh.beta = torch.nn.Parameter(fresh.beta.detach() - 1.0)
    fresh.inner.L = torch.nn.Parameter(fresh.inner.L.detach() * 0.8)
    got, _ = run_decode(fresh, q, k, v, 10)
    torch.testing.assert_close(got.double(), reference(fresh, *make_qkv(1, Hq, Hkv, 20, d)), atol=2e-5, rtol=1e-4)


def test_not_applicable_calls_return_none():
    Hq, Hkv, d = 3, 1, 8
    kernel = make_kernel("sink_window", Hq, Hkv, d)
    q, k, v = (x.float() for x in make_qkv(1, Hq, Hkv, 6, d))
    with torch.no_grad():
        _, state = kernel(q[:, :, :5], k[:, :, :5], v[:, :, :5], output_final_state=True)
        step = (q[:, :, 5:], k[:, :, 5:], v[:, :, 5:])
        assert decode_step(kernel, *(x.double() for x in step), state, 5) is None  # fp64: the torch path
        assert decode_step(kernel, *step, None, 5) is None  # nothing to continue
        assert decode_step(kernel, *step, state, 4) is None  # wrong offset
        assert decode_step(kernel, q[:, :, 3:5], k[:, :, 3:5], v[:, :, 3:5], state, 5) is None  # two tokens
    assert decode_step(kernel, *step, state, 5) is None  # autograd on (the parameters require grad)
    with torch.no_grad(), cpu_kernel.disabled():
        assert decode_step(kernel, *step, state, 5) is None


# decode shapes for hypothesis: KV heads, query heads per KV head, head dim, prompt, sinks, window, batch
DECODE_SHAPES = dict(
    Hkv=st.integers(1, 3),
    ratio=st.integers(1, 3),
    d=st.sampled_from([4, 7, 16]),
    n_prefill=st.integers(1, 40),
    n_sink=st.integers(0, 5),
    window=st.integers(0, 12),
    B=st.integers(1, 2),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**DECODE_SHAPES)
def test_fused_decode_any_shape(Hkv, ratio, d, n_prefill, n_sink, window, B):
    Hq = Hkv * ratio
    kernel = make_kernel("exact+sink_window", Hq, Hkv, d, n_sink=n_sink, window=window, exact=(0,))
    if Hkv == 1:
        kernel = kernel.inner
    q, k, v = make_qkv(B, Hq, Hkv, n_prefill + 5, d)
    got, _ = run_decode(kernel, q.float(), k.float(), v.float(), n_prefill)
    torch.testing.assert_close(got.double(), reference(kernel, q, k, v), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("kind", ["oal", "exact+sink_window"])
@pytest.mark.parametrize("d", [64, 96])
def test_fused_decode_head_dim_64_and_wide_groups(kind, threads, d):
    """d = 64 (the register-blocked readout with four full vectors and a scalar tail) and 96 (wider than the
    register-blocked shapes: the generic readout), 5 query heads per KV head (two blocks of query heads over one
    pass of the state), one thread (whole states) and four (each state in row ranges on several threads)."""
    Hq, Hkv = 10, 2
    kernel = make_kernel(kind, Hq, Hkv, d, exact=(1,))
    q, k, v = (x * 0.3 for x in make_qkv(1, Hq, Hkv, 30, d))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, _ = run_decode(kernel, q.float(), k.float(), v.float(), 20)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got.double(), reference(kernel, q, k, v), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("d, Hq, Hkv", [(64, 9, 3), (32, 2, 2), (128, 4, 1), (64, 10, 2)])
@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16, torch.int8])
def test_fused_exact_heads_long_context(d, Hq, Hkv, kv_dtype):
    """The exact heads' vector kernel (d = dv ∈ {32, 64, 128}, ≤ 4 query heads per KV head; 5 takes the generic one)
    over more keys than one split-K part (2048), with a tail of keys that is not a multiple of 16, and with its
    keys and values stored in bf16 or int8 (kv_dtype): equal to the kernel's own chunked pass (fp32: the fp64
    reference); int8: each step's new key and value quantised as quantize_int8 does, bit for bit."""
    from oal.kernels.hybrid import quantize_int8

    base = make_kernel("exact+sink_window", Hq, Hkv, d, exact=(0,) if Hkv == 1 else (0, Hkv - 1))
    kernel = ExactHeadsKernel(base.inner, base.exact_kv_heads, kv_dtype)
    q, k, v = make_qkv(1, Hq, Hkv, 2110, d)
    got, state = run_decode(kernel, q.float(), k.float(), v.float(), 2101)
    assert state.k.dtype == (kv_dtype or torch.float32)
    if kv_dtype == torch.int8:
        ex = list(kernel.exact_kv_heads)
        for x, x8, sc in ((k, state.k, state.k_scale), (v, state.v, state.v_scale)):
            want8, want_s = quantize_int8(x.float()[:, ex])
            assert torch.equal(x8[:, :, :2110], want8) and torch.equal(sc[:, :, :2110], want_s)
    if kv_dtype is None:
        want = reference(kernel, q, k, v)
    else:  # the same rounding on both sides: the chunked pass in fp32
        with torch.no_grad():
            want, _ = kernel(q.float(), k.float(), v.float())
        want = want.double()
    torch.testing.assert_close(got.double()[:, :, 2101:], want[:, :, 2101:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_exact_buffers_grow_and_keep_their_dtype(kv_dtype):
    base = make_kernel("exact+oal", 6, 2, 16, exact=(1,))
    kernel = ExactHeadsKernel(base.inner, base.exact_kv_heads, kv_dtype)
    q, k, v = (x.float() for x in make_qkv(2, 6, 2, 80, 16))
    got, state = run_decode(kernel, q, k, v, 5)  # 75 steps: the buffer grows past its first GROWTH slots
    assert state.k.dtype == state.v.dtype == kv_dtype and state.k.shape[2] >= 80
    if kv_dtype == torch.int8:  # the scales grow with their keys
        assert state.k_scale.shape == state.v_scale.shape == state.k.shape[:3]
    with torch.no_grad():
        want, _ = kernel(q, k, v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("d, Hq, Hkv", [(64, 9, 3), (32, 4, 1), (128, 4, 2), (64, 8, 2)])
def test_fused_decode_bf16_products_tight(d, Hq, Hkv):
    """bf16 keys and values with bf16 products, G = 1 … 4 query heads per KV head (AVX512_BF16's pair products where
    the CPU has them): every step from the second token on (split-K parts of 2 … 40 keys, odd counts and partial
    16-key blocks) equals bf16_product_attention on the exact heads up to fp32 rounding (≤ 1e-4 · max |v|, where the
    rounding bound of the loose test above is 2^-8)."""
    from oal.kernels.hybrid import bf16_product_attention

    base = make_kernel("exact+sink_window", Hq, Hkv, d, exact=tuple(sorted({0, Hkv - 1})))
    kernel = ExactHeadsKernel(base.inner, base.exact_kv_heads, torch.bfloat16, torch.bfloat16)
    q, k, v = (x.float() for x in make_qkv(1, Hq, Hkv, 40, d, seed=3))
    got, _ = run_decode(kernel, q, k, v, 1)
    ex, eq = list(kernel.exact_kv_heads), kernel._exact_q
    ref = bf16_product_attention(q[:, eq, 1:], k[:, ex], v[:, ex], 1, kernel.scale)
    assert float((got[:, eq, 1:] - ref).abs().max()) <= 1e-4 * float(v.abs().max())


@pytest.mark.parametrize("d, Hq, Hkv", [(64, 9, 3), (32, 2, 2), (64, 10, 2)])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_fused_decode_bf16_products(d, Hq, Hkv, kv_dtype):
    """product_dtype=bf16 in the decode step (queries and weights rounded; int8 keys and values widened, their
    scales folded into the scores and weights; the vector kernel for ≤ 4 query heads per KV head, the generic one
    for 5) over more keys than one split-K part: within 2^-8 · max |v| of the kernel's own pass (its fused prompt
    kernel) and of bf16_product_attention on the exact heads (int8: on their dequantised keys and values, the
    scales folded)."""
    from oal.kernels.hybrid import bf16_product_attention, dequantize_int8, quantize_int8

    base = make_kernel("exact+sink_window", Hq, Hkv, d, exact=(0, Hkv - 1))
    kernel = ExactHeadsKernel(base.inner, base.exact_kv_heads, kv_dtype, torch.bfloat16)
    q, k, v = (x.float() for x in make_qkv(1, Hq, Hkv, 2110, d))
    got, state = run_decode(kernel, q, k, v, 2101)
    with torch.no_grad():
        want, _ = kernel(q, k, v)
    bound = 2**-8 * float(v.abs().max())
    assert float((got[:, :, 2101:] - want[:, :, 2101:]).abs().max()) <= bound
    ex = list(kernel.exact_kv_heads)
    eq = kernel._exact_q
    ke, ve = k[:, ex], v[:, ex]
    if kv_dtype == torch.int8:
        ke, ve = dequantize_int8(*quantize_int8(ke)), dequantize_int8(*quantize_int8(ve))
    ref = bf16_product_attention(q[:, eq, 2101:], ke, ve, 2101, kernel.scale, round_kv=kv_dtype != torch.int8)
    assert float((got[:, eq, 2101:] - ref).abs().max()) <= bound
    with torch.no_grad():
        fp32 = ExactHeadsKernel(base.inner, base.exact_kv_heads, kv_dtype)
        plain, _ = run_decode(fp32, q, k, v, 2101)
    assert float((plain[:, eq, 2101:] - got[:, eq, 2101:]).abs().max()) > 1e-6  # the rounding is applied
