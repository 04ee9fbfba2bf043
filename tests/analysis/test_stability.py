import pytest
import torch

from oal.analysis import (
    ActivationProfileAccumulator,
    activation_profile,
    concentration,
    contribution_scores,
    gaussian_control_scores,
    input_stability,
    length_stability,
)


def test_input_stability_hand_cases() -> None:
    a = torch.tensor([[1.0, 5.0, 2.0, 9.0, 3.0, 0.5, 7.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])
    b = torch.tensor([[1.1, 5.2, 2.1, 9.5, 3.3, 0.4, 7.7], [9.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])
    st = input_stability(a, b, k=3)
    # Row 1: rank differences (-6, 1, 1, 1, 1, 1, 1) -> ρ = 1 - 6·42 / (7·48) = 0.25.
    torch.testing.assert_close(st.spearman, torch.tensor([1.0, 0.25], dtype=torch.float64))
    assert st.top_calibration.tolist() == [[3, 6, 1], [6, 5, 4]]
    assert st.top_heldout.tolist() == [[3, 6, 1], [0, 6, 5]]
    assert st.overlap.tolist() == [3, 2]
    rev = input_stability(a[1], a[1].flip(0), k=3)
    assert float(rev.spearman) == pytest.approx(-1.0) and int(rev.overlap) == 0


def test_input_stability_shape_error() -> None:
    with pytest.raises(ValueError, match="chi_held"):
        input_stability(torch.rand(2, 8), torch.rand(2, 7))


def planted(B: int, N: int, Hq: int = 2, Hkv: int = 1, d: int = 16, dims=(3, 9)) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = torch.randn(B, Hq, N, d), torch.randn(B, Hkv, N, d)
    q[..., dims[0]] *= 12
    k[..., dims[0]] *= 6
    q[..., dims[1]] *= 6
    return q, k


def test_length_stability_table() -> None:
    q, k = planted(3, 96)
    ls = length_stability(q, k, lengths=(96, 8, 32), top=3)
    assert ls.lengths == [8, 32, 96]
    assert ls.dims.shape == (2, 3) and ls.dims[:, :2].tolist() == [[3, 9], [3, 9]]
    chi96 = contribution_scores(q, k).mean(0)
    torch.testing.assert_close(ls.share[-1], 100 * chi96.gather(-1, ls.dims) / chi96.sum(-1, keepdim=True))
    chi8 = contribution_scores(q[:, :, :8], k[:, :, :8]).mean(0)
    torch.testing.assert_close(ls.share[0], 100 * chi8.gather(-1, ls.dims) / chi8.sum(-1, keepdim=True))
    md = ls.markdown(head=1)
    assert md.splitlines()[0] == "| Length | r=3 | r=9 | " + f"r={int(ls.dims[1, 2])} |"
    assert len(md.splitlines()) == 2 + 3
    with pytest.raises(ValueError, match="prefix_lengths"):
        length_stability(q, k, lengths=(8, 200))


def test_gaussian_controls() -> None:
    a = gaussian_control_scores([5, 17, 40], num_heads=4, num_kv_heads=2, head_dim=64, seed=3)
    assert a.shape == (3, 4, 64) and a.dtype == torch.float64
    assert torch.equal(a, gaussian_control_scores([5, 17, 40], 4, 2, 64, seed=3))
    assert not torch.equal(a, gaussian_control_scores([5, 17, 40], 4, 2, 64, seed=4))
    # Isotropic controls are far less concentrated than a planted outlier profile: top-5 of 64 dims is ~10%.
    g = concentration(gaussian_control_scores([256] * 8, 2, 1, 64).mean(0)).top_share[5]
    q, k = planted(8, 256, d=64)
    p = concentration(contribution_scores(q, k).mean(0)).top_share[5]
    assert bool((g < 0.15).all()) and bool((p > 0.5).all())
    with pytest.raises(ValueError, match="num_heads"):
        gaussian_control_scores([4], 3, 2, 8)


def test_activation_profile_and_padding() -> None:
    h0 = torch.zeros(2, 4, 6)
    h1 = torch.zeros(2, 4, 6)
    h0[0, 1, 2] = -7.0
    h0[1, 0, 5] = 3.0
    h1[1, 3, 1] = 100.0  # padding of prompt 1 (length 3): ignored
    h1[0, 3, 1] = 2.0
    h1[1, 2, 4] = -5.0
    prof = activation_profile([h0, h1], lengths=[4, 3])
    want = torch.zeros(2, 6, dtype=torch.float64)
    want[0, 2], want[0, 5], want[1, 1], want[1, 4] = 7.0, 3.0, 2.0, 5.0
    torch.testing.assert_close(prof.max_abs, want)
    vals, dims = prof.top(2)
    assert vals.tolist() == [[7.0, 3.0], [5.0, 2.0]] and dims.tolist() == [[2, 5], [4, 1]]
    assert prof.median.tolist() == [0.0, 0.0]
    d = prof.to_dict(k=2)
    assert d["layers"][1] == {"layer": 1, "top1": 5.0, "top2": 2.0, "top1_dim": 4, "top2_dim": 1, "median": 0.0}


def test_activation_accumulator_streams() -> None:
    hs = [torch.randn(5, 7, 8) for _ in range(3)]
    acc = ActivationProfileAccumulator()
    acc.update([h[:2] for h in hs])
    acc.update([h[2:] for h in hs])
    torch.testing.assert_close(acc.result().max_abs, torch.stack([h.abs().amax((0, 1)) for h in hs]).double())
    with pytest.raises(ValueError, match="hidden_states"):
        acc.update([h[:, :, :4] for h in hs])
    with pytest.raises(ValueError, match=r"hidden_states\[1\]"):
        activation_profile([hs[0], hs[1][:, :3]])
    with pytest.raises(ValueError, match="update"):
        ActivationProfileAccumulator().result()
