"""AdamW and the learning-rate schedule of App. F.2: linear warmup over the first 5 % of updates, then cosine
decay to 0.

The schedule is transformers' ``get_cosine_schedule_with_warmup`` (what ``Trainer`` uses for
``lr_scheduler_type="cosine"`` with ``warmup_ratio``): update k (0-based) of T, with W warmup updates, runs at

    lr · k / W                                   for k < W,
    lr · ½ (1 + cos(π (k − W) / (T − W)))        for k ≥ W,

so the very first update runs at lr 0 (as in transformers' Trainer) and the peak is reached at update W.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from transformers import get_cosine_schedule_with_warmup

from .config import FinetuneConfig


def lr_factor(update: int, total: int, warmup: int) -> float:
    """The multiplier of the base learning rate for 0-based ``update`` of ``total`` with ``warmup`` warmup updates
    (the closed form above)."""
    if not 0 <= update < total:
        raise ValueError(f"update: expected an index in [0, {total}), got {update}")
    if update < warmup:
        return update / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (update - warmup) / max(1, total - warmup)))


def build_optimizer(params: Iterable[torch.nn.Parameter], config: FinetuneConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (LoRA and kernel parameters alike), F.2 hyper-parameters."""
    return torch.optim.AdamW(
        list(params), lr=config.lr, betas=config.betas, eps=config.adam_eps, weight_decay=config.weight_decay
    )


def build_scheduler(optimizer: torch.optim.Optimizer, config: FinetuneConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine over ``config.updates`` updates; step it once per (global) optimizer update."""
    return get_cosine_schedule_with_warmup(optimizer, config.warmup_updates, config.updates)
