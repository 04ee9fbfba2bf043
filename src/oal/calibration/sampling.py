"""Deterministic sampling for calibration: one generator per layer, the training schedule (which sequence
and which query positions each update uses) and the fixed validation positions.

The schedule is drawn once per layer and shared by every initialisation (and by the global stage that
precedes OAL), so initialisations are compared on the same data and statistics can be reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import CalibrationConfig


def layer_generator(seed: int, layer: int) -> torch.Generator:
    """A CPU generator determined by ``(seed, layer)`` only, so a resumed run draws what an uninterrupted
    one would have drawn for the same layer."""
    if layer < 0:
        raise ValueError(f"layer: expected an index ≥ 0, got {layer}")
    words = np.random.SeedSequence([seed, layer]).generate_state(2, dtype=np.uint32)
    gen = torch.Generator()
    gen.manual_seed((int(words[0]) << 31) ^ int(words[1]))
    return gen


def _subset(n: int, count: int | None, gen: torch.Generator) -> torch.Tensor:
    if count is None or count >= n:
        return torch.arange(n)
    return torch.randperm(n, generator=gen)[:count].sort().values


@dataclass(frozen=True)
class Schedule:
    """``pools[s]``: eligible query positions of training sequence s (sorted); ``val_positions[s]``: the fixed
    validation positions of validation sequence s (sorted); update u uses training sequence ``seq[u]`` and
    the query positions ``positions[u]`` (``(U, P)``, distinct within a row)."""

    pools: tuple[torch.Tensor, ...]
    val_positions: tuple[torch.Tensor, ...]
    seq: torch.Tensor
    positions: torch.Tensor

    @property
    def num_updates(self) -> int:
        return self.seq.shape[0]


def make_schedule(
    gen: torch.Generator, num_train: int, num_val: int, n: int, val_n: int, config: CalibrationConfig
) -> Schedule:
    """Draw validation positions, pools and the per-update (sequence, positions) schedule, in that order."""
    P = config.positions_per_update
    if n < P:
        raise ValueError(f"positions_per_update: expected ≤ the training sequence length {n}, got {P}")
    # validation first, so that the validation positions do not depend on the training options
    val_positions = tuple(_subset(val_n, config.val_positions, gen) for _ in range(num_val))
    pools = tuple(_subset(n, config.train_pool, gen) for _ in range(num_train))
    seq = torch.randint(num_train, (config.max_updates,), generator=gen)
    positions = torch.empty(config.max_updates, P, dtype=torch.long)
    for u in range(config.max_updates):
        pool = pools[int(seq[u])]
        positions[u] = pool[torch.randperm(pool.numel(), generator=gen)[:P]]
    return Schedule(pools=pools, val_positions=val_positions, seq=seq, positions=positions)
