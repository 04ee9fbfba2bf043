"""Figures in the form of the paper's Figs. 1, 2a, 5, 6 and 7, and a groups-per-head histogram.

Each function writes one PNG and returns its path. Figures are drawn on the Agg canvas directly (no pyplot),
so nothing depends on or changes a global backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .contributions import top_dims
from .stability import ActivationProfile, input_stability

_HIGHLIGHT = ("tab:red", "tab:orange", "tab:purple", "tab:brown")


def _vector(x: torch.Tensor | Sequence[float], name: str, d: int | None = None) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64).detach().cpu()
    if t.dim() != 1 or t.numel() < 1 or (d is not None and t.numel() != d):
        want = "(d,)" if d is None else f"({d},)"
        raise ValueError(f"{name}: expected a vector of shape {want}, got {tuple(t.shape)}")
    return t


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    return path


def plot_head_profile(
    q_abs: torch.Tensor,
    k_abs: torch.Tensor,
    chi: torch.Tensor,
    path: str | Path,
    *,
    highlight: Sequence[int] | None = None,
    title: str | None = None,
) -> Path:
    """Fig. 1: (a) mean |q| per dimension, (b) mean |k| of the head's KV head, (c) χ_r (Eq. 2), all ``(d,)``;
    ``highlight`` (default: the two largest χ_r) is coloured in every panel."""
    c = _vector(chi, "chi")
    d = c.numel()
    panels = [(_vector(q_abs, "q_abs", d), "(a) Query magnitude", "mean |q|")]
    panels += [(_vector(k_abs, "k_abs", d), "(b) Key magnitude", "mean |k|"), (c, "(c) Contribution", r"$\chi_r$")]
    hi = top_dims(c, min(2, d)).tolist() if highlight is None else [int(r) for r in highlight]
    if any(not 0 <= r < d for r in hi) or len(hi) > len(_HIGHLIGHT):
        raise ValueError(f"highlight: expected at most {len(_HIGHLIGHT)} dimensions in [0, {d}), got {hi}")
    fig = Figure(figsize=(13, 3.4))
    colors = ["tab:gray"] * d
    for r, col in zip(hi, _HIGHLIGHT, strict=False):
        colors[r] = col
    legend = [Patch(color=col, label=f"r={r}") for r, col in zip(hi, _HIGHLIGHT, strict=False)]
    for ax, (vals, name, ylabel) in zip(fig.subplots(1, 3), panels, strict=True):
        ax.bar(range(d), vals.numpy(), color=colors, width=0.9)
        if legend:
            ax.legend(handles=legend, fontsize=8)
        ax.set_title(name)
        ax.set_xlabel("dimension r")
        ax.set_ylabel(ylabel)
        ax.set_xlim(-1, d)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_sorted_groups(
    chi_mean: torch.Tensor,
    groups: Sequence[Sequence[int]],
    path: str | Path,
    *,
    fallback_cuts: Sequence[int] = (),
    title: str | None = None,
) -> Path:
    """Fig. 2a: χ_r sorted ascending (log scale), bars coloured by group, lines at the group boundaries (dashed
    black for natural cuts, dotted grey for ``fallback_cuts``, given as cut positions k like
    ``GroupingResult.fallback_cuts``). ``groups`` must be bulk first and contiguous in the sorted order, as
    :mod:`oal.grouping` returns them."""
    c = _vector(chi_mean, "chi_mean")
    d = c.numel()
    gid = torch.full((d,), -1, dtype=torch.long)
    for g, dims in enumerate(groups):
        gid[torch.as_tensor(list(dims), dtype=torch.long)] = g
    if bool((gid < 0).any()) or sum(len(g) for g in groups) != d:
        raise ValueError(f"groups: expected a partition of range({d}), got {[list(g) for g in groups]}")
    order = torch.sort(c, stable=True).indices
    sorted_gid = gid[order]
    if bool((sorted_gid.diff() < 0).any()):
        raise ValueError("groups: expected groups contiguous in ascending χ order, bulk first")
    fig = Figure(figsize=(8, 3.6))
    ax = fig.subplots()
    palette = [f"C{g % 10}" for g in range(len(groups))]
    ax.bar(range(d), c[order].clamp_min(1e-300).numpy(), color=[palette[int(g)] for g in sorted_gid], width=0.9)
    cuts = (torch.nonzero(sorted_gid.diff()).flatten() + 1).tolist()
    if not set(fallback_cuts) <= set(cuts):
        raise ValueError(f"fallback_cuts: expected a subset of the group boundaries {cuts}, got {list(fallback_cuts)}")
    for k in cuts:
        style = ("tab:gray", ":") if k in fallback_cuts else ("black", "--")
        ax.axvline(k - 0.5, color=style[0], linestyle=style[1], linewidth=1.0)
    ax.set_yscale("log")
    ax.set_xlabel(r"rank (ascending $\chi_r$)")
    ax.set_ylabel(r"$\chi_r$")
    handles = [Patch(color=palette[g], label=f"G{g + 1} ({len(groups[g])})") for g in range(len(groups))]
    ax.legend(handles=handles, loc="upper left", fontsize=8, title="group (size)")
    ax.set_title(title or f"Sorted contributions and {len(groups)} groups")
    fig.tight_layout()
    return _save(fig, path)


def plot_concentration_controls(
    shares: Mapping[str, float], path: str | Path, *, k: int = 5, title: str | None = None
) -> Path:
    """Fig. 5: top-k contribution share (fractions in [0, 1]) per representation, e.g. pretrained vs Gaussian."""
    if not shares:
        raise ValueError("shares: expected at least one named share")
    names, vals = list(shares), [100 * float(v) for v in shares.values()]
    fig = Figure(figsize=(1.6 + 1.3 * len(names), 3.4))
    ax = fig.subplots()
    bars = ax.bar(names, vals, color=[f"C{i}" for i in range(len(names))])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel(f"top-{k} share of " + r"$\Sigma_r\,\chi_r$ (%)")
    ax.set_ylim(0, max(100.0, max(vals) * 1.1))
    ax.set_title(title or f"Top-{k} contribution concentration")
    fig.tight_layout()
    return _save(fig, path)


def plot_input_stability(
    chi_cal: torch.Tensor, chi_held: torch.Tensor, path: str | Path, *, k: int = 5, title: str | None = None
) -> Path:
    """Fig. 6: calibration vs held-out χ_r ``(d,)`` on log axes, top-k calibration dimensions marked."""
    a = _vector(chi_cal, "chi_cal")
    b = _vector(chi_held, "chi_held", a.numel())
    st = input_stability(a, b, k)
    fig = Figure(figsize=(4.2, 4.0))
    ax = fig.subplots()
    ax.scatter(a.numpy(), b.numpy(), s=12, color="tab:gray")
    top = st.top_calibration.tolist()
    ax.scatter(a[top].numpy(), b[top].numpy(), s=24, color="tab:red", label=f"top-{k} (calibration)")
    lo, hi = float(torch.cat([a, b]).clamp_min(1e-300).min()), float(torch.cat([a, b]).max())
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.7, linestyle=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(r"$\chi_r$ (calibration)")
    ax.set_ylabel(r"$\chi_r$ (held-out)")
    ax.legend(fontsize=8)
    ax.set_title(title or f"Spearman ρ = {float(st.spearman):.3f}, top-{k} overlap {int(st.overlap)}/{k}")
    fig.tight_layout()
    return _save(fig, path)


def plot_activation_profile(profile: ActivationProfile, path: str | Path, *, title: str | None = None) -> Path:
    """Fig. 7: per layer, the three largest dimension-wise max |activation| and their median (log scale)."""
    vals, _ = profile.top(min(3, profile.max_abs.shape[1]))
    layers = list(range(profile.max_abs.shape[0]))
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    for i in range(vals.shape[1]):
        ax.plot(layers, vals[:, i].numpy(), marker="o", markersize=3, label=f"Top-{i + 1}")
    ax.plot(layers, profile.median.numpy(), marker="o", markersize=3, color="black", label="Median")
    ax.set_yscale("log")
    ax.set_xlabel("layer (zero-based)")
    ax.set_ylabel("max |activation|")
    ax.legend(fontsize=8)
    ax.set_title(title or "Layer-wise activation profile")
    fig.tight_layout()
    return _save(fig, path)


def plot_group_histogram(counts: Sequence[int], path: str | Path, *, title: str | None = None) -> Path:
    """Histogram of the number of groups per (layer, head), one bar per integer count."""
    c = [int(x) for x in counts]
    if not c or min(c) < 1:
        raise ValueError(f"counts: expected positive group counts, got {c[:10]}")
    xs = list(range(min(c), max(c) + 1))
    fig = Figure(figsize=(5, 3.2))
    ax = fig.subplots()
    bars = ax.bar(xs, [c.count(x) for x in xs], color="tab:blue")
    ax.bar_label(bars)
    ax.set_xticks(xs)
    ax.set_xlabel("groups per head")
    ax.set_ylabel("heads")
    ax.set_title(title or f"Groups per head ({len(c)} heads)")
    fig.tight_layout()
    return _save(fig, path)
