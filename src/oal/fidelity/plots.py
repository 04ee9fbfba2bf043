"""Figures of the fidelity and intervention results (matplotlib, Agg backend, written atomically)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..io import atomic_write  # noqa: E402


def _save(fig, path: Path) -> Path:
    atomic_write(path, lambda p: fig.savefig(p, dpi=120, bbox_inches="tight", format=path.suffix.lstrip(".")))
    plt.close(fig)
    return path


def plot_fidelity(result: dict, path: str | Path) -> Path:
    """RelMSE before / after W_o per method (left) and per layer before W_o (right), from fidelity.json."""
    methods = [m for m in result["methods"] if m != "softmax"]
    layers = result["config"]["layers"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    x = range(len(methods))
    w = 0.4
    before = [result["methods"][m]["relmse_before_wo"] for m in methods]
    after = [result["methods"][m]["relmse_after_wo"] for m in methods]
    ax1.bar([i - w / 2 for i in x], before, w, label="before W_o")
    ax1.bar([i + w / 2 for i in x], after, w, label="after W_o")
    ax1.set_xticks(list(x), methods, rotation=30, ha="right")
    ax1.set_ylabel("RelMSE (Eq. 22)")
    ax1.set_title(f"layers {layers}, {len(result['config']['blocks'])} blocks of {result['config']['seq_len']}")
    ax1.legend()
    wl = 0.8 / max(1, len(layers))
    for j, layer in enumerate(layers):
        vals = [result["methods"][m]["per_layer"][str(layer)]["relmse_before_wo"] for m in methods]
        ax2.bar([i - 0.4 + wl * (j + 0.5) for i in x], vals, wl, label=f"layer {layer}")
    ax2.set_xticks(list(x), methods, rotation=30, ha="right")
    ax2.set_ylabel("RelMSE before W_o")
    ax2.set_title("per layer")
    ax2.legend()
    return _save(fig, Path(path))


def plot_intervention(result: dict, path: str | Path) -> Path:
    """R_S for the high-contribution subsets, the Gaussian control and the matched-control mean, from
    intervene.json."""
    methods = list(result["methods"])
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(methods))
    series = [("high-contribution S_h", [result["methods"][m]["R_S"] for m in methods])]
    if all("R_S_gaussian" in result["methods"][m] for m in methods):
        series.append(("Gaussian control", [result["methods"][m]["R_S_gaussian"] for m in methods]))
    if all("controls" in result["methods"][m] for m in methods):
        series.append(
            ("matched random subsets (mean)", [result["methods"][m]["controls"]["R_controls_mean"] for m in methods])
        )
    w = 0.8 / len(series)
    for j, (label, vals) in enumerate(series):
        ax.bar([i - 0.4 + w * (j + 0.5) for i in x], [100 * v for v in vals], w, label=label)
    ax.set_xticks(list(x), methods)
    ax.set_ylabel("retained-error ratio R_S (%)")
    ax.legend()
    return _save(fig, Path(path))
