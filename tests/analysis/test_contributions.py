import math

import pytest
import torch

from oal.analysis import (
    concentration,
    contribution_scores,
    contribution_scores_from_list,
    mean_abs,
    prefix_contribution_scores,
    top_dims,
)


def naive_chi(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Eq. 2 literally: mean over causal pairs of |q_ir k_jr scale|, O(N²·d). q (B,Hq,N,d), k (B,Hkv,N,d)."""
    B, Hq, N, d = q.shape
    group = Hq // k.shape[1]
    s = 1 / math.sqrt(d) if scale is None else scale
    out = torch.empty(B, Hq, d, dtype=torch.float64)
    mask = torch.ones(N, N, dtype=torch.bool).tril()
    for b in range(B):
        for h in range(Hq):
            qi = q[b, h].double()[:, None, :]  # (N, 1, d)
            kj = k[b, h // group].double()[None, :, :]  # (1, N, d)
            prod = (qi * kj * s).abs()  # (i, j, d)
            out[b, h] = (prod * mask[:, :, None]).sum((0, 1)) / mask.sum()
    return out


@pytest.mark.parametrize("N", [1, 63, 1000])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (3, 1), (6, 2)])
def test_matches_naive(N: int, Hq: int, Hkv: int) -> None:
    B, d = (1 if N > 100 else 2), 5
    q = torch.randn(B, Hq, N, d) * torch.rand(d) * 4
    k = torch.randn(B, Hkv, N, d) * torch.rand(d) * 4
    got = contribution_scores(q, k)
    assert got.dtype == torch.float64 and got.shape == (B, Hq, d)
    torch.testing.assert_close(got, naive_chi(q, k), rtol=1e-10, atol=0)


def test_gqa_mapping_uses_h_div_group() -> None:
    # KV head 1 is zero: query heads 3..5 (group size 3) must get zero contributions, heads 0..2 must not.
    q = torch.randn(1, 6, 9, 4)
    k = torch.randn(1, 2, 9, 4)
    k[:, 1] = 0
    chi = contribution_scores(q, k)
    assert bool((chi[0, :3] > 0).all()) and bool((chi[0, 3:] == 0).all())


def test_scale_default_and_sign() -> None:
    q, k = torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    base = contribution_scores(q, k, scale=1.0)
    torch.testing.assert_close(contribution_scores(q, k), base / 4)
    torch.testing.assert_close(contribution_scores(q, k, scale=-0.5), base / 2)
    torch.testing.assert_close(contribution_scores(q, k, scale=0.3), naive_chi(q, k, 0.3))


def test_hand_computed() -> None:
    # One head, d=1, N=2, scale=1: pairs (1,1),(2,1),(2,2) -> (|1*3| + |-2*3| + |-2*4|)/3 = 17/3.
    q = torch.tensor([1.0, -2.0]).view(1, 1, 2, 1)
    k = torch.tensor([3.0, 4.0]).view(1, 1, 2, 1)
    assert contribution_scores(q, k, scale=1.0).item() == pytest.approx(17 / 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_accumulate_in_fp64(dtype: torch.dtype) -> None:
    q = (torch.randn(1, 3, 300, 8) * 30).to(dtype)
    k = (torch.randn(1, 1, 300, 8) * 30).to(dtype)
    torch.testing.assert_close(contribution_scores(q, k), naive_chi(q.double(), k.double()), rtol=1e-10, atol=0)


def test_lengths_normalise_each_prompt_by_its_own_pairs() -> None:
    lens = [1, 63, 40]
    N, d = 64, 6
    q = torch.randn(3, 3, N, d)
    k = torch.randn(3, 1, N, d)
    for b, n in enumerate(lens):  # padding garbage must be ignored
        q[b, :, n:] = 1e6
        k[b, :, n:] = 1e6
    got = contribution_scores(q, k, lengths=lens)
    for b, n in enumerate(lens):
        torch.testing.assert_close(got[b], naive_chi(q[b : b + 1, :, :n], k[b : b + 1, :, :n])[0], rtol=1e-10, atol=0)
    # The list form gives the same per-prompt scores, and the χ_r mean weighs prompts equally (not by pairs).
    pairs = [(q[b : b + 1, :, :n], k[b : b + 1, :, :n]) for b, n in enumerate(lens)]
    torch.testing.assert_close(contribution_scores_from_list(pairs), got)
    torch.testing.assert_close(got.mean(0), sum(got[b] for b in range(3)) / 3)


def test_prefix_scores_equal_truncation() -> None:
    q, k = torch.randn(2, 4, 50, 8), torch.randn(2, 2, 50, 8)
    ns = [1, 7, 50]
    got = prefix_contribution_scores(q, k, ns)
    assert got.shape == (3, 2, 4, 8)
    for t, n in enumerate(ns):
        torch.testing.assert_close(got[t], contribution_scores(q[:, :, :n], k[:, :, :n]), rtol=1e-12, atol=0)


def test_mean_abs_with_lengths() -> None:
    x = torch.randn(2, 3, 10, 4)
    x[1, :, 6:] = 1e9
    got = mean_abs(x, [10, 6])
    torch.testing.assert_close(got[0], x[0].double().abs().mean(1))
    torch.testing.assert_close(got[1], x[1, :, :6].double().abs().mean(1))


def test_concentration_hand_values() -> None:
    c = concentration(torch.tensor([[2.0, 1.0, 4.0, 3.0], [1.0, 1.0, 1.0, 1.0]]), ks=(1, 2))
    torch.testing.assert_close(c.top_share[1], torch.tensor([0.4, 0.25], dtype=torch.float64))
    torch.testing.assert_close(c.top_share[2], torch.tensor([0.7, 0.5], dtype=torch.float64))
    torch.testing.assert_close(c.median_share, torch.tensor([0.25, 0.25], dtype=torch.float64))
    assert c.top_dims.tolist() == [[2, 3], [0, 1]]  # ties: lower index first
    odd = concentration(torch.tensor([5.0, 1.0, 4.0]), ks=(2,))
    assert odd.median_share.item() == pytest.approx(0.4)
    assert odd.top_share[2].item() == pytest.approx(0.9)


def test_top_dims_bounds() -> None:
    with pytest.raises(ValueError, match="k"):
        top_dims(torch.ones(3), 4)


@pytest.mark.parametrize(
    "q,k,kw,match",
    [
        (torch.randn(1, 4, 5, 8), torch.randn(1, 3, 5, 8), {}, "KV heads"),
        (torch.randn(1, 4, 5, 8), torch.randn(1, 2, 6, 8), {}, "k: expected shape"),
        (torch.randn(4, 5, 8), torch.randn(1, 2, 5, 8), {}, "q: expected"),
        (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), {"lengths": [5, 0]}, "lengths"),
        (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), {"lengths": [5, 6]}, "lengths"),
        (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), {"lengths": [5]}, "lengths"),
        (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), {"scale": float("nan")}, "scale"),
    ],
)
def test_errors(q, k, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        contribution_scores(q, k, **kw)


def test_concentration_rejects_negative() -> None:
    with pytest.raises(ValueError, match="chi"):
        concentration(torch.tensor([1.0, -1.0, 2.0]))
