"""Ground truth: the explicit N×N matrix ``φ_q(q_i)ᵀ φ_k(k_j)``, masked causally and normalised."""

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
    key_scales,
    pair_scales,
    values_with_ones,
)


def causal_kernel_matrix(
    fq: torch.Tensor,
    fk: torch.Tensor,
    positions: torch.Tensor,
    *,
    log_keys: bool,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Explicit causal kernel between queries at ``positions`` and all keys.

    ``fq (B, Hq, P, m)`` query features at the positions, ``fk (B, Hk, N, m)`` key features (log-features if
    ``log_keys``), ``positions (P,)``. Returns ``(B, Hq, P, N)``, zero where key > position, and for log keys the
    per-query log-units ``c (B, Hk, P)`` (row p is the kernel divided by ``exp(c_p)``, the maximum log-feature
    over the keys ≤ p and, if given, the preceding state's ``shift (B, Hk)``); ``None`` otherwise.
    """
    B, Hq, P, m = fq.shape
    Hk, N = fk.shape[1], fk.shape[2]
    c = None
    if log_keys:
        if shift is None:
            shift = torch.full((B, Hk), float("-inf"), dtype=fk.dtype, device=fk.device)
        fk, M, c_all = key_scales(fk, shift)
        c = c_all[..., positions]
    kern = fq.reshape(B, Hk, Hq // Hk, P, m) @ fk[:, :, None].mT  # (B, Hk, G, P, N)
    if c is not None:
        kern = kern * pair_scales(M, c)[:, :, None]
    mask = torch.arange(N, device=fk.device)[None, :] <= positions[:, None]
    return torch.where(mask, kern, torch.zeros_like(kern)).reshape(B, Hq, P, N), c


def naive_linear_attention(
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
    """O(N²) causal normalised feature attention; see :func:`oal.ops.linear_attention` for the arguments."""
    dims = check_inputs(q, k, v)
    Hk = check_key_heads(key_heads, dims)
    B, Hq, Hkv, N, d, dv = dims
    G = Hq // Hk
    cdt = accumulation_dtype(dtype, q.dtype)
    qf, kf, vf = q.to(cdt), k.to(cdt), v.to(cdt)
    fq = query_map(qf, kf)
    check_features("query_map", fq, (B, Hq, N, -1), cdt)
    m = fq.shape[-1]
    fk = key_map(qf, kf)
    check_features("key_map", fk, (B, Hk, N, m), cdt)
    kv0 = shift0 = None
    if initial_state is not None:
        check_state(initial_state, B, Hk, m, dv, log_keys)
        kv0, shift0 = initial_state.kv.to(cdt), initial_state.shift.to(cdt)

    u = values_with_ones(vf, Hk)  # (B, Hk, N, dv+1)
    positions = torch.arange(N, device=q.device)
    kern, c = causal_kernel_matrix(fq, fk, positions, log_keys=log_keys, shift=shift0)
    num = kern.reshape(B, Hk, G, N, N) @ u[:, :, None]
    if kv0 is not None:
        prefix = fq.reshape(B, Hk, G, N, m) @ kv0[:, :, None]
        if c is not None:
            prefix = prefix * torch.exp(shift0[..., None] - c)[:, :, None, :, None]
        num = num + prefix
    o = (num[..., :dv] / num[..., dv:]).reshape(B, Hq, N, dv).to(q.dtype)

    final = None
    if output_final_state:
        if log_keys:
            start = shift0 if shift0 is not None else torch.full((B, Hk), float("-inf"), dtype=cdt, device=q.device)
            fk_hat, M, c_all = key_scales(fk, start)
            end = c_all[..., -1]
            kv = (fk_hat * torch.exp(M - end[..., None])[..., None]).mT @ u
            if kv0 is not None:
                kv = kv + kv0 * torch.exp(shift0 - end)[..., None, None]
            final = LinearState(kv, end)
        else:
            kv = fk.mT @ u
            final = LinearState(kv if kv0 is None else kv + kv0, torch.zeros(B, Hk, dtype=cdt, device=q.device))
    return o, final
