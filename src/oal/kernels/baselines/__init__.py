"""The App. F.1 baselines as :class:`oal.kernels.AttentionKernel` subclasses."""

from .common import FeatureKernel, kernel_generator
from .dijiang import DiJiangKernel, dct_matrix, dijiang_projection
from .performer import PerformerKernel, favor_log_features, orthogonal_gaussian_projection
from .spectraformer import SpectraFormerKernel, fastfood, hadamard_matrix, oprf_coefficient
from .taylorshift import TaylorShiftKernel

__all__ = [
    "DiJiangKernel",
    "FeatureKernel",
    "PerformerKernel",
    "SpectraFormerKernel",
    "TaylorShiftKernel",
    "dct_matrix",
    "dijiang_projection",
    "fastfood",
    "favor_log_features",
    "hadamard_matrix",
    "kernel_generator",
    "oprf_coefficient",
    "orthogonal_gaussian_projection",
]
