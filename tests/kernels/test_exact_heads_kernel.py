"""ExactHeadsKernel: exact heads equal softmax, the other heads equal the inner kernel on its own, in every
mode; prefill + decode = one pass; weights/at_positions agree with forward; config round trip; bad input."""

from __future__ import annotations

import pytest
import torch

from oal.kernels import (
    ExactHeadsKernel,
    ExactHeadsState,
    OALKernel,
    SinkWindowKernel,
    SoftmaxKernel,
    kernel_config,
    kernel_from_config,
)
from oal.kernels.base import prompt_end


def make_qkv(B, Hq, Hkv, N, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, N, d, generator=g, dtype=dtype) for h in (Hq, Hkv, Hkv))


def make_inner(kind, Hq, Hkv, d, dtype=torch.float64):
    torch.manual_seed(1)
    oal = OALKernel(torch.randint(0, 3, (Hq, d)), Hkv, L=torch.randn(Hq, 4, 4) * 0.4).to(dtype)
    if kind == "oal":
        return oal
    return SinkWindowKernel(oal, n_sink=2, window=5, beta=torch.randn(Hq) * 0.3).to(dtype)


def group_q(heads, g):
    return [h * g + i for h in heads for i in range(g)]


@pytest.mark.parametrize("kind", ["oal", "sink_window"])
@pytest.mark.parametrize("Hq,Hkv,exact", [(6, 3, [1]), (6, 3, [0, 2]), (4, 4, [3]), (3, 1, [0]), (9, 3, [0, 1, 2])])
@pytest.mark.parametrize("mode", ["naive", "chunk", "recurrent"])
@pytest.mark.parametrize("N", [1, 63, 130])
def test_heads_are_softmax_or_inner(kind, Hq, Hkv, exact, mode, N):
    d = 8
    inner = make_inner(kind, Hq, Hkv, d)
    m = ExactHeadsKernel(inner, exact)
    q, k, v = make_qkv(2, Hq, Hkv, N, d)
    o, _ = m(q, k, v, mode=mode)
    g = Hq // Hkv
    eq = group_q(exact, g)
    ref_soft, _ = SoftmaxKernel(Hq, Hkv, d)(q, k, v)
    torch.testing.assert_close(o[:, eq], ref_soft[:, eq], rtol=1e-10, atol=1e-10)
    rest = [h for h in range(Hkv) if h not in exact]
    if rest:
        ref_inner, _ = inner(q, k, v, mode="naive")
        rq = group_q(rest, g)
        torch.testing.assert_close(o[:, rq], ref_inner[:, rq], rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("kind", ["oal", "sink_window"])
@pytest.mark.parametrize("exact", [[1], [0, 2]])
def test_prefill_then_decode_equals_one_pass(kind, exact):
    d, N, split = 8, 77, 40
    m = ExactHeadsKernel(make_inner(kind, 6, 3, d), exact)
    q, k, v = make_qkv(1, 6, 3, N, d)
    full, _ = m(q, k, v)
    o1, state = m(q[:, :, :split], k[:, :, :split], v[:, :, :split], output_final_state=True)
    outs = [o1]
    o2, state = m(q[:, :, split:60], k[:, :, split:60], v[:, :, split:60], initial_state=state, output_final_state=True)
    outs.append(o2)
    for t in range(60, N):
        ot, state = m(
            q[:, :, t : t + 1],
            k[:, :, t : t + 1],
            v[:, :, t : t + 1],
            mode="recurrent",
            initial_state=state,
            output_final_state=True,
        )
        outs.append(ot)
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-9, atol=1e-9)
    assert isinstance(state, ExactHeadsState) and state.offset == N
    assert state.k.shape == (1, len(exact), N, d) and state.v.shape == (1, len(exact), N, d)


@pytest.mark.parametrize("exact", [[1], [0, 2], [0, 1, 2]])
@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float64, None), (torch.float32, None), (torch.float32, torch.int8)])
def test_a_prompt_in_chunks_writes_its_keys_into_one_buffer(exact, dtype, kv_dtype):
    # within prompt_end (a prompt in chunks, its caller owning the state) the first chunk allocates the exact
    # heads' buffers for the whole prompt (int8: and their scales) and later chunks write into them: no copy of
    # the past per chunk
    d, N = 8, 150
    m = ExactHeadsKernel(make_inner("sink_window", 6, 3, d, dtype), exact, kv_dtype)
    q, k, v = make_qkv(2, 6, 3, N, d, dtype)
    full, _ = m(q, k, v)
    outs, state, ptrs = [], None, set()
    with prompt_end(N):
        for a in range(0, N, 64):
            b = min(N, a + 64)
            o, state = m(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], initial_state=state, output_final_state=True)
            outs.append(o)
            assert state.k.shape == (2, len(exact), N, d) and state.offset == b
            scales = () if kv_dtype is None else (state.k_scale.data_ptr(), state.v_scale.data_ptr())
            ptrs.add((state.k.data_ptr(), state.v.data_ptr(), *scales))
    assert len(ptrs) == 1
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-5, atol=1e-5)


def test_a_call_outside_a_prompt_leaves_its_initial_state_as_it_was():
    # the same state continued twice (two continuations of one prefix) without prompt_end: each call copies
    d = 8
    m = ExactHeadsKernel(make_inner("oal", 6, 3, d), [0, 2])
    q, k, v = make_qkv(1, 6, 3, 60, d)
    with prompt_end(100):  # a prompt's first chunk: buffers with room for 100 keys
        _, state = m(q[:, :, :40], k[:, :, :40], v[:, :, :40], output_final_state=True)
    assert state.k.shape[2] == 100
    before = state.k.clone()
    _, s1 = m(q[:, :, 40:], k[:, :, 40:], v[:, :, 40:], initial_state=state, output_final_state=True)
    q2, k2, v2 = make_qkv(1, 6, 3, 20, d, seed=5)
    _, s2 = m(q2, k2, v2, initial_state=state, output_final_state=True)
    # bit for bit: the room past the 40 keys is uninitialised memory, which may hold NaN patterns
    assert torch.equal(state.k.view(torch.int64), before.view(torch.int64)) and s1.k.data_ptr() != s2.k.data_ptr()
    assert torch.equal(s1.k[:, :, 40:60], k[:, [0, 2], 40:]) and torch.equal(s2.k[:, :, 40:60], k2[:, [0, 2]])


def test_all_heads_exact_is_softmax_and_has_no_inner_state():
    q, k, v = make_qkv(1, 6, 3, 20, 8)
    m = ExactHeadsKernel(make_inner("oal", 6, 3, 8), [0, 1, 2])
    o, state = m(q, k, v, output_final_state=True)
    torch.testing.assert_close(o, SoftmaxKernel(6, 3, 8)(q, k, v)[0])
    assert state.inner is None


def test_at_positions_matches_forward_and_gradients_reach_inner():
    d = 8
    m = ExactHeadsKernel(make_inner("sink_window", 6, 3, d), [1])
    q, k, v = make_qkv(1, 6, 3, 50, d)
    pos = torch.tensor([0, 7, 33, 49])
    full, _ = m(q, k, v, mode="naive")
    torch.testing.assert_close(m.at_positions(q, k, v, pos), full[:, :, pos], rtol=1e-9, atol=1e-9)
    m(q, k, v)[0].square().sum().backward()
    assert m.inner.inner.L.grad is not None and m.inner.beta.grad is not None
    # the exact heads' parameters take no part
    assert torch.all(m.inner.beta.grad[2:4] == 0) and bool(m.inner.beta.grad[[0, 1, 4, 5]].abs().sum() > 0)


def test_fp32_chunk_matches_fp64_naive():
    d = 16
    inner64 = make_inner("sink_window", 9, 3, d)
    m64 = ExactHeadsKernel(inner64, [2])
    m32 = ExactHeadsKernel(make_inner("sink_window", 9, 3, d, dtype=torch.float32), [2])
    q, k, v = make_qkv(1, 9, 3, 200, d)
    ref, _ = m64(q, k, v, mode="naive")
    with torch.no_grad():
        o, _ = m32(q.float(), k.float(), v.float())
    assert float((o.double() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("kind", ["oal", "sink_window"])
def test_config_round_trip_is_bit_identical(kind):
    m = ExactHeadsKernel(make_inner(kind, 6, 3, 8, dtype=torch.float32), [2, 0])
    cfg = kernel_config(m)
    assert cfg["name"] == "exact-heads" and cfg["exact_kv_heads"] == [0, 2]
    m2 = kernel_from_config(cfg)
    m2.load_state_dict(m.state_dict())
    q, k, v = (x.float() for x in make_qkv(1, 6, 3, 30, 8))
    assert torch.equal(m(q, k, v)[0], m2(q, k, v)[0])
    assert m2.name == m.name == f"{m.inner.name}+exact"


@pytest.mark.parametrize(
    "heads,match", [([], "at least one"), ([3], r"\[0, 3\)"), ([1, 1], "distinct"), (["0"], "integer")]
)
def test_bad_heads(heads, match):
    with pytest.raises(ValueError, match=match):
        ExactHeadsKernel(make_inner("oal", 6, 3, 8), heads)


def test_bad_inputs():
    m = ExactHeadsKernel(make_inner("oal", 6, 3, 8), [0])
    q, k, v = make_qkv(1, 6, 3, 10, 8)
    with pytest.raises(ValueError, match="KV heads"):
        m(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="ExactHeadsState"):
        m(q, k, v, initial_state=torch.zeros(1))
    with pytest.raises(ValueError, match="inner: expected"):
        ExactHeadsKernel(SoftmaxKernel(6, 3, 8), [0])


@pytest.mark.parametrize("kind", ["oal", "sink_window"])
def test_bf16_kv_rounds_the_exact_heads_keys_and_values_only(kind):
    """kv_dtype=bf16: the exact heads attend over their keys/values rounded to bf16, stored so in the state; the
    inner kernel's heads see the inputs as they are; prefill + continuation = one pass; config round trip."""
    inner = make_inner(kind, 6, 3, 8, dtype=torch.float32)
    m = ExactHeadsKernel(inner, [0, 2], kv_dtype=torch.bfloat16)
    q, k, v = (x.float() for x in make_qkv(1, 6, 3, 40, 8))
    kr, vr = k.clone(), v.clone()
    kr[:, [0, 2]] = k[:, [0, 2]].bfloat16().float()
    vr[:, [0, 2]] = v[:, [0, 2]].bfloat16().float()
    plain = ExactHeadsKernel(inner, [0, 2])
    with torch.no_grad():
        o, state = m(q, k, v, output_final_state=True)
        want, _ = plain(q, kr, vr)
        head, st = m(q[:, :, :17], k[:, :, :17], v[:, :, :17], output_final_state=True)
        tail, _ = m(q[:, :, 17:], k[:, :, 17:], v[:, :, 17:], initial_state=st)
    assert state.k.dtype == state.v.dtype == torch.bfloat16
    g = 2  # query heads per KV head
    exact_q, kernel_q = group_q([0, 2], g), group_q([1], g)
    torch.testing.assert_close(o[:, exact_q], want[:, exact_q], atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        unrounded, _ = plain(q, k, v)
    torch.testing.assert_close(o[:, kernel_q], unrounded[:, kernel_q], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.cat([head, tail], 2), o, atol=1e-6, rtol=1e-5)
    cfg = kernel_config(m)
    assert cfg["kv_dtype"] == "bfloat16" and "kv_dtype" not in kernel_config(plain)
    assert kernel_from_config(cfg).kv_dtype == torch.bfloat16


def test_bad_kv_dtype_and_state_dtype():
    with pytest.raises(ValueError, match="kv_dtype: expected None, torch.bfloat16 or torch.int8"):
        ExactHeadsKernel(make_inner("oal", 6, 3, 8), [0], kv_dtype=torch.float16)
    m = ExactHeadsKernel(make_inner("oal", 6, 3, 8, dtype=torch.float32), [0], kv_dtype=torch.bfloat16)
    q, k, v = (x.float() for x in make_qkv(1, 6, 3, 10, 8))
    with torch.no_grad():
        _, st = m(q, k, v, output_final_state=True)
        bad = ExactHeadsState(st.k.float(), st.v.float(), st.inner, st.offset)
        with pytest.raises(ValueError, match="in torch.bfloat16"):
            m(q, k, v, initial_state=bad)
    cfg = {**kernel_config(m), "kv_dtype": "float16"}
    with pytest.raises(ValueError, match=r"kv_dtype expected one of \['bfloat16', 'int8'\]"):
        kernel_from_config(cfg)


@pytest.mark.parametrize("kind", ["oal", "sink_window"])
def test_bf16_products_every_path_agrees(kind, spy_fast_path, monkeypatch):
    """product_dtype=bf16: the fused prompt kernel, the torch path (fused kernels off), prefill + continuation and
    the rounded-query autograd path agree within 2^-8 · max |v| on the exact heads; the kernel heads are untouched;
    the exact heads differ from fp32 products (the rounding is applied); config round trip. AMX tiles off, so that
    the fused kernel runs on any CPU (the tiles' path: test_bf16_products_on_amx_tiles_are_bf16_sdpa)."""
    import oal.kernels.hybrid as hybrid
    from oal.ops.quadratic import cpu as cpu_kernels

    monkeypatch.setenv("OAL_CPU_AMX", "0")

    calls = spy_fast_path(hybrid, "_fused_exact")
    inner = make_inner(kind, 6, 3, 64, dtype=torch.float32)
    m = ExactHeadsKernel(inner, [0, 2], kv_dtype=torch.bfloat16, product_dtype=torch.bfloat16)
    fp32 = ExactHeadsKernel(inner, [0, 2], kv_dtype=torch.bfloat16)
    q, k, v = (x.float() for x in make_qkv(1, 6, 3, 300, 64))
    with torch.no_grad():
        o, _ = m(q, k, v)
        with cpu_kernels.disabled():
            o_torch, _ = m(q, k, v)
        head, st = m(q[:, :, :170], k[:, :, :170], v[:, :, :170], output_final_state=True)
        tail, _ = m(q[:, :, 170:], k[:, :, 170:], v[:, :, 170:], initial_state=st)
        o_fp32, _ = fp32(q, k, v)
    if cpu_kernels.load("window") is not None:  # the no-grad calls reached the fused kernel, the disabled one not
        assert calls == [True, False, True, True, True]
    qg = q.clone().requires_grad_()
    o_grad, _ = m(qg, k, v)
    o_grad.sum().backward()
    assert qg.grad is not None and bool(torch.isfinite(qg.grad).all())
    bound = 2**-8 * float(v.abs().max())
    exact_q, kernel_q = group_q([0, 2], 2), group_q([1], 2)
    for other in (o_torch, torch.cat([head, tail], 2), o_grad.detach()):
        assert float((other[:, exact_q] - o[:, exact_q]).abs().max()) <= bound
    torch.testing.assert_close(o[:, kernel_q], o_fp32[:, kernel_q], atol=1e-6, rtol=1e-5)
    assert float((o[:, exact_q] - o_fp32[:, exact_q]).abs().max()) > 1e-5
    cfg = kernel_config(m)
    assert cfg["product_dtype"] == "bfloat16" and "product_dtype" not in kernel_config(fp32)
    back = kernel_from_config(cfg)
    assert back.product_dtype == torch.bfloat16 and back.kv_dtype == torch.bfloat16
    assert "product_dtype=torch.bfloat16" in repr(m)


def test_bad_product_dtype():
    inner = make_inner("oal", 6, 3, 8)
    with pytest.raises(ValueError, match="product_dtype: expected None or torch.bfloat16"):
        ExactHeadsKernel(inner, [0], kv_dtype=torch.bfloat16, product_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"product_dtype: bf16 products need .* int8 .* got kv_dtype=None"):
        ExactHeadsKernel(inner, [0], product_dtype=torch.bfloat16)
    cfg = {**kernel_config(ExactHeadsKernel(inner, [0], kv_dtype=torch.bfloat16)), "product_dtype": "float16"}
    with pytest.raises(ValueError, match=r"product_dtype expected one of \['bfloat16'\]"):
        kernel_from_config(cfg)


def test_bf16_products_in_a_bf16_model_are_sdpa():
    """bf16 queries (a bf16 model): SDPA's bf16 products, within the bound of bf16_product_attention (plus the bf16
    output's own rounding)."""
    from oal.kernels.hybrid import bf16_product_attention

    inner = make_inner("sink_window", 6, 3, 64, dtype=torch.bfloat16)
    m = ExactHeadsKernel(inner, [0, 2], kv_dtype=torch.bfloat16, product_dtype=torch.bfloat16)
    q, k, v = (x.bfloat16() for x in make_qkv(1, 6, 3, 200, 64))
    with torch.no_grad():
        o, _ = m(q, k, v)
    exact_q = group_q([0, 2], 2)
    ref = bf16_product_attention(q[:, exact_q].float(), k[:, [0, 2]], v[:, [0, 2]], 0, m.scale)
    assert o.dtype == torch.bfloat16
    bound = 2**-8 * float(v.float().abs().max()) + 2**-8 * float(ref.abs().max())
    assert float((o[:, exact_q].float() - ref).abs().max()) <= bound


@pytest.mark.parametrize("exact", [[1], [0, 2]])
def test_bf16_queries_after_a_cached_past_take_the_mask_free_softmax(exact, monkeypatch):
    """A kernel in bf16 called directly after a cached past (a prompt's later chunk off the fused prompt kernel,
    which takes fp32 queries only): the exact heads take oal.ops.softmax.softmax_at_end instead of SDPA with a
    (N, past + N) mask, with the one call's outputs up to bf16 rounding; under autograd the masked SDPA stays (and
    agrees)."""
    import oal.kernels.hybrid as hybrid
    from oal.ops.softmax import naive_softmax_at_end

    calls = []
    real = hybrid.softmax_at_end

    def spy(q, *args):  # the chunks it evaluated (not those it declined)
        out = real(q, *args)
        if out is not None:
            calls.append(q.shape[2])
        return out

    monkeypatch.setattr(hybrid, "softmax_at_end", spy)
    inner = make_inner("sink_window", 6, 3, 64, dtype=torch.bfloat16)
    m = ExactHeadsKernel(inner, exact, kv_dtype=torch.bfloat16, product_dtype=torch.bfloat16)
    q, k, v = (x.bfloat16() for x in make_qkv(1, 6, 3, 301, 64))
    exact_q = group_q(exact, 2)
    with torch.no_grad():
        whole, _ = m(q, k, v)
        with prompt_end(301):
            first, state = m(q[:, :, :170], k[:, :, :170], v[:, :, :170], output_final_state=True)
            second, _ = m(q[:, :, 170:], k[:, :, 170:], v[:, :, 170:], initial_state=state)
    assert calls == [131]  # the one call and the first chunk are causal squares: SDPA without a mask
    ref = naive_softmax_at_end(q[:, exact_q, 170:].double(), k[:, exact].double(), v[:, exact].double(), m.scale)
    bound = 2**-7 * float(v.float().abs().max())
    assert float((second[:, exact_q].double() - ref).abs().max()) <= bound
    assert float((second[:, exact_q].float() - whole[:, exact_q, 170:].float()).abs().max()) <= bound
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    _, state = m(qg[:, :, :170], kg[:, :, :170], vg[:, :, :170], output_final_state=True)
    trained, _ = m(qg[:, :, 170:], kg[:, :, 170:], vg[:, :, 170:], initial_state=state)
    assert calls == [131]  # autograd: SDPA with the mask
    assert float((trained[:, exact_q].detach().double() - ref).abs().max()) <= bound


def test_quantize_int8_per_vector_absmax():
    """One scale per vector (absmax / 127), rounding half to even, every number within half a step; a zero vector
    stays zero; bf16 inputs quantise as their fp32 values."""
    from oal.kernels.hybrid import dequantize_int8, quantize_int8

    x = torch.randn(2, 3, 50, 64) * torch.logspace(-3, 2, 50)[:, None]
    x[0, 0, 7] = 0
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == x.shape[:-1]
    torch.testing.assert_close(s, x.abs().amax(-1).clamp_min(1e-30) / 127, rtol=0, atol=0)
    assert int(q.abs().max()) == 127 and bool((q.abs().amax(-1)[s > 1e-29] == 127).all())
    err = (dequantize_int8(q, s) - x).abs()
    assert bool((err <= s.unsqueeze(-1) * (0.5 + 1e-6)).all())
    assert bool((q[0, 0, 7] == 0).all())
    half = torch.tensor([[0.5, 1.5, 2.5, -2.5, 127.0]])  # scale 1: x / scale exactly these
    assert quantize_int8(half)[0].tolist() == [[0, 2, 2, -2, 127]]
    xb = x.bfloat16()
    assert torch.equal(quantize_int8(xb)[0], quantize_int8(xb.float())[0])


@pytest.mark.parametrize("kind", ["oal", "sink_window"])
@pytest.mark.parametrize("products", [None, torch.bfloat16])
def test_int8_kv_quantises_the_exact_heads_keys_and_values_only(kind, products, spy_fast_path):
    """kv_dtype=int8: the exact heads attend over their keys and values quantised per token and head and back
    (int8 and fp32 scales in the state); the kernel heads see the inputs as they are; the fused prompt kernel, the
    torch path and a prefill + continuation agree; autograd reaches q, k and v (straight through); config round
    trip."""
    import oal.kernels.hybrid as hybrid
    from oal.kernels.hybrid import bf16_product_attention, dequantize_int8, quantize_int8
    from oal.ops.quadratic import cpu as cpu_kernels

    calls = spy_fast_path(hybrid, "_fused_exact")
    inner = make_inner(kind, 6, 3, 64, dtype=torch.float32)
    m = ExactHeadsKernel(inner, [0, 2], kv_dtype=torch.int8, product_dtype=products)
    plain = ExactHeadsKernel(inner, [0, 2])
    q, k, v = (x.float() for x in make_qkv(1, 6, 3, 300, 64))
    kr, vr = k.clone(), v.clone()
    kr[:, [0, 2]] = dequantize_int8(*quantize_int8(k[:, [0, 2]]))
    vr[:, [0, 2]] = dequantize_int8(*quantize_int8(v[:, [0, 2]]))
    with torch.no_grad():
        o, state = m(q, k, v, output_final_state=True)
        with cpu_kernels.disabled():
            o_torch, _ = m(q, k, v)
        want, _ = plain(q, kr, vr)
        head, st = m(q[:, :, :170], k[:, :, :170], v[:, :, :170], output_final_state=True)
        tail, _ = m(q[:, :, 170:], k[:, :, 170:], v[:, :, 170:], initial_state=st)
        unrounded, _ = ExactHeadsKernel(inner, [0, 2])(q, k, v)
    if cpu_kernels.load("window") is not None:
        assert calls[:2] == [True, False] and all(calls[2:])
    assert state.k.dtype == state.v.dtype == torch.int8
    assert state.k_scale.shape == state.v_scale.shape == (1, 2, 300) and state.k_scale.dtype == torch.float32
    qk, sk = quantize_int8(k[:, [0, 2]])
    assert torch.equal(state.k[:, :, :300], qk) and torch.equal(state.k_scale[:, :, :300], sk)
    exact_q, kernel_q = group_q([0, 2], 2), group_q([1], 2)
    bound = 2**-8 * float(v.abs().max()) if products is not None else 1e-5
    if products is None:  # the softmax of the dequantised numbers
        torch.testing.assert_close(o[:, exact_q], want[:, exact_q], atol=1e-5, rtol=1e-5)
    else:  # bf16 products with the scales folded into them
        ref = bf16_product_attention(q[:, exact_q], kr[:, [0, 2]], vr[:, [0, 2]], 0, m.scale, round_kv=False)
        assert float((o[:, exact_q] - ref).abs().max()) <= bound
    for other in (o_torch, torch.cat([head, tail], 2)):
        assert float((other[:, exact_q] - o[:, exact_q]).abs().max()) <= bound
    torch.testing.assert_close(o[:, kernel_q], unrounded[:, kernel_q], atol=1e-6, rtol=1e-5)
    assert float((o[:, exact_q] - unrounded[:, exact_q]).abs().max()) > 1e-4  # the quantisation is applied
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    o_grad, _ = m(qg, kg, vg)
    o_grad.sum().backward()
    assert all(x.grad is not None and bool(torch.isfinite(x.grad).all()) for x in (qg, kg, vg))
    assert float(kg.grad[:, [0, 2]].abs().max()) > 0
    assert float((o_grad.detach()[:, exact_q] - o[:, exact_q]).abs().max()) <= 2**-8 * float(v.abs().max())
    cfg = kernel_config(m)
    assert cfg["kv_dtype"] == "int8"
    back = kernel_from_config(cfg)
    assert back.kv_dtype == torch.int8 and back.product_dtype == products
    assert "kv_dtype=torch.int8" in repr(m)


def test_int8_state_needs_its_scales():
    m = ExactHeadsKernel(make_inner("oal", 6, 3, 8, dtype=torch.float32), [0], kv_dtype=torch.int8)
    q, k, v = (x.float() for x in make_qkv(1, 6, 3, 10, 8))
    with torch.no_grad():
        _, st = m(q, k, v, output_final_state=True)
        with pytest.raises(ValueError, match="expected k_scale and v_scale"):
            m(q, k, v, initial_state=st._replace(k_scale=None))
        with pytest.raises(ValueError, match="fp32 scales of shape"):
            m(q, k, v, initial_state=st._replace(v_scale=st.v_scale[:, :, :5]))
        bf16 = ExactHeadsKernel(make_inner("oal", 6, 3, 8, dtype=torch.float32), [0], kv_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="in torch.bfloat16"):
            bf16(q, k, v, initial_state=st)


def test_bf16_products_on_amx_tiles_are_bf16_sdpa(monkeypatch):
    """On a CPU with AMX tiles (forced here: torch's bf16 SDPA runs on any CPU) an fp32 model's exact heads take
    bf16 SDPA over a prompt, in one call and in chunks after a cached past: within the bound of
    bf16_product_attention plus the bf16 output's rounding; int8 storage and autograd stay off that path."""
    import oal.kernels.hybrid as hybrid
    from oal.kernels.hybrid import bf16_product_attention
    from oal.ops.quadratic import cpu as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "amx_bf16", lambda: True)
    calls = []
    real = hybrid._bf16_sdpa
    monkeypatch.setattr(hybrid, "_bf16_sdpa", lambda *a: calls.append(a[3]) or real(*a))
    inner = make_inner("sink_window", 6, 3, 64, dtype=torch.float32)
    m = ExactHeadsKernel(inner, [0, 2], kv_dtype=torch.bfloat16, product_dtype=torch.bfloat16)
    q, k, v = (x.float() for x in make_qkv(1, 6, 3, 300, 64))
    exact_q = group_q([0, 2], 2)
    ref = bf16_product_attention(q[:, exact_q], k[:, [0, 2]], v[:, [0, 2]], 0, m.scale)
    bound = 2**-8 * float(v.abs().max()) + 2**-8 * float(ref.abs().max())
    with torch.no_grad():
        whole, _ = m(q, k, v)
        first, state = m(q[:, :, :170], k[:, :, :170], v[:, :, :170], output_final_state=True)
        second, _ = m(q[:, :, 170:], k[:, :, 170:], v[:, :, 170:], initial_state=state)
    assert calls == [0, 0, 170]
    assert whole.dtype == torch.float32
    assert float((whole[:, exact_q] - ref).abs().max()) <= bound
    chunked = torch.cat([first, second], 2)[:, exact_q]
    assert float((chunked - ref).abs().max()) <= bound
    m8 = ExactHeadsKernel(inner, [0, 2], kv_dtype=torch.int8, product_dtype=torch.bfloat16)
    with torch.no_grad():
        m8(q, k, v)
    m(q.requires_grad_(), k, v)
    assert calls == [0, 0, 170]


def test_amx_flag_override(monkeypatch):
    from oal.ops.quadratic import cpu as cpu_kernels

    monkeypatch.setenv("OAL_CPU_AMX", "0")
    assert cpu_kernels.amx_bf16() is False
    monkeypatch.setenv("OAL_CPU_AMX", "1")
    assert cpu_kernels.amx_bf16() is True
    monkeypatch.setenv("OAL_CPU_AMX", "yes")
    with pytest.raises(ValueError, match=r"OAL_CPU_AMX: expected 0 or 1, got 'yes'"):
        cpu_kernels.amx_bf16()


@pytest.mark.parametrize("exact", [[1], [0, 2]])
def test_a_short_prompt_of_the_kernel_heads_is_softmax_without_coefficients(exact, monkeypatch):
    """The kernel heads of a sink/window inner kernel on a fresh prompt of at most n_sink + window tokens: causal
    softmax, the inner kernel's coefficients not computed (under autograd for β they are)."""
    import oal.kernels.hybrid as module

    m = ExactHeadsKernel(make_inner("sink_window", 9, 3, 8), exact)
    q, k, v = make_qkv(1, 9, 3, 7, 8)
    with torch.enable_grad():
        want, want_state = m(q, k, v, output_final_state=True)
    monkeypatch.setattr(module, "oal_coefficients", lambda *a: pytest.fail("coefficients computed"))
    with torch.no_grad():
        got, state = m(q, k, v, output_final_state=True)
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(got, SoftmaxKernel(9, 3, 8)(q, k, v)[0], rtol=0, atol=1e-12)
    for x, y in zip(state.inner[:5], want_state.inner[:5], strict=True):
        assert torch.equal(x, y)
    with torch.no_grad(), pytest.raises(pytest.fail.Exception, match="coefficients computed"):
        m(*make_qkv(1, 9, 3, 8, 8))  # 8 > n_sink + window = 7
