"""The protocol loop: Adam and clipping arithmetic, validation schedule, best checkpoints, early stopping."""

from __future__ import annotations

import pytest
import torch

from oal.calibration import CalibrationConfig
from oal.calibration.fit import Adam, autograd_step, clip_per_unit, optimise


def test_adam_matches_torch():
    p_ref = torch.randn(3, 4, 5, requires_grad=True)
    p = p_ref.detach().clone()
    opt = torch.optim.Adam([p_ref], lr=0.02)
    adam = Adam(p, 0.02)
    for _ in range(25):
        g = torch.randn(3, 4, 5) * 3
        p_ref.grad = g.clone()
        opt.step()
        adam.step(g)
    torch.testing.assert_close(p, p_ref.detach(), rtol=0, atol=1e-7)


def test_clip_per_unit_equals_clip_each_unit_alone():
    g1, g2 = torch.randn(2, 3, 4, 4) * 10, torch.randn(2, 3, 5) * 10
    g1[0, 1] *= 1e-3  # one unit below the threshold: untouched
    g2[0, 1] *= 1e-3
    grads = [g1.clone(), g2.clone()]
    clip_per_unit(grads, [2, 2], max_norm=10.0)
    for i in range(2):
        for h in range(3):
            a, b = g1[i, h].clone().requires_grad_(), g2[i, h].clone().requires_grad_()
            a.grad, b.grad = a.detach().clone(), b.detach().clone()
            torch.nn.utils.clip_grad_norm_([a, b], 10.0)
            torch.testing.assert_close(grads[0][i, h], a.grad)
            torch.testing.assert_close(grads[1][i, h], b.grad)
    assert torch.equal(grads[0][0, 1], g1[0, 1]) and torch.equal(grads[1][0, 1], g2[0, 1])


def _scripted(vals: list[list[float]], config: CalibrationConfig, per_layer: bool = False):
    """A fit whose parameter after update u equals u in every unit and whose validation returns
    ``vals[j]`` at the j-th validation (index 0: the initialisation)."""
    units = len(vals[0])
    p = torch.zeros(units)
    calls = []

    def step(u: int) -> None:
        p.fill_(u + 1)

    def val_mse() -> torch.Tensor:
        calls.append(float(p[0]))
        return torch.tensor(vals[len(calls) - 1], dtype=torch.float64)

    outcome = optimise([p], [0 if per_layer else 1], step, val_mse, config, per_layer=per_layer)
    return outcome, calls


def test_early_stopping_and_best_checkpoint_per_unit():
    cfg = CalibrationConfig(max_updates=10, val_every=2, patience=4)
    inf = float("inf")
    vals = [
        # unit 0 improves at 2, 4 then stalls → stops at 8 (4 updates without improvement), best at 4
        # unit 1 never improves on its init → stops at 4, best is the init (update 0)
        # unit 2 keeps improving → runs all 10 updates, best at 10
        [5.0, 5.0, 5.0],
        [4.0, 6.0, 4.0],
        [3.0, 5.0, 3.0],
        [3.0, 1.0, 2.0],  # unit 1 "improves" after it has stopped: ignored
        [3.5, inf, 1.0],
        [9.0, 0.5, 0.5],  # update 10 (also the last update)
    ]
    out, calls = _scripted(vals, cfg)
    assert calls == [0, 2, 4, 6, 8, 10]  # validation at the initialisation and every 2 updates
    assert out.best_update.tolist() == [4, 0, 10]
    assert out.updates.tolist() == [8, 4, 10]
    assert out.best_val.tolist() == [3.0, 5.0, 0.5]
    assert out.best[0].tolist() == [4.0, 0.0, 10.0]  # snapshots taken at each unit's best update
    assert out.init_val.tolist() == [5.0, 5.0, 5.0]
    assert [u for u, _ in out.history] == calls


def test_all_units_stopped_ends_the_loop():
    cfg = CalibrationConfig(max_updates=1000, val_every=3, patience=3)
    vals = [[1.0, 1.0]] + [[2.0, 2.0]] * 5
    out, calls = _scripted(vals, cfg)
    assert calls == [0, 3]
    assert out.updates.tolist() == [3, 3] and out.best_update.tolist() == [0, 0]


def test_last_update_is_validated_and_nan_never_selected():
    cfg = CalibrationConfig(max_updates=5, val_every=2, patience=100)
    nan = float("nan")
    out, calls = _scripted([[1.0], [nan], [nan], [0.5]], cfg)
    assert calls == [0, 2, 4, 5]
    assert out.best_update.tolist() == [5] and out.best_val.tolist() == [0.5]


def test_per_layer_selection_uses_the_mean_over_heads():
    cfg = CalibrationConfig(max_updates=4, val_every=1, patience=10)
    vals = [[1.0, 1.0], [0.1, 2.5], [0.5, 0.5], [2.0, 0.1], [0.9, 0.9]]  # means 1, 1.3, .5, 1.05, .9
    out, _ = _scripted(vals, cfg, per_layer=True)
    assert out.best_update.tolist() == [2] and out.best[0].tolist() == [2.0, 2.0]
    assert out.history[2][1].tolist() == [0.5, 0.5]  # per-head values kept for reporting


def test_shared_parameters_require_per_layer():
    cfg = CalibrationConfig(max_updates=1)
    with pytest.raises(ValueError, match="per_layer"):
        optimise([torch.zeros(2)], [0], lambda u: None, lambda: torch.zeros(2), cfg)


def test_autograd_step_clips_per_head_and_shared_jointly():
    cfg = CalibrationConfig(lr=1.0, grad_clip=1.0)
    w = torch.zeros(2, 3, requires_grad=True)  # per head
    s = torch.zeros(4, requires_grad=True)  # shared
    scale = torch.tensor([[100.0], [1e-3]])

    def loss(u):
        return (w * scale).sum(-1) + s.sum() * 100

    step = autograd_step([w, s], [1, 0], loss, cfg)
    step(0)
    # first Adam step moves every coordinate by lr·sign(g) whatever the clipping; check the gradients instead
    assert torch.allclose(w.grad[0].norm(), torch.tensor(1.0)) and torch.allclose(w.grad[1], torch.full((3,), 1e-3))
    assert torch.allclose(s.grad.norm(), torch.tensor(1.0))
