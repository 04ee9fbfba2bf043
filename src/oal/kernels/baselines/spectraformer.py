"""SpectraFormer OPRF–FastFoodL (learnable FastFood projection, optimal positive random features), App. F.1.

How the upstream code (dukenguyenxyz/spectraformer, ``FastAttention`` with ``kernel_fn="oprf"`` and
``feat="fastfood_learnable"``) builds its features, which this module re-derives in closed form:

* Scaling. The Performer wrapper divides q and k by ``d^{1/4}``; the FastFood map multiplies by
  ``sqrt(softmax_temp) = d^{-1/4}`` again and its output by ``d^{-1/2}``. With ``x = q d^{-1/4}``:
  ``V(x) = d^{-1/2} · S ⊙ H G Π H B (x d^{-1/4})`` with H the unnormalised d×d Walsh–Hadamard matrix, Π a fixed
  permutation and B, G, S diagonal (vectors). At the fixed-branch initialisation (B Rademacher, G standard
  normal, S = χ_d samples / ‖G‖) the rows of the implied matrix have χ_d norms, i.e. V behaves like a Gaussian
  projection of ``q/√d``.
* 65 features for d = 64. The "smoothed" FastFood map appends one constant coordinate 1 to the d projections:
  ``V̄(x) = [V(x); 1]`` (m = d + 1).
* OPRF ("optimal positive random features", the GERF family of Likhosherstov et al., 2022, with s = +1).
  The log-feature is ``A‖ω‖² + B_c ωᵀx + C‖x‖²`` with ``B_c = sqrt(1 − 4A)`` and A chosen to minimise the
  estimator's variance from the statistic ``φ = ‖x + y‖²`` of the query x and key y *of the same token*
  (upstream averages it over the batch; here each sequence uses its own, which is the upstream computation at
  batch size 1 and keeps outputs independent of batch composition):

      ρ = 2d / (sqrt((2φ + d)² + 8φd) + 2φ + d),   A = (1 − 1/ρ)/8,   B_c = sqrt((1 + 1/ρ)/2) ≥ 1.

  (this is upstream's ``(sqrt(b² − 4ac) − b)/2a`` with a = 2φ, b = 2φ + d, c = −d, rewritten without the
  cancellation, so φ → 0 gives ρ → 1 instead of 0/0). Upstream's ``A‖ω‖²`` uses one norm for all features
  (the norm of the vector S⊙G⊙B) and ``C‖x‖²`` is per token, so both are per-token constants that the row-max
  stabilisation below removes exactly, as is the GERF factor D (its sign is +1 for A < 1/4); they are omitted.
* Stabilisation. ``φ_l(x) = exp(z_l − max_l' z_l') + 10⁻⁴`` with ``z = B_c · V̄(x)``: a per-token row maximum,
  then an additive offset. For keys this per-token factor does not cancel: it is part of the kernel, applied
  identically in every mode, and left in the autograd graph.

The query of head h at token i uses ``B_c(q_{h,i}, k_{g(h),i})``, and so does the key of token i for head h: key
features therefore depend on the query head and the state is kept per query head, ``(B, Hq, d + 1, dv + 1)``.
B, G, S (fp32 parameters, 3d per layer, shared by the layer's query heads) are trained; Π is a fixed buffer.
Features and prefix sums default to fp64 (F.1).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn

from ..base import repeat_kv
from .common import FeatureKernel, kernel_generator


@lru_cache(maxsize=8)
def _hadamard_cpu(d: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < d:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


def hadamard_matrix(d: int, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """Unnormalised Sylvester–Hadamard matrix ``(d, d)`` (entries ±1, ``H Hᵀ = d I``, symmetric); d a power of 2."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"d: expected a power of 2, got {d}")
    return _hadamard_cpu(d).to(dtype=dtype, device=device)


def fastfood(x: torch.Tensor, B: torch.Tensor, G: torch.Tensor, S: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``S ⊙ H G Π H B x`` on the last axis: x ``(..., d)``; B, G, S ``(d,)``; perm ``(d,)`` with
    ``(Π y)_i = y_{perm_i}``."""
    H = hadamard_matrix(x.shape[-1], x.dtype, x.device)
    y = ((x * B) @ H)[..., perm]
    return ((y * G) @ H) * S


def oprf_coefficient(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """OPRF projection coefficient ``B_c = sqrt(1 − 4A)`` per token: x, y ``(..., d)`` -> ``(...)``."""
    d = x.shape[-1]
    phi = (x + y).square().sum(-1)
    b = 2 * phi + d
    inv_rho = (torch.sqrt(b.square() + 8 * d * phi) + b) / (2 * d)
    return torch.sqrt((1 + inv_rho) / 2)


class SpectraFormerKernel(FeatureKernel):
    """SpectraFormer OPRF–FastFoodL kernel for the query heads of one layer.

    Parameters (fp32, per layer, shared by all query heads): ``ff_B``, ``ff_G``, ``ff_S`` ``(d,)``. Buffer:
    ``perm (d,)``. m = d + 1 features; state ``(B, Hq, d + 1, dv + 1)`` (the shift stays 0).
    """

    name = "spectraformer"
    _config_keys = ("eps", "dtype")

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        eps: float = 1e-4,
        layer_idx: int = 0,
        seed: int = 0,
        dtype: torch.dtype | str = torch.float64,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, layer_idx=layer_idx, seed=seed, dtype=dtype)
        if head_dim & (head_dim - 1):
            raise ValueError(f"head_dim: FastFood needs a power of 2, got {head_dim}")
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps: expected a finite non-negative number, got {eps!r}")
        self.eps = float(eps)
        g = kernel_generator(self.name, seed, layer_idx)
        d = head_dim
        # the upstream fixed-branch distributions (F.1: the learnable branch's small-normal init gives nearly
        # token-independent features)
        B = torch.randint(0, 2, (d,), generator=g).double() * 2 - 1
        G = torch.randn(d, generator=g, dtype=torch.float64)
        S = torch.randn(d, d, generator=g, dtype=torch.float64).norm(dim=1) / G.norm()
        self.register_buffer("perm", torch.randperm(d, generator=g))
        self.ff_B = nn.Parameter(B.float())
        self.ff_G = nn.Parameter(G.float())
        self.ff_S = nn.Parameter(S.float())

    @property
    def num_features(self) -> int:
        return self.head_dim + 1

    @property
    def key_heads(self) -> int:
        return self.num_heads

    def projection(self, x: torch.Tensor) -> torch.Tensor:
        """``V(x) = d^{-1/2} · FastFood(x d^{-1/4})`` for inputs already scaled by ``d^{-1/4}``: ``(..., d)``."""
        dt = x.dtype
        v = fastfood(x * self.input_scale, self.ff_B.to(dt), self.ff_G.to(dt), self.ff_S.to(dt), self.perm)
        return v * self.head_dim**-0.5

    def _features(self, proj: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        z = coef[..., None] * torch.cat([proj, torch.ones_like(proj[..., :1])], dim=-1)
        return torch.exp(z - z.amax(-1, keepdim=True)) + self.eps

    def _scaled(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xq = q * self.input_scale
        xk = k * self.input_scale
        return xq, xk, oprf_coefficient(xq, repeat_kv(xk, self.num_heads))

    def query_features(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        xq, _, coef = self._scaled(q, k)
        return self._features(self.projection(xq), coef)

    def key_features(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        _, xk, coef = self._scaled(q, k)
        return self._features(repeat_kv(self.projection(xk), self.num_heads), coef)
