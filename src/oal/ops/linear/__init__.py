"""Causal normalised linear (feature-map) attention in three modes: the operator behind the F.1 baselines."""

from __future__ import annotations

import torch

from .chunk import DEFAULT_CHUNK, chunk_linear_attention
from .naive import causal_kernel_matrix, naive_linear_attention
from .recurrent import recurrent_linear_attention
from .utils import FeatureMap, LinearState, accumulation_dtype

MODES = ("naive", "chunk", "recurrent")


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_map: FeatureMap,
    key_map: FeatureMap,
    *,
    key_heads: int,
    log_keys: bool = False,
    dtype: torch.dtype = torch.float32,
    mode: str = "chunk",
    chunk_size: int = DEFAULT_CHUNK,
    initial_state: LinearState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LinearState | None]:
    """Causal normalised attention with a feature kernel ``κ(q_i, k_j) = φ_q(q_i)ᵀ φ_k(k_j)``:

        o_i = Σ_{j≤i} κ(q_i, k_j) v_j / Σ_{j≤i} κ(q_i, k_j).

    Args:
        q: ``(B, Hq, N, d)`` queries; k: ``(B, Hkv, N, d)`` keys; v: ``(B, Hkv, N, dv)`` values.
        query_map: ``(q (B, Hq, n, d), k (B, Hkv, n, d)) -> (B, Hq, n, m)`` non-negative query features of n
            tokens (the keys of the same tokens are passed for maps whose coefficients depend on both).
        key_map: same inputs ``-> (B, Hk, n, m)`` non-negative key features, or their logarithms if
            ``log_keys``. Query head h reads key-feature head ``h // (Hq // Hk)``.
        key_heads: Hk, a divisor of Hq and a multiple of Hkv.
        log_keys: key_map returns log-features; each query's keys are exponentiated relative to one shared
            maximum over its causal prefix (see :mod:`oal.ops.linear.utils`), which cancels in the normalisation.
        dtype: accumulation dtype of features and prefix sums (fp64 inputs always accumulate in fp64).
        mode: ``"naive"`` (explicit N×N reference), ``"chunk"`` (block form) or ``"recurrent"`` (token by token).
        chunk_size: tokens per chunk in ``"chunk"`` mode; need not divide N.
        initial_state: :class:`LinearState` of a preceding segment.
        output_final_state: also return the state after this segment.

    Returns:
        ``(o (B, Hq, N, dv) in q's dtype, LinearState or None)``. ``"naive"`` and ``"chunk"`` are differentiable.
    """
    kw = dict(key_heads=key_heads, log_keys=log_keys, dtype=dtype)
    kw.update(initial_state=initial_state, output_final_state=output_final_state)
    if mode == "chunk":
        return chunk_linear_attention(q, k, v, query_map, key_map, chunk_size=chunk_size, **kw)
    if mode == "recurrent":
        return recurrent_linear_attention(q, k, v, query_map, key_map, **kw)
    if mode == "naive":
        return naive_linear_attention(q, k, v, query_map, key_map, **kw)
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


__all__ = [
    "DEFAULT_CHUNK",
    "FeatureMap",
    "LinearState",
    "MODES",
    "accumulation_dtype",
    "causal_kernel_matrix",
    "chunk_linear_attention",
    "linear_attention",
    "naive_linear_attention",
    "recurrent_linear_attention",
]
