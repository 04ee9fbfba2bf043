"""The sink/window operator: chunk and recurrent against the naive reference, states, limits, gradients, bf16."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from oal.kernels import oal_coefficients, oal_factor, taylor_L
from oal.ops import quadratic_attention
from oal.ops.quadratic import KernelFactor, feature_dim
from oal.ops.sink_window import SinkWindowState, sink_window_attention, sink_window_weights
from oal.ops.sink_window.utils import all_exact


def make_inputs(B, Hq, Hkv, N, d, dv, dtype=torch.float64):
    q = torch.randn(B, Hq, N, d, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, d, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, dv, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_kernel(Hq, d, G=3, dtype=torch.float64, eps=1e-3):
    """OAL coefficients, the matching factor, and a random β."""
    groups = torch.randint(0, G, (Hq, d))
    L = torch.randn(Hq, G + 1, G + 1, dtype=dtype) * 0.5
    beta = torch.randn(Hq, dtype=dtype)
    return oal_coefficients(groups, L, eps), oal_factor(groups, L, eps), beta


def rel_rms(x, ref):
    return ((x.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()


def run(mode, q, k, v, coef, factor, beta, **kw):
    return sink_window_attention(
        q, k, v, *coef, beta, mode=mode, factor=factor if mode == "chunk" else None, kernel_floor=1e-3, **kw
    )


def states_close(x: SinkWindowState, y: SinkWindowState, tol: float) -> bool:
    assert x.offset == y.offset
    return all(torch.allclose(a.double(), b.double(), rtol=tol, atol=tol) for a, b in zip(x[:5], y[:5], strict=True))


GRID = list(itertools.product([1, 5, 63, 200], [0, 1, 16, 64], [0, 1, 4], [1, 3]))


@pytest.mark.parametrize("N,w,n_sink,group", GRID)
def test_chunk_and_recurrent_match_naive_fp64(N, w, n_sink, group):
    Hkv = 2 if N < 100 else 1
    Hq = Hkv * group
    B = 2 if N < 100 else 1
    q, k, v = make_inputs(B, Hq, Hkv, N, 8, 5)
    coef, factor, beta = random_kernel(Hq, 8)
    ref, ref_state = run("naive", q, k, v, coef, factor, beta, n_sink=n_sink, window=w, output_final_state=True)
    assert ref.shape == (B, Hq, N, 5)
    for mode in ("chunk", "recurrent"):
        out, state = run(
            mode, q, k, v, coef, factor, beta, n_sink=n_sink, window=w, output_final_state=True, chunk_size=16
        )
        assert rel_rms(out, ref) < 1e-10, mode
        assert states_close(state, ref_state, 1e-10), mode


@pytest.mark.parametrize("N,w,n_sink,group", [(63, 16, 4, 3), (200, 64, 1, 1), (200, 0, 4, 3), (5, 64, 0, 1)])
def test_fp32_within_1e4_of_fp64(N, w, n_sink, group):
    q, k, v = make_inputs(1, 3 * group, 3, N, 16, 8)
    coef, factor, beta = random_kernel(3 * group, 16)
    ref, _ = run("naive", q, k, v, coef, factor, beta, n_sink=n_sink, window=w)
    f32 = [x.float() for x in (q, k, v)]
    c32 = [x.float() for x in coef]
    f32_factor = KernelFactor(*(x.float() for x in factor))
    for mode in ("chunk", "recurrent"):
        out, _ = run(mode, *f32, c32, f32_factor, beta.float(), n_sink=n_sink, window=w)
        assert out.dtype == torch.float32
        assert rel_rms(out, ref) < 1e-4, mode


def test_naive_by_hand():
    """N = 3, n_sink = 1, w = 1: query 2 reads keys 0 (sink) and 2 (window) exactly and key 1 through the
    kernel; query 1 reads 0 (sink) and 1 (window); query 0 reads only the sink."""
    q, k, v = make_inputs(1, 1, 1, 3, 2, 2)
    coef, _, beta = random_kernel(1, 2, G=1)
    a, b, C = coef
    s = (q[0, 0] @ k[0, 0].T) / math.sqrt(2)
    x = q[0, 0, 2] * k[0, 0, 1] / math.sqrt(2)
    kappa_21 = a[0] + b[0] @ x + x @ C[0] @ x
    V = v[0, 0]
    w2 = torch.stack([s[2, 0].exp(), beta[0].exp() * kappa_21, s[2, 2].exp()])
    expected = torch.stack(
        [V[0], (s[1, 0].exp() * V[0] + s[1, 1].exp() * V[1]) / (s[1, 0].exp() + s[1, 1].exp()), (w2 @ V) / w2.sum()]
    )
    out, _ = sink_window_attention(q, k, v, a, b, C, beta, n_sink=1, window=1, mode="naive")
    assert torch.allclose(out[0, 0], expected, rtol=1e-12, atol=1e-14)
    for mode in ("chunk", "recurrent"):
        assert torch.allclose(sink_window_attention(q, k, v, a, b, C, beta, n_sink=1, window=1, mode=mode)[0], out)


def test_weights_rows_are_bounded_and_causal():
    q, k, _ = make_inputs(1, 3, 1, 40, 8, 1)
    coef, factor, beta = random_kernel(3, 8)
    beta = beta * 30  # far-off scales: every weight stays ≤ 1 and every row sum ≥ 1
    logits = (q @ k.mT) / math.sqrt(8)
    from oal.ops.quadratic import factored_kernel

    kappa = factored_kernel(q, k, factor, 1 / math.sqrt(8))
    pos = torch.tensor([0, 3, 4, 39])
    W = sink_window_weights(logits[:, :, pos], kappa[:, :, pos], pos, beta, n_sink=2, window=4)
    assert (W <= 1 + 1e-12).all() and (W.sum(-1) >= 1 - 1e-12).all()
    assert (W[:, :, 0, 1:] == 0).all() and (W[:, :, 1, 4:] == 0).all()
    assert (W[:, :, 3] > 0).all()


@pytest.mark.parametrize("n_sink,w", [(0, 500), (4, 200), (3, 60)])
def test_window_covering_everything_is_exact_softmax(n_sink, w):
    N = 60
    q, k, v = make_inputs(2, 6, 2, N, 8, 4)
    coef, factor, beta = random_kernel(6, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for mode in ("naive", "chunk", "recurrent"):
        out, _ = run(mode, q, k, v, coef, factor, beta * 50, n_sink=n_sink, window=w, chunk_size=16)
        assert rel_rms(out, expected) < 1e-12, mode


def test_sinks_covering_everything_is_exact_softmax():
    q, k, v = make_inputs(1, 3, 1, 20, 8, 4)
    coef, factor, beta = random_kernel(3, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for mode in ("naive", "chunk", "recurrent"):
        out, _ = run(mode, q, k, v, coef, factor, beta, n_sink=20, window=0)
        assert rel_rms(out, expected) < 1e-12, mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_sinks_no_window_is_the_plain_kernel(dtype):
    q, k, v = make_inputs(2, 6, 2, 77, 16, 8, dtype=dtype)
    coef, factor, beta = random_kernel(6, 16, dtype=dtype)
    for mode in ("chunk", "recurrent"):
        f = factor if mode == "chunk" else None
        plain, plain_state = quadratic_attention(
            q, k, v, *coef, mode=mode, factor=f, kernel_floor=1e-3, chunk_size=16, output_final_state=True
        )
        for b in (beta, beta + 7):
            out, state = run(mode, q, k, v, coef, factor, b, n_sink=0, window=0, output_final_state=True, chunk_size=16)
            assert torch.equal(out, plain), mode
            assert torch.equal(state.kernel, plain_state), mode
            assert state.sink_k.shape[2] == 0 and state.window_k.shape[2] == 0
    naive, _ = run("naive", q, k, v, coef, factor, beta, n_sink=0, window=0)
    assert rel_rms(naive, quadratic_attention(q, k, v, *coef, mode="naive")[0]) < (
        1e-12 if dtype == torch.float64 else 1e-6
    )


@pytest.mark.parametrize("n_sink,w", [(4, 16), (4, 64), (0, 16), (4, 0), (1, 1)])
@pytest.mark.parametrize("split", [1, 3, 17, 64, 90])
def test_prefill_then_decode_equals_full(n_sink, w, split):
    N = 100
    q, k, v = make_inputs(2, 6, 2, N, 8, 4)
    coef, factor, beta = random_kernel(6, 8)
    full, full_state = run("naive", q, k, v, coef, factor, beta, n_sink=n_sink, window=w, output_final_state=True)
    cut = lambda x, lo, hi: x[:, :, lo:hi]  # noqa: E731
    pre, state = run(
        "chunk", *(cut(x, 0, split) for x in (q, k, v)), coef, factor, beta, n_sink=n_sink, window=w,
        output_final_state=True, chunk_size=16,
    )  # fmt: skip
    outs = [pre]
    t = split
    for step in itertools.cycle([1, 1, 3, 1, 7]):  # decode steps of T = 1 and T > 1
        if t >= N:
            break
        o, state = run(
            "recurrent", *(cut(x, t, t + step) for x in (q, k, v)), coef, factor, beta, n_sink=n_sink, window=w,
            initial_state=state, output_final_state=True,
        )  # fmt: skip
        outs.append(o)
        t += step
    assert rel_rms(torch.cat(outs, 2), full) < 1e-10
    assert states_close(state, full_state, 1e-10)
    # a chunked continuation of the prefill state
    rest, _ = run(
        "chunk", *(cut(x, split, N) for x in (q, k, v)), coef, factor, beta, n_sink=n_sink, window=w,
        initial_state=run("chunk", *(cut(x, 0, split) for x in (q, k, v)), coef, factor, beta, n_sink=n_sink,
                          window=w, output_final_state=True)[1], chunk_size=7,
    )  # fmt: skip
    assert rel_rms(rest, full[:, :, split:]) < 1e-10


def test_state_memory_is_constant_in_n():
    sizes = []
    for N in (10, 300):
        q, k, v = make_inputs(1, 6, 2, N, 8, 4, dtype=torch.bfloat16)
        coef, factor, beta = random_kernel(6, 8, dtype=torch.float32)
        _, state = run("chunk", q, k, v, coef, factor, beta, n_sink=4, window=16, output_final_state=True)
        sizes.append(state.nbytes)
        assert state.kernel.dtype == torch.float32 and state.window_k.dtype == torch.bfloat16
    D = feature_dim(8)
    assert sizes[0] == sizes[1] == 2 * (D * 5 * 4 + (4 + 16) * (8 + 4) * 2)


def test_gradcheck_chunk_fp64():
    q, k, v = make_inputs(1, 3, 1, 11, 3, 2)
    groups = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 1]])
    L = torch.randn(3, 3, 3, dtype=torch.float64) * 0.5
    beta = torch.randn(3, dtype=torch.float64)
    args = [x.clone().requires_grad_() for x in (q, k, v, L, beta)]

    def f(q, k, v, L, beta):
        a, b, C = oal_coefficients(groups, L, 0.1)
        return sink_window_attention(
            q, k, v, a, b, C, beta, n_sink=2, window=3, chunk_size=4, factor=oal_factor(groups, L, 0.1),
            kernel_floor=0.1,
        )[0]  # fmt: skip

    assert torch.autograd.gradcheck(f, args)


def test_chunk_grads_match_naive_grads():
    q, k, v = make_inputs(2, 6, 2, 60, 8, 4)
    groups = torch.randint(0, 3, (6, 8))
    L0 = torch.randn(6, 4, 4, dtype=torch.float64) * 0.5
    beta0 = torch.randn(6, dtype=torch.float64)
    grads = {}
    for mode in ("naive", "chunk"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, L0, beta0)]
        a, b, C = oal_coefficients(groups, xs[3], 0.01)
        f = oal_factor(groups, xs[3], 0.01) if mode == "chunk" else None
        o, _ = sink_window_attention(*xs[:3], a, b, C, xs[4], n_sink=3, window=10, mode=mode, chunk_size=16, factor=f)
        (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum().backward()
        grads[mode] = [x.grad for x in xs]
    for g_chunk, g_naive in zip(grads["chunk"], grads["naive"], strict=True):
        assert rel_rms(g_chunk, g_naive) < 1e-9


def _large_logit_inputs(N, d, dtype):
    """A large outlier coordinate shared by all queries and keys: logits around 48 ± a few, a sink key at
    ~55 carrying a large share of the softmax mass with a small value, as measured on SmolLM2."""
    q, k, v = make_inputs(1, 3, 1, N, d, d, dtype=torch.float32)
    q[..., 0] = 16.0
    k[..., 0] = (12.0 + 0.3 * k[..., 0]) * math.sqrt(d) / 4
    k[:, :, 0, 0] = 13.75 * math.sqrt(d) / 4
    v[:, :, 0] *= 0.05
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("beta0", [-60.0, 0.0, 42.0, 80.0])
def test_bf16_long_sequence_large_logits(beta0):
    """bf16 inputs, N = 4096, logits ~50: finite, and within bf16 output rounding of the fp64 evaluation of the
    same rounded inputs, for β making the kernel part vanish (-60, 0), share the mass (42) or swamp the exact
    part by e^30 (80; unshifted, e^{β} Σκ ≈ e^{95} would overflow fp32)."""
    N, d = 4096, 16
    q, k, v = _large_logit_inputs(N, d, torch.bfloat16)
    groups = torch.randint(0, 4, (3, d))
    L = taylor_L(3, 4)
    coef, factor = oal_coefficients(groups, L, 1e-6), oal_factor(groups, L, 1e-6)
    beta = torch.full((3,), beta0)
    kw = dict(n_sink=4, window=64, kernel_floor=1e-6)
    ref, _ = sink_window_attention(
        q.double(), k.double(), v.double(), *(x.double() for x in coef), beta.double(),
        factor=KernelFactor(*(x.double() for x in factor)), **kw,
    )  # fmt: skip
    out, _ = sink_window_attention(q, k, v, *coef, beta, factor=factor, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    rounding = rel_rms(ref.bfloat16(), ref)  # ~1.7e-3: the error of rounding the exact output to bf16
    assert rel_rms(out, ref) < rounding + 1e-4
    out32, _ = sink_window_attention(q.float(), k.float(), v.float(), *coef, beta, factor=factor, **kw)
    assert rel_rms(out32, ref) < 1e-4
    tail = slice(N - 200, N)  # the recurrent path over the last tokens, from the chunked prefix state
    _, state = sink_window_attention(
        q[:, :, : tail.start], k[:, :, : tail.start], v[:, :, : tail.start], *coef, beta, factor=factor,
        output_final_state=True, **kw,
    )  # fmt: skip
    rec, _ = sink_window_attention(
        q[:, :, tail], k[:, :, tail], v[:, :, tail], *coef, beta, mode="recurrent", initial_state=state, **kw
    )
    assert (
        torch.isfinite(rec).all()
        and rel_rms(rec, ref[:, :, tail]) < rel_rms(ref[:, :, tail].bfloat16(), ref[:, :, tail]) + 1e-4
    )


def test_large_logits_all_parts_matter():
    """The regime the bf16 test is meant to cover: at β = 42 the sink, the window and the kernel part each
    carry a sizeable share of the mass for late queries (checked on the explicit weights)."""
    N, d = 512, 16
    q, k, _ = _large_logit_inputs(N, d, torch.float64)
    groups = torch.randint(0, 4, (3, d))
    factor = oal_factor(groups, taylor_L(3, 4, torch.float64), 1e-6)
    from oal.ops.quadratic import factored_kernel

    pos = torch.arange(N - 64, N)
    logits = (q[:, :, pos] @ k.mT) / math.sqrt(d)
    assert logits.amax() > 50
    W = sink_window_weights(
        logits, factored_kernel(q[:, :, pos], k, factor, d**-0.5), pos, torch.full((3,), 42.0), n_sink=4, window=64
    )
    W = W / W.sum(-1, keepdim=True)
    j = torch.arange(N)
    sink = W[..., j < 4].sum(-1).mean()
    window = (W * (j[None] > pos[:, None] - 64)).sum(-1).mean()
    kernel = 1 - sink - window
    assert min(sink, window, kernel) > 0.05, (sink, window, kernel)


class TestErrors:
    def setup_method(self):
        self.q, self.k, self.v = make_inputs(1, 4, 2, 8, 4, 3)
        self.coef, _, self.beta = random_kernel(4, 4)

    def call(self, **kw):
        args = dict(q=self.q, k=self.k, v=self.v, a=self.coef[0], b=self.coef[1], C=self.coef[2], beta=self.beta)
        args.update(kw)
        return sink_window_attention(**args)

    @pytest.mark.parametrize(
        "kw,match",
        [
            (dict(beta=torch.zeros(3, dtype=torch.float64)), r"beta: expected shape \(4,\)"),
            (dict(beta=torch.tensor([0.0, 1.0, float("inf"), 0.0], dtype=torch.float64)), "beta: contains NaN"),
            (dict(n_sink=-1), "n_sink: expected a non-negative integer"),
            (dict(window=2.5), "window: expected a non-negative integer"),
            (dict(mode="fast"), "mode: expected one of"),
            (dict(chunk_size=0), "chunk_size: expected a positive integer"),
            (dict(initial_state=torch.zeros(3)), "initial_state: expected a SinkWindowState"),
            (dict(k=torch.randn(1, 2, 9, 4, dtype=torch.float64)), r"k: expected shape"),
        ],
    )
    def test_bad_input(self, kw, match):
        with pytest.raises(ValueError, match=match):
            self.call(**kw)

    def test_state_must_match_config_and_dtype(self):
        _, state = self.call(n_sink=2, window=3, output_final_state=True)
        with pytest.raises(ValueError, match=r"initial_state.sink_k: expected shape \(1, 2, 4, 4\)"):
            self.call(n_sink=4, window=3, initial_state=state)
        with pytest.raises(ValueError, match=r"initial_state.window_k: expected shape \(1, 2, 5, 4\)"):
            self.call(n_sink=2, window=5, initial_state=state)
        with pytest.raises(ValueError, match="initial_state.sink_k: expected dtype torch.float32"):
            self.call(q=self.q.float(), k=self.k.float(), v=self.v.float(), n_sink=2, window=3, initial_state=state)
        with pytest.raises(ValueError, match="initial_state.offset"):
            self.call(n_sink=2, window=3, initial_state=state._replace(offset=-1))
        with pytest.raises(ValueError, match="initial_state: the naive reference"):
            self.call(n_sink=2, window=3, initial_state=state, mode="naive")

    def test_chunk_mode_checks_what_its_kernel_part_no_longer_rechecks(self):
        # the chunk path calls the kernel part's operator unchecked: the factor, the floor and the state's sink and
        # window buffers (keys of the kernel part once they leave the window) are checked on the way in
        from oal.ops.quadratic import KernelFactor

        _, state = self.call(n_sink=2, window=3, output_final_state=True)
        bad = state.window_k.clone()
        bad[0, 1, 2, 0] = float("nan")
        with pytest.raises(ValueError, match="initial_state.window_k: contains NaN"):
            self.call(n_sink=2, window=3, initial_state=state._replace(window_k=bad))
        with pytest.raises(ValueError, match="initial_state.sink_v: contains NaN"):
            self.call(n_sink=2, window=3, initial_state=state._replace(sink_v=state.sink_v * float("inf")))
        with pytest.raises(ValueError, match="kernel_floor: expected a positive finite number"):
            self.call(kernel_floor=0.0)
        factor = KernelFactor(torch.ones(4), torch.ones(4, 2), torch.ones(3, 2, 4))
        with pytest.raises(ValueError, match=r"factor.W: expected shape \(4, 2, 4\)"):
            self.call(factor=factor)


def _fp32(x):
    return x.float() if isinstance(x, torch.Tensor) else KernelFactor(*(t.float() for t in x))


@pytest.mark.parametrize(
    "N,w,n_sink,group,split",
    [(1, 16, 4, 3, 0), (63, 16, 4, 3, 0), (1000, 64, 4, 3, 0), (200, 0, 4, 1, 0), (200, 64, 0, 1, 0),
     (63, 16, 4, 3, 9), (200, 64, 4, 3, 130), (5, 64, 1, 3, 2)],
)  # fmt: skip
def test_fused_exact_part_equals_torch_loop(N, w, n_sink, group, split, monkeypatch):
    """The fused CPU exact part (window.cpp) against the torch block loop, fp32, with and without a state to
    continue (split: tokens prefilled first), and against the fp64 naive reference."""
    from oal.ops.quadratic import cpu as cpu_kernel

    ext = cpu_kernel.load("window")
    if ext is None:
        pytest.skip("the fused CPU window kernel did not build (no C++ compiler?)")
    calls = []
    fused_call = ext.window_combine
    monkeypatch.setattr(ext, "window_combine", lambda *a: calls.append(1) or fused_call(*a))
    Hkv, d, dv = 2, 8, 4
    q, k, v = make_inputs(2, Hkv * group, Hkv, N + split, d, dv)
    coef, factor, beta = random_kernel(Hkv * group, d)
    want, _ = run("naive", q, k, v, coef, factor, beta, n_sink=n_sink, window=w)
    q32, k32, v32 = (x.float() for x in (q, k, v))
    coef32, factor32, beta32 = tuple(_fp32(c) for c in coef), _fp32(factor), beta.float()

    def chunked():
        state = None
        outs = []
        if split:
            o, state = run("chunk", q32[:, :, :split], k32[:, :, :split], v32[:, :, :split], coef32, factor32, beta32,
                           n_sink=n_sink, window=w, output_final_state=True, chunk_size=16)  # fmt: skip
            outs.append(o)
        o, _ = run("chunk", q32[:, :, split:], k32[:, :, split:], v32[:, :, split:], coef32, factor32, beta32,
                   n_sink=n_sink, window=w, initial_state=state, chunk_size=16)  # fmt: skip
        return torch.cat([*outs, o], dim=2)

    # the no-grad fp32 calls reach the fused kernel, but for a fresh segment of at most n_sink + w tokens (causal
    # softmax, no exact part to combine)
    blockwise = int(bool(split) and not all_exact(split, n_sink, w, None)) + int(
        bool(split) or not all_exact(N, n_sink, w, None)
    )
    with torch.no_grad():
        fused = chunked()
        assert len(calls) == blockwise
        with cpu_kernel.disabled():
            loop = chunked()
    assert len(calls) == blockwise
    torch.testing.assert_close(fused, loop, atol=2e-5, rtol=1e-4)
    assert rel_rms(fused, want) < 1e-4


@pytest.fixture
def softmax_calls(monkeypatch):
    """Records each segment the chunk mode evaluates as causal softmax (the all-exact path)."""
    import oal.ops.sink_window.utils as utils

    calls = []
    real = utils.causal_softmax
    monkeypatch.setattr(utils, "causal_softmax", lambda q, *a: calls.append(q.shape[2]) or real(q, *a))
    return calls


@pytest.mark.parametrize(
    "N,n_sink,w,group", [(1, 4, 16, 3), (20, 4, 16, 1), (20, 4, 16, 3), (16, 0, 16, 3), (7, 7, 0, 1)]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_fresh_segment_within_the_sinks_and_window_is_causal_softmax(N, n_sink, w, group, dtype, softmax_calls):
    """A fresh segment of at most n_sink + w tokens has no kernel key: the chunk mode takes causal softmax, with the
    outputs and the state of the blockwise evaluation (which runs when β records a gradient) and of the naive
    reference, and decoding continues from its state as from the blockwise one."""
    Hkv, cdt = 2, torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = make_inputs(2, Hkv * group, Hkv, N + 3, 8, 5, dtype)
    coef, factor, beta = random_kernel(Hkv * group, 8, dtype=cdt)
    kw = {"n_sink": n_sink, "window": w, "output_final_state": True, "chunk_size": 16}
    prompt = [x[:, :, :N] for x in (q, k, v)]
    fast, fast_state = run("chunk", *prompt, coef, factor, beta, **kw)
    assert softmax_calls == [N]
    with torch.enable_grad():
        slow, slow_state = run("chunk", *prompt, coef, factor, beta.clone().requires_grad_(), **kw)
    assert softmax_calls == [N]
    want, _ = run("naive", *(x.double() for x in prompt), tuple(c.double() for c in coef), None, beta.double(), **kw)
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]
    assert fast.dtype == dtype
    torch.testing.assert_close(fast, slow.detach(), rtol=0, atol=tol)
    torch.testing.assert_close(fast.double(), want, rtol=0, atol=tol)
    assert fast_state.offset == slow_state.offset == N
    for x, y in zip(fast_state[:5], slow_state[:5], strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    rest = [x[:, :, N:] for x in (q, k, v)]
    after_fast, _ = run("recurrent", *rest, coef, factor, beta, n_sink=n_sink, window=w, initial_state=fast_state)
    after_slow, _ = run("recurrent", *rest, coef, factor, beta, n_sink=n_sink, window=w, initial_state=slow_state)
    torch.testing.assert_close(after_fast, after_slow, rtol=0, atol=tol)


def test_causal_softmax_only_where_no_query_has_a_kernel_key(softmax_calls):
    """n_sink + w + 1 tokens (the last query has key n_sink in its kernel set), a segment after a state, the
    recurrent mode and the naive reference all evaluate blockwise."""
    q, k, v = make_inputs(1, 3, 1, 21, 8, 5)
    coef, factor, beta = random_kernel(3, 8)
    run("chunk", q, k, v, coef, factor, beta, n_sink=4, window=17)
    assert softmax_calls == [21]
    run("chunk", q, k, v, coef, factor, beta, n_sink=4, window=16)
    _, state = run("chunk", q[:, :, :2], k[:, :, :2], v[:, :, :2], coef, factor, beta, n_sink=4, window=16,
                   output_final_state=True)  # fmt: skip
    run("chunk", q[:, :, 2:4], k[:, :, 2:4], v[:, :, 2:4], coef, factor, beta, n_sink=4, window=16, initial_state=state)
    run("recurrent", q[:, :, :5], k[:, :, :5], v[:, :, :5], coef, factor, beta, n_sink=4, window=16)
    run("naive", q[:, :, :5], k[:, :, :5], v[:, :, :5], coef, factor, beta, n_sink=4, window=16)
    assert softmax_calls == [21, 2]


@pytest.mark.parametrize("group", [1, 3])
def test_causal_softmax_segment_gradients(group, softmax_calls):
    """Under autograd in q, k, v (β without a gradient) the all-exact path runs and gives the blockwise gradients."""
    q, k, v = make_inputs(2, 2 * group, 2, 12, 8, 5)
    coef, factor, beta = random_kernel(2 * group, 8)
    w = torch.randn(2, 2 * group, 12, 5, dtype=torch.float64)

    def grads(b):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        o, _ = run("chunk", *x, coef, factor, b, n_sink=2, window=10)
        return torch.autograd.grad((o * w).sum(), x)

    fast = grads(beta)
    assert softmax_calls == [12]
    slow = grads(beta.clone().requires_grad_())
    assert softmax_calls == [12]
    for f, s in zip(fast, slow, strict=True):
        torch.testing.assert_close(f, s, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "N,w,n_sink,group,split",
    [(1, 16, 4, 3, 0), (63, 16, 4, 3, 0), (1000, 64, 4, 3, 0), (200, 0, 4, 1, 0), (200, 64, 0, 1, 0),
     (63, 16, 4, 3, 9), (200, 64, 4, 3, 130)],
)  # fmt: skip
def test_fused_gradients_equal_torch_loop(N, w, n_sink, group, split, monkeypatch):
    """Training on CPU fp32: the exact part's backward (window.cpp) and the kernel part's (chunk.cpp) against
    autograd through the fp64 torch loops, for q, k, v, the kernel's L and β, with and without a prefilled state."""
    from oal.ops.quadratic import cpu as cpu_kernel

    ext = cpu_kernel.load("window")
    if ext is None or cpu_kernel.load() is None:
        pytest.skip("the fused CPU kernels did not build (no C++ compiler?)")
    calls = []
    fused_call = ext.window_backward
    monkeypatch.setattr(ext, "window_backward", lambda *a: calls.append(1) or fused_call(*a))
    Hkv, d, dv, G = 2, 8, 4, 3
    q, k, v = make_inputs(2, Hkv * group, Hkv, N + split, d, dv)
    groups = torch.randint(0, G, (Hkv * group, d))
    L0 = torch.randn(Hkv * group, G + 1, G + 1, dtype=torch.float64) * 0.5
    beta0 = torch.randn(Hkv * group, dtype=torch.float64)
    weights = torch.linspace(-1, 1, (N + split) * Hkv * group * dv * 2, dtype=torch.float64)

    def grads(dtype, mode="chunk"):
        xs = [x.clone().to(dtype).requires_grad_() for x in (q, k, v, L0, beta0)]
        coef, factor = oal_coefficients(groups, xs[3], 1e-3), oal_factor(groups, xs[3], 1e-3)
        state, outs = None, []
        if split:
            o, state = run(mode, *(x[:, :, :split] for x in xs[:3]), coef, factor, xs[4], n_sink=n_sink,
                           window=w, output_final_state=True, chunk_size=16)  # fmt: skip
            outs.append(o)
        o, _ = run(mode, *(x[:, :, split:] for x in xs[:3]), coef, factor, xs[4], n_sink=n_sink, window=w,
                   initial_state=state, chunk_size=16)  # fmt: skip
        o = torch.cat([*outs, o], dim=2)
        (o * weights.to(dtype).view_as(o)).sum().backward()
        return [x.grad for x in xs]

    fused = grads(torch.float32)
    assert len(calls) == 1 + bool(split)  # the fp32 call with gradients reaches the fused backward
    with cpu_kernel.disabled():
        ref = grads(torch.float64)
    assert len(calls) == 1 + bool(split)
    refs = [ref]
    if not split and N <= 200:  # and autograd on the explicit fp64 reference (no state to continue there)
        refs.append(grads(torch.float64, mode="naive"))
    for g, r in ((g, r) for ref in refs for g, r in zip(fused, ref, strict=True)):
        if r is None or g is None:  # no kernel key at all (N = 1): no gradient for L (None, or zeros in naive)
            assert g is None and (r is None or not r.any())
            continue
        assert torch.isfinite(g).all()
        # a lone exact key (N = 1, no kernel key) gives q and k a zero gradient: compare absolutely there
        assert rel_rms(g, r) < 1e-4 or (r.abs().max() < 1e-12 and g.abs().max() < 1e-5)
