"""Per-layer concentration summaries of the contribution profile (§3.1) as Markdown tables and JSON dicts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .contributions import concentration


@dataclass(frozen=True)
class LayerSummary:
    """Concentration of χ_r for every query head of one layer, as fractions of Σ_r χ_r.

    ``top_share[k][h]``: share of head h's top-k dimensions; ``median_share[h]``: its median dimension's share;
    ``top_dims[h]``: its highest-contribution dimensions, largest first.
    """

    layer: int
    top_share: dict[int, list[float]]
    median_share: list[float]
    top_dims: list[list[int]]

    def mean_top_share(self, k: int) -> float:
        return sum(self.top_share[k]) / len(self.top_share[k])

    @property
    def mean_median_share(self) -> float:
        return sum(self.median_share) / len(self.median_share)

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "num_heads": len(self.median_share),
            "mean_top_share": {str(k): self.mean_top_share(k) for k in self.top_share},
            "mean_median_share": self.mean_median_share,
            "top_share": {str(k): v for k, v in self.top_share.items()},
            "median_share": self.median_share,
            "top_dims": self.top_dims,
        }


def layer_summaries(
    chi_mean: torch.Tensor, layers: Sequence[int] | None = None, ks: Sequence[int] = (1, 2, 5)
) -> list[LayerSummary]:
    """One :class:`LayerSummary` per layer of ``chi_mean`` ``(L, Hq, d)`` (χ_r already averaged over prompts)."""
    if not isinstance(chi_mean, torch.Tensor) or chi_mean.dim() != 3:
        raise ValueError(f"chi_mean: expected a (L, Hq, d) tensor, got {getattr(chi_mean, 'shape', chi_mean)}")
    ids = list(range(chi_mean.shape[0])) if layers is None else [int(x) for x in layers]
    if len(ids) != chi_mean.shape[0]:
        raise ValueError(f"layers: expected {chi_mean.shape[0]} layer ids, got {len(ids)}")
    out = []
    for layer, chi in zip(ids, chi_mean, strict=True):
        c = concentration(chi, ks)
        out.append(
            LayerSummary(
                layer=layer,
                top_share={k: v.tolist() for k, v in c.top_share.items()},
                median_share=c.median_share.tolist(),
                top_dims=c.top_dims.tolist(),
            )
        )
    return out


def summary_table_markdown(summaries: Sequence[LayerSummary]) -> str:
    """Markdown table, one row per layer: head-averaged top-k shares and median share in percent."""
    if not summaries:
        raise ValueError("summaries: expected at least one layer summary")
    ks = list(summaries[0].top_share)
    head = "| Layer | Heads | " + " | ".join(f"Top-{k} (%)" for k in ks) + " | Median (%) |"
    rule = "|---:|---:|" + "---:|" * (len(ks) + 1)
    rows = [
        f"| {s.layer} | {len(s.median_share)} | "
        + " | ".join(f"{100 * s.mean_top_share(k):.2f}" for k in ks)
        + f" | {100 * s.mean_median_share:.3f} |"
        for s in summaries
    ]
    return "\n".join([head, rule, *rows])
