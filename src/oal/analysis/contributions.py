"""Dimension-wise query–key contribution scores (§3.1, Eq. 2) and their concentration.

For one prompt p of length N_p and one query head,

    χ_{p,r} = 1/|Ω_p| Σ_{(i,j)∈Ω_p} |q_{i,r} k_{j,r} · scale|,   Ω_p = {(i, j): 1 ≤ j ≤ i ≤ N_p},

and χ_r is the equal-weight mean of χ_{p,r} over prompts. Because |q_{i,r} k_{j,r}| = |q_{i,r}| |k_{j,r}|, the
inner sum over j ≤ i is a prefix sum of |k|, so a head costs O(N·d) rather than O(N²·d). Everything is
accumulated in float64.

Shapes: q ``(B, Hq, N, d)`` post-RoPE, k ``(B, Hkv, N, d)`` un-repeated; query head h reads KV head
``h // (Hq // Hkv)``. Prompts of different length are either right-padded in one batch with ``lengths``, or
given as a list of ``(q, k)`` pairs; each prompt is normalised by its own |Ω_p|.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
            got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a floating tensor of shape (B, H, N, d), got {got}")
    B, Hq, N, d = q.shape
    if k.shape[0] != B or k.shape[2] != N or k.shape[3] != d:
        raise ValueError(f"k: expected shape ({B}, Hkv, {N}, {d}) to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.shape[1] < 1 or Hq % k.shape[1]:
        raise ValueError(f"k: expected a number of KV heads dividing Hq={Hq}, got {k.shape[1]}")
    if N < 1:
        raise ValueError(f"q: expected at least one position, got shape {tuple(q.shape)}")


def check_lengths(lengths: torch.Tensor | Sequence[int] | None, batch: int, n: int) -> torch.Tensor:
    """``lengths``: ``(B,)`` valid prefix lengths in ``[1, n]`` (right padding); None means all ``n``."""
    if lengths is None:
        return torch.full((batch,), n, dtype=torch.long)
    t = torch.as_tensor(lengths)
    if t.dim() != 1 or t.shape[0] != batch or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"lengths: expected {batch} integers, got {tuple(t.shape)} of {t.dtype}")
    t = t.long().cpu()
    if batch and (int(t.min()) < 1 or int(t.max()) > n):
        raise ValueError(f"lengths: expected values in [1, {n}], got [{int(t.min())}, {int(t.max())}]")
    return t


def _scale(scale: float | None, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale: expected a finite number, got {scale!r}")
    return abs(float(scale))


def _cumulative_pair_sums(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``T[b, h, n, r] = Σ_{j ≤ i ≤ n} |q_{i,r}| |k_{j,r}|`` (0-based n), float64, shape ``(B, Hq, N, d)``."""
    B, Hq, N, d = q.shape
    Hkv = k.shape[1]
    kc = k.detach().to(torch.float64).abs().cumsum(2)  # Σ_{j≤i} |k_j|, shared by the query heads of a group
    qa = q.detach().to(torch.float64).abs().view(B, Hkv, Hq // Hkv, N, d)
    return (qa * kc[:, :, None]).cumsum(3).view(B, Hq, N, d)


def prefix_contribution_scores(
    q: torch.Tensor, k: torch.Tensor, prefix_lengths: Sequence[int], scale: float | None = None
) -> torch.Tensor:
    """χ_{p,r} (Eq. 2) of every prompt truncated to each prefix length, in one O(N·d) pass.

    Returns float64 ``(len(prefix_lengths), B, Hq, d)``; entry ``[t]`` equals
    ``contribution_scores(q[:, :, :n], k[:, :, :n])`` for ``n = prefix_lengths[t]``.
    """
    _check_qk(q, k)
    B, _, N, d = q.shape
    ns = [int(n) for n in prefix_lengths]
    if not ns or any(n < 1 or n > N for n in ns):
        raise ValueError(
            f"prefix_lengths: expected a non-empty list of lengths in [1, {N}], got {list(prefix_lengths)}"
        )
    s = _scale(scale, d)
    T = _cumulative_pair_sums(q, k)
    idx = torch.tensor(ns, device=T.device) - 1
    pairs = torch.tensor([n * (n + 1) / 2 for n in ns], dtype=torch.float64, device=T.device)
    return (T.index_select(2, idx).permute(2, 0, 1, 3) * (s / pairs)[:, None, None, None]).cpu()


def contribution_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float | None = None,
    *,
    lengths: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Per-prompt contribution scores χ_{p,r} (Eq. 2), float64 ``(B, Hq, d)`` on the CPU.

    q ``(B, Hq, N, d)``, k ``(B, Hkv, N, d)``; ``scale`` defaults to 1/sqrt(d) (only |scale| matters).
    ``lengths`` ``(B,)`` marks right-padded prompts: prompt b uses its first ``lengths[b]`` positions and is
    normalised by its own ``|Ω_b| = n(n+1)/2``. Average over prompts (dim 0) for χ_r.
    """
    _check_qk(q, k)
    B, _, N, d = q.shape
    n = check_lengths(lengths, B, N)
    s = _scale(scale, d)
    T = _cumulative_pair_sums(q, k)
    last = (n - 1).to(T.device)[:, None, None, None].expand(B, T.shape[1], 1, d)
    pairs = (n * (n + 1)).to(torch.float64).to(T.device) / 2
    return (T.gather(2, last).squeeze(2) * (s / pairs)[:, None, None]).cpu()


def contribution_scores_from_list(
    pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], scale: float | None = None
) -> torch.Tensor:
    """χ_{p,r} for a list of ``(q, k)`` prompts of any lengths, each ``(B_p, Hq, N_p, d)`` / ``(B_p, Hkv, N_p, d)``;
    returns float64 ``(Σ B_p, Hq, d)`` in input order."""
    out = [contribution_scores(q, k, scale) for q, k in pairs]
    if not out:
        raise ValueError("pairs: expected at least one (q, k) pair, got none")
    shapes = {tuple(c.shape[1:]) for c in out}
    if len(shapes) != 1:
        raise ValueError(f"pairs: expected every prompt to have the same (Hq, d), got {sorted(shapes)}")
    return torch.cat(out, 0)


def mean_abs(x: torch.Tensor, lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Per-prompt mean |x| over the valid positions: ``(B, H, N, d)`` -> float64 ``(B, H, d)`` (Fig. 1 a/b)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected a floating tensor of shape (B, H, N, d), got {got}")
    B, _, N, _ = x.shape
    n = check_lengths(lengths, B, N).to(x.device)
    valid = (torch.arange(N, device=x.device)[None, :] < n[:, None]).to(torch.float64)
    total = torch.einsum("bhnd,bn->bhd", x.detach().to(torch.float64).abs(), valid)
    return (total / n.to(torch.float64)[:, None, None]).cpu()


def top_dims(chi: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``(..., k)`` of the k largest entries along the last dim, largest first; ties go to the lower index."""
    if k < 1 or k > chi.shape[-1]:
        raise ValueError(f"k: expected 1 ≤ k ≤ {chi.shape[-1]}, got {k}")
    return torch.sort(chi, dim=-1, descending=True, stable=True).indices[..., :k]


@dataclass(frozen=True)
class Concentration:
    """Share of the total contribution Σ_r χ_r carried by the top-k dimensions and by the median dimension.

    ``top_share[k]`` and ``median_share`` have the batch shape of the input (e.g. ``(Hq,)``), as fractions in
    [0, 1]; ``top_dims`` ``(..., max k)`` are the dimension indices, largest first.
    """

    top_share: dict[int, torch.Tensor]
    median_share: torch.Tensor
    top_dims: torch.Tensor


def concentration(chi: torch.Tensor, ks: Sequence[int] = (1, 2, 5)) -> Concentration:
    """Concentration of a contribution profile ``(..., d)`` (e.g. χ_r per head ``(Hq, d)``).

    The median share is median_r(χ_r) / Σ_t χ_t, with the mean of the two middle values for even d.
    """
    if not isinstance(chi, torch.Tensor) or chi.dim() < 1 or not chi.is_floating_point():
        raise ValueError(f"chi: expected a floating tensor of shape (..., d), got {getattr(chi, 'shape', chi)}")
    if not ks:
        raise ValueError("ks: expected at least one k")
    c = chi.detach().to(torch.float64).cpu()
    total = c.sum(-1)
    if bool((total <= 0).any()) or bool((c < 0).any()):
        raise ValueError("chi: expected non-negative contributions with a positive total per profile")
    order = top_dims(c, max(ks))
    vals = c.gather(-1, order)
    share = {int(k): vals[..., :k].sum(-1) / total for k in ks}
    median = torch.quantile(c, 0.5, dim=-1) / total
    return Concentration(top_share=share, median_share=median, top_dims=order)
