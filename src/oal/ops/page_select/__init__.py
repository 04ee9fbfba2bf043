"""Page-selected decode steps of the exact heads (beyond the paper; Quest-style): per KV head, a one-token step
over more keys than its budget attends exactly to page 0, the recent pages and the pages whose key bounds promise
the highest scores. ``naive.py`` is the ground truth; the fused CPU step is ``../quadratic/cpu/decode.cpp``
(reached through :func:`oal.kernels.decode.decode_step`)."""

from .naive import (
    RECENT_PAGES,
    check_budget,
    gather_keys,
    num_pages,
    page_bounds,
    page_keys,
    page_scores,
    select_pages,
)

__all__ = [
    "RECENT_PAGES",
    "check_budget",
    "gather_keys",
    "num_pages",
    "page_bounds",
    "page_keys",
    "page_scores",
    "select_pages",
]
