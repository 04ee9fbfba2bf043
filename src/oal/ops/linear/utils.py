"""Pieces shared by the three evaluation modes of causal normalised linear (feature-map) attention.

A feature kernel is ``κ_h(q_i, k_j) = φ_q(q_i)ᵀ φ_k(k_j)`` with non-negative features of size m. Queries of head
h read key head ``h // (Hq // Hk)``, where the number of key-feature heads ``Hk`` is ``Hkv`` when the key
features depend on the KV head only (the query side then carries every per-head coefficient) or ``Hq`` when they
depend on the query head too (Performer's per-head projections, SpectraFormer's per-token OPRF coefficients).

Feature maps are callables evaluated one chunk at a time, so the full ``(N, m)`` feature matrices never need to
exist: ``query_map(q, k) -> (B, Hq, n, m)`` and ``key_map(q, k) -> (B, Hk, n, m)`` receive the queries
``(B, Hq, n, d)`` and keys ``(B, Hkv, n, d)`` of the same n tokens, in the accumulation dtype.

Exponential key features can be handed over as log-features (``log_keys=True``). Every key feature a query
reads is then divided by one shared constant, ``exp(c_t)`` with ``c_t`` the maximum log-feature over all
features and all keys the query at position t attends to (its causal prefix): a factor common to the numerator
and the denominator of that query, so it cancels exactly (App. F.1's "shared maximum over tokens and features
within each head", taken over the causal prefix so that it is defined as tokens arrive). Every exponent is ≤ 0,
so no feature overflows, and the largest key feature a query sees is 1, so nothing it attends to is flushed to
zero by keys that come later. The state stores the prefix sums in units of ``exp(shift)``,

    kv = Σ_{j ≤ t} exp(ℓ_j − shift) [v_j; 1]ᵀ   (B, Hk, m, dv + 1),   shift = c_t,

and is rescaled by ``exp(c_old − c_new)`` when the maximum grows (the online-softmax update). All three modes
use the same per-query units, so they agree up to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..quadratic.utils import Dims, check_qkv

FeatureMap = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LinearState(NamedTuple):
    """Recurrent state of causal linear attention.

    ``kv (B, Hk, m, dv + 1)``: prefix sums ``Σ_j φ_k(k_j) [v_j; 1]ᵀ`` in units of ``exp(shift)`` (the last column
    is the normaliser). ``shift (B, Hk)``: the log-scale of ``kv``; zero for kernels whose key features are
    handed over directly.
    """

    kv: torch.Tensor
    shift: torch.Tensor


def accumulation_dtype(dtype: torch.dtype, input_dtype: torch.dtype) -> torch.dtype:
    """The requested accumulation dtype, promoted to fp64 for fp64 inputs (never below the input precision)."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    return torch.float64 if input_dtype == torch.float64 else dtype


def check_key_heads(key_heads: int, dims: Dims) -> int:
    """Hk must be a multiple of Hkv and divide Hq."""
    if not isinstance(key_heads, int) or key_heads < 1 or dims.Hq % key_heads or key_heads % dims.Hkv:
        raise ValueError(
            f"key_heads: expected a divisor of Hq={dims.Hq} that is a multiple of Hkv={dims.Hkv}, got {key_heads!r}"
        )
    return key_heads


def check_features(name: str, f: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(f, torch.Tensor):
        raise ValueError(f"{name}: expected to return a torch.Tensor, got {type(f).__name__}")
    if f.dim() != 4 or tuple(f.shape[:3]) != shape[:3] or (shape[3] >= 0 and f.shape[3] != shape[3]):
        want = tuple("m" if s < 0 else s for s in shape)
        raise ValueError(f"{name}: expected features of shape {want}, got {tuple(f.shape)}")
    if f.dtype != dtype:
        raise ValueError(f"{name}: expected features in the accumulation dtype {dtype}, got {f.dtype}")


def check_state_type(state: object) -> None:
    if state is not None and not isinstance(state, LinearState):
        raise ValueError(f"initial_state: expected a LinearState(kv, shift) or None, got {type(state).__name__}")


def check_state(state: LinearState, B: int, Hk: int, m: int, dv: int, log_keys: bool) -> None:
    """Shapes ``kv (B, Hk, m, dv + 1)``, ``shift (B, Hk)``, finite (m is known once features are computed);
    kernels without log key features keep their state in plain units (shift 0)."""
    check_state_type(state)
    kv, shift = state
    if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != (B, Hk, m, dv + 1):
        got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"initial_state: expected kv of shape {(B, Hk, m, dv + 1)}, got {got}")
    if not isinstance(shift, torch.Tensor) or tuple(shift.shape) != (B, Hk):
        got = tuple(shift.shape) if isinstance(shift, torch.Tensor) else type(shift).__name__
        raise ValueError(f"initial_state: expected shift of shape {(B, Hk)}, got {got}")
    if not (bool(torch.isfinite(kv).all()) and bool(torch.isfinite(shift).all())):
        raise ValueError("initial_state: contains NaN or infinite values")
    if not log_keys and bool((shift != 0).any()):
        raise ValueError("initial_state: expected shift 0 for a kernel without log key features")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Dims:
    dims = check_qkv(q, k, v)
    if dims.N < 1:
        raise ValueError(f"q: expected at least one token, got shape {tuple(q.shape)}")
    return dims


def values_with_ones(v: torch.Tensor, heads: int) -> torch.Tensor:
    """``[v; 1]`` repeated to ``heads`` heads: ``(B, Hkv, n, dv) -> (B, heads, n, dv + 1)``."""
    u = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    B, Hkv, n, e = u.shape
    if heads == Hkv:
        return u
    return u[:, :, None].expand(B, Hkv, heads // Hkv, n, e).reshape(B, heads, n, e)


def key_scales(lk: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split log key features into well-scaled features and log-scales.

    ``lk (B, Hk, n, m)`` log-features of n consecutive keys, ``shift (B, Hk)`` the log-scale of the state before
    them (−inf for none). Returns ``f̂ = exp(lk − M) (B, Hk, n, m)`` (max 1 per key), the per-key maxima
    ``M (B, Hk, n)`` and the running shared maxima ``c (B, Hk, n)``, ``c_t = max(shift, M_1..M_t)``: the log-unit
    in which the numerator and denominator of the query at t are accumulated. ``exp(M_j − c_t) ≤ 1`` for j ≤ t.
    The scales are detached: they cancel in the normalisation, so they carry no gradient.
    """
    M = lk.detach().amax(-1)
    c = torch.maximum(torch.cummax(M, dim=-1).values, shift[..., None])
    return torch.exp(lk - M[..., None]), M, c


def pair_scales(M: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``exp(M_j − c_i)`` ``(B, Hk, P, N)`` for queries with log-units ``c (B, Hk, P)`` and keys with maxima
    ``M (B, Hk, N)``; exponents are clamped at 0 so the entries of future keys (masked later) cannot overflow."""
    return torch.exp((M[..., None, :] - c[..., :, None]).clamp(max=0))
