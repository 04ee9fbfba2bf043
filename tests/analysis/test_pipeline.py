import json

import pytest
import torch

from oal.analysis import (
    ContributionAnalysis,
    analyze_contributions,
    concentration,
    contribution_scores,
    layer_summaries,
    mean_abs,
    summary_table_markdown,
)
from oal.grouping import group_heads


def captures(Hq: int = 6, Hkv: int = 2, d: int = 8, layers=(1, 4)):
    """Two batches of prompts: one of 2 padded prompts (lengths 9 and 5), one single prompt of length 13."""
    g = torch.Generator().manual_seed(0)
    first, second = {}, {}
    for layer in layers:
        q1, k1 = torch.randn(2, Hq, 9, d, generator=g), torch.randn(2, Hkv, 9, d, generator=g)
        q2, k2 = torch.randn(1, Hq, 13, d, generator=g), torch.randn(1, Hkv, 13, d, generator=g)
        first[layer] = (q1, k1, torch.tensor([9, 5]))
        second[layer] = (q2, k2)
    return [first, second]


def test_analyze_matches_direct_calls() -> None:
    caps = captures()
    an = analyze_contributions(iter(caps), model_id="toy")
    assert an.layers == [1, 4] and an.lengths == [9, 5, 13]
    assert an.chi.shape == (2, 3, 6, 8) and an.k_abs.shape == (2, 3, 2, 8)
    assert (an.num_heads, an.num_kv_heads, an.head_dim) == (6, 2, 8)
    for i, layer in enumerate(an.layers):
        q1, k1, n1 = caps[0][layer]
        q2, k2 = caps[1][layer]
        want = torch.cat([contribution_scores(q1, k1, lengths=n1), contribution_scores(q2, k2)])
        torch.testing.assert_close(an.chi[i], want, rtol=0, atol=0)
        torch.testing.assert_close(an.q_abs[i], torch.cat([mean_abs(q1, n1), mean_abs(q2)]))
    qa, ka, chi = an.head_profile(4, 5)  # query head 5 reads KV head 5 // 3 = 1
    torch.testing.assert_close(ka, an.k_abs[1, :, 1].mean(0))
    torch.testing.assert_close(chi, an.chi_mean[1, 5])
    torch.testing.assert_close(qa, an.q_abs[1, :, 5].mean(0))
    assert set(an.chi_by_layer()) == {1, 4}
    assert an.gaussian_control(seed=1).shape == (3, 6, 8)


def test_analysis_feeds_grouping_and_round_trips(tmp_path) -> None:
    an = analyze_contributions(captures(), model_id="toy")
    ga = group_heads(an.chi_by_layer(), model_id=an.model_id, alpha=0.5, gamma=0.5, n_boot=20)
    assert ga.group_ids(4).shape == (6, 8)
    path = an.save(tmp_path / "chi.safetensors")
    back = ContributionAnalysis.load(path, model_id="toy")
    assert back.layers == an.layers and back.lengths == an.lengths and back.model_id == "toy"
    assert torch.equal(back.chi, an.chi) and torch.equal(back.k_abs, an.k_abs)
    with pytest.raises(ValueError, match="model_id"):
        ContributionAnalysis.load(path, model_id="other")


def test_analyze_errors() -> None:
    caps = captures()
    with pytest.raises(ValueError, match="expected layers"):
        analyze_contributions([caps[0], {1: caps[1][1]}])
    with pytest.raises(ValueError, match="none"):
        analyze_contributions([])
    other = captures(Hq=4)
    with pytest.raises(ValueError, match=r"\(Hq, Hkv, d\)"):
        analyze_contributions([caps[0], other[1]])
    with pytest.raises(ValueError, match="lengths"):
        bad = {1: caps[0][1], 4: (*caps[0][4][:2], torch.tensor([9, 6]))}
        analyze_contributions([bad])


def test_layer_summaries_and_markdown() -> None:
    chi = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0, 0.0], [1.0] * 6]], dtype=torch.float64)
    (s,) = layer_summaries(chi, layers=[7], ks=(1, 2))
    assert s.layer == 7 and s.top_share[1] == [0.4, pytest.approx(1 / 6)]
    assert s.mean_top_share(2) == pytest.approx((0.7 + 2 / 6) / 2)
    assert s.median_share == [pytest.approx(0.15), pytest.approx(1 / 6)]
    d = json.loads(json.dumps(s.to_dict()))
    assert d["num_heads"] == 2 and d["top_dims"][0] == [0, 1]
    md = summary_table_markdown([s])
    assert md.splitlines()[0] == "| Layer | Heads | Top-1 (%) | Top-2 (%) | Median (%) |"
    assert md.splitlines()[2] == f"| 7 | 2 | {100 * (0.4 + 1 / 6) / 2:.2f} | {100 * (0.7 + 2 / 6) / 2:.2f} | 15.833 |"
    assert concentration(chi[0]).top_share[5].shape == (2,)
    with pytest.raises(ValueError, match="layers"):
        layer_summaries(chi, layers=[1, 2])
