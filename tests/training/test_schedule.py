import math

import pytest
import torch

from oal.training import build_optimizer, build_scheduler, lr_factor
from oal.training.config import FinetuneConfig


def test_lr_factor_by_hand():
    # T = 20 updates, W = ceil(0.05 · 20) = 1: update 0 at 0, update 1 at the peak, then cosine to 0.
    assert lr_factor(0, 20, 1) == 0.0
    assert lr_factor(1, 20, 1) == 1.0
    assert lr_factor(10, 20, 1) == pytest.approx(0.5 * (1 + math.cos(math.pi * 9 / 19)))
    # T = 512, W = 26: linear warmup 0, 1/26, …, then ½(1 + cos(π (k − 26) / 486)).
    assert lr_factor(13, 512, 26) == pytest.approx(0.5)
    assert lr_factor(26 + 243, 512, 26) == pytest.approx(0.5)
    assert lr_factor(511, 512, 26) == pytest.approx(0.5 * (1 + math.cos(math.pi * 485 / 486)))
    with pytest.raises(ValueError, match="update"):
        lr_factor(512, 512, 26)


@pytest.mark.parametrize("updates", [1, 2, 7, 64, 512])
def test_scheduler_follows_the_closed_form(updates):
    config = FinetuneConfig(updates=updates, val_every=updates)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([p], config)
    sched = build_scheduler(opt, config)
    lrs = []
    for _ in range(updates):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [config.lr * lr_factor(k, updates, config.warmup_updates) for k in range(updates)]
    assert lrs == pytest.approx(want, rel=1e-12, abs=1e-15)
    # the peak is update W (for T = 1 the only update is update 0, which runs at lr 0 as in transformers)
    assert max(lrs) == (pytest.approx(config.lr) if updates > 1 else 0.0)
    # after the last update the schedule has decayed to 0
    if updates > 1:
        assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_optimizer_hyperparameters():
    config = FinetuneConfig()
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], config)
    assert isinstance(opt, torch.optim.AdamW)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (5e-4, (0.9, 0.999), 1e-8, 0.01)
