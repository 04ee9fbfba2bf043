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


def _tail_dims(groups: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per head, the largest group ("bulk") and the other ("tail") dimensions, padded to a common count.

    Returns ``bulk (Hq,)``, ``tail_idx (Hq, t)`` dimension indices and ``tail_onehot (Hq, G, t)`` (zero rows
    for the bulk group and zero columns for padding)."""
    Hq, d = groups.shape
    counts = F.one_hot(groups, G).sum(1)  # (Hq, G)
    bulk = counts.argmax(1)
    is_tail = groups != bulk[:, None]
    t = max(1, int(is_tail.sum(1).max()))
    # stable sort puts each head's tail dimensions first, in index order
    order = torch.sort((~is_tail).to(torch.int8), dim=1, stable=True).indices[:, :t]
    valid = torch.gather(is_tail, 1, order)
    gid = torch.gather(groups, 1, order)
    onehot = (F.one_hot(gid, G).mT * valid[:, None, :]).contiguous()
    return bulk, order, onehot


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
    positions; ``None`` computes the exact causal softmax output (with ``scale``) in the same pass.

    Cost per position and head, over its causal prefix of i keys: the full score (d MACs per key), the
    scores of the non-bulk groups (their dimensions only: the bulk group's score is the full score minus
    the others, since groups partition the dimensions), and one (G+1 + G(G+1)/2 rows) × (dv+1) product;
    the pair (0, 0) statistics are prefix sums. Positions are processed in sorted blocks whose key range
    stops at the block's last position; a block holds about ``block_bytes`` of score rows.
    """
    Hq, N, d = q.shape
    Hkv, dv = k.shape[0], v.shape[-1]
    check_groups(groups, num_groups)
    if groups.shape != (Hq, d):
        raise ValueError(f"groups: expected shape {(Hq, d)}, got {tuple(groups.shape)}")
    G = num_groups
    n = (G + 1) * (G + 2) // 2
    quad = G * (G + 1) // 2
    softmax = target is None
    rep = Hq // Hkv
    P = positions.numel()
    if target is not None and target.shape != (Hq, P, dv):
        raise ValueError(f"target: expected shape {(Hq, P, dv)}, got {tuple(target.shape)}")

    order = positions.argsort()
    pos_sorted = positions[order]
    bulk, tail_idx, tail_onehot = _tail_dims(groups.long(), G)
    tail_onehot = tail_onehot.to(q.dtype)
    t = tail_idx.shape[1]
    kv_of = torch.arange(Hq) // rep
    k_tail = k[kv_of[:, None], :, tail_idx]  # (Hq, t, N): each query head's tail dimensions of its keys
    qs = q * scale
    u = torch.cat([v, v.new_ones(Hkv, N, 1)], dim=-1)
    u_cum = u.cumsum(1)  # Σ_{j≤i} u_j: the statistics of the pair (0, 0)
    R = torch.empty(Hq, P, n, n, dtype=torch.float64)
    f = torch.empty(Hq, P, n, dtype=torch.float64)
    y_out = q.new_empty(Hq, P, dv)
    per_position = Hq * (G + quad + 1) * (int(pos_sorted[-1]) + 1 if P else 1) * q.element_size()
    block = max(1, block_bytes // per_position)
    for start in range(0, P, block):
        idx = order[start : start + block]
        p = pos_sorted[start : start + block]
        nb, lo, nk = p.numel(), int(p[0]) + 1, int(p[-1]) + 1
        qp = qs[:, p]  # (Hq, nb, d)
        total = (qp.view(Hkv, rep * nb, d) @ k[:, :nk].mT).view(Hq, nb, nk)
        q_tail = torch.gather(qp, 2, tail_idx[:, None, :].expand(Hq, nb, t))
        q_tail = (q_tail[:, :, None, :] * tail_onehot[:, None]).reshape(Hq, nb * G, t)
        s = (q_tail @ k_tail[:, :, :nk]).view(Hq, nb, G, nk)  # s_g of the tail groups, 0 for the bulk
        s.scatter_add_(2, bulk.view(Hq, 1, 1, 1).expand(Hq, nb, 1, nk), (total - s.sum(2))[:, :, None])
        # keys before the block's first position are causal for all of it; only the tail needs a mask
        tail = (torch.arange(lo, nk)[None, :] <= p[:, None])[None, :, None]  # (1, nb, 1, nk - lo)
        s[..., lo:] *= tail
        prod = q.new_empty(Hq, nb, quad, nk)  # products s_a s_b, 1 ≤ a ≤ b ≤ G, row-major
        off = 0
        for a in range(G):
            torch.mul(s[:, :, a : a + 1], s[:, :, a:], out=prod[:, :, off : off + G - a])
            off += G - a
        lin = (s.view(Hkv, rep * nb * G, nk) @ u[:, :nk]).view(Hq, nb, G, dv + 1)
        sq = (prod.view(Hkv, rep * nb * quad, nk) @ u[:, :nk]).view(Hq, nb, quad, dv + 1)
        if softmax:
            total[..., lo:].masked_fill_(~tail[:, :, 0], float("-inf"))
            total.sub_(total.amax(-1, keepdim=True)).exp_()
            soft = (total.view(Hkv, rep * nb, nk) @ u[:, :nk]).view(Hq, nb, dv + 1)
            y = soft[..., :dv] / soft[..., dv:]
        else:
            y = target[:, idx]
        # pair order of pair_indices: (0, 0), (0, 1..G), then row-major a ≤ b over the groups
        Fp = torch.cat([u_cum[kv_of[:, None], p[None, :]][:, :, None], lin, sq], dim=2)
        E = (Fp[..., :dv] - Fp[..., dv:] * y[:, :, None, :]).double()
        R[:, idx] = E @ E.mT
        f[:, idx] = Fp[..., dv].double()
        y_out[:, idx] = y
    return OutputStats(R=R, f=f, y=y_out)
