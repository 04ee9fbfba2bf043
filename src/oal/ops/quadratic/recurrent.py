"""Token-by-token evaluation of the quadratic kernel from the HD state: Algorithm 1, lines 6–11.

Per token: ``u_i = [v_i; 1]``, ``S ← S + φ_k(k_i) u_iᵀ`` (the packed H0, H1, H2 updates of Eq. 5), then the
readout ``num = φ_q(q_i) S`` of Eq. 6 and ``ŷ_i = num[:dv] / num[dv]``. This is the decoding path: its memory is
one ``(D, dv+1)`` state per KV head whatever the context length, and a state handed over from
``chunk_quadratic_attention(..., output_final_state=True)`` continues a prefill exactly.
"""

from __future__ import annotations

import torch

from .utils import (
    QuadraticAttentionOutput,
    check_coefficients,
    check_floor,
    check_key_weight,
    check_qkv,
    check_state,
    compute_dtype,
    default_scale,
    feature_dim,
    key_features,
    query_features,
    query_weights,
)


def recurrent_quadratic_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    C: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    kernel_floor: float | None = None,
    key_weight: torch.Tensor | None = None,
    return_denominator: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | QuadraticAttentionOutput:
    """Recurrent causal quadratic-kernel attention; see :func:`oal.ops.quadratic_attention` for the arguments.

    q ``(B, Hq, T, d)`` for T ≥ 1 new tokens, k/v their keys and values, ``initial_state`` the packed state
    ``(B, Hkv, D, dv+1)`` of everything before them. Returns ``o (B, Hq, T, dv)`` and optionally the new state
    (with ``return_denominator`` a :class:`QuadraticAttentionOutput`).
    """
    dims = check_qkv(q, k, v)
    check_coefficients(a, b, C, dims)
    if initial_state is not None:
        check_state(initial_state, dims)
    check_floor(kernel_floor)
    if key_weight is not None:
        check_key_weight(key_weight, dims, q.device)
    s = default_scale(dims.d, scale)
    B, Hq, Hkv, T, d, dv = dims
    G = dims.group
    cdt = compute_dtype(q.dtype)
    wq = query_weights(a.to(cdt), b.to(cdt), C.to(cdt), s)
    if initial_state is None:
        state = torch.zeros(B, Hkv, feature_dim(d), dv + 1, dtype=cdt, device=q.device)
    else:
        state = initial_state.to(cdt)
    outs, dens = [], []
    for t in range(T):
        kt = k[:, :, t].to(cdt)
        vt = v[:, :, t].to(cdt)
        ut = torch.cat([vt, torch.ones_like(vt[..., :1])], dim=-1)
        if key_weight is not None:
            ut = ut * key_weight[:, :, t, None].to(cdt)
        state = state + key_features(kt)[..., :, None] * ut[..., None, :]
        fq = query_features(q[:, :, t : t + 1].to(cdt), wq).view(B, Hkv, G, -1)
        num = fq @ state
        den = num[..., dv:]
        count = state[:, :, None, 0, dv:].detach()  # (weighted) keys seen so far
        if kernel_floor is not None:
            den = torch.maximum(den, kernel_floor * count)
        dens.append(den.reshape(B, Hq))
        if key_weight is not None:  # no key with weight > 0 yet: output 0, not 0/0
            den = torch.where(count > 0, den, torch.ones_like(den))
        outs.append((num[..., :dv] / den).reshape(B, Hq, dv))
    o = torch.stack(outs, dim=2).to(q.dtype)
    final = state if output_final_state else None
    if return_denominator:
        return QuadraticAttentionOutput(o, torch.stack(dens, dim=2), final)
    return o, final
