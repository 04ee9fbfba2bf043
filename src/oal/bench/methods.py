"""The registry of benchmarked attention methods: name -> factory of a callable ``o = fn(q, k, v)``.

A :class:`Method` builds its callable from the problem shape, the device and a seed, so that everything that
is not the timed work (parameters, group maps, backend choice) happens once, before timing. Any
:class:`oal.kernels.AttentionKernel` becomes a method through :func:`kernel_method`; the baselines of App. F.1
are added that way with one :func:`register_method` call each.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels import (
    AttentionKernel,
    DiJiangKernel,
    GlobalQuadraticKernel,
    OALKernel,
    PerformerKernel,
    SpectraFormerKernel,
    TaylorShiftKernel,
)
from ..ops.quadratic.chunk import DEFAULT_CHUNK
from .flops import AttnShape, quadratic_chunk_flops, sdpa_causal_flops

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Method:
    """``build(shape, device, seed)`` returns ``fn(q, k, v) -> o (B, Hq, N, dv)``; ``flops(shape)`` is the
    analytical FLOP count of one call (None when unknown: no GFLOP/s is then reported)."""

    name: str
    label: str
    build: Callable[[AttnShape, torch.device, int], AttentionFn]
    flops: Callable[[AttnShape], float] | None = None
    description: str = ""


METHODS: dict[str, Method] = {}


def register_method(method: Method, *, replace: bool = False) -> Method:
    """Add ``method`` to :data:`METHODS` (a name is registered once unless ``replace``)."""
    if not isinstance(method, Method):
        raise ValueError(f"method: expected a Method, got {type(method).__name__}")
    if method.name in METHODS and not replace:
        raise ValueError(f"method: {method.name!r} is already registered; pass replace=True to override it")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The registered method called ``name``."""
    if name not in METHODS:
        raise ValueError(f"methods: expected names from {sorted(METHODS)}, got {name!r}")
    return METHODS[name]


def sdpa_method(name: str, label: str, backend: SDPBackend, description: str) -> Method:
    """PyTorch SDPA pinned to one backend (no silent fallback: an unsupported case raises), causal, GQA."""

    def build(shape: AttnShape, device: torch.device, seed: int) -> AttentionFn:
        gqa = shape.heads_q != shape.heads_kv

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        return fn

    return Method(name, label, build, sdpa_causal_flops, description)


def kernel_method(
    name: str,
    make: type[AttentionKernel] | Callable[[AttnShape, int], AttentionKernel],
    *,
    label: str | None = None,
    flops: Callable[[AttnShape], float] | None = None,
    description: str = "",
    **kernel_kwargs: object,
) -> Method:
    """A method running ``kernel(q, k, v)[0]`` (the kernel's default, linear-time forward).

    ``make`` is either an AttentionKernel subclass, constructed as ``cls(Hq, Hkv, d, **kernel_kwargs)`` (plus
    ``seed=`` when its constructor takes one), or a function ``(shape, seed) -> kernel``.
    """
    if isinstance(make, type):
        if not issubclass(make, AttentionKernel):
            raise ValueError(f"make: expected an AttentionKernel subclass or a factory, got class {make.__name__}")
        cls = make
        takes_seed = "seed" in inspect.signature(cls.__init__).parameters

        def factory(shape: AttnShape, seed: int) -> AttentionKernel:
            extra = {"seed": seed} if takes_seed else {}
            return cls(shape.heads_q, shape.heads_kv, shape.head_dim, **extra, **kernel_kwargs)

    elif kernel_kwargs:
        raise ValueError(f"kernel_kwargs: only used with a kernel class, got {sorted(kernel_kwargs)} with a factory")
    else:
        factory = make

    def build(shape: AttnShape, device: torch.device, seed: int) -> AttentionFn:
        kernel = factory(shape, seed).to(device).eval()
        kernel.requires_grad_(False)

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return kernel(q, k, v)[0]

        return fn

    return Method(name, label or name, build, flops, description)


def random_factor(num_heads: int, num_groups: int, generator: torch.Generator) -> torch.Tensor:
    """A random lower-triangular ``L (Hq, G+1, G+1)`` with a positive diagonal (so ``M = L Lᵀ`` is positive
    definite), entries of order 0.5: a stand-in for a calibrated factor."""
    L = (0.5 * torch.randn(num_heads, num_groups + 1, num_groups + 1, generator=generator)).tril()
    diag = 0.5 + torch.rand(num_heads, num_groups + 1, generator=generator)
    return L - torch.diag_embed(L.diagonal(dim1=1, dim2=2)) + torch.diag_embed(diag)


def random_groups(num_heads: int, head_dim: int, num_groups: int, generator: torch.Generator) -> torch.Tensor:
    """A fixed random group map ``(Hq, d)``: each head's dimensions shuffled and dealt round-robin into the G
    groups, so every group is used (when d ≥ G) and sizes differ by at most one."""
    return torch.stack([torch.randperm(head_dim, generator=generator) % num_groups for _ in range(num_heads)])


def random_oal_kernel(shape: AttnShape, num_groups: int, seed: int) -> AttentionKernel:
    """OAL with ``num_groups`` random fixed groups and a random factor L, deterministic in ``seed``; G = 1 is the
    learned global quadratic (:class:`oal.kernels.GlobalQuadraticKernel`, App. D)."""
    gen = torch.Generator().manual_seed(seed)
    L = random_factor(shape.heads_q, num_groups, gen)
    if num_groups == 1:
        return GlobalQuadraticKernel(shape.heads_q, shape.heads_kv, shape.head_dim, L=L)
    groups = random_groups(shape.heads_q, shape.head_dim, num_groups, gen)
    return OALKernel(groups, shape.heads_kv, num_groups=num_groups, L=L)


def oal_method(name: str, num_groups: int, chunk: int = DEFAULT_CHUNK) -> Method:
    """OAL (§4.3) through the chunked HD operator, with the kernel of :func:`random_oal_kernel`."""

    def make(shape: AttnShape, seed: int) -> AttentionKernel:
        return random_oal_kernel(shape, num_groups, seed)

    def flops(shape: AttnShape) -> float:
        return quadratic_chunk_flops(shape, rank=num_groups + 1, chunk=chunk)

    kind = "learned global quadratic" if num_groups == 1 else "OAL"
    return kernel_method(
        name,
        make,
        label=f"{kind} (G={num_groups})",
        flops=flops,
        description=f"{kind}, chunked HD operator (chunk {chunk}), random fixed groups and random factor L",
    )


register_method(
    sdpa_method(
        "sdpa", "SDPA flash", SDPBackend.FLASH_ATTENTION, "torch SDPA, FLASH_ATTENTION backend, causal, enable_gqa"
    )
)
register_method(sdpa_method("sdpa_math", "SDPA math", SDPBackend.MATH, "torch SDPA, MATH backend, causal, enable_gqa"))
register_method(oal_method("oal", num_groups=5))
register_method(oal_method("global", num_groups=1))
# the App. F.1 baselines with the constructor defaults that calibration and conversion use (feature counts, and
# the fp64 feature maps of Performer and SpectraFormer), at their default linear-time chunked forward
for _name, _label, _cls in (
    ("performer", "Performer", PerformerKernel),
    ("spectraformer", "SpectraFormer", SpectraFormerKernel),
    ("dijiang", "DiJiang", DiJiangKernel),
    ("taylorshift", "TaylorShift", TaylorShiftKernel),
):
    register_method(kernel_method(_name, _cls, label=_label, description=f"{_label} (App. F.1), constructor defaults"))

DEFAULT_METHODS = ("sdpa", "sdpa_math", "oal", "global")
