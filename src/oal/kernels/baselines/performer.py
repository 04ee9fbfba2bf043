"""Performer (FAVOR+) positive orthogonal random features, adapted as in App. F.1.

With ``x = q · d^{-1/4}`` and ``y = k · d^{-1/4}`` (so that ``xᵀy = qᵀk/√d``) and rows ω_l of a fixed projection,

    φ(x)_l = exp(ω_lᵀ x − ‖x‖²/2) / √m,        E_ω[φ(x)ᵀ φ(y)] = exp(xᵀy) = exp(qᵀk/√d)

for ω_l ~ N(0, I). The projection stacks ⌈m/d⌉ independent Haar-orthogonal d×d blocks (rows mutually orthogonal
within a block) and rescales each row to a χ_d-distributed norm, so every row is still marginally N(0, I) and
the estimator unbiased (FAVOR+'s orthogonal random features). It is drawn independently for every query head
and layer from the recorded seed and stored as a buffer; nothing is trained (only LoRA is, in F.1).

Because the projections belong to query heads, key features are computed per query head: the state is kept per
query head, ``(B, Hq, m, dv + 1)``, not per KV head.

Stabilisers (App. F.1), both of which cancel exactly in normalised attention:

* queries: the log-features of each token are shifted by their own maximum (a per-query factor);
* keys: the log-features are shifted by one maximum shared over tokens and features of a (batch, head) — the
  only kind of factor the prefix sums of linear attention allow. It is taken over the causal prefix of each
  query (a running maximum, ``oal.ops.linear.utils``), so it is defined as tokens arrive during prefill and
  decoding, the state is rescaled whenever it grows, and keys that arrive later (even within a chunk) never
  push the features an earlier query reads towards underflow. Positive-random-feature log-features are at most
  ``‖ω‖²/2``, so the danger is underflow for large ‖k‖, not overflow.

Unlike the upstream code, no ``+eps`` is added to the features (it would not cancel), so the kernel is exactly
the FAVOR+ estimator above up to those factors; features and prefix sums default to fp64 as in F.1.
"""

from __future__ import annotations

import math

import torch

from ..base import repeat_kv
from .common import FeatureKernel, kernel_generator


def orthogonal_gaussian_projection(num_features: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """``(m, d)`` FAVOR+ projection in fp64: stacked Haar-orthogonal blocks with χ_d row norms."""
    num_blocks = -(-num_features // dim)
    Q, R = torch.linalg.qr(torch.randn(num_blocks, dim, dim, generator=generator, dtype=torch.float64))
    # the sign correction makes each Q Haar-distributed (QR alone leaves a sign bias); rows of Qᵀ are orthonormal
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[:, None, :]
    directions = Q.mT.reshape(num_blocks * dim, dim)[:num_features]
    norms = torch.randn(num_features, dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return directions * norms[:, None]


def favor_log_features(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """Unshifted log-features ``ω_lᵀx − ‖x‖²/2 − log(m)/2``: x ``(B, H, n, d)``, omega ``(H, m, d)`` ->
    ``(B, H, n, m)``. ``exp`` of it is the FAVOR+ feature map without stabiliser."""
    m = omega.shape[-2]
    return x @ omega.mT - 0.5 * x.square().sum(-1, keepdim=True) - 0.5 * math.log(m)


class PerformerKernel(FeatureKernel):
    """FAVOR+ kernel for the query heads of one layer.

    Buffers: ``omega (Hq, m, d)`` (fp32). No trainable parameters. State: ``(B, Hq, m, dv + 1)`` plus the
    running key shift ``(B, Hq)``.
    """

    name = "performer"
    log_keys = True
    _config_keys = ("num_features", "dtype")

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_features: int = 250,
        layer_idx: int = 0,
        seed: int = 0,
        dtype: torch.dtype | str = torch.float64,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, layer_idx=layer_idx, seed=seed, dtype=dtype)
        if not isinstance(num_features, int) or isinstance(num_features, bool) or num_features < 1:
            raise ValueError(f"num_features: expected a positive integer, got {num_features!r}")
        g = kernel_generator(self.name, seed, layer_idx)
        omega = torch.stack([orthogonal_gaussian_projection(num_features, head_dim, g) for _ in range(num_heads)])
        self.register_buffer("omega", omega.float())

    @property
    def num_features(self) -> int:
        return self.omega.shape[1]

    @property
    def key_heads(self) -> int:
        return self.num_heads

    def query_features(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        logits = favor_log_features(q * self.input_scale, self.omega.to(q.dtype))
        return torch.exp(logits - logits.detach().amax(-1, keepdim=True))

    def key_features(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Key log-features ``(B, Hq, n, m)``: exponentiated by the operator under the shared running shift."""
        return favor_log_features(repeat_kv(k, self.num_heads) * self.input_scale, self.omega.to(k.dtype))
