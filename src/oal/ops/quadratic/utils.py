"""Pieces shared by the three evaluation modes of the quadratic-kernel operator.

The kernel is Eq. 3 of the paper,

    κ(q, k) = a + Σ_r b_r x_r + Σ_{r,t} C_rt x_r x_t,      x_r = q_r k_r · scale,

evaluated through the HD states of Eq. 5,

    H0 = Σ_j u_j,   H1_r = Σ_j k_jr u_j,   H2_rt = Σ_j k_jr k_jt u_j,      u_j = [v_j; 1],

and the readout of Eq. 6. Because H2_rt = H2_tr, only r ≤ t is stored ("packed-symmetric", App. D), so one
state per KV head is a ``(D, dv + 1)`` matrix with ``D = 1 + d + d(d+1)/2`` rows, laid out as
``[H0 | H1_1..H1_d | H2_rt for r ≤ t in row-major upper-triangle order]``. The key side of this layout is the
feature map ``key_features``; the query side carries the coefficients (``query_weights``), which is what lets
all query heads of a GQA group share one state.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch


class QuadraticAttentionOutput(NamedTuple):
    """What ``quadratic_attention(..., return_denominator=True)`` returns; unpacks as ``o, den, final_state``.

    ``o (B, Hq, N, dv)`` in q's dtype; ``denominator (B, Hq, N)`` in the accumulation dtype, the value each output
    was divided by (after the ``kernel_floor`` clamp; 0 for a query whose keys all have weight 0, whose output
    is then 0); ``final_state`` as without the option. ``o · denominator`` is the unnormalised numerator.
    """

    o: torch.Tensor
    denominator: torch.Tensor
    final_state: torch.Tensor | None


class KernelFactor(NamedTuple):
    """A kernel written as a sum of squares (Eq. 7 with M = L Lᵀ, column m of L giving one square):

        κ(q, k) = c0 + Σ_m (c_m + scale · Σ_r W_mr q_r k_r)²

    Shapes: ``c0 (Hq,)``, ``c (Hq, R)``, ``W (Hq, R, d)``. It is the same kernel as
    ``a = c0 + Σ_m c_m²``, ``b = 2 Σ_m c_m W_m``, ``C = Σ_m W_m W_mᵀ``; the chunked operator uses it to
    build the within-chunk kernel from R score matrices instead of D-dimensional features, and every value
    it produces is ≥ c0 in floating point as well as in exact arithmetic.
    """

    c0: torch.Tensor
    c: torch.Tensor
    W: torch.Tensor


def factor_from_coefficients(
    a: torch.Tensor, b: torch.Tensor, C: torch.Tensor, *, rtol: float = 1e-10
) -> KernelFactor | None:
    """A :class:`KernelFactor` of the Eq. 3 kernel ``(a (Hq,), b (Hq, d), C (Hq, d, d))``, or None if it has none.

    With x̄ = [1, x], κ = x̄ᵀ M x̄ for ``M = [[a, bᵀ/2], [b/2, C]]`` per head; an eigendecomposition
    ``M = U Λ Uᵀ`` (fp64) writes it as ``Σ_m λ_m (U_0m + Σ_r U_rm x_r)²``, i.e. ``c_m = √λ_m U_0m``,
    ``W_m = √λ_m U_{1:, m}``, ``c0 = 0``, keeping the R eigenvalues above ``rtol · max λ`` of each head (the
    largest R of all heads; a head with fewer pads with zero squares). This is what lets a call without a factor
    reach the fused CPU kernel. None when some head's M has an eigenvalue below ``-rtol · max |λ|``: such a
    kernel is not a sum of squares (it can be negative), and only the feature-based torch path evaluates it.
    The factor reproduces κ up to fp64 rounding of the decomposition (relative ~1e-12 · cond(M)).
    """
    Hq, d = b.shape
    M = torch.empty(Hq, d + 1, d + 1, dtype=torch.float64, device=a.device)
    with torch.no_grad():
        M[:, 0, 0] = a.double()
        M[:, 0, 1:] = M[:, 1:, 0] = b.double() / 2
        M[:, 1:, 1:] = (C.double() + C.double().mT) / 2
        lam, U = torch.linalg.eigh(M)
        top = lam.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
        if bool((lam < -rtol * top).any()):
            return None
        keep = lam > rtol * top
        R = max(1, int(keep.sum(-1).max()))
        # eigh sorts ascending: the kept eigenvalues are the last ones of each head
        lam, U = lam[:, -R:].clamp_min(0) * keep[:, -R:], U[:, :, -R:]
        F = U * lam.sqrt()[:, None, :]  # (Hq, d+1, R)
    dt = a.dtype
    return KernelFactor(
        c0=torch.zeros(Hq, dtype=dt, device=a.device), c=F[:, 0, :].to(dt), W=F[:, 1:, :].mT.contiguous().to(dt)
    )


def feature_dim(d: int) -> int:
    """Rows of one packed state: 1 + d + d(d+1)/2 (App. D, "Exact state and parameter counts")."""
    return 1 + d + d * (d + 1) // 2


@lru_cache(maxsize=32)
def _triu_cpu(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    iu = torch.triu_indices(d, d)
    return iu[0].contiguous(), iu[1].contiguous()


def triu_indices(d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices (r, t), r ≤ t, of the packed H2 layout, row-major."""
    r, t = _triu_cpu(d)
    return r.to(device), t.to(device)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other floating dtype (fp32, bf16, fp16) accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def key_features(k: torch.Tensor) -> torch.Tensor:
    """Packed key features ``[1, k, k_r k_t (r ≤ t)]``: ``(..., N, d) -> (..., N, D)``.

    ``key_features(k)ᵀ u`` summed over tokens is the packed state of Eq. 5.
    """
    r, t = triu_indices(k.shape[-1], k.device)
    ones = torch.ones(*k.shape[:-1], 1, dtype=k.dtype, device=k.device)
    return torch.cat([ones, k, k[..., r] * k[..., t]], dim=-1)


def query_weights(a: torch.Tensor, b: torch.Tensor, C: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-head coefficients of the query features (Eq. 6): ``(Hq, D)``.

    ``[a, scale·b_r, scale²·w_rt]`` with ``w_rr = C_rr`` and ``w_rt = C_rt + C_tr`` for r < t, so that the
    packed readout counts each off-diagonal pair twice (App. D) and the gradient with respect to C is the
    symmetric one of the explicit kernel.
    """
    d = b.shape[-1]
    r, t = triu_indices(d, C.device)
    w = C[:, r, t] + C[:, t, r]
    w = torch.where(r == t, C[:, r, t], w)
    return torch.cat([a[:, None], b * scale, w * scale**2], dim=-1)


def query_features(q: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Coefficient-weighted query features: ``q (B, Hq, N, d)``, ``weights (Hq, D)`` -> ``(B, Hq, N, D)``.

    ``query_features(q_i) · key_features(k_j) = κ(q_i, k_j)`` (Eq. 24–25).
    """
    return key_features(q) * weights[:, None, :]


def cyclic_width(d: int) -> int:
    """Offsets δ = 0 … ⌊d/2⌋ of the cyclic pair layout over d coordinates."""
    return d // 2 + 1


@lru_cache(maxsize=32)
def _cyclic_maps_cpu(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    e = d + 1
    P = cyclic_width(e)
    r = torch.arange(e)[:, None].expand(e, P)
    t = (r + torch.arange(P)[None, :]) % e
    lo, hi = torch.minimum(r, t).flatten(), torch.maximum(r, t).flatten()
    # canonical feature index: 0 for (d, d) = 1·1, 1 + r for (r, d) = x_r·1, and for r ≤ t < d the packed
    # row-major upper-triangle position after those d + 1 entries
    pair = d + 1 + lo * d - lo * (lo - 1) // 2 + (hi - lo)
    canon_of_cyclic = torch.where(hi == d, torch.where(lo == d, 0, 1 + lo), pair)
    cyclic_of_canon = torch.empty(feature_dim(d), dtype=torch.long)
    cyclic_of_canon[canon_of_cyclic] = torch.arange(e * P)
    return canon_of_cyclic, cyclic_of_canon


def cyclic_maps(d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index maps between the canonical packed state rows and the cyclic layout used inside ``chunk.py``.

    With ``x' = [x, 1]`` (e = d + 1 coordinates) and ``P = ⌊e/2⌋ + 1``, the cyclic layout stores
    ``x'_r · x'_{(r+δ) mod e}`` at index ``r·P + δ``. The products with the appended 1 are the constant and
    linear features, so one broadcast product against a strided view yields ``[1, x, x_r x_t]`` with no gather.
    For even d (the usual case, e odd) every unordered pair appears exactly once and the layout is a
    permutation of the canonical one (``e·P = D``); for odd d the offset δ = e/2 lists its d/2 + 1 pairs twice
    and those rows are read with half weight.

    Returns ``canon_of_cyclic (e·P,)`` and ``cyclic_of_canon (D,)``.
    """
    return tuple(x.to(device) for x in _cyclic_maps_cpu(d))  # type: ignore[return-value]


def cyclic_pair_products(y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Cyclic pair features from their source ``y = [x, 1, x, 1]``: ``(..., n, 2e)`` -> ``(..., n, e·P)``,
    ``e = d + 1``: one broadcast product of ``x'_r`` against a strided view of ``x'_{r+δ}``.

    ``y`` needs a unit stride in its last dimension only; ``out`` (contiguous, the result's shape) avoids an
    allocation when no gradient is needed.
    """
    e = y.shape[-1] // 2
    P = cyclic_width(e)
    st = y.stride()
    shifted = y.as_strided((*y.shape[:-1], e, P), (*st[:-1], st[-1], st[-1]))
    head = y[..., :e, None]
    if out is None:
        return (head * shifted).flatten(-2)
    torch.mul(head, shifted, out=out.view(*out.shape[:-1], e, P))
    return out


def cyclic_features(x: torch.Tensor) -> torch.Tensor:
    """Cyclic pair features of ``x' = [x, 1]``: ``(..., n, d)`` -> ``(..., n, (d+1)·P)``."""
    ones = torch.ones_like(x[..., :1])
    return cyclic_pair_products(torch.cat([x, ones, x, ones], dim=-1))


def cyclic_query_weights(a: torch.Tensor, b: torch.Tensor, C: torch.Tensor, scale: float) -> torch.Tensor:
    """Query-side coefficients for the cyclic layout: ``(Hq, (d+1)·P)``.

    Write the kernel as a quadratic form over ``x' = [x, 1]`` with the symmetric
    ``A = [[scale²·C, scale·b/2], [scale·bᵀ/2, a]]``; then the weight of the feature ``x'_r x'_t`` is
    ``A_rt + A_tr`` for r ≠ t and ``A_rr`` for r = t, halved on duplicated rows (odd d).
    """
    Hq, d = b.shape
    e = d + 1
    P = cyclic_width(e)
    A = torch.cat(
        [
            torch.cat([C * scale**2, (b * scale / 2)[:, :, None]], dim=2),
            torch.cat([(b * scale / 2)[:, None, :], a[:, None, None]], dim=2),
        ],
        dim=1,
    )
    r = torch.arange(e, device=C.device)[:, None].expand(e, P)
    t = (r + torch.arange(P, device=C.device)[None, :]) % e
    w = torch.where((r == t)[None], A[:, r, t], A[:, r, t] + A[:, t, r])
    if e % 2 == 0:
        w = torch.where((torch.arange(P, device=C.device) == e // 2)[None, None, :], w / 2, w)
    return w.flatten(1)


def split_state(state: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpack a packed state ``(..., D, dv+1)`` into ``H0 (..., dv+1)``, ``H1 (..., d, dv+1)`` and the full
    symmetric ``H2 (..., d, d, dv+1)`` of Eq. 5."""
    h0 = state[..., 0, :]
    h1 = state[..., 1 : d + 1, :]
    packed = state[..., d + 1 :, :]
    r, t = triu_indices(d, state.device)
    h2 = state.new_zeros(*state.shape[:-2], d, d, state.shape[-1])
    h2[..., r, t, :] = packed
    h2[..., t, r, :] = packed
    return h0, h1, h2


def default_scale(d: int, scale: float | None) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    return float(scale)


def _need_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    return x


def _need_shape(name: str, x: torch.Tensor, expected: tuple[int | str, ...]) -> None:
    ok = x.dim() == len(expected) and all(isinstance(e, str) or s == e for s, e in zip(x.shape, expected, strict=True))
    if not ok:
        want = "(" + ", ".join(str(e) for e in expected) + ("," if len(expected) == 1 else "") + ")"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")


def _need_finite(name: str, x: torch.Tensor) -> None:
    # NaN propagates through min/max and ±inf is its own extreme: no input-sized temporary, unlike isfinite(); one
    # pass for both (11–13 against 14–22 µs for amax and amin on a SmolLM2 layer's 64-token k and q)
    if x.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(x))).all()):
        raise ValueError(f"{name}: contains NaN or infinite values")


class Dims(NamedTuple):
    B: int
    Hq: int
    Hkv: int
    N: int
    d: int
    dv: int

    @property
    def group(self) -> int:
        return self.Hq // self.Hkv


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Dims:
    """Validate q ``(B, Hq, N, d)``, k ``(B, Hkv, N, d)``, v ``(B, Hkv, N, dv)``; nothing is broadcast."""
    q, k, v = _need_tensor("q", q), _need_tensor("k", k), _need_tensor("v", v)
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dimensions (B, Hq, N, d), got shape {tuple(q.shape)}")
    B, Hq, N, d = q.shape
    if k.dim() != 4:
        raise ValueError(f"k: expected 4 dimensions (B, Hkv, N, d), got shape {tuple(k.shape)}")
    Hkv = k.shape[1]
    _need_shape("k", k, (B, "Hkv", N, d))
    if v.dim() != 4:
        raise ValueError(f"v: expected 4 dimensions (B, Hkv, N, dv), got shape {tuple(v.shape)}")
    dv = v.shape[-1]
    _need_shape("v", v, (B, Hkv, N, "dv"))
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"k: the number of query heads Hq={Hq} must be a multiple of the KV heads Hkv={Hkv}")
    if d == 0 or dv == 0:
        raise ValueError(f"q, v: head dimensions must be positive, got d={d}, dv={dv}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name}: expected dtype {q.dtype} on {q.device} like q, got {x.dtype} on {x.device}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _need_finite(name, x)
    return Dims(B, Hq, Hkv, N, d, dv)


def check_coefficients(a: torch.Tensor, b: torch.Tensor, C: torch.Tensor, dims: Dims) -> None:
    """Validate a ``(Hq,)``, b ``(Hq, d)``, C ``(Hq, d, d)`` symmetric and finite."""
    a, b, C = _need_tensor("a", a), _need_tensor("b", b), _need_tensor("C", C)
    _need_shape("a", a, (dims.Hq,))
    _need_shape("b", b, (dims.Hq, dims.d))
    _need_shape("C", C, (dims.Hq, dims.d, dims.d))
    for name, x in (("a", a), ("b", b), ("C", C)):
        _need_finite(name, x)
    with torch.no_grad():
        asym = (C - C.mT).abs().amax()
        tol = 64 * torch.finfo(C.dtype).eps * (C.abs().amax() + torch.finfo(C.dtype).tiny)
        if asym > tol:
            raise ValueError(f"C: expected a symmetric matrix per head, got max |C - Cᵀ| = {asym.item():.3e}")


def check_factor(factor: KernelFactor, dims: Dims) -> None:
    if not isinstance(factor, KernelFactor):
        raise ValueError(f"factor: expected a KernelFactor, got {type(factor).__name__}")
    c0, c, W = (_need_tensor(f"factor.{n}", x) for n, x in zip(("c0", "c", "W"), factor, strict=True))
    _need_shape("factor.c0", c0, (dims.Hq,))
    R = c.shape[-1] if c.dim() == 2 else -1
    _need_shape("factor.c", c, (dims.Hq, "R"))
    _need_shape("factor.W", W, (dims.Hq, R, dims.d))


def check_state(state: torch.Tensor, dims: Dims) -> None:
    state = _need_tensor("initial_state", state)
    _need_shape("initial_state", state, (dims.B, dims.Hkv, feature_dim(dims.d), dims.dv + 1))
    _need_finite("initial_state", state)


def check_key_weight(key_weight: torch.Tensor, dims: Dims, device: torch.device) -> None:
    """key_weight: ``(B, Hkv, N)`` finite and non-negative (a weight scales ``u_j = [v_j; 1]``, so the weighted
    key count that the denominator floor uses must stay a lower bound)."""
    key_weight = _need_tensor("key_weight", key_weight)
    _need_shape("key_weight", key_weight, (dims.B, dims.Hkv, dims.N))
    if key_weight.device != device:
        raise ValueError(f"key_weight: expected a tensor on {device} like q, got {key_weight.device}")
    _need_finite("key_weight", key_weight)
    if bool((key_weight < 0).any()):
        raise ValueError(f"key_weight: expected non-negative weights, got minimum {key_weight.min().item():.3e}")


def check_floor(kernel_floor: float | None) -> None:
    if kernel_floor is not None and not (math.isfinite(kernel_floor) and kernel_floor > 0):
        raise ValueError(f"kernel_floor: expected a positive finite number or None, got {kernel_floor!r}")
