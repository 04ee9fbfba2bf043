"""Dimension-wise query–key contribution analysis (§3, App. A) and its figures and tables."""

from .contributions import (
    Concentration,
    check_lengths,
    concentration,
    contribution_scores,
    contribution_scores_from_list,
    mean_abs,
    prefix_contribution_scores,
    top_dims,
)
from .pipeline import ContributionAnalysis, analyze_contributions
from .report import LayerSummary, layer_summaries, summary_table_markdown
from .stability import (
    ActivationProfile,
    ActivationProfileAccumulator,
    InputStability,
    LengthStability,
    activation_profile,
    gaussian_control_scores,
    input_stability,
    length_stability,
)

__all__ = [
    "ActivationProfile",
    "ActivationProfileAccumulator",
    "Concentration",
    "ContributionAnalysis",
    "InputStability",
    "LayerSummary",
    "LengthStability",
    "activation_profile",
    "analyze_contributions",
    "check_lengths",
    "concentration",
    "contribution_scores",
    "contribution_scores_from_list",
    "gaussian_control_scores",
    "input_stability",
    "layer_summaries",
    "length_stability",
    "mean_abs",
    "prefix_contribution_scores",
    "summary_table_markdown",
    "top_dims",
]
