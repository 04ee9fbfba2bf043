import pytest
import torch

from oal.analysis import activation_profile
from oal.analysis.plots import (
    plot_activation_profile,
    plot_concentration_controls,
    plot_group_histogram,
    plot_head_profile,
    plot_input_stability,
    plot_sorted_groups,
)
from oal.grouping import group_dimensions

PNG = b"\x89PNG\r\n\x1a\n"


def is_png(path) -> bool:
    data = path.read_bytes()
    return data[:8] == PNG and len(data) > 2000


def test_all_figures_written(tmp_path) -> None:
    d = 64
    chi_p = torch.rand(20, d, dtype=torch.float64) + 0.2
    chi_p[:, 26] *= 40
    chi_p[:, 58] *= 15
    chi_p[:, 7] *= 4
    res = group_dimensions(chi_p, alpha=0.25, gamma=0.9, n_boot=100)
    chi = chi_p.mean(0)
    paths = [
        plot_head_profile(torch.rand(d) + 1, torch.rand(d), chi, tmp_path / "fig1.png", title="L4 H0"),
        plot_sorted_groups(chi, res.groups, tmp_path / "sub" / "fig2a.png", fallback_cuts=res.fallback_cuts),
        plot_concentration_controls(
            {"pretrained": 0.62, "Gaussian (seed 0)": 0.1, "Gaussian (seed 1)": 0.11}, tmp_path / "fig5.png"
        ),
        plot_input_stability(chi, chi * (1 + 0.05 * torch.rand(d)), tmp_path / "fig6.png"),
        plot_activation_profile(
            activation_profile([torch.randn(2, 5, 32) * (i + 1) for i in range(6)]), tmp_path / "fig7.png"
        ),
        plot_group_histogram([2, 2, 3, 5, 2, 4], tmp_path / "hist.png"),
    ]
    for p in paths:
        assert p.exists() and is_png(p), p


def test_plot_errors(tmp_path) -> None:
    chi = torch.rand(8, dtype=torch.float64)
    with pytest.raises(ValueError, match="k_abs"):
        plot_head_profile(torch.rand(8), torch.rand(7), chi, tmp_path / "x.png")
    with pytest.raises(ValueError, match="highlight"):
        plot_head_profile(torch.rand(8), torch.rand(8), chi, tmp_path / "x.png", highlight=[9])
    with pytest.raises(ValueError, match="partition"):
        plot_sorted_groups(chi, [[0, 1, 2], [3, 4]], tmp_path / "x.png")
    order = torch.sort(chi, stable=True).indices.tolist()
    with pytest.raises(ValueError, match="contiguous"):
        plot_sorted_groups(chi, [sorted(order[4:]), sorted(order[:4])], tmp_path / "x.png")
    with pytest.raises(ValueError, match="fallback_cuts"):
        plot_sorted_groups(chi, [sorted(order[:4]), sorted(order[4:])], tmp_path / "x.png", fallback_cuts=[5])
    with pytest.raises(ValueError, match="counts"):
        plot_group_histogram([], tmp_path / "x.png")
