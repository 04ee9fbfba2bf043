"""DiJiang's DCT feature map with a feature-wise softmax, adapted as in App. F.1.

With ``x = q · d^{-1/4}``, the fixed projection ``P = C diag(w)`` (C the orthonormal d×d DCT-II matrix,
``C[k, n] = c_k cos(π k (2n + 1) / 2d)``, ``c_0 = sqrt(1/d)``, ``c_k = sqrt(2/d)``; w_n = Φ⁻¹(U_n) inverse
standard-normal samples of uniforms, as upstream's ``_build_projection``) and positive weights
``D_h = exp(θ_h)``:

    φ_h(x) = softmax(x P) ⊙ D_h   (softmax over the m = d feature coordinates),
    κ_h(q, k) = φ_h(q)ᵀ φ_h(k) = Σ_l softmax(x_q P)_l · exp(2 θ_{h,l}) · softmax(x_k P)_l.

θ ``(Hq, d)`` is trainable, initialised to zero (F.1). The projection is drawn once per layer from the recorded
seed and shared by the layer's heads, as upstream builds one per attention module.

Since D multiplies query and key features alike, its square can sit on the query side: the key features then
depend on the KV head only, and the state is kept per KV head, ``(B, Hkv, d, dv + 1)`` — the same kernel as
repeating keys and values across query heads, without the copies. The released model's positional decay,
GroupNorm and output gate are omitted (F.1); features and prefix sums default to fp32 (F.1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .common import FeatureKernel, kernel_generator


def dct_matrix(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``(d, d)``: row k is the k-th cosine basis vector (``scipy.fft.dct(eye, axis=0,
    norm="ortho")``)."""
    k = torch.arange(d, dtype=torch.float64)[:, None]
    n = torch.arange(d, dtype=torch.float64)[None, :]
    C = torch.cos(math.pi * k * (2 * n + 1) / (2 * d)) * math.sqrt(2 / d)
    C[0] /= math.sqrt(2)
    return C.to(dtype)


def dijiang_projection(d: int, generator: torch.Generator) -> torch.Tensor:
    """``C diag(w)`` in fp64, w = Φ⁻¹(U) with U uniform on [0, 1); an infinite sample (U = 0) becomes 0 as upstream."""
    w = torch.special.ndtri(torch.rand(d, generator=generator, dtype=torch.float64))
    w = torch.where(torch.isinf(w), torch.zeros_like(w), w)
    return dct_matrix(d) * w[None, :]


class DiJiangKernel(FeatureKernel):
    """DiJiang kernel for the query heads of one layer.

    Parameter: ``theta (Hq, d)`` (the log feature weights). Buffer: ``projection (d, d)`` (fp32).
    m = d features; state ``(B, Hkv, d, dv + 1)`` (the shift stays 0).
    """

    name = "dijiang"
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
        super().__init__(num_heads, num_kv_heads, head_dim, layer_idx=layer_idx, seed=seed, dtype=dtype)
        g = kernel_generator(self.name, seed, layer_idx)
        self.register_buffer("projection", dijiang_projection(head_dim, g).float())
        self.theta = nn.Parameter(torch.zeros(num_heads, head_dim))

    @property
    def num_features(self) -> int:
        return self.head_dim

    @property
    def key_heads(self) -> int:
        return self.num_kv_heads

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """``softmax(x d^{-1/4} P)`` over the feature axis: ``(..., d) -> (..., d)``.

        Written out (the max shift cancels, so it is detached): on the tiny per-token tensors of the recurrent
        mode ``torch.softmax`` measured over 10× slower on CPU than these three element-wise ops.
        """
        z = (x * self.input_scale) @ self.projection.to(x.dtype)
        e = torch.exp(z - z.detach().amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    def query_features(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``softmax(x_q P) ⊙ D_h²``: both copies of D on the query side."""
        return self.feature_map(q) * torch.exp(2 * self.theta.to(q.dtype))[None, :, None, :]

    def key_features(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.feature_map(k)
