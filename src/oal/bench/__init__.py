"""Benchmarks of the attention operator (`oal bench op`).

``methods`` holds the registry of benchmarked methods, ``flops`` the analytical FLOP counts, ``devices`` the
per-device timing and memory reading, ``op`` the sweep (each point in a fresh process) and ``report`` the
Markdown table and plot. ``op`` is not imported here so that ``python -m oal.bench.op`` runs it cleanly.
"""

from .flops import AttnShape, quadratic_chunk_flops, sdpa_causal_flops
from .methods import METHODS, Method, get_method, kernel_method, register_method

__all__ = [
    "METHODS",
    "AttnShape",
    "Method",
    "get_method",
    "kernel_method",
    "quadratic_chunk_flops",
    "register_method",
    "sdpa_causal_flops",
]
