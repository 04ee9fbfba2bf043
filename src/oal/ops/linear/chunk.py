"""Chunked causal linear attention: the block form of fla's chunk linear attention, with feature maps applied one
chunk at a time.

For a chunk of n positions and the prefix state ``S = Σ_{j<s} φ_k(k_j) [v_j; 1]ᵀ``:

    num = φ_q(Q) S + tril(φ_q(Q) φ_k(K)ᵀ) [V; 1]        (inter-chunk readout + explicit intra-chunk part)
    S  ← S + φ_k(K)ᵀ [V; 1]
    o  = num[:, :dv] / num[:, dv]

With log key features each query's terms are expressed in its own log-unit c_t (the running maximum, see
:mod:`oal.ops.linear.utils`): the readout of S is multiplied by ``exp(shift − c_t)`` and the intra-chunk score of
key j by ``exp(M_j − c_t)``, with ``M_j`` the key's own maximum, so keys later in the chunk never rescale what an
earlier query sees.

The G = Hq / Hk query heads sharing a key-feature head are stacked into one GEMM against its state. Live memory
beyond inputs and output is one state per head plus one chunk's features and its n×n block, whatever N is; cost is
O(N · (n + m) · dv) per head. Everything is out-of-place, so the function is differentiable in q, k, v, the
parameters the feature maps close over, and the initial state.
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
    pair_scales,
    values_with_ones,
)

DEFAULT_CHUNK = 64


def chunk_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_map: FeatureMap,
    key_map: FeatureMap,
    *,
    key_heads: int,
    log_keys: bool = False,
    dtype: torch.dtype = torch.float32,
    chunk_size: int = DEFAULT_CHUNK,
    initial_state: LinearState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LinearState | None]:
    """Chunked causal feature attention; see :func:`oal.ops.linear_attention` for the arguments."""
    dims = check_inputs(q, k, v)
    Hk = check_key_heads(key_heads, dims)
    check_state_type(initial_state)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    B, Hq, Hkv, N, d, dv = dims
    G = Hq // Hk
    cdt = accumulation_dtype(dtype, q.dtype)
    cs = min(chunk_size, N)
    causal = torch.ones(cs, cs, dtype=torch.bool, device=q.device).tril()

    kv = shift = None
    outs = []
    for start in range(0, N, cs):
        end = min(start + cs, N)
        n = end - start
        qc, kc = q[:, :, start:end].to(cdt), k[:, :, start:end].to(cdt)
        fq = query_map(qc, kc)
        check_features("query_map", fq, (B, Hq, n, -1), cdt)
        m = fq.shape[-1]
        fk = key_map(qc, kc)
        check_features("key_map", fk, (B, Hk, n, m), cdt)
        if kv is None and initial_state is None:
            kv = torch.zeros(B, Hk, m, dv + 1, dtype=cdt, device=q.device)
            shift = torch.full((B, Hk), float("-inf") if log_keys else 0.0, dtype=cdt, device=q.device)
        elif kv is None:
            check_state(initial_state, B, Hk, m, dv, log_keys)
            kv, shift = initial_state.kv.to(cdt), initial_state.shift.to(cdt)

        u = values_with_ones(v[:, :, start:end].to(cdt), Hk)  # (B, Hk, n, dv+1)
        fq_g = fq.reshape(B, Hk, G * n, m)
        inter = (fq_g @ kv).view(B, Hk, G, n, dv + 1)
        if log_keys:
            fk, M, c = key_scales(fk, shift)
            inter = inter * torch.exp(shift[..., None] - c)[:, :, None, :, None]
            scores = (fq_g @ fk.mT).view(B, Hk, G, n, n) * pair_scales(M, c)[:, :, None]
            last = c[..., -1]
            fk = fk * torch.exp(M - last[..., None])[..., None]  # now in the unit of the chunk's last token
            kv = kv * torch.exp(shift - last)[..., None, None]
            shift = last
        else:
            scores = (fq_g @ fk.mT).view(B, Hk, G, n, n)
        scores = torch.where(causal[:n, :n], scores, torch.zeros_like(scores))
        num = inter + scores @ u[:, :, None]
        outs.append((num[..., :dv] / num[..., dv:]).reshape(B, Hq, n, dv))
        kv = kv + fk.mT @ u
    o = torch.cat(outs, dim=2).to(q.dtype)
    return o, (LinearState(kv, shift) if output_final_state else None)
