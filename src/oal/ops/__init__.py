"""Attention operators. One folder per op, each with ``naive.py`` (ground truth), ``chunk.py`` and ``recurrent.py``."""

from .quadratic import (
    KernelFactor,
    chunk_quadratic_attention,
    feature_dim,
    naive_quadratic_attention,
    quadratic_attention,
    recurrent_quadratic_attention,
    split_state,
)
from .sink_window import SinkWindowState, sink_window_attention

__all__ = [
    "KernelFactor",
    "SinkWindowState",
    "chunk_quadratic_attention",
    "feature_dim",
    "naive_quadratic_attention",
    "quadratic_attention",
    "recurrent_quadratic_attention",
    "sink_window_attention",
    "split_state",
]
