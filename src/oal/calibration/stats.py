"""Output statistics that make the Eq. 20 objective of grouped quadratic kernels (OAL, the learned global)
independent of the sequence length once computed.

For one query position i of one head, the OAL kernel (Eq. 7) is linear in ``M = L Lᵀ``:

    κ(q_i, k_j) = ε + s̄ᵀ M s̄ = Σ_{a≤b} m_ab s̄_a s̄_b,     s̄ = [1, s_1, …, s_G],  s_g = scale·Σ_{r∈g} q_ir k_jr,

with ``m_ab = M_ab`` on the diagonal, ``2 M_ab`` off it, and ε added to ``m_00`` (s̄_0 = 1). With
``F_p = Σ_{j≤i} s̄_a s̄_b [v_j; 1]`` for the ``n = (G+1)(G+2)/2`` pairs ``p = (a, b)``, the normalised output is
``ŷ_i = mᵀF_v / mᵀf`` (``F_v`` the value part, ``f`` the last column), so for a target ``y*_i``

    ‖ŷ_i − y*_i‖² = mᵀ R m / (mᵀ f)²,      R = E Eᵀ,  E = F_v − f y*ᵀ   (n × dv).

``R (n × n)`` and ``f (n)`` are computed once per sampled position (one pass over its causal prefix), after
which the loss and its gradient in L cost O(n²) per position and head, whatever N. The identity is exact;
R is kept in fp64 so that the quadratic form does not lose the small residual of a good fit to rounding.
The learned global quadratic is OAL with its factor embedded (App. D), so it reuses the same statistics.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
from torch.nn import functional as F

from ..kernels import check_groups


class OutputStats(NamedTuple):
    """Statistics of P query positions, head-major: ``R (Hq, P, n, n)`` and ``f (Hq, P, n)`` in fp64, and the
    target outputs ``y (Hq, P, dv)`` in the inputs' dtype."""

    R: torch.Tensor
    f: torch.Tensor
    y: torch.Tensor


@lru_cache(maxsize=16)
def pair_indices(num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major pairs ``(a, b)``, ``a ≤ b``, over the G+1 entries of s̄: two ``(n,)`` index tensors."""
    iu = torch.triu_indices(num_groups + 1, num_groups + 1)
    return iu[0].contiguous(), iu[1].contiguous()


def pair_weights(M: torch.Tensor, eps: float) -> torch.Tensor:
    """``M (..., G+1, G+1)`` symmetric -> the pair weights ``m (..., n)`` of the kernel ``ε + s̄ᵀ M s̄``."""
    ia, ib = pair_indices(M.shape[-1] - 1)
    m = M[..., ia, ib] * torch.where(ia == ib, 1.0, 2.0).to(M.dtype)
    return m + eps * (torch.arange(ia.numel()) == 0).to(M.dtype)


def stats_mse(m: torch.Tensor, R: torch.Tensor, f: torch.Tensor, dv: int) -> torch.Tensor:
    """Mean squared output error per head: ``m (I, Hq, n)``, ``R (Hq, P, n, n)``, ``f (Hq, P, n)`` ->
    ``(I, Hq)`` fp64, the mean over the P positions and dv output channels. Differentiable in m."""
    m = m.double()
    quad = torch.einsum("ihn,hpnk,ihk->ihp", m, R, m)
    den = torch.einsum("ihn,hpn->ihp", m, f)
    return (quad / den.square()).mean(-1) / dv


@lru_cache(maxsize=16)
def pair_map(num_groups: int, factor_size: int) -> torch.Tensor:
    """Linear map ``W ((r·r), n)`` (fp64) from a factor's ``vec(M)``, ``M = L Lᵀ`` of size r, to the pair
    weights over G groups: ``m = vec(M) W + ε e_0``. Only the upper triangle of M is read.

    ``r = G+1``: OAL (``m_ab = M_ab``, doubled off the diagonal). ``r = 2``: the global quadratic embedded as
    in App. D (``M_00 = m00``, ``M_0g = m01``, ``M_gh = m11``), i.e. the weights of
    ``ε + m00 + 2 m01 Σ_g s_g + m11 (Σ_g s_g)²``.
    """
    G, r = num_groups, factor_size
    ia, ib = pair_indices(G)
    dup = torch.where(ia == ib, 1.0, 2.0).double()
    W = torch.zeros(r * r, ia.numel(), dtype=torch.float64)
    if r == G + 1:
        W[ia * r + ib, torch.arange(ia.numel())] = dup
    elif r == 2:
        W[0, 0] = 1.0
        W[1, (ia == 0) & (ib > 0)] = 2.0
        W[3] = torch.where(ia > 0, dup, 0.0)
    else:
        raise ValueError(f"factor_size: expected {G + 1} (OAL) or 2 (global), got {r}")
    return W


def factor_mse(
    L: torch.Tensor, W: torch.Tensor, eps: float, R: torch.Tensor, f: torch.Tensor, dv: int, *, grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-head output MSE of factors ``L (I, Hq, r, r)`` (lower triangle used) on statistics
    ``R (Hq, P, n, n)``, ``f (Hq, P, n)``, and its gradient in L, in closed form (fp64).

    With ``m = vec(L Lᵀ) W + ε e_0``, ``q_p = mᵀR_p m``, ``d_p = mᵀf_p`` and ``ℓ = mean_p q_p/d_p² / dv``:
    ``∂ℓ/∂m = mean_p (2 R_p m / d_p² − 2 q_p f_p / d_p³) / dv``, ``∂ℓ/∂M = unvec(W ∂ℓ/∂m)`` and
    ``∂ℓ/∂L = tril((∂ℓ/∂M + ∂ℓ/∂Mᵀ) L)``. Returns ``(mse (I, Hq), grad (I, Hq, r, r) or None)``.
    """
    I, Hq, r, _ = L.shape
    P, n = R.shape[1], R.shape[2]
    Lt = L.double().tril()
    m = (Lt @ Lt.mT).flatten(-2) @ W
    m[..., 0] += eps
    mh = m.permute(1, 2, 0)  # (Hq, n, I): batched matmuls over heads on the contiguous statistics
    Rm = (R.view(Hq, P * n, n) @ mh).view(Hq, P, n, I)
    quad = (Rm * mh[:, None]).sum(2)  # (Hq, P, I)
    den = f @ mh
    inv = 1.0 / den.square()
    mse = (quad * inv).mean(1).T / dv
    if not grad:
        return mse, None
    gm = (Rm * inv[:, :, None]).sum(1) - f.mT @ (quad * inv / den)  # (Hq, n, I)
    gM = (gm.permute(2, 0, 1) * (2.0 / (P * dv))) @ W.mT
    gM = gM.view(I, Hq, r, r)
    return mse, ((gM + gM.mT) @ Lt).tril()


def grouped_output_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    positions: torch.Tensor,
    *,
    scale: float,
    target: torch.Tensor | None = None,
    block_bytes: int = 1 << 26,
) -> OutputStats:
    """Statistics for the query positions ``positions (P,)`` of one sequence.

    q ``(Hq, N, d)``, k ``(Hkv, N, d)``, v ``(Hkv, N, dv)`` (fp32, or fp64 for reference checks), groups
    ``(Hq, d)`` with ids in ``[0, num_groups)``. ``target (Hq, P, dv)``: the outputs to match at those
    positions; ``None`` computes the exact causal softmax output (with ``scale``) in the same pass, from the
    summed group scores.

    Positions are processed in sorted blocks whose key range stops at the block's last position; a block
    holds about ``block_bytes`` of pair products.
    """
    Hq, N, d = q.shape
    Hkv, dv = k.shape[0], v.shape[-1]
    check_groups(groups, num_groups)
    if groups.shape != (Hq, d):
        raise ValueError(f"groups: expected shape {(Hq, d)}, got {tuple(groups.shape)}")
    G = num_groups
    n = (G + 1) * (G + 2) // 2
    softmax = target is None
    rows = G + 1 + softmax  # s̄ = [1, s_1..s_G] and, for a softmax target, the logit row
    rep = Hq // Hkv
    P = positions.numel()
    if target is not None and target.shape != (Hq, P, dv):
        raise ValueError(f"target: expected shape {(Hq, P, dv)}, got {tuple(target.shape)}")

    order = positions.argsort()
    pos_sorted = positions[order]
    onehot = F.one_hot(groups.long(), G).mT.to(q.dtype) * scale  # (Hq, G, d)
    kx = torch.cat([k, k.new_ones(Hkv, N, 1)], dim=-1).mT  # (Hkv, d+1, N)
    u = torch.cat([v, v.new_ones(Hkv, N, 1)], dim=-1)
    R = torch.empty(Hq, P, n, n, dtype=torch.float64)
    f = torch.empty(Hq, P, n, dtype=torch.float64)
    y_out = q.new_empty(Hq, P, dv)
    quad = G * (G + 1) // 2
    per_position = Hq * (rows + quad) * (int(pos_sorted[-1]) + 1 if P else 1) * 4
    block = max(1, block_bytes // per_position)
    for start in range(0, P, block):
        idx = order[start : start + block]
        p = pos_sorted[start : start + block]
        nb, lo, nk = p.numel(), int(p[0]) + 1, int(p[-1]) + 1
        # query side of one matmul giving every row: k carries an extra ones column, so the row selecting
        # it is s̄_0 = 1, group rows are the group-masked queries, the logit row is the whole query
        qp = q[:, p]  # (Hq, nb, d)
        qb = q.new_zeros(Hq, nb, rows, d + 1)
        qb[:, :, 0, d] = 1.0
        torch.mul(qp[:, :, None, :], onehot[:, None], out=qb[:, :, 1 : G + 1, :d])
        if softmax:
            torch.mul(qp, scale, out=qb[:, :, G + 1, :d])
        s = (qb.view(Hkv, rep * nb * rows, d + 1) @ kx[:, :, :nk]).view(Hq, nb, rows, nk)
        # keys before the block's first position are causal for all of it; only the tail needs a mask
        tail = (torch.arange(lo, nk)[None, :] <= p[:, None])[None, :, None]  # (1, nb, 1, nk - lo)
        s[:, :, : G + 1, lo:] *= tail
        if softmax:
            logit = s[:, :, G + 1]
            logit[:, :, lo:].masked_fill_(~tail[:, :, 0], float("-inf"))
            logit.sub_(logit.amax(-1, keepdim=True)).exp_()
        lin = (s.view(Hkv, rep * nb * rows, nk) @ u[:, :nk]).view(Hq, nb, rows, dv + 1)
        prod = q.new_empty(Hq, nb, quad, nk)  # products s_a s_b, 1 ≤ a ≤ b ≤ G, row-major
        off = 0
        for a in range(1, G + 1):
            torch.mul(s[:, :, a : a + 1], s[:, :, a : G + 1], out=prod[:, :, off : off + G + 1 - a])
            off += G + 1 - a
        sq = (prod.view(Hkv, rep * nb * quad, nk) @ u[:, :nk]).view(Hq, nb, quad, dv + 1)
        # pair order of pair_indices: (0, 0..G) first, then row-major a ≤ b over the groups
        Fp = torch.cat([lin[:, :, : G + 1], sq], dim=2)
        y = lin[:, :, G + 1, :dv] / lin[:, :, G + 1, dv:] if softmax else target[:, idx]
        E = (Fp[..., :dv] - Fp[..., dv:] * y[:, :, None, :]).double()
        R[:, idx] = E @ E.mT
        f[:, idx] = Fp[..., dv].double()
        y_out[:, idx] = y
    return OutputStats(R=R, f=f, y=y_out)
