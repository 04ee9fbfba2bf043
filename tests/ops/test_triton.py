"""Triton kernels of the quadratic-kernel operator against the torch references.

With a CUDA device (and TRITON_INTERPRET unset) the kernels run compiled on the GPU. Otherwise this module sets
``TRITON_INTERPRET=1`` before anything imports the kernels and runs them in Triton's CPU interpreter, which is
slow: shapes here are tiny (d ≤ 16, N ≤ 100). References are the naive O(N²) operator in fp64 on CPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not ON_GPU:
    if "oal.ops.quadratic.triton.kernels" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

from oal.kernels.oal import oal_coefficients, oal_factor  # noqa: E402
from oal.ops.quadratic import (  # noqa: E402
    KernelFactor,
    chunk_quadratic_attention,
    feature_dim,
    naive_quadratic_attention,
    quadratic_attention,
    recurrent_quadratic_attention,
)
from oal.ops.quadratic.triton import (  # noqa: E402
    chunk_quadratic_attention_triton,
    recurrent_quadratic_attention_triton,
    unsupported_reason,
)
from oal.ops.quadratic.triton.utils import block_table  # noqa: E402
from oal.ops.quadratic.utils import triu_indices  # noqa: E402

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


class Problem:
    """Random q, k, v (fp64, CPU), an OAL kernel with G groups (a, b, C and its factor) and a prefix state."""

    def __init__(self, B, Hq, Hkv, N, d, dv, G=3, eps=1e-2, prefix=0, seed=0):
        gen = torch.Generator().manual_seed(seed)
        dt = torch.float64
        self.q = torch.randn(B, Hq, N + prefix, d, generator=gen, dtype=dt)
        self.k = torch.randn(B, Hkv, N + prefix, d, generator=gen, dtype=dt)
        self.v = torch.randn(B, Hkv, N + prefix, dv, generator=gen, dtype=dt)
        self.groups = torch.randint(0, G, (Hq, d), generator=gen)
        self.L = torch.randn(Hq, G + 1, G + 1, generator=gen, dtype=dt) * 0.5
        self.eps = eps
        self.init = None
        if prefix:
            a, b, C = self.coefficients()
            _, self.init = naive_quadratic_attention(
                *(x[:, :, :prefix] for x in (self.q, self.k, self.v)), a, b, C, output_final_state=True
            )
            self.q, self.k, self.v = (x[:, :, prefix:].contiguous() for x in (self.q, self.k, self.v))

    def coefficients(self, L=None):
        return oal_coefficients(self.groups, self.L if L is None else L, self.eps)

    def factor(self, L=None):
        return oal_factor(self.groups, self.L if L is None else L, self.eps)

    def inputs(self, dtype, device=DEVICE):
        return tuple(x.to(device=device, dtype=dtype, copy=True) for x in (self.q, self.k, self.v))

    def reference(self, **kw):
        a, b, C = self.coefficients()
        return naive_quadratic_attention(self.q, self.k, self.v, a, b, C, initial_state=self.init, **kw)


def _on(x, device=DEVICE):
    return None if x is None else x.to(device)


def _f32(xs):
    return tuple(x.to(device=DEVICE, dtype=torch.float32) for x in xs)


def _rel(x, ref):
    return ((x.detach().double().cpu() - ref.detach().double().cpu()).abs().max() / ref.abs().max()).item()


# (B, Hq, Hkv, N, d, chunk, factor, prefix, floor, budget): N ∈ {1, 17, 64, 100}, chunks that do and do not
# divide N, GQA ratios 1 and 3, both intra-chunk paths, several windows (budget 1 byte: one chunk per window)
FORWARD_CASES = [
    pytest.param(2, 6, 2, 1, 16, 16, True, 0, None, None, id="N1-gqa3-factor"),
    pytest.param(2, 2, 2, 17, 16, 16, False, 5, None, None, id="N17-gqa1-general-init"),
    pytest.param(2, 3, 1, 64, 16, 32, True, 4, 1e-2, 1, id="N64-gqa3-factor-init-floor-windows"),
    pytest.param(2, 1, 1, 100, 8, 32, False, 0, 1e-2, None, id="N100-gqa1-general-floor"),
]


@pytest.mark.parametrize(
    ("B", "Hq", "Hkv", "N", "d", "chunk", "use_factor", "prefix", "floor", "budget"), FORWARD_CASES
)
def test_forward_matches_naive_fp32(B, Hq, Hkv, N, d, chunk, use_factor, prefix, floor, budget):
    p = Problem(B, Hq, Hkv, N, d, 16, prefix=prefix)
    ref, ref_state = p.reference(output_final_state=True)
    extra = {} if budget is None else {"snapshot_budget": budget}
    o, state = chunk_quadratic_attention_triton(
        *p.inputs(torch.float32),
        *_f32(p.coefficients()),
        chunk_size=chunk,
        factor=KernelFactor(*_f32(p.factor())) if use_factor else None,
        initial_state=None if p.init is None else _on(p.init.float()),
        output_final_state=True,
        kernel_floor=floor,
        **extra,
    )
    assert o.dtype == torch.float32 and o.shape == ref.shape
    assert state.dtype == torch.float32 and state.shape == ref_state.shape
    assert _rel(o, ref) < 1e-4
    assert _rel(state, ref_state) < 1e-5


def test_forward_odd_dims_fp64():
    """d = 7, dv = 5: padded feature and value tiles; fp64 runs only in the interpreter."""
    if ON_GPU:
        pytest.skip("float64 kernels are an interpreter test path")
    p = Problem(2, 3, 1, 30, 7, 5, prefix=3)
    ref, ref_state = p.reference(output_final_state=True)
    o, state = chunk_quadratic_attention_triton(
        *p.inputs(torch.float64), *p.coefficients(), chunk_size=16, initial_state=p.init, output_final_state=True
    )
    assert o.dtype == torch.float64
    assert _rel(o, ref) < 1e-12
    assert _rel(state, ref_state) < 1e-12


def test_forward_bf16_within_tolerance():
    """bf16 inputs: features and snapshots are rounded to bf16 for the tensor-core products (fp32 accumulation,
    fp32 denominators). Stated tolerance: max |o − o_ref| ≤ 0.05 with |o| ≲ 3, and at most 3× the error of the
    torch chunked path on the same bf16 inputs plus 0.01; final state within 1% of its largest entry."""
    p = Problem(2, 3, 1, 40, 16, 16, prefix=6)
    ref, ref_state = p.reference(output_final_state=True)
    a, b, C = _f32(p.coefficients())
    factor = KernelFactor(*_f32(p.factor()))
    q, k, v = p.inputs(torch.bfloat16)
    init = _on(p.init.float())
    o, state = chunk_quadratic_attention_triton(
        q, k, v, a, b, C, chunk_size=16, factor=factor, initial_state=init, output_final_state=True
    )
    o_torch, _ = chunk_quadratic_attention(q, k, v, a, b, C, chunk_size=16, factor=factor, initial_state=init)
    assert o.dtype == torch.bfloat16
    err = (o.double().cpu() - ref).abs().max().item()
    err_torch = (o_torch.double().cpu() - ref).abs().max().item()
    assert err < 0.05
    assert err < 3 * err_torch + 0.01
    assert _rel(state, ref_state) < 1e-2


def test_floor_clamp_matches_torch_chunk():
    """A floor above the kernel's minimum clamps some denominators; forward and gradients then follow the torch
    chunked path, which clamps the same way (the naive reference does not clamp)."""
    p = Problem(1, 3, 1, 20, 8, 8, eps=1e-3, prefix=2)
    dt = torch.float64 if not ON_GPU else torch.float32
    floor = 0.3
    results = []
    for impl in (chunk_quadratic_attention_triton, chunk_quadratic_attention):
        q, k, v = (x.requires_grad_(True) for x in p.inputs(dt))
        L = p.L.to(device=DEVICE, dtype=dt, copy=True).requires_grad_(True)
        a, b, C = oal_coefficients(_on(p.groups), L, p.eps)
        o, _ = impl(
            q,
            k,
            v,
            a,
            b,
            C,
            chunk_size=16,
            factor=oal_factor(_on(p.groups), L, p.eps),
            initial_state=_on(p.init.to(dt)),
            kernel_floor=floor,
        )
        w = torch.linspace(-1, 1, o.numel(), dtype=dt, device=o.device).view_as(o)
        (o * w).sum().backward()
        results.append((o.detach(), q.grad, k.grad, v.grad, L.grad))
    tol = 1e-10 if dt == torch.float64 else 2e-4
    for x, y in zip(*results, strict=True):
        assert _rel(x, y) < tol


@pytest.mark.parametrize(
    ("Hq", "Hkv", "N", "d", "use_factor"),
    [
        pytest.param(3, 1, 21, 8, True, id="gqa3-factor"),
        pytest.param(2, 2, 24, 8, False, id="gqa1-general"),
    ],
)
def test_backward_matches_naive_autograd(Hq, Hkv, N, d, use_factor):
    """Gradients of a weighted sum of o and of the final state, through q, k, v, the initial state and the kernel
    (L for the factor path, a/b/C directly for the general path), against autograd of the naive operator."""
    p = Problem(2, Hq, Hkv, N, d, 8, prefix=3, seed=1)
    dt = torch.float64 if not ON_GPU else torch.float32
    grads = []
    for backend in ("naive", "triton"):
        dev = torch.device("cpu") if backend == "naive" else DEVICE
        use_dt = torch.float64 if backend == "naive" else dt
        q, k, v = (x.requires_grad_(True) for x in p.inputs(use_dt, dev))
        init = p.init.to(device=dev, dtype=use_dt, copy=True).requires_grad_(True)
        if use_factor:
            L = p.L.to(device=dev, dtype=use_dt, copy=True).requires_grad_(True)
            a, b, C = oal_coefficients(p.groups.to(dev), L, p.eps)
            leaves = (q, k, v, init, L)
            factor = oal_factor(p.groups.to(dev), L, p.eps)
        else:
            a, b, C = (x.to(device=dev, dtype=use_dt, copy=True).requires_grad_(True) for x in p.coefficients())
            leaves = (q, k, v, init, a, b, C)
            factor = None
        if backend == "naive":
            o, st = naive_quadratic_attention(q, k, v, a, b, C, initial_state=init, output_final_state=True)
        else:
            o, st = chunk_quadratic_attention_triton(
                q,
                k,
                v,
                a,
                b,
                C,
                chunk_size=16,
                factor=factor,
                initial_state=init,
                output_final_state=True,
                snapshot_budget=1,
            )
        wo = torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view_as(o).to(o)
        ws = torch.cos(torch.arange(st.numel(), dtype=torch.float64)).view_as(st).to(st) * 1e-2
        ((o * wo).sum() + (st * ws).sum()).backward()
        grads.append([x.grad for x in leaves])
    tol = 1e-10 if dt == torch.float64 else 1e-3
    for g_tri, g_ref in zip(grads[1], grads[0], strict=True):
        assert g_tri is not None
        assert _rel(g_tri, g_ref) < tol


def test_recurrent_step_matches_torch():
    """T = 2 decode steps from a prefix state, GQA 3, floor: outputs and state; in place and out of place."""
    p = Problem(2, 3, 1, 2, 8, 8, prefix=9)
    a, b, C = _f32(p.coefficients())
    q, k, v = p.inputs(torch.float32)
    init = _on(p.init.float())
    o_ref, s_ref = recurrent_quadratic_attention(
        q.cpu(),
        k.cpu(),
        v.cpu(),
        a.cpu(),
        b.cpu(),
        C.cpu(),
        initial_state=init.cpu(),
        output_final_state=True,
        kernel_floor=1e-2,
    )
    o, s = recurrent_quadratic_attention_triton(
        q, k, v, a, b, C, initial_state=init, output_final_state=True, kernel_floor=1e-2
    )
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-6
    assert _rel(init, p.init) < 1e-6  # out of place: the input state is untouched
    state = init.clone()
    o1, s1 = recurrent_quadratic_attention_triton(
        q, k, v, a, b, C, initial_state=state, inplace=True, kernel_floor=1e-2
    )
    assert s1 is state
    assert _rel(o1, o_ref) < 1e-5 and _rel(state, s_ref) < 1e-6


def test_prefill_then_decode_equals_full():
    """Triton chunked prefill (output_final_state) continued by Triton decode steps reproduces the full sequence."""
    p = Problem(2, 3, 1, 22, 8, 8)
    ref, ref_state = p.reference(output_final_state=True)
    a, b, C = _f32(p.coefficients())
    factor = KernelFactor(*_f32(p.factor()))
    q, k, v = p.inputs(torch.float32)
    P = 20
    o_pre, state = chunk_quadratic_attention_triton(
        q[:, :, :P], k[:, :, :P], v[:, :, :P], a, b, C, chunk_size=16, factor=factor, output_final_state=True
    )
    outs = [o_pre]
    for t in range(P, 22):
        o_t, state = recurrent_quadratic_attention_triton(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], a, b, C, initial_state=state, inplace=True
        )
        outs.append(o_t)
    assert _rel(torch.cat(outs, dim=2), ref) < 1e-4
    assert _rel(state, ref_state) < 1e-5


def test_dispatch_backend_argument():
    p = Problem(1, 2, 1, 5, 8, 8)
    a, b, C = _f32(p.coefficients())
    q, k, v = p.inputs(torch.float32)
    o_tri, _ = quadratic_attention(q, k, v, a, b, C, chunk_size=16, backend="triton")
    o_torch, _ = quadratic_attention(q, k, v, a, b, C, chunk_size=16, backend="torch")
    assert _rel(o_tri, o_torch) < 1e-5
    with pytest.raises(ValueError, match="backend"):
        quadratic_attention(q, k, v, a, b, C, backend="cuda")
    with pytest.raises(ValueError, match="naive"):
        quadratic_attention(q, k, v, a, b, C, mode="naive", backend="triton")
    with pytest.raises(ValueError, match="chunk_size"):
        quadratic_attention(q, k, v, a, b, C, chunk_size=48, backend="triton")
    with pytest.raises(ValueError, match="key_weight"):
        quadratic_attention(q, k, v, a, b, C, return_denominator=True, backend="triton")
    with pytest.raises(ValueError, match="not differentiable"):
        quadratic_attention(q.requires_grad_(True), k, v, a, b, C, mode="recurrent", backend="triton")
    if not ON_GPU:  # auto keeps CPU tensors on torch even under the interpreter
        o_auto, _ = quadratic_attention(q.detach(), k, v, a, b, C, chunk_size=48)
        assert _rel(o_auto, o_torch) < 1e-5


def test_unsupported_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, v = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    assert "CUDA" in unsupported_reason(q, v, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert unsupported_reason(q, v, 64) is None
    assert "chunk_size" in unsupported_reason(q, v, 24)
    assert "exceeds" in unsupported_reason(torch.zeros(1, 1, 4, 200), v, 64)


@pytest.mark.parametrize("d", [1, 2, 7, 8, 16, 64])
def test_block_table_covers_canonical_rows(d):
    """Every canonical state row is produced by exactly one block row, with the right pair of factors."""
    col1, col2, row = block_table(d, torch.device("cpu")).long()
    valid = row >= 0
    rows = row[valid]
    assert rows.numel() == feature_dim(d) and torch.equal(rows.sort().values, torch.arange(feature_dim(d)))
    lo, hi = triu_indices(d, torch.device("cpu"))
    expect = {0: (d, d), **{1 + r: (r, d) for r in range(d)}}
    expect.update({1 + d + n: (int(lo[n]), int(hi[n])) for n in range(lo.numel())})
    for c1, c2, r in zip(col1[valid].tolist(), col2[valid].tolist(), rows.tolist(), strict=True):
        assert (min(c1, c2), max(c1, c2)) == expect[r]


def test_block_table_is_one_read_only_copy_per_device():
    tab = block_table(16, DEVICE)
    assert tab is block_table(16, DEVICE) and tab.device.type == DEVICE.type and tab.dtype == torch.int32
    assert block_table(8, DEVICE) is not tab


def test_fp32_dot_precision_names_the_variable(monkeypatch):
    from oal.ops.quadratic.triton.utils import fp32_dot_precision

    monkeypatch.delenv("OAL_TRITON_FP32_DOT", raising=False)
    assert fp32_dot_precision() == "ieee"
    monkeypatch.setenv("OAL_TRITON_FP32_DOT", "split")
    assert fp32_dot_precision() == "split"
    monkeypatch.setenv("OAL_TRITON_FP32_DOT", "tf32")
    with pytest.raises(ValueError, match=r"OAL_TRITON_FP32_DOT: expected one of .*'tf32x3'.*got 'tf32'"):
        fp32_dot_precision()


_SPLIT_CHECK = """
import torch
from oal.kernels.oal import oal_coefficients, oal_factor
from oal.ops.quadratic import naive_quadratic_attention
from oal.ops.quadratic.triton import chunk_quadratic_attention_triton
from oal.ops.quadratic.triton.kernels import FP32_DOT
assert FP32_DOT == "split", FP32_DOT
dev = "cuda" if torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1" else "cpu"
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, h, 37, 16, generator=gen, dtype=torch.float64) for h in (6, 2, 2))
groups = torch.randint(0, 3, (6, 16), generator=gen)
L = torch.randn(6, 4, 4, generator=gen, dtype=torch.float64) * 0.5
a, b, C = oal_coefficients(groups, L, 1e-2)
ref = naive_quadratic_attention(q, k, v, a, b, C)[0]
leaves = [x.float().to(dev).requires_grad_(True) for x in (q, k, v)]
o, _ = chunk_quadratic_attention_triton(*leaves, *(x.float().to(dev) for x in (a, b, C)), chunk_size=16)
o.sum().backward()
ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
naive_quadratic_attention(*ref_leaves, a, b, C)[0].sum().backward()
errs = [((o.double().cpu() - ref).abs().max() / ref.abs().max()).item()]
errs += [((x.grad.double().cpu() - r.grad).abs().max() / r.grad.abs().max()).item() for x, r in zip(leaves, ref_leaves)]
print("ERRS", errs)
assert max(errs) < 1e-5, errs
"""


def test_split_fp32_products_match_naive_forward_and_backward():
    """OAL_TRITON_FP32_DOT=split (three tf32 products from a truncated high part and its remainder) gives fp32
    accuracy; in a fresh process, since the kernels read the choice when they load."""
    import subprocess

    env = dict(os.environ, OAL_TRITON_FP32_DOT="split")
    if not ON_GPU:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", _SPLIT_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ERRS" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- GPU-only shapes


def _paper_problem(N, Hq=6, Hkv=2, d=64, G=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, N, d, generator=gen) for h in (Hq, Hkv, Hkv))
    groups = torch.randint(0, G, (Hq, d), generator=gen)
    L = torch.randn(Hq, G + 1, G + 1, generator=gen) * 0.3
    return q, k, v, groups, L


@gpu
@needs_gpu
@pytest.mark.parametrize("chunk", [64, 128])
def test_gpu_d64_bf16_forward_matches_torch_chunk(chunk):
    q, k, v, groups, L = (x.cuda() for x in _paper_problem(1000))
    a, b, C = oal_coefficients(groups, L, 1e-3)
    fac = oal_factor(groups, L, 1e-3)
    ref, ref_state = chunk_quadratic_attention(q, k, v, a, b, C, factor=fac, output_final_state=True)
    o, state = chunk_quadratic_attention_triton(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), a, b, C, chunk_size=chunk, factor=fac, output_final_state=True
    )
    o32, state32 = chunk_quadratic_attention_triton(
        q, k, v, a, b, C, chunk_size=chunk, factor=fac, output_final_state=True
    )
    assert _rel(o32, ref) < 1e-4 and _rel(state32, ref_state) < 1e-5
    assert (o.float() - ref).abs().max().item() < 0.05
    assert _rel(state, ref_state) < 1e-2


@gpu
@needs_gpu
def test_gpu_d64_backward_matches_torch_chunk():
    q, k, v, groups, L = (x.cuda() for x in _paper_problem(300, Hq=6, Hkv=2))
    grads = []
    for impl in (chunk_quadratic_attention, chunk_quadratic_attention_triton):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, L)]
        a, b, C = oal_coefficients(groups, leaves[3], 1e-3)
        o, _ = impl(*leaves[:3], a, b, C, factor=oal_factor(groups, leaves[3], 1e-3), kernel_floor=1e-3)
        (o * torch.linspace(-1, 1, o.numel(), device="cuda").view_as(o)).sum().backward()
        grads.append([x.grad for x in leaves])
    for g_tri, g_ref in zip(grads[1], grads[0], strict=True):
        assert _rel(g_tri, g_ref) < 1e-3


@gpu
@needs_gpu
def test_gpu_d64_decode_matches_torch():
    q, k, v, groups, L = (x.cuda() for x in _paper_problem(257))
    a, b, C = oal_coefficients(groups, L, 1e-3)
    _, state = chunk_quadratic_attention(q[:, :, :256], k[:, :, :256], v[:, :, :256], a, b, C, output_final_state=True)
    tail = (q[:, :, 256:], k[:, :, 256:], v[:, :, 256:])
    o_ref, s_ref = recurrent_quadratic_attention(
        *tail, a, b, C, initial_state=state, output_final_state=True, kernel_floor=1e-3
    )
    o, s = recurrent_quadratic_attention_triton(
        *tail, a, b, C, initial_state=state, output_final_state=True, kernel_floor=1e-3
    )
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-6
