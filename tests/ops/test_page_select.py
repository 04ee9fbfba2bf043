"""The page-selected decode step's ground truth (oal.ops.page_select), checked against hand-computed answers."""

from __future__ import annotations

import pytest
import torch

from oal.ops.page_select import RECENT_PAGES, check_budget, page_bounds, page_keys, page_scores, select_pages


def test_page_bounds_by_hand():
    k = torch.tensor([[1.0, -2.0], [3.0, 0.0], [-1.0, 5.0]]).view(1, 1, 3, 2)
    b = page_bounds(k, 2)
    assert b.dtype == torch.bfloat16 and b.shape == (1, 1, 2, 2, 2)
    assert b[0, 0, 0].float().tolist() == [[1.0, -2.0], [3.0, 0.0]]  # page 0: min, max of its two keys
    assert b[0, 0, 1].float().tolist() == [[-1.0, 5.0], [-1.0, 5.0]]  # the partial page: its one key


def test_page_bounds_round_to_nearest_bf16():
    x = 1.0 + 2.0**-8 + 2.0**-10  # between the bf16 numbers 1 and 1 + 2^-7, nearer the second
    b = page_bounds(torch.full((1, 1, 1, 1), x), 4)
    assert float(b[0, 0, 0, 0, 0]) == float(b[0, 0, 0, 1, 0]) == 1.0 + 2.0**-7


def test_page_scores_bound_every_score():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 4, 16, generator=gen), torch.randn(2, 3, 40, 16, generator=gen)
    U = page_scores(q, page_bounds(k.to(torch.bfloat16).float(), 8), 0.5)
    s = 0.5 * q @ k.to(torch.bfloat16).float().mT  # (2, 3, 4, 40)
    assert U.dtype == torch.float64
    assert (s.view(2, 3, 4, 5, 8).amax(-1).double() <= U + 1e-6).all()


def test_select_pages_by_hand():
    """page 2 keys, budget 8 = 4 pages: page 0, the 2 recent pages and the best other; 13 keys = 7 pages."""
    k = torch.zeros(1, 1, 13, 2)
    k[0, 0, 6] = torch.tensor([4.0, 0.0])  # page 3 holds the key the query x-axis favours
    k[0, 0, 9] = torch.tensor([0.0, 3.0])  # page 4 the y-axis one
    b = page_bounds(k, 2)
    q = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    assert select_pages(q, b, 13, 8, 2, 1.0).tolist() == [[[0, 3, 5, 6]]]
    q = torch.tensor([0.0, 1.0]).view(1, 1, 1, 2)
    assert select_pages(q, b, 13, 8, 2, 1.0).tolist() == [[[0, 4, 5, 6]]]
    # two query heads, each best on its own page (its bound minus its own best: 0 for both): the lower page wins
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    assert select_pages(q, b, 13, 8, 2, 1.0).tolist() == [[[0, 3, 5, 6]]]
    # a budget of 10 keys = 5 pages takes both
    assert select_pages(q, b, 13, 10, 2, 1.0).tolist() == [[[0, 3, 4, 5, 6]]]


def test_select_pages_within_the_budget_takes_every_page():
    b = page_bounds(torch.randn(2, 3, 16, 4), 4)
    q = torch.randn(2, 3, 2, 4)
    assert select_pages(q, b, 16, 16, 4, 1.0).tolist() == [[[0, 1, 2, 3]] * 3] * 2


def test_page_keys_cut_the_partial_last_page():
    pages = torch.tensor([[[0, 2, 3]], [[0, 1, 3]]])  # two rows, 13 keys of pages of 4: page 3 holds key 12 only
    assert page_keys(pages, 13, 4).tolist() == [[[0, 1, 2, 3, 8, 9, 10, 11, 12]], [[0, 1, 2, 3, 4, 5, 6, 7, 12]]]


@pytest.mark.parametrize("budget, page", [(100, 64), (3 * 64, 64), (0, 16), (256, 0), (True, 64)])
def test_check_budget_names_what_is_wrong(budget, page):
    with pytest.raises(ValueError, match="decode_budget|decode_page"):
        check_budget(budget, page)


def test_check_budget_accepts_the_least_budget():
    check_budget((RECENT_PAGES + 2) * 16, 16)
    check_budget(None, 64)
