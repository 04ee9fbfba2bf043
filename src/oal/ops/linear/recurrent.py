"""Token-by-token causal linear attention from the prefix state: the decoding path.

Per token t: ``S ← S + φ_k(k_t) [v_t; 1]ᵀ`` (for log key features, after rescaling S to the new running maximum),
``num = φ_q(q_t) S``, ``o_t = num[:dv] / num[dv]``. Memory is one ``(m, dv + 1)`` state per key-feature head
whatever the context length; a state from ``chunk_linear_attention(..., output_final_state=True)`` continues a
prefill exactly.
"""

from __future__ import annotations

import torch

from .utils import (
    FeatureMap,
    LinearState,
    accumulation_dtype,
    check_features,
    check_inputs,
    check_key_heads,
    check_state,
    check_state_type,
    key_scales,
    values_with_ones,
)


def recurrent_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_map: FeatureMap,
    key_map: FeatureMap,
    *,
    key_heads: int,
    log_keys: bool = False,
    dtype: torch.dtype = torch.float32,
    initial_state: LinearState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LinearState | None]:
    """Recurrent causal feature attention over T ≥ 1 new tokens; see :func:`oal.ops.linear_attention`."""
    dims = check_inputs(q, k, v)
    Hk = check_key_heads(key_heads, dims)
    check_state_type(initial_state)
    B, Hq, Hkv, T, d, dv = dims
    G = Hq // Hk
    cdt = accumulation_dtype(dtype, q.dtype)
    kv = shift = None
    outs = []
    for t in range(T):
        qt, kt = q[:, :, t : t + 1].to(cdt), k[:, :, t : t + 1].to(cdt)
        fq = query_map(qt, kt)
        check_features("query_map", fq, (B, Hq, 1, -1), cdt)
        m = fq.shape[-1]
        fk = key_map(qt, kt)
        check_features("key_map", fk, (B, Hk, 1, m), cdt)
        if kv is None and initial_state is None:
            kv = torch.zeros(B, Hk, m, dv + 1, dtype=cdt, device=q.device)
            shift = torch.full((B, Hk), float("-inf") if log_keys else 0.0, dtype=cdt, device=q.device)
        elif kv is None:
            check_state(initial_state, B, Hk, m, dv, log_keys)
            kv, shift = initial_state.kv.to(cdt), initial_state.shift.to(cdt)
        if log_keys:
            fk, M, c = key_scales(fk, shift)  # one token: c = max(shift, M)
            fk = fk * torch.exp(M - c)[..., None]
            kv = kv * torch.exp(shift - c[..., 0])[..., None, None]
            shift = c[..., 0]
        kv = kv + fk.mT @ values_with_ones(v[:, :, t : t + 1].to(cdt), Hk)
        num = fq.reshape(B, Hk, G, m) @ kv  # (B, Hk, G, dv+1)
        outs.append((num[..., :dv] / num[..., dv:]).reshape(B, Hq, 1, dv))
    o = torch.cat(outs, dim=2).to(q.dtype)
    return o, (LinearState(kv, shift) if output_final_state else None)
