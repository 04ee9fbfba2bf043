"""FLOP counts against hand counts and against the matrix products the operators actually dispatch."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from oal.bench.flops import AttnShape, chunk_sizes, quadratic_chunk_flops, sdpa_causal_flops
from oal.bench.methods import get_method, random_factor, random_groups
from oal.kernels import oal_coefficients, oal_factor
from oal.ops.quadratic import cpu as cpu_kernel
from oal.ops.quadratic import quadratic_attention


class MatmulFlops(TorchDispatchMode):
    """Counts 2·m·n·k per batch for every (b)mm / baddbmm, in-place and out= variants included
    (FlopCounterMode skips ``baddbmm_``, which the chunked operator uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "bmm", "baddbmm", "baddbmm_", "addmm", "addmm_"):
            a, b = (args[1], args[2]) if name.startswith("add") or name.startswith("badd") else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return func(*args, **(kwargs or {}))


def test_chunk_sizes():
    assert chunk_sizes(5, 2) == [2, 2, 1]
    assert chunk_sizes(3, 64) == [3]
    assert chunk_sizes(128, 64) == [64, 64]
    with pytest.raises(ValueError, match="chunk"):
        chunk_sizes(4, 0)


def test_quadratic_flops_hand_count():
    # B=1, Hq=2, Hkv=1 (g=2), N=5 in chunks 2,2,1 (Σn=5, Σn²=9), d=2 (D=6), dv=1 (dv+1=2), R=2:
    # readout 2·2·5·6·2=240, scores 2·2·2·9·3=216, values 2·2·9·2=72, state 2·1·5·6·2=120
    shape = AttnShape(1, 2, 1, 5, 2, 1)
    assert quadratic_chunk_flops(shape, rank=2, chunk=2) == 648
    assert quadratic_chunk_flops(AttnShape(2, 2, 1, 5, 2, 1), rank=2, chunk=2) == 2 * 648


def test_quadratic_flops_paper_shape_per_token():
    # Hq=9, Hkv=3, d=dv=64, G=5 (R=6), chunk 64: per token 2·65·12·2145 + 2·9·64·(6·65 + 65)
    shape = AttnShape(1, 9, 3, 4096, 64, 64)
    per_token = 2 * 65 * 12 * 2145 + 2 * 9 * 64 * (6 * 65 + 65)
    assert quadratic_chunk_flops(shape, rank=6, chunk=64) == 4096 * per_token


def test_sdpa_flops_hand_count():
    # N²/2 pairs · 2·(d+dv) FLOPs · Hq: 16/2 · 2·8 · 2 = 256
    assert sdpa_causal_flops(AttnShape(1, 2, 1, 4, 3, 5)) == 256


@pytest.mark.parametrize(("hq", "hkv"), [(6, 2), (2, 2)])
@pytest.mark.parametrize("groups", [3, 1])
def test_quadratic_flops_match_dispatched_products(hq, hkv, groups):
    n, d, dv = 70, 8, 5  # chunks of 64 and 6; odd dv
    gen = torch.Generator().manual_seed(1)
    L = random_factor(hq, groups, gen)
    g = random_groups(hq, d, groups, gen)
    a, b, C = oal_coefficients(g, L, 1e-6)
    factor = oal_factor(g, L, 1e-6)
    q, k, v = torch.randn(1, hq, n, d), torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, dv)
    # the torch chunk loop: the fused CPU kernel runs the same products in its own tile kernel, which no
    # dispatch mode sees
    with cpu_kernel.disabled(), torch.no_grad(), MatmulFlops() as counter:
        quadratic_attention(q, k, v, a, b, C, factor=factor, kernel_floor=1e-6, chunk_size=64)
    assert counter.flops == quadratic_chunk_flops(AttnShape(1, hq, hkv, n, d, dv), rank=groups + 1, chunk=64)


def test_sdpa_flops_are_half_the_math_backend_products():
    shape = AttnShape(1, 6, 2, 40, 8, 8)
    fn = get_method("sdpa_math").build(shape, torch.device("cpu"), 0)
    q, k, v = torch.randn(1, 6, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn(q, k, v)
    assert counter.get_total_flops() == 2 * sdpa_causal_flops(shape)


def test_oal_method_flops_use_rank_g_plus_one():
    shape = AttnShape(1, 9, 3, 1000, 64, 64)
    assert get_method("oal").flops(shape) == quadratic_chunk_flops(shape, rank=6)
    assert get_method("global").flops(shape) == quadratic_chunk_flops(shape, rank=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"n": 0}, "n:"), ({"heads_q": 4, "heads_kv": 3}, "heads_q"), ({"head_dim": 2.0}, "head_dim")],
)
def test_shape_validation(kwargs, match):
    base = {"batch": 1, "heads_q": 9, "heads_kv": 3, "n": 8, "head_dim": 4, "value_dim": 4}
    with pytest.raises(ValueError, match=match):
        AttnShape(**{**base, **kwargs})
