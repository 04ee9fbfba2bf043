"""The optimisation loop of the calibration protocol (App. B), shared by every kernel.

Parameters are tensors whose leading dimensions index independent *units* — (initialisation, query head)
for the batched fast path, query heads for the generic path — or are shared by all heads of the layer.
Because Adam is elementwise and each unit's loss depends only on its own parameters, one optimiser over
the stacked units runs every unit exactly as if it were alone; clipping is done per unit for the same
reason (per-head gradient-norm clipping), jointly for shared parameters. Each unit keeps its own best
validation checkpoint and early-stops on its own; the loop ends when every unit has stopped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import CalibrationConfig

ProgressFn = Callable[[int, int], None]


@dataclass
class FitOutcome:
    """Per-unit results; ``units`` is the shape of the validation tensor, e.g. ``(I, Hq)``.

    ``best``: snapshots of the parameters at each unit's best validation; ``best_val``: that validation MSE;
    ``best_update``: the update count of the checkpoint (0 = the initialisation); ``updates``: updates run
    before the unit stopped; ``init_val``: validation MSE of the initialisation; ``history``: (update,
    validation MSE as returned by ``val_mse``, i.e. per head even under per-layer selection) at every
    validation."""

    best: list[torch.Tensor]
    best_val: torch.Tensor
    best_update: torch.Tensor
    updates: torch.Tensor
    init_val: torch.Tensor
    history: list[tuple[int, torch.Tensor]]


def unit_clip_coef(grads: list[torch.Tensor], lead: list[int], max_norm: float) -> torch.Tensor | None:
    """Per-unit factor ``min(1, max_norm / (‖g_unit‖ + 1e-6))`` over all unit-indexed gradients (those with
    ``lead > 0``, sharing their leading unit dimensions), as ``clip_grad_norm_`` computes it for one unit."""
    sq = None
    for g, nl in zip(grads, lead, strict=True):
        if nl and g is not None:
            g2 = g.double().square().reshape(*g.shape[:nl], -1).sum(-1)
            sq = g2 if sq is None else sq + g2
    return None if sq is None else (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)


def clip_per_unit(grads: list[torch.Tensor], lead: list[int], max_norm: float) -> None:
    """Clip each unit's gradient (over all unit-indexed parameters) to norm ≤ max_norm, in place."""
    coef = unit_clip_coef(grads, lead, max_norm)
    if coef is None:
        return
    for g, nl in zip(grads, lead, strict=True):
        if nl and g is not None:
            g.mul_(coef.to(g.dtype).view(*coef.shape, *([1] * (g.dim() - nl))))


class Adam:
    """Adam for one tensor updated with an explicitly computed gradient: the arithmetic of
    ``torch.optim.Adam`` (betas (0.9, 0.999), eps 1e-8, no weight decay), without autograd or optimiser
    bookkeeping, which dominate the cost of the fast path's tiny updates."""

    def __init__(self, param: torch.Tensor, lr: float, betas=(0.9, 0.999), eps: float = 1e-8) -> None:
        self.param, self.lr, self.betas, self.eps = param, lr, betas, eps
        self.exp_avg = torch.zeros_like(param)
        self.exp_avg_sq = torch.zeros_like(param)
        self.t = 0

    def step(self, grad: torch.Tensor) -> None:
        b1, b2 = self.betas
        self.t += 1
        self.exp_avg.lerp_(grad, 1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        step_size = self.lr / (1 - b1**self.t)
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(1 - b2**self.t)).add_(self.eps)
        self.param.addcdiv_(self.exp_avg, denom, value=-step_size)


def autograd_step(
    params: list[torch.Tensor], lead: list[int], train_loss: Callable[[int], torch.Tensor], config: CalibrationConfig
) -> Callable[[int], None]:
    """An update for leaf ``params``: backward of ``train_loss(u).sum()``, per-unit clipping of unit-indexed
    gradients and joint clipping of shared ones, then ``torch.optim.Adam``."""
    opt = torch.optim.Adam(params, lr=config.lr)
    shared = [p for p, nl in zip(params, lead, strict=True) if nl == 0]

    def step(u: int) -> None:
        opt.zero_grad(set_to_none=True)
        train_loss(u).sum().backward()
        clip_per_unit([p.grad for p in params], lead, config.grad_clip)
        if shared:
            torch.nn.utils.clip_grad_norm_(shared, config.grad_clip)
        opt.step()

    return step


def optimise(
    params: list[torch.Tensor],
    lead: list[int],
    step: Callable[[int], None],
    val_mse: Callable[[], torch.Tensor],
    config: CalibrationConfig,
    *,
    per_layer: bool = False,
    progress: ProgressFn | None = None,
) -> FitOutcome:
    """Run the protocol: ``step(u)`` performs update u on ``params`` in place (the caller keeps ``best``);
    validation every ``config.val_every`` updates, best checkpoint and early stopping per unit.

    ``lead[i]``: how many leading dimensions of ``params[i]`` index units (0 = shared by all heads).
    ``val_mse()``: per-unit validation MSE, e.g. ``(I, Hq)``. ``per_layer``: select checkpoints on the
    mean over heads (the last unit dimension) — required when a parameter is shared, since heads then
    cannot stop independently; such fits hold a single layer unit.
    """
    if any(nl == 0 for nl in lead) and not per_layer:
        raise ValueError("lead: shared parameters (lead 0) need per_layer=True selection")
    history: list[tuple[int, torch.Tensor]] = []

    def criterion(u: int) -> torch.Tensor:
        with torch.no_grad():
            val = val_mse().detach()
        history.append((u, val.clone()))
        return val.mean(-1, keepdim=True) if per_layer else val

    def mask_for(improved: torch.Tensor, p: torch.Tensor, nl: int) -> torch.Tensor:
        if per_layer:
            return improved.reshape(-1)[0].view([1] * p.dim())
        return improved.reshape(p.shape[:nl]).view(*p.shape[:nl], *([1] * (p.dim() - nl)))

    init_val = criterion(0)
    if per_layer and init_val.numel() != 1:
        raise ValueError(f"per_layer: expected a single layer unit, got units of shape {tuple(init_val.shape)}")
    best = [p.detach().clone() for p in params]
    best_val = init_val.clone()
    best_update = torch.zeros(init_val.shape, dtype=torch.long)
    updates = torch.zeros(init_val.shape, dtype=torch.long)
    done = torch.zeros(init_val.shape, dtype=torch.bool)
    for u in range(1, config.max_updates + 1):
        step(u - 1)
        if progress is not None:
            progress(u, config.max_updates)
        if u % config.val_every and u != config.max_updates:
            continue
        val = criterion(u)
        improved = (val < best_val) & ~done
        with torch.no_grad():
            for b, p, nl in zip(best, params, lead, strict=True):
                b.copy_(torch.where(mask_for(improved, p, nl), p, b))
        best_val = torch.where(improved, val, best_val)
        best_update = torch.where(improved, u, best_update)
        updates = torch.where(done, updates, u)
        done |= (u - best_update) >= config.patience
        if bool(done.all()):
            break
    return FitOutcome(best, best_val, best_update, updates, init_val, history)
