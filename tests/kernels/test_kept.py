"""The kept form (oal.kernels.kept): kernel heads keep their keys and values below the memory crossover, the fused
decode step evaluates the kernel part from them, and folding gives the state the kernel itself builds. Checked
against the fp64 naive reference and the kernels' own chunked states: every converted kind, GQA 1 and 3, the
register-blocked shapes (d = dv ∈ {32, 64, 128}, ≤ 4 query heads per KV head) and the generic ones, prompts of
1 / 63 / 1000 tokens, steps that cross the limit, hypothesis shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_decode import DECODE_SHAPES, KINDS, make_kernel, make_qkv, reference

from oal.kernels import ExactHeadsKernel
from oal.kernels import kept as kept_form
from oal.kernels.decode import decode_step
from oal.kernels.hybrid import ExactHeadsState
from oal.kernels.kept import FOLD_SPREAD, KEPT_GROWTH, KeptKV, keep_limit
from oal.ops.quadratic import cpu as cpu_kernel
from oal.ops.sink_window import SinkWindowState

pytestmark = pytest.mark.skipif(
    cpu_kernel.load("decode") is None, reason="the fused CPU decode kernel did not build (no C++ compiler?)"
)


def kept_of(state) -> KeptKV | None:
    inner = state.inner if isinstance(state, ExactHeadsState) else state
    return inner if isinstance(inner, KeptKV) else None


def run_kept(kernel, q, k, v, n_prefill, threads=None):
    """Prefill n_prefill tokens into the kept form, then decode the rest with the fused step; every token's output
    and the kept length (None once folded) after each step."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            o, state = kept_form.start(kernel, q[:, :, :n_prefill], k[:, :, :n_prefill], v[:, :, :n_prefill])
            outs, lengths = [o], [kept_of(state).length]
            for t in range(n_prefill, q.shape[2]):
                step = decode_step(kernel, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, t)
                assert step is not None, "the fused path should apply to CPU fp32 without autograd"
                o, state = step
                outs.append(o)
                kept = kept_of(state)
                lengths.append(None if kept is None else kept.length)
    finally:
        torch.set_num_threads(previous)
    return torch.cat(outs, dim=2), state, lengths


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("Hq, Hkv", [(3, 3), (9, 3)])
@pytest.mark.parametrize("n_prefill", [1, 3, 63])
def test_kept_decode_matches_naive_across_the_limit(kind, Hq, Hkv, n_prefill):
    """d = 16: the limit is 81 tokens (93 with 4 sinks and an 8-token window); 40 steps cross it from 63."""
    d, B, steps = 16, 2, 40
    kernel = make_kernel(kind, Hq, Hkv, d, exact=(Hkv - 1,))
    limit = keep_limit(kernel, d, d)
    assert limit == 153 * 17 // 32 + (12 if "sink" in kind else 0)
    q, k, v = make_qkv(B, Hq, Hkv, n_prefill + steps, d)
    got, state, lengths = run_kept(kernel, q.float(), k.float(), v.float(), n_prefill)
    torch.testing.assert_close(got.double(), reference(kernel, q, k, v), atol=2e-5, rtol=1e-4)
    # kept while at most `limit` tokens, folded by the step that would exceed it
    want = [n if n <= limit else None for n in range(n_prefill, n_prefill + steps + 1)]
    assert lengths == want


@pytest.mark.parametrize("kind", KINDS)
def test_state_weights_are_built_where_the_kept_form_folds(kind):
    """The state's query weights (Eq. 6's query side) are not built for steps from kept keys, and are by the step
    that folds them."""
    from oal.kernels import decode

    d, Hq, Hkv = 16, 9, 3
    kernel = make_kernel(kind, Hq, Hkv, d, exact=(Hkv - 1,))
    limit = keep_limit(kernel, d, d)
    q, k, v = (x.float() for x in make_qkv(1, Hq, Hkv, limit + 2, d))
    _, _, lengths = run_kept(kernel, q[:, :, :limit], k[:, :, :limit], v[:, :, :limit], limit - 3)
    assert lengths[-1] == limit and getattr(kernel, decode._STATE_WEIGHTS_ATTR, None) is None
    got, _, lengths = run_kept(kernel, q, k, v, limit - 3)
    assert lengths[-1] is None and getattr(kernel, decode._STATE_WEIGHTS_ATTR, None) is not None
    torch.testing.assert_close(
        got.double(), reference(kernel, q.double(), k.double(), v.double()), atol=2e-5, rtol=1e-4
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 3, 5, 9, 20])
@pytest.mark.parametrize("d", [7, 8])
def test_fold_is_the_kernels_own_state(kind, n, d):
    """Folding the kept keys gives the state the chunked kernel returns after the same tokens (fewer tokens than
    the sinks and than the window included; odd d: the cyclic layout lists some pairs twice)."""
    Hq, Hkv = 6, 2
    kernel = make_kernel(kind, Hq, Hkv, d, exact=(0,))
    q, k, v = (x.float() for x in make_qkv(2, Hq, Hkv, n, d))
    with torch.no_grad():
        o_kept, state = kept_form.start(kernel, q, k, v)
        o_ref, want = kernel(q, k, v, output_final_state=True)
    torch.testing.assert_close(o_kept, o_ref, rtol=0, atol=0)
    got = kept_form.fold(kernel, state)
    if isinstance(want, ExactHeadsState):
        assert got.offset == want.offset == n
        torch.testing.assert_close(got.k, want.k, rtol=0, atol=0)
        torch.testing.assert_close(got.v, want.v, rtol=0, atol=0)
        got, want = got.inner, want.inner
    assert type(got) is type(want)
    as_tuple = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731
    for a, b in zip(as_tuple(got), as_tuple(want), strict=True):
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        else:
            assert a == b
    assert kept_form.fold(kernel, want) is want  # a state that is not kept is returned as it is


@pytest.mark.parametrize("d, Hq, Hkv", [(64, 9, 3), (32, 2, 2), (128, 4, 1), (64, 10, 2), (64, 3, 3), (24, 6, 2)])
@pytest.mark.parametrize("kind", ["oal", "exact+sink_window"])
@pytest.mark.parametrize("threads", [1, 2])
def test_kept_blocked_kernel_part(d, Hq, Hkv, kind, threads):
    """The register-blocked kernel part (d = dv ∈ {32, 64, 128}, ≤ 4 query heads per KV head; 5 per head and d = 24
    take the generic one) over more keys than one task (256) with a tail that is not a multiple of 16."""
    base = make_kernel(kind, Hq, Hkv, d, n_sink=4, window=64, exact=(0,) if Hkv <= 2 else (0, Hkv - 1))
    kernel = base.inner if Hkv == 1 and isinstance(base, ExactHeadsKernel) else base
    n = min(301, keep_limit(kernel, d, d) - 5)  # d = 32: 284 (plain), d = 24: 164
    q, k, v = (x * 0.3 for x in make_qkv(1, Hq, Hkv, n + 5, d))
    got, _, lengths = run_kept(kernel, q.float(), k.float(), v.float(), n, threads)
    assert lengths[-1] == n + 5
    torch.testing.assert_close(got.double(), reference(kernel, q, k, v), atol=2e-5, rtol=1e-4)


def test_smollm2_shape_at_1000_tokens():
    """SmolLM2's layer shape (9 / 3 heads, d = 64) with a 1,000-token prompt, under the 1,089-token limit."""
    kernel = make_kernel("exact+sink_window", 9, 3, 64, n_sink=4, window=256, exact=(1,))
    q, k, v = (x * 0.3 for x in make_qkv(1, 9, 3, 1003, 64))
    got, state, lengths = run_kept(kernel, q.float(), k.float(), v.float(), 1000)
    assert lengths == [1000, 1001, 1002, 1003]
    assert keep_limit(kernel, 64, 64) == 1089 + 260
    torch.testing.assert_close(got.double()[:, :, -3:], reference(kernel, q, k, v)[:, :, -3:], atol=2e-5, rtol=1e-4)


def test_kept_buffers_grow_in_blocks_and_never_past_the_limit():
    kernel = make_kernel("oal", 6, 2, 8)  # limit 25
    q, k, v = (x.float() for x in make_qkv(1, 6, 2, 30, 8))
    with torch.no_grad():
        _, state = kept_form.start(kernel, q[:, :, :2], k[:, :, :2], v[:, :, :2])
        assert state.k.shape[2] == 2 and state.k.dtype == torch.float32  # a prompt: no spare slots
        caps, ptrs = [], []
        for t in range(2, 30):
            _, state = decode_step(kernel, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, t)
            caps.append(state.k.shape[2] if isinstance(state, KeptKV) else None)
            ptrs.append(state.k.data_ptr() if isinstance(state, KeptKV) else None)
    assert caps[:17] == [3 + KEPT_GROWTH] * 17 and len(set(ptrs[:17])) == 1  # grown once, then written in place
    assert caps[17:23] == [25] * 6  # grown to the limit, not past it
    assert caps[23:] == [None] * 5  # folded: 26 tokens are more than the state


def test_start_does_not_apply_where_the_fused_step_does_not():
    kernel = make_kernel("exact+oal", 6, 2, 8)
    q, k, v = (x.float() for x in make_qkv(1, 6, 2, 30, 8))
    assert kept_form.start(kernel, q, k, v) is None  # 30 tokens: more than the 25-token limit
    assert kept_form.start(kernel, q.double()[:, :, :4], k.double()[:, :, :4], v.double()[:, :, :4]) is None
    assert kept_form.start(kernel, q.bfloat16()[:, :, :4], k.bfloat16()[:, :, :4], v.bfloat16()[:, :, :4]) is None
    with torch.enable_grad():
        assert kept_form.start(kernel, q[:, :, :4], k[:, :, :4], v[:, :, :4]) is None  # trainable parameters
    every_head_exact = ExactHeadsKernel(kernel.inner, (0, 1))
    assert keep_limit(every_head_exact, 8, 8) == 0
    assert kept_form.start(every_head_exact, q[:, :, :4], k[:, :, :4], v[:, :, :4]) is None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**DECODE_SHAPES)
def test_kept_decode_any_shape(Hkv, ratio, d, n_prefill, n_sink, window, B):
    Hq = Hkv * ratio
    kernel = make_kernel("exact+sink_window", Hq, Hkv, d, n_sink=n_sink, window=window, exact=(0,))
    if Hkv == 1:
        kernel = kernel.inner
    n_prefill = min(n_prefill, keep_limit(kernel, d, d))
    q, k, v = make_qkv(B, Hq, Hkv, n_prefill + 8, d)
    got, state, _ = run_kept(kernel, q.float(), k.float(), v.float(), n_prefill)
    torch.testing.assert_close(got.double(), reference(kernel, q, k, v), atol=5e-5, rtol=1e-4)
    folded = kept_form.fold(kernel, state)
    inner = folded.inner if isinstance(folded, ExactHeadsState) else folded
    assert isinstance(inner, SinkWindowState) and inner.offset == n_prefill + 8


@pytest.mark.parametrize("layer", [None, 0, 3, 35])
def test_layers_fold_on_different_tokens(layer):
    """Layer i folds (i mod FOLD_SPREAD) tokens after the limit (one decode step folds one or two layers of a model,
    not all), with the same outputs; the kept keys then hold no more than a softmax layer's keys and values."""
    kernel = make_kernel("sink_window", 6, 2, 8)  # limit 25 + 4 sinks + an 8-token window = 37
    q, k, v = make_qkv(1, 6, 2, 45, 8)
    point = kept_form.fold_point(kernel, 8, 8, layer)
    assert point == 37 + (0 if layer is None else layer % FOLD_SPREAD)
    with torch.no_grad():
        o, state = kept_form.start(kernel, q.float()[:, :, :30], k.float()[:, :, :30], v.float()[:, :, :30])
        outs, kept = [o], []
        for t in range(30, 45):
            args = (q.float()[:, :, t : t + 1], k.float()[:, :, t : t + 1], v.float()[:, :, t : t + 1])
            o, state = decode_step(kernel, *args, state, t, layer)
            outs.append(o)
            kept.append(isinstance(state, KeptKV))
    assert kept == [t + 1 <= point for t in range(30, 45)]
    assert state.k.shape[2] <= point if isinstance(state, KeptKV) else isinstance(state, SinkWindowState)
    torch.testing.assert_close(torch.cat(outs, 2).double(), reference(kernel, q, k, v), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [8, 64])
def test_bf16_model_keeps_bf16_keys_exactly(kind, d):
    """A bf16 model's keys and values are bf16 numbers: kept in bf16 they give the fp32 kept form's outputs and fold
    into the same state, at half the bytes (twice the limit)."""
    Hq, Hkv = 6, 2
    kernel = make_kernel(kind, Hq, Hkv, d, exact=(0,))
    assert keep_limit(kernel, d, d, 2) == 2 * keep_limit(kernel, d, d)
    n = min(40, keep_limit(kernel, d, d))  # both kept throughout (d = 8: the fp32 limit is 25 tokens)
    q, k, v = ((x * (0.3 if d == 64 else 1)).bfloat16().float() for x in make_qkv(2, Hq, Hkv, n, d))
    runs = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            o, state = kept_form.start(kernel, q[:, :, : n // 2], k[:, :, : n // 2], v[:, :, : n // 2], dtype)
            assert kept_of(state).k.dtype == dtype
            outs = [o]
            for t in range(n // 2, n):
                args = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
                o, state = decode_step(kernel, *args, state, t)
                outs.append(o)
            runs[dtype] = (torch.cat(outs, 2), kept_form.fold(kernel, state))
    (o32, s32), (o16, s16) = runs[torch.float32], runs[torch.bfloat16]
    torch.testing.assert_close(o16, o32, rtol=0, atol=0)
    if isinstance(s32, ExactHeadsState):  # the exact heads' buffers: their first n slots (the rest is spare room)
        torch.testing.assert_close(s16.k[:, :, :n], s32.k[:, :, :n], rtol=0, atol=0)
        s16, s32 = s16.inner, s32.inner
    as_tuple = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731
    for a, b in zip(as_tuple(s16), as_tuple(s32), strict=True):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            assert a == b


@pytest.mark.parametrize("kind", ["exact+oal", "exact+sink_window"])
def test_int8_exact_heads_in_the_kept_form(kind):
    """A short prompt's kept form with an 8-bit exact cache: the exact heads' keys and values quantised (with their
    scales) beside the kernel heads' kept ones, decoded across the fold: the kernel's own one pass, which
    quantises the same numbers."""
    Hq, Hkv, d = 9, 3, 16
    base = make_kernel(kind, Hq, Hkv, d, exact=(1,))
    kernel = ExactHeadsKernel(base.inner, base.exact_kv_heads, torch.int8)
    q, k, v = (x.float() for x in make_qkv(2, Hq, Hkv, 130, d))
    got, state, lengths = run_kept(kernel, q, k, v, 20)
    assert lengths[0] == 20 and lengths[-1] is None  # kept, then folded
    assert state.k.dtype == torch.int8 and state.k_scale.shape == state.k.shape[:3]
    with torch.no_grad():
        want, _ = kernel(q, k, v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_spare_slots_spread_layers_over_the_growth_cycle():
    """A prompt's spare slots: none outside a model's layer, one distinct share per layer of 64 consecutive ones
    (so that decode steps grow one layer's buffers at a time), and the context restored after the block."""
    from oal.kernels.base import GROWTH, model_layer, spare_slots

    assert spare_slots(GROWTH) == 0
    shares = []
    for layer in range(GROWTH):
        with model_layer(layer):
            shares.append(spare_slots(GROWTH))
            assert 0 <= spare_slots(16) < 16
    assert sorted(shares) == list(range(GROWTH))
    assert spare_slots(GROWTH) == 0


def in_pieces(kernel, q, k, v, pieces, model_dtype):
    """A prompt of ``sum(pieces)`` tokens in the kept form, piece by piece (:func:`kept_form.start`, then
    :func:`kept_form.extend`): ``(o, state)`` after each."""
    at, state = 0, None
    for size in pieces:
        piece = [x[:, :, at : at + size] for x in (q, k, v)]
        if state is None:
            o, state = kept_form.start(kernel, *piece, model_dtype)
        else:
            o, state = kept_form.extend(kernel, *piece, state, model_dtype)
        at += size
        yield o, state


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("Hq, Hkv", [(3, 3), (9, 3)])
@pytest.mark.parametrize("pieces", [(1, 2), (63, 18), (30, 1, 17, 33)])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_extend_evaluates_after_the_kept_keys_without_a_fold(kind, Hq, Hkv, pieces, model_dtype, monkeypatch):
    """A prompt in pieces that stays in the kept form (d = 16: ≤ 81 tokens): every later piece's queries are
    evaluated over the kept and the new keys with no state (queries aligned at the end of the keys), so the outputs
    are the one call's over the whole prompt (fp32 rounding), the kept keys are the prompt's with model layer 3's
    spare slots after them (as a one-call prompt leaves them), and nothing is folded."""
    from oal.kernels.base import model_layer

    d, B, n = 16, 2, sum(pieces)
    folded = []
    monkeypatch.setattr(kept_form, "_fold_inner", lambda *a: folded.append(a))
    kernel = make_kernel(kind, Hq, Hkv, d, exact=(Hkv - 1,))
    q, k, v = (x.bfloat16().float() for x in make_qkv(B, Hq, Hkv, n, d))
    with torch.no_grad(), model_layer(3):
        want, _ = kernel(q, k, v)
        outs, states = zip(*in_pieces(kernel, q, k, v, pieces, model_dtype), strict=True)
    state = states[-1]
    assert not folded
    torch.testing.assert_close(torch.cat(outs, 2), want, rtol=2e-5, atol=2e-5)
    kept = kept_of(state)
    heads = list(kernel.kernel_kv_heads) if isinstance(kernel, ExactHeadsKernel) else list(range(Hkv))
    assert kept.length == n and kept.k.dtype == model_dtype
    if len(pieces) > 1:
        assert kept.k.shape[2] == kept.v.shape[2] == n + 41 * 3 % KEPT_GROWTH
    torch.testing.assert_close(kept.k[:, :, :n].float(), k[:, heads], rtol=0, atol=0)
    torch.testing.assert_close(kept.v[:, :, :n].float(), v[:, heads], rtol=0, atol=0)
    if isinstance(state, ExactHeadsState):
        torch.testing.assert_close(state.k[:, :, :n].float(), k[:, list(kernel.exact_kv_heads)], rtol=0, atol=0)
        assert state.offset == n


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_prompt_in_chunks_writes_into_its_first_chunks_buffers(kind, model_dtype):
    """Within a prompt in chunks (its caller owns the state, :func:`prompt_end`), the first chunk's kept buffers
    have room for the whole prompt and the layer's spare slots, and every later chunk's keys and values go into
    them in place (no second buffer per chunk, which a chunk's transients would leave as a hole in the heap); the
    outputs are the one call's."""
    from oal.kernels.base import model_layer, prompt_end

    d, B, Hq, Hkv, pieces = 16, 2, 6, 2, (30, 17, 33)
    n = sum(pieces)
    kernel = make_kernel(kind, Hq, Hkv, d, exact=(Hkv - 1,))
    q, k, v = (x.bfloat16().float() for x in make_qkv(B, Hq, Hkv, n, d))
    with torch.no_grad(), model_layer(3), prompt_end(n):
        want, _ = kernel(q, k, v)
        outs, states = zip(*in_pieces(kernel, q, k, v, pieces, model_dtype), strict=True)
    first, kept = kept_of(states[0]), kept_of(states[-1])
    room = min(n + 41 * 3 % KEPT_GROWTH, keep_limit(kernel, d, d, model_dtype.itemsize))  # fp32: the limit, 81
    assert first.k.shape[2] == room and [kept_of(s).length for s in states] == [30, 47, 80]
    for later in map(kept_of, states[1:]):
        assert later.k.data_ptr() == first.k.data_ptr() and later.v.data_ptr() == first.v.data_ptr()
    torch.testing.assert_close(torch.cat(outs, 2), want, rtol=2e-5, atol=2e-5)
    heads = list(kernel.kernel_kv_heads) if isinstance(kernel, ExactHeadsKernel) else list(range(Hkv))
    torch.testing.assert_close(kept.k[:, :, :n].float(), k[:, heads], rtol=0, atol=0)
    torch.testing.assert_close(kept.v[:, :, :n].float(), v[:, heads], rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_extend_without_the_fused_path_folds(kind, monkeypatch):
    """Where the fused kernels cannot take a chunk after the kept keys, it comes from the folded state (the
    kernel's chunked mode): the naive reference's outputs, the same kept keys after."""
    d, Hq, Hkv = 16, 6, 2
    monkeypatch.setattr(kept_form, "_at_end_usable", lambda kernel: False)
    folds = []
    fold_inner = kept_form._fold_inner
    monkeypatch.setattr(kept_form, "_fold_inner", lambda *a: folds.append(1) or fold_inner(*a))
    kernel = make_kernel(kind, Hq, Hkv, d, exact=(Hkv - 1,))
    q, k, v = make_qkv(2, Hq, Hkv, 60, d)
    with torch.no_grad():
        o, state = kept_form.start(kernel, q[:, :, :20].float(), k[:, :, :20].float(), v[:, :, :20].float())
        outs = [o]
        for a, b in ((20, 35), (35, 60)):
            o, state = kept_form.extend(kernel, q[:, :, a:b].float(), k[:, :, a:b].float(), v[:, :, a:b].float(), state)
            outs.append(o)
    assert len(folds) == 2 and kept_of(state).length == 60
    torch.testing.assert_close(torch.cat(outs, 2).double(), reference(kernel, q, k, v), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("inner", ["exact+oal", "exact+sink_window"])
def test_exact_heads_kernel_takes_a_kept_inner_state(inner):
    """ExactHeadsKernel's inner kernel continues from a kept form given as its state (no fold): the new tokens'
    outputs are the one call's rows, the state after holds the kept form grown; under autograd (no fused path) a
    kept inner state is refused, naming the fold."""
    d, Hq, Hkv = 16, 9, 3
    kernel = make_kernel(inner, Hq, Hkv, d, exact=(1,))
    q, k, v = (x.float() for x in make_qkv(1, Hq, Hkv, 40, d))
    with torch.no_grad():
        want, _ = kernel(q, k, v)
        _, state = kept_form.start(kernel, q[:, :, :25], k[:, :, :25], v[:, :, :25])
        assert isinstance(state.inner, KeptKV)
        o, after = kernel(q[:, :, 25:], k[:, :, 25:], v[:, :, 25:], initial_state=state, output_final_state=True)
    torch.testing.assert_close(o, want[:, :, 25:], rtol=2e-5, atol=2e-5)
    assert isinstance(after.inner, KeptKV) and after.inner.length == after.offset == 40
    torch.testing.assert_close(after.inner.k[:, :, :40], k[:, [0, 2]], rtol=0, atol=0)
    with pytest.raises(ValueError, match="initial_state: a kept form .* fold it"):
        kernel(q[:, :, 25:].requires_grad_(), k[:, :, 25:], v[:, :, 25:], initial_state=state)


def test_cache_empty_takes_a_reserved_buffer_of_the_same_shape_dtype_and_device_once():
    from oal.kernels.base import cache_empty, reserved_buffers

    like = torch.empty(0)
    a, b = torch.empty(2, 3, 4), torch.empty(2, 3, 4, dtype=torch.bfloat16)
    pool = [a, b]
    with reserved_buffers(pool):
        assert cache_empty(like, 2, 3, 5).data_ptr() not in (a.data_ptr(), b.data_ptr())  # no such shape
        assert cache_empty(like, 2, 3, 4, dtype=torch.bfloat16) is b
        assert cache_empty(like, 2, 3, 4) is a
        assert pool == []
        fresh = cache_empty(like, 2, 3, 4)
        assert fresh is not a and fresh.shape == (2, 3, 4)
    pool = [a]
    assert cache_empty(like, 2, 3, 4) is not a and pool == [a]  # outside the block nothing is reserved


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 40, 200])
def test_prompt_buffers_are_what_a_prompt_keeps(kind, n, monkeypatch):
    """kept.prompt_buffers names the buffers a one-call prompt leaves in the state (the model's prefill reserves
    them before its first layer): reserved, the prompt takes every one of them and allocates none besides."""
    from oal.kernels.base import model_layer, reserved_buffers

    kernel = make_kernel(kind, 9, 3, 16, exact=(1,))
    if isinstance(kernel, ExactHeadsKernel):
        kernel.decode_budget, kernel.decode_page = 32, 8
    q, k, v = (x.float() for x in make_qkv(2, 9, 3, n, 16))
    with model_layer(5), torch.no_grad():
        shapes = kept_form.prompt_buffers(kernel, 2, n, 16, 16)
        pool = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
        ptrs = {t.data_ptr() for t in pool}
        with reserved_buffers(pool):
            _, state = kept_form.start(kernel, q, k, v) or kernel(q, k, v, output_final_state=True)
    assert pool == []
    kept = kept_of(state)
    held = [] if kept is None else [kept.k, kept.v]
    if isinstance(state, ExactHeadsState):
        held += [t for t in (state.k, state.v, state.k_bounds) if t is not None]
    assert {t.data_ptr() for t in held} == ptrs
