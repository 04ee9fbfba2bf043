"""TaylorShift's second-order Taylor kernel with ℓ2-normalised queries and keys, adapted as in App. F.1.

    κ_h(q, k) = 1 + s + s²/2,      s = τ_h q̂ᵀk̂,   q̂ = q/‖q‖, k̂ = k/‖k‖,

with a trainable temperature τ_h per query head (init 1). This is the quadratic kernel of Eq. 3 on (q̂, k̂) with
scale 1 and per-head coefficients ``a = 1``, ``b = τ·1``, ``C = (τ²/2)·11ᵀ`` (since ``Σ_r q̂_r k̂_r = q̂ᵀk̂``), so
every mode runs through :func:`oal.ops.quadratic_attention` with its packed per-KV-head state
``(B, Hkv, 1 + d + d(d+1)/2, dv + 1)``. The chunked mode uses the sum-of-squares form
``1 + s + s²/2 = 1/2 + ((1 + s)/√2)²`` (a :class:`KernelFactor` with one square), which is ≥ 1/2 also in floating
point; that floor also clamps the denominators of the fast modes.

Upstream's direct path divides by a per-query maximum and its efficient path multiplies q and k by ``d^{1/4}``
and compensates in the coefficients: both cancel in the normalisation and are omitted. The optional output
amplitude normalisation is disabled (``output_normalized=False``, F.1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...ops.linear import accumulation_dtype
from ...ops.quadratic import KernelFactor, feature_dim, quadratic_attention
from ..base import AttentionKernel, check_positions, repeat_kv
from .common import ConfigMixin, check_nonnegative_int, check_qk, parse_dtype

KERNEL_FLOOR = 0.5


class TaylorShiftKernel(ConfigMixin, AttentionKernel):
    """TaylorShift kernel for the query heads of one layer. Parameter: ``temperature (Hq,)``."""

    name = "taylorshift"
    _config_keys = ("dtype",)

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        layer_idx: int = 0,
        seed: int = 0,
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        for key, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if check_nonnegative_int(key, value) == 0:
                raise ValueError(f"{key}: expected a positive integer, got {value}")
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.layer_idx = check_nonnegative_int("layer_idx", layer_idx)
        self.seed = check_nonnegative_int("seed", seed)  # deterministic kernel: recorded for uniform configs only
        self.dtype = parse_dtype(dtype)
        self.temperature = nn.Parameter(torch.ones(num_heads))

    def coefficients(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Eq. 3 coefficients on (q̂, k̂): ``a (Hq,)``, ``b (Hq, d)``, ``C (Hq, d, d)``. Differentiable in τ."""
        tau = self.temperature.to(dtype)
        ones = torch.ones(self.head_dim, dtype=dtype, device=tau.device)
        a = torch.ones_like(tau)
        b = tau[:, None] * ones
        C = (tau.square() / 2)[:, None, None] * (ones[:, None] * ones[None, :])
        return a, b, C

    def factor(self, dtype: torch.dtype = torch.float32) -> KernelFactor:
        """``1/2 + (1/√2 + (τ/√2) Σ_r q̂_r k̂_r)²`` as a :class:`KernelFactor` (c0, one square)."""
        tau = self.temperature.to(dtype)
        r = math.sqrt(0.5)
        c0 = torch.full_like(tau, KERNEL_FLOOR)
        c = torch.full_like(tau, r)[:, None]
        W = (tau * r)[:, None, None] * torch.ones(1, 1, self.head_dim, dtype=dtype, device=tau.device)
        return KernelFactor(c0=c0, c=c, W=W)

    def state_shape(self, batch_size: int, dv: int) -> tuple[int, int, int, int]:
        """Shape of the packed quadratic state for a batch: ``(B, Hkv, 1 + d + d(d+1)/2, dv + 1)``."""
        return (batch_size, self.num_kv_heads, feature_dim(self.head_dim), dv + 1)

    def _normalised(self, q: torch.Tensor, k: torch.Tensor, cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.normalize(q.to(cdt), dim=-1), nn.functional.normalize(k.to(cdt), dim=-1)

    def weights(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Explicit ``1 + s + s²/2`` ``(B, Hq, P, N)`` in the accumulation dtype, zero above the diagonal."""
        check_qk(self, q, k)
        positions = check_positions(positions, q.shape[2])
        cdt = accumulation_dtype(self.dtype, q.dtype)
        qn, kn = self._normalised(q[:, :, positions], k, cdt)
        s = self.temperature.to(cdt)[None, :, None, None] * (qn @ repeat_kv(kn, self.num_heads).mT)
        return (1 + s + s.square() / 2) * self.causal_mask(positions, k.shape[2])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mode: str = "chunk",
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        chunk_size: int = 64,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Outputs ``(B, Hq, N, dv)`` in q's dtype and, if asked, the packed quadratic state
        ``(B, Hkv, 1 + d + d(d+1)/2, dv + 1)`` in the accumulation dtype."""
        check_qk(self, q, k)
        if not isinstance(v, torch.Tensor) or v.dtype != q.dtype:
            got = v.dtype if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"v: expected a tensor of dtype {q.dtype} like q, got {got}")
        cdt = accumulation_dtype(self.dtype, q.dtype)
        qn, kn = self._normalised(q, k, cdt)
        a, b, C = self.coefficients(cdt)
        o, state = quadratic_attention(
            qn,
            kn,
            v.to(cdt),
            a,
            b,
            C,
            scale=1.0,
            mode=mode,
            chunk_size=chunk_size,
            initial_state=initial_state,
            output_final_state=output_final_state,
            factor=self.factor(cdt) if mode == "chunk" else None,
            kernel_floor=KERNEL_FLOOR,
        )
        return o.to(q.dtype), state
