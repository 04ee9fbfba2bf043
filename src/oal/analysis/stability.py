"""Stability and control analyses of the contribution profile (App. A.1, A.3) and the residual-stream
activation profile of App. F (Fig. 7).

- :func:`input_stability` — calibration vs held-out χ: Spearman ρ and top-k overlap per head (Fig. 6).
- :func:`length_stability` — χ_r/Σ_t χ_t (%) of the top dimensions found at the longest prefix, at every
  prefix length of the same sequences (Table 4).
- :func:`gaussian_control_scores` — χ of i.i.d. N(0, 1) queries/keys of the same shapes (Fig. 5 controls).
- :class:`ActivationProfile` — per-layer, per-dimension max |activation| over tokens and prompts (Fig. 7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from scipy.stats import spearmanr

from .contributions import check_lengths, contribution_scores, prefix_contribution_scores, top_dims


@dataclass(frozen=True)
class InputStability:
    """Per-profile agreement between two contribution estimates (batch shape ``S``, e.g. ``(Hq,)``)."""

    spearman: torch.Tensor  # (S) float64 Spearman rank correlation
    overlap: torch.Tensor  # (S) long, |top-k(cal) ∩ top-k(held)|
    top_calibration: torch.Tensor  # (S, k)
    top_heldout: torch.Tensor  # (S, k)
    k: int


def input_stability(chi_cal: torch.Tensor, chi_held: torch.Tensor, k: int = 5) -> InputStability:
    """Compare χ from calibration and held-out prompts, both ``(..., d)`` (App. A.3 "Across inputs")."""
    if not isinstance(chi_cal, torch.Tensor) or not isinstance(chi_held, torch.Tensor) or chi_cal.dim() < 1:
        raise ValueError("chi_cal, chi_held: expected tensors of shape (..., d)")
    if chi_cal.shape != chi_held.shape:
        raise ValueError(f"chi_held: expected shape {tuple(chi_cal.shape)} like chi_cal, got {tuple(chi_held.shape)}")
    a = chi_cal.detach().to(torch.float64).cpu()
    b = chi_held.detach().to(torch.float64).cpu()
    batch = a.shape[:-1]
    fa, fb = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    rho = torch.tensor(
        [float(spearmanr(x.numpy(), y.numpy()).statistic) for x, y in zip(fa, fb, strict=True)], dtype=torch.float64
    )
    ta, tb = top_dims(a, k), top_dims(b, k)
    overlap = (ta[..., :, None] == tb[..., None, :]).any(-1).sum(-1)
    return InputStability(rho.reshape(batch), overlap, ta, tb, k)


@dataclass(frozen=True)
class LengthStability:
    """Table 4: ``share[t, h, i]`` is χ_r/Σ_t χ_t in percent of dimension ``dims[h, i]`` at ``lengths[t]``,
    where ``dims[h]`` are head h's top dimensions at the longest length, largest first."""

    lengths: list[int]
    dims: torch.Tensor  # (Hq, top) long
    share: torch.Tensor  # (len(lengths), Hq, top) float64, percent

    def markdown(self, head: int = 0) -> str:
        """Table 4 for one head: one row per length, one column per top dimension."""
        cols = [int(r) for r in self.dims[head]]
        lines = ["| Length | " + " | ".join(f"r={r}" for r in cols) + " |", "|---:|" + "---:|" * len(cols)]
        for t, n in enumerate(self.lengths):
            lines.append(f"| {n} | " + " | ".join(f"{float(v):.2f}" for v in self.share[t, head]) + " |")
        return "\n".join(lines)


def length_stability(
    q: torch.Tensor,
    k: torch.Tensor,
    lengths: Sequence[int] = (128, 512, 1024, 2048, 4096),
    *,
    top: int = 5,
    scale: float | None = None,
) -> LengthStability:
    """Prefixes of the same sequences (q ``(B, Hq, N, d)``, k ``(B, Hkv, N, d)``, N ≥ max(lengths)); χ at each
    length is averaged over the B sequences with equal weight (App. A.3 "Across sequence lengths")."""
    ns = sorted({int(n) for n in lengths})
    if not ns:
        raise ValueError("lengths: expected at least one prefix length")
    chi = prefix_contribution_scores(q, k, ns, scale).mean(1)  # (T, Hq, d)
    share = 100.0 * chi / chi.sum(-1, keepdim=True)
    dims = top_dims(chi[-1], top)
    return LengthStability(ns, dims, share.gather(-1, dims[None].expand(len(ns), -1, -1)))


def gaussian_control_scores(
    lengths: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    seed: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """χ_{p,r} (Eq. 2) for i.i.d. N(0, 1) queries ``(1, Hq, N_p, d)`` and keys ``(1, Hkv, N_p, d)``, one prompt per
    entry of ``lengths`` (App. A.1 Gaussian control); returns float64 ``(P, Hq, d)``. Deterministic in ``seed``;
    independent seeds give independent controls."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
    if head_dim < 1 or not lengths:
        raise ValueError(f"head_dim, lengths: expected head_dim ≥ 1 and ≥ 1 prompt, got {head_dim}, {list(lengths)}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        if int(n) < 1:
            raise ValueError(f"lengths: expected positive lengths, got {list(lengths)}")
        q = torch.randn(1, num_heads, int(n), head_dim, generator=g)
        k = torch.randn(1, num_kv_heads, int(n), head_dim, generator=g)
        out.append(contribution_scores(q, k, scale))
    return torch.cat(out, 0)


@dataclass(frozen=True)
class ActivationProfile:
    """Fig. 7: ``max_abs[l, c]`` is the max |activation| of hidden dimension c at the output of block l over all
    tokens and prompts seen."""

    max_abs: torch.Tensor  # (L, hidden) float64

    def top(self, k: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k dimension-wise maxima per layer, ``values (L, k)`` and ``dims (L, k)``, largest first."""
        dims = top_dims(self.max_abs, k)
        return self.max_abs.gather(-1, dims), dims

    @property
    def median(self) -> torch.Tensor:
        """Median over hidden dimensions of the dimension-wise maxima, ``(L,)``."""
        return torch.quantile(self.max_abs, 0.5, dim=-1)

    def to_dict(self, k: int = 3) -> dict:
        vals, dims = self.top(k)
        return {
            "layers": [
                {
                    "layer": layer,
                    **{f"top{i + 1}": float(vals[layer, i]) for i in range(k)},
                    **{f"top{i + 1}_dim": int(dims[layer, i]) for i in range(k)},
                    "median": float(self.median[layer]),
                }
                for layer in range(self.max_abs.shape[0])
            ]
        }


class ActivationProfileAccumulator:
    """Streams hidden states batch by batch into an :class:`ActivationProfile`.

    ``update(hidden_states, lengths=None)`` takes one ``(B, N, hidden)`` tensor per decoder block, in block
    order; ``lengths`` ``(B,)`` excludes right padding. Hugging Face ``output_hidden_states`` gives the
    embeddings first and, by default (``tie_last_hidden_states``), the *final-normed* output in place of the
    last block's residual stream: pass ``hidden_states[1:]`` and set ``config.tie_last_hidden_states = False``
    (or hook the decoder layers) to get the raw last block.
    """

    def __init__(self) -> None:
        self._max: torch.Tensor | None = None

    def update(
        self, hidden_states: Sequence[torch.Tensor], lengths: torch.Tensor | Sequence[int] | None = None
    ) -> None:
        if not hidden_states:
            raise ValueError("hidden_states: expected one (B, N, hidden) tensor per layer, got none")
        first = hidden_states[0]
        if not isinstance(first, torch.Tensor) or first.dim() != 3:
            raise ValueError(f"hidden_states: expected (B, N, hidden) tensors, got {getattr(first, 'shape', first)}")
        B, N, C = first.shape
        n = check_lengths(lengths, B, N).to(first.device)
        pad = torch.arange(N, device=first.device)[None, :, None] >= n[:, None, None]
        rows = []
        for i, h in enumerate(hidden_states):
            if not isinstance(h, torch.Tensor) or tuple(h.shape) != (B, N, C):
                raise ValueError(
                    f"hidden_states[{i}]: expected shape {(B, N, C)} like layer 0, got {getattr(h, 'shape', h)}"
                )
            rows.append(h.detach().abs().masked_fill(pad, 0).amax((0, 1)).to(torch.float64).cpu())
        new = torch.stack(rows)
        if self._max is not None and self._max.shape != new.shape:
            raise ValueError(
                f"hidden_states: expected {tuple(self._max.shape)} (layers, hidden), got {tuple(new.shape)}"
            )
        self._max = new if self._max is None else torch.maximum(self._max, new)

    def result(self) -> ActivationProfile:
        if self._max is None:
            raise ValueError("no hidden states were given to update()")
        return ActivationProfile(self._max.clone())


def activation_profile(
    hidden_states: Sequence[torch.Tensor], lengths: torch.Tensor | Sequence[int] | None = None
) -> ActivationProfile:
    """One-shot :class:`ActivationProfileAccumulator` for a single batch."""
    acc = ActivationProfileAccumulator()
    acc.update(hidden_states, lengths)
    return acc.result()
