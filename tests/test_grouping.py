import json
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oal.grouping import (
    GroupAssignment,
    bootstrap_counts,
    fixed_budget_groups,
    group_dimensions,
    group_heads,
    tail_candidates,
)
from oal.kernels import OALKernel


def profile_chi(values, P: int = 8, noise: float = 0.0, seed: int = 0) -> torch.Tensor:
    """(P, d) per-prompt contributions around the given per-dimension means (multiplicative noise)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.tensor(values, dtype=torch.float64)
    return v * (1 + noise * (2 * torch.rand(P, v.numel(), generator=g, dtype=torch.float64) - 1))


def reference_support(chi: torch.Tensor, cands, tau: float, n_boot: int, seed: int, eps: float = 1e-12):
    """Eqs. 17–18 one replicate at a time, drawing the prompt indices with the same generator."""
    P, d = chi.shape
    order = torch.sort(chi.mean(0), stable=True).indices.tolist()
    idx = torch.randint(P, (n_boot, P), generator=torch.Generator().manual_seed(seed))
    hits = [0] * len(cands)
    for b in range(n_boot):
        boot = [sum(float(chi[i, r]) for i in idx[b].tolist()) / P for r in range(d)]
        for c, k in enumerate(cands):
            upper = min(boot[r] for r in order[k:])
            lower = max(boot[r] for r in order[:k])
            hits[c] += upper / max(lower, eps) >= tau
    return [h / n_boot for h in hits]


def test_two_step_tail_gives_exactly_those_groups() -> None:
    # 13 bulk dims around 1, two dims at 10, one at 100, at scattered original indices.
    d = 16
    vals = [1.0 + 0.01 * i for i in range(d)]
    vals[3], vals[11], vals[7] = 10.0, 10.5, 100.0
    chi = profile_chi(vals, P=12, noise=0.05)
    res = group_dimensions(chi, alpha=0.25, gamma=0.9)
    assert res.candidates == [12, 13, 14, 15]
    assert res.natural_cuts == [13, 15] and res.fallback_cuts == []
    bulk = sorted(set(range(d)) - {3, 7, 11})
    assert res.groups == [bulk, [3, 11], [7]]
    assert (
        res.group_ids[[3, 11]].tolist() == [1, 1] and res.group_ids[7] == 2 and bool((res.group_ids[bulk] == 0).all())
    )
    assert res.support[1] == 1.0 and res.support[3] == 1.0
    mean = chi.mean(0)
    # ρ_13 = χ_{π_14} / χ_{π_13}: smallest of the two middle dims over the largest bulk dim.
    assert res.rho[1] == pytest.approx(float(mean[[3, 11]].min() / mean[bulk].max()), rel=1e-12)


def test_flat_profile_falls_back_in_candidate_order() -> None:
    # Every candidate has S = 0 and ρ = 1 (exact ties): fallback keeps the original candidate order.
    chi = torch.ones(5, 12, dtype=torch.float64)
    res = group_dimensions(chi, alpha=0.25, gamma=0.9, n_boot=50)
    assert res.order == list(range(12))  # stable sort of ties
    assert res.candidates == [9, 10, 11] and res.natural_cuts == [] and res.fallback_cuts == [9]
    assert res.groups == [list(range(9)), [9, 10, 11]]
    res3 = group_dimensions(chi, alpha=0.25, gamma=0.9, n_boot=50, g_min=3)
    assert res3.fallback_cuts == [9, 10] and res3.groups == [list(range(9)), [9], [10, 11]]


def test_zero_contributions_use_eps() -> None:
    chi = torch.zeros(4, 8, dtype=torch.float64)
    chi[:, 5] = 1.0
    res = group_dimensions(chi, alpha=0.25, gamma=0.9, n_boot=20)
    assert res.natural_cuts == [7] and res.groups == [[0, 1, 2, 3, 4, 6, 7], [5]]
    assert res.rho[0] == 0.0 and res.rho[1] == pytest.approx(1e12)


def unstable_chi() -> torch.Tensor:
    # Dim 6 (Y) is 2 in nine prompts and 20 in one; dim 1 (X) is always 8. ρ(X|Y) = 8/3.8 ≈ 2.1 ≥ τ, but the
    # bootstrap keeps X/Y ≥ 1.5 only when the outlier prompt is drawn at most once: S ≈ 0.74.
    chi = torch.tensor([[1.0, 8.0, 1.01, 1.02, 1.03, 1.04, 2.0, 1.05]], dtype=torch.float64).repeat(10, 1)
    chi[4, 6] = 20.0
    return chi


def test_unstable_gap_needs_support() -> None:
    chi = unstable_chi()
    strict = group_dimensions(chi, alpha=0.5, gamma=0.9)
    assert strict.candidates == [4, 5, 6, 7]
    assert strict.rho[3] >= 1.5 and 0.6 < strict.support[3] < 0.85
    assert strict.natural_cuts == [6] and strict.fallback_cuts == []
    assert strict.groups == [[0, 2, 3, 4, 5, 7], [1, 6]]
    loose = group_dimensions(chi, alpha=0.5, gamma=0.5)
    assert loose.natural_cuts == [6, 7] and loose.groups == [[0, 2, 3, 4, 5, 7], [6], [1]]
    assert loose.support == strict.support  # same seed, same resamples


def test_fallback_prioritises_support_over_rho() -> None:
    # Gap A = Y→X (k=7): X is 2.5 in nine prompts and 100 in one, so ρ_A = 12.25/1.82 is large but S_A ≈ 0.65.
    # Gap B = bulk→Y (k=6): Y is 2 in nine prompts and 0.2 in one, so ρ_B = 1.82/1.05 is smaller, S_B ≈ 0.93.
    # With γ = 1 neither is natural; fallback ranks support first, so the single cut must be B.
    chi = torch.tensor([[1.0, 2.5, 1.01, 1.02, 1.03, 1.04, 2.0, 1.05]], dtype=torch.float64).repeat(10, 1)
    chi[4, 1] = 100.0
    chi[7, 6] = 0.2
    res = group_dimensions(chi, alpha=0.5, gamma=1.0)
    rho = dict(zip(res.candidates, res.rho, strict=True))
    sup = dict(zip(res.candidates, res.support, strict=True))
    assert rho[7] > rho[6] >= 1.5 and 1.0 > sup[6] > sup[7] > 0
    assert res.natural_cuts == [] and res.fallback_cuts == [6]
    assert res.groups == [[0, 2, 3, 4, 5, 7], [1, 6]]
    assert group_dimensions(chi, alpha=0.5, gamma=1.0, g_min=3).fallback_cuts == [6, 7]


def test_support_matches_per_replicate_reference() -> None:
    chi = profile_chi([1, 1.2, 3, 3.5, 9, 2.6, 1.1, 20], P=6, noise=0.6, seed=3)
    res = group_dimensions(chi, alpha=0.5, gamma=0.5, tau=1.4, n_boot=200, seed=7)
    want = reference_support(chi, res.candidates, 1.4, 200, 7)
    assert res.support == pytest.approx(want, abs=0)


def test_determinism_and_seed() -> None:
    chi = unstable_chi()
    a = group_dimensions(chi, alpha=0.5, gamma=0.9, seed=1)
    b = group_dimensions(chi, alpha=0.5, gamma=0.9, seed=1)
    c = group_dimensions(chi, alpha=0.5, gamma=0.9, seed=2)
    assert a.to_dict() == b.to_dict()
    assert a.support != c.support


def test_alpha_limits_candidates() -> None:
    # A huge gap low in the profile (between sorted ranks 4 and 5) is outside the tail and never cut.
    vals = [1.0] * 4 + [1000.0 + i for i in range(12)]
    chi = profile_chi(vals, P=4)
    res = group_dimensions(chi, alpha=0.25, gamma=0.9, n_boot=50)
    assert 4 not in res.candidates and 4 not in res.cuts
    assert res.num_groups == 2 and res.fallback_cuts == [12]
    wide = group_dimensions(chi, alpha=0.75, gamma=0.9, n_boot=50)
    assert wide.candidates[0] == 4 and wide.natural_cuts == [4]


def test_tail_candidates() -> None:
    assert tail_candidates(64, 0.25) == list(range(48, 64))
    assert tail_candidates(64, 0.5) == list(range(32, 64))
    assert tail_candidates(10, 1.0) == list(range(1, 10))
    assert tail_candidates(10, 0.01) == [9]
    assert tail_candidates(100, 0.07) == list(range(93, 100))
    assert tail_candidates(1, 0.5) == []


def test_bootstrap_counts() -> None:
    c = bootstrap_counts(7, 30, 0)
    assert c.shape == (30, 7) and bool((c.sum(1) == 7).all())
    assert torch.equal(c, bootstrap_counts(7, 30, 0))


@pytest.mark.parametrize(
    "chi,kw,match",
    [
        (torch.ones(3, 4, 2), {}, "chi"),
        (-torch.ones(3, 4), {}, "non-negative"),
        (torch.full((3, 4), float("nan")), {}, "finite"),
        (torch.ones(3, 4), {"alpha": 0.0}, "alpha"),
        (torch.ones(3, 4), {"gamma": 1.5}, "gamma"),
        (torch.ones(3, 4), {"tau": -1.0}, "tau"),
        (torch.ones(3, 4), {"g_min": 0}, "g_min"),
        (torch.ones(3, 4), {"n_boot": 0}, "n_boot"),
        (torch.ones(3, 16), {"alpha": 0.25, "g_min": 6}, "g_min"),
    ],
)
def test_errors(chi, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        group_dimensions(chi, **{"alpha": 0.5, "gamma": 0.5, "n_boot": 10, **kw})


@st.composite
def grouping_cases(draw):
    P = draw(st.integers(1, 6))
    d = draw(st.integers(1, 24))
    base = draw(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=d, max_size=d))
    noise = draw(st.lists(st.floats(0.5, 1.5), min_size=P * d, max_size=P * d))
    chi = torch.tensor(base, dtype=torch.float64) * torch.tensor(noise, dtype=torch.float64).view(P, d)
    alpha = draw(st.sampled_from([0.1, 0.25, 0.5, 1.0]))
    n_cands = len(tail_candidates(d, alpha))
    g_min = draw(st.integers(1, n_cands + 1))
    return chi, alpha, draw(st.floats(0, 1)), draw(st.floats(1.01, 4)), g_min


@given(grouping_cases())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_property_partition_bulk_first(case) -> None:
    chi, alpha, gamma, tau, g_min = case
    d = chi.shape[1]
    res = group_dimensions(chi, alpha=alpha, gamma=gamma, tau=tau, g_min=g_min, n_boot=16)
    assert sorted(r for g in res.groups for r in g) == list(range(d))
    assert all(g == sorted(g) and g for g in res.groups)
    assert res.num_groups >= g_min and res.num_groups == len(res.cuts) + 1
    # Bulk first: the groups are consecutive runs of the ascending order π.
    pos = {r: i for i, r in enumerate(res.order)}
    runs = [sorted(pos[r] for r in g) for g in res.groups]
    assert [x for run in runs for x in run] == list(range(d))
    mean = chi.mean(0)
    for lo, hi in zip(res.groups[:-1], res.groups[1:], strict=True):
        assert float(mean[lo].max()) <= float(mean[hi].min())
    for k in res.natural_cuts:
        i = res.candidates.index(k)
        assert res.rho[i] >= tau and res.support[i] >= gamma
    assert set(res.cuts) <= set(res.candidates)
    assert res.group_ids.tolist() == [next(g for g, grp in enumerate(res.groups) if r in grp) for r in range(d)]


def test_fixed_budget_groups() -> None:
    vals = torch.tensor([1.0, 50.0, 1.1, 5.0, 1.2, 400.0, 6.0], dtype=torch.float64)
    # Sorted: 1, 1.1, 1.2, 5, 6, 50, 400 -> ρ = 1.1, 1.09, 4.17, 1.2, 8.33, 8.0.
    two = fixed_budget_groups(vals, 2)
    assert two.cuts == [5] and two.groups == [[0, 2, 3, 4, 6], [1, 5]]
    three = fixed_budget_groups(vals, 3)
    assert three.cuts == [5, 6] and three.groups == [[0, 2, 3, 4, 6], [1], [5]]
    four = fixed_budget_groups(vals, 4)
    assert four.cuts == [3, 5, 6] and four.groups == [[0, 2, 4], [3, 6], [1], [5]]
    assert fixed_budget_groups(vals, 1).groups == [list(range(7))]
    assert fixed_budget_groups(vals, 7).groups == [[0], [2], [4], [3], [6], [1], [5]]
    for G in range(1, 7):  # nested budgets
        assert set(fixed_budget_groups(vals, G).cuts) <= set(fixed_budget_groups(vals, G + 1).cuts)
    with pytest.raises(ValueError, match="G"):
        fixed_budget_groups(vals, 8)


def chi_stack(L: int = 3, P: int = 10, H: int = 4, d: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    base = torch.rand(L, 1, H, d, generator=g, dtype=torch.float64) ** 6 * 100 + 1
    return base * (1 + 0.3 * torch.rand(L, P, H, d, generator=g, dtype=torch.float64))


def test_group_heads_equals_per_head() -> None:
    chi = chi_stack()
    ga = group_heads(chi, model_id="toy", alpha=0.5, gamma=0.5, n_boot=100, layers=[2, 5, 9])
    assert sorted(ga.layers) == [2, 5, 9] and ga.head_dim == 16 and ga.num_heads == 4
    for i, layer in enumerate([2, 5, 9]):
        for h in range(4):
            one = group_dimensions(chi[i, :, h], alpha=0.5, gamma=0.5, n_boot=100)
            assert ga.layers[layer][h].to_dict() == one.to_dict()
    ids = ga.group_ids(5)
    assert ids.shape == (4, 16) and ids.dtype == torch.long
    kern = OALKernel(ids, num_kv_heads=2, num_groups=ga.num_groups(5))
    assert torch.equal(kern.groups, ids)
    as_map = group_heads({2: chi[0], 5: chi[1], 9: chi[2]}, model_id="toy", alpha=0.5, gamma=0.5, n_boot=100)
    assert as_map.to_dict() == ga.to_dict()
    assert len(ga.group_counts()) == 12


def test_group_heads_shape_errors() -> None:
    with pytest.raises(ValueError, match="layers"):
        group_heads(chi_stack(), model_id="m", alpha=0.5, gamma=0.5, layers=[0, 1])
    with pytest.raises(ValueError, match="same"):
        group_heads({0: torch.ones(4, 2, 8), 1: torch.ones(4, 2, 9)}, model_id="m", alpha=0.5, gamma=0.5)
    with pytest.raises(ValueError, match="layer"):
        group_heads(chi_stack(), model_id="m", alpha=0.5, gamma=0.5, n_boot=10).group_ids(7)


def test_json_round_trip_and_validation(tmp_path) -> None:
    ga = group_heads(chi_stack(L=2), model_id="toy/model", alpha=0.25, gamma=0.9, n_boot=50)
    path = ga.save(tmp_path / "groups.json")
    back = GroupAssignment.load(path, model_id="toy/model", head_dim=16, num_heads=4)
    assert back.to_dict() == ga.to_dict()
    assert torch.equal(back.group_ids(1), ga.group_ids(1))
    with pytest.raises(ValueError, match="model_id"):
        GroupAssignment.load(path, model_id="other/model")
    with pytest.raises(ValueError, match="head_dim"):
        GroupAssignment.load(path, head_dim=64)
    data = json.loads(path.read_text())
    data["layers"]["0"][1]["groups"][0].append(data["layers"]["0"][1]["groups"][-1][0])  # duplicate a dim
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="layer 0 head 1"):
        GroupAssignment.load(tmp_path / "bad.json")
    data = json.loads(path.read_text())
    data["version"] = 99
    (tmp_path / "v.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version"):
        GroupAssignment.load(tmp_path / "v.json")
    data = json.loads(path.read_text())
    del data["layers"]["0"][2]["order"]
    (tmp_path / "m.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="malformed"):
        GroupAssignment.load(tmp_path / "m.json")
    (tmp_path / "t.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON"):
        GroupAssignment.load(tmp_path / "t.json")
    assert set(back.group_id_tensors()) == {0, 1}
    data = json.loads(path.read_text())
    data["layers"]["1"] = data["layers"]["1"][:3]
    (tmp_path / "h.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="expected 4 heads"):
        GroupAssignment.load(tmp_path / "h.json")


@pytest.mark.slow
def test_paper_scale_runs_in_seconds() -> None:
    # The brief's scale: 30 layers x 27 heads x d=64, 40 prompts, B = 1000 (a few seconds on an idle core).
    chi = chi_stack(L=30, P=40, H=27, d=64)
    t0 = time.perf_counter()
    ga = group_heads(chi, model_id="big", alpha=0.25, gamma=0.9, n_boot=1000)
    elapsed = time.perf_counter() - t0
    assert len(ga.group_counts()) == 810 and min(ga.group_counts()) >= 2
    assert elapsed < 60, elapsed
