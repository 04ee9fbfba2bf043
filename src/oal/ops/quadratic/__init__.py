"""The dimension-aware quadratic-kernel attention operator (Eq. 3, 5, 6) in three modes."""

from __future__ import annotations

import torch

from .chunk import chunk_quadratic_attention, factored_kernel
from .naive import naive_kernel_matrix, naive_quadratic_attention
from .recurrent import recurrent_quadratic_attention
from .utils import (
    KernelFactor,
    QuadraticAttentionOutput,
    feature_dim,
    key_features,
    query_features,
    query_weights,
    split_state,
)

MODES = ("naive", "chunk", "recurrent")


def quadratic_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    C: torch.Tensor,
    *,
    scale: float | None = None,
    mode: str = "chunk",
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    factor: KernelFactor | None = None,
    key_weight: torch.Tensor | None = None,
    return_denominator: bool = False,
    kernel_floor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | QuadraticAttentionOutput:
    """Causal normalised attention with the dimension-aware quadratic kernel of Eq. 3:

        o_i = Σ_{j≤i} ω_j κ(q_i, k_j) v_j / Σ_{j≤i} ω_j κ(q_i, k_j),
        κ(q, k) = a + Σ_r b_r x_r + Σ_{r,t} C_rt x_r x_t,   x_r = q_r k_r · scale.

    Args:
        q: ``(B, Hq, N, d)`` queries (post-RoPE). Query head h reads KV head ``h // (Hq // Hkv)``.
        k: ``(B, Hkv, N, d)`` keys, not repeated across the query heads of a group.
        v: ``(B, Hkv, N, dv)`` values.
        a: ``(Hq,)`` constant term; b: ``(Hq, d)`` linear terms; C: ``(Hq, d, d)`` symmetric quadratic terms.
        scale: score scale, default ``1/sqrt(d)``.
        mode: ``"naive"`` (explicit N×N reference), ``"chunk"`` (block-GEMM over the HD states, Eq. 5–6)
            or ``"recurrent"`` (token by token, Algorithm 1; the decoding path).
        chunk_size: tokens per chunk in ``"chunk"`` mode; need not divide N.
        initial_state: packed state ``(B, Hkv, 1 + d + d(d+1)/2, dv + 1)`` of a preceding segment.
        output_final_state: also return the packed state after this segment.
        factor: the same kernel as a :class:`KernelFactor` (sum of squares, Eq. 7); ``"chunk"`` then builds
            the intra-chunk kernel from it. The caller guarantees it matches (a, b, C);
            :func:`oal.kernels.oal_factor` and :func:`oal.kernels.oal_coefficients` produce matching pairs.
        key_weight: optional ``(B, Hkv, N)`` non-negative weights ω_j (default 1) scaling ``u_j = [v_j; 1]``, so
            ω_j = 0 removes key j from numerator, denominator and state. The floor then uses the weighted key
            count ``Σ_{j≤i} ω_j`` (plus the count held in ``initial_state``), and a query whose count is 0
            gets output 0. Differentiable in ``"chunk"`` and ``"naive"`` like the other inputs.
        return_denominator: return a :class:`QuadraticAttentionOutput` ``(o, denominator (B, Hq, N),
            final_state)`` instead of ``(o, final_state)``; the denominator is the one each output was divided by.
        kernel_floor: a known lower bound κ ≥ floor > 0 (OAL's ε). Denominators are then clamped to
            ``floor · (number of keys)``, which the exact value always exceeds, so fp32 rounding in the state
            readout can never make a denominator non-positive. Ignored by ``"naive"``.

    bf16/fp16 inputs accumulate in fp32; the output has q's dtype, the state the accumulation dtype.
    ``"chunk"`` and ``"naive"`` are differentiable in q, k, v, a, b and C.

    Returns:
        ``(o, final_state)``: o ``(B, Hq, N, dv)``; final_state as above, or None. With ``return_denominator``,
        ``(o, denominator, final_state)`` as a :class:`QuadraticAttentionOutput`.
    """
    if mode == "chunk":
        return chunk_quadratic_attention(
            q,
            k,
            v,
            a,
            b,
            C,
            scale=scale,
            chunk_size=chunk_size,
            initial_state=initial_state,
            output_final_state=output_final_state,
            factor=factor,
            kernel_floor=kernel_floor,
            key_weight=key_weight,
            return_denominator=return_denominator,
        )
    if mode == "recurrent":
        return recurrent_quadratic_attention(
            q,
            k,
            v,
            a,
            b,
            C,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            kernel_floor=kernel_floor,
            key_weight=key_weight,
            return_denominator=return_denominator,
        )
    if mode == "naive":
        return naive_quadratic_attention(
            q,
            k,
            v,
            a,
            b,
            C,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            key_weight=key_weight,
            return_denominator=return_denominator,
        )
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


__all__ = [
    "KernelFactor",
    "MODES",
    "QuadraticAttentionOutput",
    "chunk_quadratic_attention",
    "factored_kernel",
    "feature_dim",
    "key_features",
    "naive_kernel_matrix",
    "naive_quadratic_attention",
    "quadratic_attention",
    "query_features",
    "query_weights",
    "recurrent_quadratic_attention",
    "split_state",
]
