"""Attention kernels: OAL (§4.3), the learned global quadratic (App. D) and, later, the F.1 baselines."""

from .base import AttentionKernel, SoftmaxKernel, check_positions, repeat_kv
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
from .sink_window import SinkWindowKernel, sink_window_name, split_sink_window_name

__all__ = [
    "AttentionKernel",
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
