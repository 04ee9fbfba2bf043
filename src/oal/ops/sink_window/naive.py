"""Ground truth: the explicit N×N weights of the sink/window operator, straight from its definition.

Nothing here shares the delayed-key construction or the blockwise evaluation of ``chunk.py`` and
``recurrent.py``: the exact and kernel sets are masks over the full (query, key) grid, the kernel is
:func:`oal.ops.quadratic.naive_kernel_matrix` (Eq. 3 written over all d² pairs), and the final state is the
explicit Eq. 5 sum over the keys that left the window.
"""

from __future__ import annotations

import math

import torch

from ..quadratic import key_features, naive_kernel_matrix
from ..quadratic.utils import KernelFactor, check_coefficients, check_qkv, compute_dtype, default_scale
from .utils import SinkWindowState, check_beta, check_config


def sink_window_weights(
    logits: torch.Tensor,
    kappa: torch.Tensor,
    positions: torch.Tensor,
    beta: torch.Tensor,
    *,
    n_sink: int,
    window: int,
) -> torch.Tensor:
    """Combined unnormalised weights ``(B, Hq, P, N)`` of the queries at ``positions``, one common scale per row.

    logits ``s_ij = q_i·k_j·scale`` and kappa ``κ(q_i, k_j)`` are ``(B, Hq, P, N)``, positions ``(P,)``, beta
    ``(Hq,)``. With E_i = {j ≤ i : j < n_sink or j > i - window} and K_i = {n_sink ≤ j ≤ i - window}:

        W_ij = e^{s_ij - M_i}           for j ∈ E_i,
        W_ij = e^{β_h - M_i} κ_ij       for j ∈ K_i,          0 otherwise,

    with ``M_i = max(max_{E_i} s_ij, β_h + log Σ_{K_i} κ_ij)``. Every weight is ≤ 1 for a positive kernel and the
    row sum is ≥ 1; any per-row scale cancels in ``W v / Σ W``. The kernel weights are evaluated as
    ``e^{ℓ_i - M_i} κ_ij / Σ_{K_i} κ`` (ℓ_i = β_h + log Σ_{K_i} κ), the same number, so that ``e^{β_h - M_i}``
    is never formed where K_i is empty and M_i may sit far below β_h.
    """
    N = logits.shape[-1]
    i = positions.to(logits.device)[:, None]
    j = torch.arange(N, device=logits.device)[None, :]
    causal = j <= i
    exact = causal & ((j < n_sink) | (j > i - window))
    kern = causal & ~exact
    has_kern = kern.any(-1)  # (P,)
    kern_sum = (kappa * kern).sum(-1)
    kern_sum = torch.where(has_kern, kern_sum, torch.ones_like(kern_sum))
    log_mass = torch.where(
        has_kern, beta[:, None].to(logits.dtype) + torch.log(kern_sum), torch.full_like(kern_sum, -math.inf)
    )
    s = logits.masked_fill(~exact, -math.inf)
    M = torch.maximum(s.amax(-1), log_mass).detach()[..., None]
    w_exact = torch.exp(s - M)
    w_kern = torch.exp(log_mass[..., None] - M) * kappa / kern_sum[..., None]
    return w_exact + torch.where(kern, w_kern, torch.zeros_like(w_kern))


def naive_sink_window_attention(
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
    initial_state: SinkWindowState | None = None,
    output_final_state: bool = False,
    factor: KernelFactor | None = None,
    kernel_floor: float | None = None,
) -> tuple[torch.Tensor, SinkWindowState | None]:
    """O(N²) reference: ``o_i = Σ_j W_ij v_j / Σ_j W_ij`` with the weights of :func:`sink_window_weights`.

    Shapes as in :func:`oal.ops.sink_window_attention`. ``factor`` and ``kernel_floor`` are accepted for a
    uniform signature and unused (the kernel comes from a, b, C). A whole sequence from position 0 only:
    ``initial_state`` is refused.
    """
    dims = check_qkv(q, k, v)
    check_coefficients(a, b, C, dims)
    check_beta(beta, dims)
    check_config(n_sink, window)
    if initial_state is not None:
        raise ValueError(
            "initial_state: the naive reference evaluates whole sequences from position 0; "
            "continue a state with mode='chunk' or mode='recurrent'"
        )
    s = default_scale(dims.d, scale)
    B, Hq, Hkv, N, d, dv = dims
    G = dims.group
    cdt = compute_dtype(q.dtype)
    qf, kf, vf = q.to(cdt), k.to(cdt), v.to(cdt)
    kq = kf.repeat_interleave(G, dim=1)  # (B, Hq, N, d): query head h reads KV head h // G
    logits = (qf @ kq.mT) * s
    kappa = torch.stack(
        [
            torch.stack(
                [
                    naive_kernel_matrix(qf[bi, h], kq[bi, h], a[h].to(cdt), b[h].to(cdt), C[h].to(cdt), s)
                    for h in range(Hq)
                ]
            )
            for bi in range(B)
        ]
    )
    W = sink_window_weights(logits, kappa, torch.arange(N), beta.to(cdt), n_sink=n_sink, window=window)
    o = (W @ vf.repeat_interleave(G, dim=1)) / W.sum(-1, keepdim=True)

    final = None
    if output_final_state:
        left = (torch.arange(N, device=q.device) >= n_sink) & (torch.arange(N, device=q.device) <= N - 1 - window)
        u = torch.cat([vf, torch.ones_like(vf[..., :1])], dim=-1) * left[:, None].to(cdt)
        pad = max(window - N, 0)
        m = min(n_sink, N)

        def buf(x: torch.Tensor, lo: int, hi: int, before: int, after: int) -> torch.Tensor:
            z = x.new_zeros
            return torch.cat([z(B, Hkv, before, x.shape[-1]), x[:, :, lo:hi], z(B, Hkv, after, x.shape[-1])], dim=2)

        final = SinkWindowState(
            kernel=key_features(kf).mT @ u,
            sink_k=buf(k, 0, m, 0, n_sink - m),
            sink_v=buf(v, 0, m, 0, n_sink - m),
            window_k=buf(k, N - window + pad, N, pad, 0),
            window_v=buf(v, N - window + pad, N, pad, 0),
            offset=N,
        )
    return o.to(q.dtype), final
