"""Quadratic-kernel attention with exact attention sinks and an exact local window (beyond the paper; see
``docs/sink_window.md``), in three modes."""

from __future__ import annotations

import torch

from ..quadratic import KernelFactor
from .chunk import chunk_sink_window_attention
from .naive import naive_sink_window_attention, sink_window_weights
from .recurrent import recurrent_sink_window_attention
from .utils import MODES, SinkWindowState, check_mode


def sink_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    C: torch.Tensor,
    beta: torch.Tensor,
    *,
    n_sink: int = 4,
    window: int = 64,
    scale: float | None = None,
    mode: str = "chunk",
    chunk_size: int = 64,
    initial_state: SinkWindowState | None = None,
    output_final_state: bool = False,
    factor: KernelFactor | None = None,
    kernel_floor: float | None = None,
) -> tuple[torch.Tensor, SinkWindowState | None]:
    """Causal attention that is exact on the first ``n_sink`` keys and on the last ``window`` keys of each query
    and uses the quadratic kernel of Eq. 3 on every other key, all in one normalisation.

    For query i (head h) with logits ``s_ij = q_i·k_j·scale``, the exact set
    ``E_i = {j ≤ i : j < n_sink or i - window < j}`` (the window includes the query; a sink inside the window
    counts once) and the kernel set ``K_i = {j : n_sink ≤ j ≤ i - window}``:

        o_i = [Σ_{E_i} e^{s_ij} v_j + e^{β_h} Σ_{K_i} κ_ij v_j] / [Σ_{E_i} e^{s_ij} + e^{β_h} Σ_{K_i} κ_ij].

    β_h is a per-head log-scale putting the kernel's weights in the units of e^{s}. With n_sink = window = 0
    this is the plain kernel operator (β drops out); with window ≥ i + 1 for every query, exact softmax.

    Stable evaluation: writing the kernel part as its normalised output ``ō_i = Σ_K κ v / Σ_K κ`` and its log-mass
    ``ℓ_i = β_h + log Σ_{K_i} κ_ij`` (-∞ for an empty K_i), and ``M_i = max(max_{E_i} s_ij, ℓ_i)``,

        o_i = [Σ_{E_i} e^{s_ij - M_i} v_j + e^{ℓ_i - M_i} ō_i] / [Σ_{E_i} e^{s_ij - M_i} + e^{ℓ_i - M_i}].

    Every exponent is ≤ 0, so no term overflows whatever β_h and the logits are; the term attaining M_i is 1,
    so the denominator is ≥ 1 (no 0/0), and E_i ∪ K_i always holds key 0 or key i, so M_i is finite. A term
    that underflows to 0 is below 2⁻¹²⁶ (fp32) of the total and its loss is beneath the output's rounding:
    when β_h ≪ M_i the kernel part simply vanishes, and when ℓ_i ≫ max s_ij the exact part does. The kernel's
    mass never appears un-logged (Σ κ ≤ N·max κ is moderate in fp32 anyway), and bf16/fp16 inputs are
    evaluated in fp32 throughout. The kernel must be positive (κ ≥ kernel_floor > 0 for OAL); a non-positive
    kernel mass shows as NaN rather than being dropped.

    Args:
        q: ``(B, Hq, N, d)``; k: ``(B, Hkv, N, d)``; v: ``(B, Hkv, N, dv)``; query head h reads KV head
            ``h // (Hq // Hkv)``.
        a, b, C: the kernel's Eq. 3 coefficients ``(Hq,)``, ``(Hq, d)``, ``(Hq, d, d)``.
        beta: ``(Hq,)`` per-head log-scale of the kernel part.
        n_sink: exact keys at the start of the sequence (0 for none); window: exact most recent keys,
            the query's own included (0 for none).
        scale: score scale for the logits and the kernel, default ``1/sqrt(d)``.
        mode: ``"naive"`` (explicit N×N reference), ``"chunk"`` (prefill) or ``"recurrent"`` (decode).
        chunk_size: queries per block of the exact part and tokens per chunk of the kernel part (``"chunk"``).
        initial_state: the :class:`SinkWindowState` after the tokens before this segment (not ``"naive"``).
        output_final_state: also return the state after this segment.
        factor, kernel_floor: as in :func:`oal.ops.quadratic_attention`, for the kernel part.

    Returns:
        ``(o (B, Hq, N, dv)`` in q's dtype, ``final_state)``; chunk prefill followed by recurrent decode from
        its state gives the same outputs as one pass over the whole sequence.
    """
    check_mode(mode)
    fn = {
        "chunk": chunk_sink_window_attention,
        "recurrent": recurrent_sink_window_attention,
        "naive": naive_sink_window_attention,
    }[mode]
    extra = {"chunk_size": chunk_size} if mode == "chunk" else {}
    return fn(
        q,
        k,
        v,
        a,
        b,
        C,
        beta,
        n_sink=n_sink,
        window=window,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        factor=factor,
        kernel_floor=kernel_floor,
        **extra,
    )


__all__ = [
    "MODES",
    "SinkWindowState",
    "chunk_sink_window_attention",
    "naive_sink_window_attention",
    "recurrent_sink_window_attention",
    "sink_window_attention",
    "sink_window_weights",
]
