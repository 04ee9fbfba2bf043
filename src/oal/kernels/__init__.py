"""Attention kernels: OAL (§4.3), the learned global quadratic (App. D) and the F.1 baselines."""

from .base import AttentionKernel, SoftmaxKernel, check_positions, repeat_kv
from .baselines import DiJiangKernel, FeatureKernel, PerformerKernel, SpectraFormerKernel, TaylorShiftKernel
from .hybrid import EXACT_HEADS, ExactHeadsKernel, ExactHeadsState
from .oal import (
    GlobalQuadraticKernel,
    OALKernel,
    check_groups,
    embed_global,
    oal_attention,
    oal_coefficients,
    oal_factor,
    taylor_global_L,
    taylor_L,
)
from .registry import KERNELS, SINK_WINDOW_KERNELS, build_kernel, kernel_config, kernel_from_config
from .sink_window import SinkWindowKernel, sink_window_name, split_sink_window_name

__all__ = [
    "KERNELS",
    "SINK_WINDOW_KERNELS",
    "AttentionKernel",
    "DiJiangKernel",
    "EXACT_HEADS",
    "ExactHeadsKernel",
    "ExactHeadsState",
    "FeatureKernel",
    "PerformerKernel",
    "SpectraFormerKernel",
    "TaylorShiftKernel",
    "build_kernel",
    "kernel_config",
    "kernel_from_config",
    "GlobalQuadraticKernel",
    "OALKernel",
    "SinkWindowKernel",
    "SoftmaxKernel",
    "check_positions",
    "repeat_kv",
    "check_groups",
    "embed_global",
    "oal_attention",
    "oal_coefficients",
    "oal_factor",
    "taylor_L",
    "taylor_global_L",
    "sink_window_name",
    "split_sink_window_name",
]
