"""Ground truth of the exact heads' page-selected decode step (beyond the paper; Quest-style query-aware sparsity).

A decode step of an exact head reads every cached key: at 8k that is what makes a converted model's decode grow
with the context (docs/results/bench/model, stop 36's cost model). With a token ``budget``, a one-token step over
``n > budget`` keys attends, exactly, only to the keys of ``budget // page`` pages of ``page`` consecutive keys:

* the keys are cut into pages ``[p·page, (p+1)·page)`` (the last one partial), and each page keeps the element-wise
  minimum and maximum of its keys, rounded to bf16 (:func:`page_bounds`: 4 bytes per key and head at page 64);
* for a query ``a = scale·q``, ``U(p) = Σ_i max(a_i·min_pi, a_i·max_pi)`` bounds every score ``a·k`` of page p from
  above (up to the bounds' rounding);
* page 0 (the attention sinks) and the last :data:`RECENT_PAGES` pages (the local context, the new key's page
  among them) are always attended; the others are ranked by ``max_g (U_g(p) − max_p' U_g(p'))`` over the query
  heads g of the KV head (each head's bound against its own best page; one selection per KV head, whose keys are
  then read once for its query heads), ties to the lower page, and the best ``budget // page − 1 − RECENT_PAGES``
  join them (:func:`select_pages`);
* the exact softmax then runs over the selected pages' keys only, in their order.

With ``n ≤ budget`` (or no more pages than the budget's) every key is attended: the step is the exact one. Prompts
are never selected (every query of a prompt attends to all of its keys). Nothing here is fused: the bounds are
recomputed from the keys, the selection is a sort, the keys are gathered.
"""

from __future__ import annotations

import torch

RECENT_PAGES = 2  # the new key's page and the one before: the local context every step keeps


def check_budget(budget: int | None, page: int) -> None:
    """Raise ValueError unless ``budget`` (None: off) is a multiple of ``page`` with room for page 0, the
    :data:`RECENT_PAGES` recent pages and one selected page."""
    if not isinstance(page, int) or isinstance(page, bool) or page < 1:
        raise ValueError(f"decode_page: expected a positive number of keys per page, got {page!r}")
    if budget is None:
        return
    least = (RECENT_PAGES + 2) * page
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < least or budget % page:
        raise ValueError(
            f"decode_budget: expected None or a multiple of decode_page={page} of at least {least} keys (page 0, "
            f"{RECENT_PAGES} recent pages and one selected page), got {budget!r}"
        )


def num_pages(n: int, page: int) -> int:
    """Pages of ``page`` keys that ``n`` keys fill (the last one partial)."""
    return -(-n // page)


def page_bounds(k: torch.Tensor, page: int) -> torch.Tensor:
    """``k (B, E, n, d)`` (the keys as stored: fp32, bf16 or dequantised int8 numbers) -> ``(B, E, P, 2, d)`` bf16:
    per page of ``page`` keys (``P = ⌈n / page⌉``, the last one over the keys it has) the element-wise minimum
    (``[..., 0, :]``) and maximum (``[..., 1, :]``), rounded to nearest bf16 (exact for bf16 keys)."""
    B, E, n, d = k.shape
    P = num_pages(n, page)
    kf = k.float()
    pad = P * page - n
    lo = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("inf")).view(B, E, P, page, d).amin(3)
    hi = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("-inf")).view(B, E, P, page, d).amax(3)
    return torch.stack([lo, hi], 3).to(torch.bfloat16)


def page_scores(q: torch.Tensor, bounds: torch.Tensor, scale: float) -> torch.Tensor:
    """``q (B, E, G, d)`` (G query heads per KV head), ``bounds (B, E, P, 2, d)`` -> ``U (B, E, G, P)`` fp64: the
    upper bound ``Σ_i max(a_i·min_pi, a_i·max_pi)`` of the scores ``a·k`` over each page, ``a = scale·q`` rounded
    to fp32. The products of fp32 and bf16 numbers are exact in fp64 and the sums nearly so, so the fused step's
    other order of additions ranks the pages alike (only scores within ~1e-15 of each other could swap)."""
    a = (q.float() * scale).double()
    lo, hi = bounds[..., 0, :].double(), bounds[..., 1, :].double()
    return torch.maximum(a[:, :, :, None] * lo[:, :, None], a[:, :, :, None] * hi[:, :, None]).sum(-1)


def select_pages(q: torch.Tensor, bounds: torch.Tensor, n: int, budget: int, page: int, scale: float) -> torch.Tensor:
    """The pages a decode step over ``n`` keys attends: ``q (B, E, G, d)``, ``bounds (B, E, ≥P, 2, d)`` (only the
    first ``P = ⌈n / page⌉`` pages are read) -> ``(B, E, S)`` int64 page indices in increasing order, ``S =
    min(P, budget // page)`` (all P pages when they fit the budget); see the module docstring for the rule."""
    check_budget(budget, page)
    B, E = q.shape[:2]
    P, S = num_pages(n, page), budget // page
    if P <= S:
        return torch.arange(P, device=q.device).expand(B, E, P)
    recent = torch.arange(P - RECENT_PAGES, P, device=q.device)
    U = page_scores(q, bounds[:, :, 1 : P - RECENT_PAGES], scale)  # candidates: pages 1 … P-1-RECENT_PAGES
    score = (U - U.amax(-1, keepdim=True)).amax(2)  # (B, E, candidates)
    # stable descending sort: among equal scores the lower page comes first
    order = torch.sort(-score, dim=-1, stable=True).indices[..., : S - 1 - RECENT_PAGES] + 1
    first = torch.zeros(B, E, 1, dtype=torch.long, device=q.device)
    chosen = torch.cat([first, order, recent.expand(B, E, RECENT_PAGES)], -1)
    return chosen.sort(-1).values


def page_keys(pages: torch.Tensor, n: int, page: int) -> torch.Tensor:
    """``pages (B, E, S)`` increasing page indices -> ``(B, E, m)`` the indices of their keys below ``n``, in order
    (every row has the same count: only the last page, always selected, can be partial)."""
    offs = torch.arange(page, device=pages.device)
    idx = (pages[..., None] * page + offs).flatten(-2)
    return idx[..., : idx.shape[-1] - (num_pages(n, page) * page - n)]


def gather_keys(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x (B, E, n, ·)`` (or scales ``(B, E, n)``) at the key indices ``idx (B, E, m)`` -> ``(B, E, m, ·)``."""
    if x.dim() == 3:
        return x.gather(2, idx)
    return x.gather(2, idx[..., None].expand(*idx.shape, x.shape[-1]))
