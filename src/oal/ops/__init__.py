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

__all__ = [
    "KernelFactor",
    "chunk_quadratic_attention",
    "feature_dim",
    "naive_quadratic_attention",
    "quadratic_attention",
    "recurrent_quadratic_attention",
    "split_state",
]
