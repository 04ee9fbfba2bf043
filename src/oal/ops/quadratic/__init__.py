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
BACKENDS = ("auto", "torch", "triton")


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
    backend: str = "auto",
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
        backend: ``"torch"``, ``"triton"`` (the kernels of :mod:`.triton`; CUDA tensors, or CPU tensors under
            ``TRITON_INTERPRET=1``; ``"chunk"`` and ``"recurrent"`` only; chunk_size one of 16/32/64/128; no
            key_weight or return_denominator yet; the recurrent kernel is inference-only) or ``"auto"``: Triton
            for CUDA tensors in fp16/bf16/fp32 when triton is installed and the call is one it takes, torch
            otherwise. Both compute the same function.

    bf16/fp16 inputs accumulate in fp32; the output has q's dtype, the state the accumulation dtype.
    ``"chunk"`` and ``"naive"`` are differentiable in q, k, v, a, b and C.

    Returns:
        ``(o, final_state)``: o ``(B, Hq, N, dv)``; final_state as above, or None. With ``return_denominator``,
        ``(o, denominator, final_state)`` as a :class:`QuadraticAttentionOutput`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    extras = key_weight is not None or return_denominator
    if backend != "torch" and _use_triton(
        backend, mode, q, v, chunk_size, extras, (q, k, v, a, b, C, initial_state, *(factor or ()))
    ):
        from . import triton as tri

        if mode == "chunk":
            return tri.chunk_quadratic_attention_triton(
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
            )
        return tri.recurrent_quadratic_attention_triton(
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
        )
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
    raise AssertionError(mode)  # unreachable: mode was checked above


def _use_triton(backend: str, mode: str, q, v, chunk_size: int, extras: bool, tensors: tuple) -> bool:
    """Whether this call goes to the Triton kernels; with ``backend="triton"`` a call they cannot take raises."""
    from .triton.utils import unsupported_reason

    reason = None
    if mode == "naive":
        reason = "mode='naive' is the torch reference; use mode='chunk' or 'recurrent'"
    elif extras:
        reason = "key_weight and return_denominator are not implemented in the Triton kernels"
    elif not all(isinstance(x, torch.Tensor) for x in (q, v)):
        reason = "q and v must be tensors"
    else:
        reason = unsupported_reason(q, v, chunk_size if mode == "chunk" else None)
        grad = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in tensors)
        if reason is None and mode == "recurrent" and grad:
            reason = "mode='recurrent' is not differentiable on Triton; use mode='chunk' for training"
        if reason is None and backend == "auto" and (q.device.type != "cuda" or q.dtype == torch.float64):
            reason = "auto uses Triton for CUDA tensors in fp16/bf16/fp32 only"
    if reason is None:
        return True
    if backend == "triton":
        raise ValueError(f"backend='triton': {reason}")
    return False


__all__ = [
    "BACKENDS",
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
