"""The OAL kernel (§4.3, Eq. 7) and its global special case (App. D, Eq. 23).

A head's dimensions are split into G groups; ``s̄ = [1, s_1, …, s_G]`` with ``s_g = Σ_{r∈g} x_r`` and
``x_r = q_r k_r · scale``. With a lower-triangular ``L ∈ R^{(G+1)×(G+1)}`` and ``M = L Lᵀ``,

    κ_OAL(q, k) = ε + s̄ᵀ M s̄ ≥ ε > 0,

which is Eq. 3 with ``a = ε + M_00``, ``b_r = 2 M_{0, g(r)}``, ``C_rt = M_{g(r), g(t)}`` (group ids shifted by
one for the constant row). The learned global quadratic is G = 1.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops.quadratic import KernelFactor, factored_kernel, quadratic_attention
from .base import AttentionKernel, check_positions


def check_groups(groups: torch.Tensor, num_groups: int, *, name: str = "groups") -> None:
    """groups: ``(Hq, d)`` integer group ids in ``[0, num_groups)``."""
    if not isinstance(groups, torch.Tensor) or groups.dtype not in (torch.int64, torch.int32, torch.int16):
        got = groups.dtype if isinstance(groups, torch.Tensor) else type(groups).__name__
        raise ValueError(f"{name}: expected an integer tensor of shape (Hq, d), got {got}")
    if groups.dim() != 2:
        raise ValueError(f"{name}: expected shape (Hq, d), got {tuple(groups.shape)}")
    lo, hi = int(groups.min()), int(groups.max())
    if lo < 0 or hi >= num_groups:
        raise ValueError(f"{name}: expected group ids in [0, {num_groups}), got values in [{lo}, {hi}]")


def _check_L(L: torch.Tensor, groups: torch.Tensor) -> int:
    if not isinstance(L, torch.Tensor) or L.dim() != 3 or L.shape[1] != L.shape[2]:
        got = tuple(L.shape) if isinstance(L, torch.Tensor) else type(L).__name__
        raise ValueError(f"L: expected shape (Hq, G+1, G+1), got {got}")
    if L.shape[0] != groups.shape[0]:
        raise ValueError(f"L: expected {groups.shape[0]} heads like groups, got shape {tuple(L.shape)}")
    G = L.shape[-1] - 1
    if G < 1:
        raise ValueError(f"L: expected at least one group (G+1 ≥ 2), got shape {tuple(L.shape)}")
    check_groups(groups, G)
    return G


def _check_eps(eps: float) -> None:
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps: expected a positive finite number, got {eps!r}")


def oal_coefficients(
    groups: torch.Tensor, L: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map ``(groups (Hq, d), L (Hq, G+1, G+1), ε)`` to the Eq. 3 coefficients ``a (Hq,)``, ``b (Hq, d)``,
    ``C (Hq, d, d)`` (§4.3). Only the lower triangle of L is used. Differentiable in L."""
    G = _check_L(L, groups)
    _check_eps(eps)
    Lt = L.tril()
    M = Lt @ Lt.mT
    idx = groups.long() + 1
    Hq, d = idx.shape
    a = eps + M[:, 0, 0]
    b = 2 * M[:, 0, :].gather(1, idx)
    rows = M.gather(1, idx[:, :, None].expand(Hq, d, G + 1))
    C = rows.gather(2, idx[:, None, :].expand(Hq, d, d))
    return a, b, C


def oal_factor(groups: torch.Tensor, L: torch.Tensor, eps: float) -> KernelFactor:
    """The same kernel as a sum of G+1 squares, ``κ = ε + Σ_m (L_0m + Σ_r L_{g(r)+1, m} x_r)²`` (Eq. 7 with
    ``s̄ᵀ L Lᵀ s̄ = ‖Lᵀ s̄‖²``); used by the chunked operator for the within-chunk kernel."""
    G = _check_L(L, groups)
    _check_eps(eps)
    Lt = L.tril()
    idx = groups.long() + 1
    Hq, d = idx.shape
    W = Lt.gather(1, idx[:, :, None].expand(Hq, d, G + 1)).mT
    c0 = torch.full((Hq,), float(eps), dtype=L.dtype, device=L.device)
    return KernelFactor(c0=c0, c=Lt[:, 0, :], W=W)


def taylor_global_L(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """Cholesky factor of ``M = [[1, 1/2], [1/2, 1/2]]``: κ = ε + 1 + s + s²/2, the second-order Taylor
    expansion of exp(s) (the Based/TaylorShift form; App. D with m00 = 1, m01 = 1/2, m11 = 1/2)."""
    return torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=dtype, device=device)


def embed_global(L_global: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Embed a global quadratic ``L_global (Hq, 2, 2)`` into a grouped ``(Hq, G+1, G+1)`` factor with the
    same kernel (App. D): ``M_00 = m00``, ``M_0g = m01``, ``M_gh = m11`` for all groups g, h.

    Row g ≥ 1 of the result is ``[l10, l11, 0, …]``, so ``(L Lᵀ)_gh = l10² + l11² = m11`` and
    ``(L Lᵀ)_0g = l00 l10 = m01``; the result is lower-triangular as required.
    """
    if L_global.dim() != 3 or L_global.shape[1:] != (2, 2):
        raise ValueError(f"L_global: expected shape (Hq, 2, 2), got {tuple(L_global.shape)}")
    if num_groups < 1:
        raise ValueError(f"num_groups: expected ≥ 1, got {num_groups}")
    Lg = L_global.tril()
    Hq = Lg.shape[0]
    out = Lg.new_zeros(Hq, num_groups + 1, num_groups + 1)
    out[:, 0, 0] = Lg[:, 0, 0]
    out[:, 1:, 0] = Lg[:, 1, 0][:, None]
    out[:, 1:, 1] = Lg[:, 1, 1][:, None]
    return out


def taylor_L(num_heads: int, num_groups: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Second-order Taylor initialisation of a grouped factor: every head's kernel is ε + 1 + s + s²/2."""
    return embed_global(taylor_global_L(dtype).expand(num_heads, 2, 2), num_groups)


def oal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: torch.Tensor,
    L: torch.Tensor,
    eps: float = 1e-6,
    *,
    scale: float | None = None,
    mode: str = "chunk",
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal OAL attention (Algorithm 1, causal evaluation): Eq. 7's kernel through the HD operator.

    q ``(B, Hq, N, d)``, k ``(B, Hkv, N, d)``, v ``(B, Hkv, N, dv)``, groups ``(Hq, d)``,
    L ``(Hq, G+1, G+1)``. The chunked mode builds its within-chunk kernel from the G+1 squares of Eq. 7, and
    every mode but the naive reference clamps denominators at ``ε · (number of keys)``.
    """
    a, b, C = oal_coefficients(groups, L, eps)
    factor = oal_factor(groups, L, eps) if mode == "chunk" else None
    return quadratic_attention(
        q,
        k,
        v,
        a,
        b,
        C,
        scale=scale,
        mode=mode,
        chunk_size=chunk_size,
        initial_state=initial_state,
        output_final_state=output_final_state,
        factor=factor,
        kernel_floor=eps,
    )


class OALKernel(AttentionKernel):
    """Trainable OAL kernel for the query heads of one attention layer (§4.3, Algorithm 1).

    Holds the fixed group map ``groups (Hq, d)`` as a buffer and the factor ``L (Hq, G+1, G+1)`` as a
    parameter (its strict upper triangle is ignored). Heads with fewer groups than G simply leave the extra
    rows of L unused. The default initialisation is the second-order Taylor kernel (App. B).
    """

    name = "oal"

    def __init__(
        self,
        groups: torch.Tensor,
        num_kv_heads: int,
        num_groups: int | None = None,
        eps: float = 1e-6,
        L: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(groups, torch.Tensor) or groups.dim() != 2:
            raise ValueError("groups: expected an integer tensor of shape (Hq, d)")
        super().__init__(groups.shape[0], num_kv_heads, groups.shape[1])
        G = int(groups.max()) + 1 if num_groups is None else num_groups
        check_groups(groups, G)
        _check_eps(eps)
        self.eps = float(eps)
        self.register_buffer("groups", groups.long().clone())
        init = taylor_L(groups.shape[0], G) if L is None else L.detach().float().clone()
        _check_L(init, groups)
        self.L = nn.Parameter(init)

    @property
    def num_groups(self) -> int:
        return self.L.shape[-1] - 1

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return oal_coefficients(self.groups, self.L, self.eps)

    def weights(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        positions = check_positions(positions, q.shape[2])
        factor = oal_factor(self.groups, self.L, self.eps)
        kern = factored_kernel(q[:, :, positions].float(), k.float(), factor, self.scale)
        return kern * self.causal_mask(positions, k.shape[2])

    def forward(self, q, k, v, *, mode="chunk", initial_state=None, output_final_state=False, chunk_size=64):
        return oal_attention(
            q,
            k,
            v,
            self.groups,
            self.L,
            self.eps,
            mode=mode,
            chunk_size=chunk_size,
            initial_state=initial_state,
            output_final_state=output_final_state,
        )


class GlobalQuadraticKernel(OALKernel):
    """The learned global quadratic ``ε + m00 + 2 m01 s + m11 s²`` (App. D, Eq. 23): OAL with one group."""

    name = "global"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float = 1e-6, L: torch.Tensor | None = None
    ) -> None:
        groups = torch.zeros(num_heads, head_dim, dtype=torch.long)
        super().__init__(groups, num_kv_heads, num_groups=1, eps=eps, L=L)
