"""Which process of a multi-process launch this is, for work that is sharded rather than data-parallel (capture and
calibration are split into independent blocks and layers; fine-tuning uses accelerate's DDP directly).

Under ``torchrun`` or ``accelerate launch`` (``WORLD_SIZE`` > 1, or an MPI launcher's size variable) the process
group is created through accelerate's :class:`~accelerate.PartialState` on the CPU backend (gloo): capture and
calibration run on the CPU, and the group only carries barriers. A single process needs neither accelerate nor
``torch.distributed``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch

T = TypeVar("T")

# Rank 0 waits at a barrier while the others finish their last layer (one layer at most with round-robin
# sharding); at N = 4096 a layer takes minutes on a CPU, so the default 30 min of torch is too tight.
BARRIER_TIMEOUT = timedelta(hours=6)
_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")


@dataclass(frozen=True)
class Processes:
    """``rank`` of ``world`` processes; the default is a single process."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.world, int) and self.world >= 1 and isinstance(self.rank, int)):
            raise ValueError(f"world: expected a positive integer, got {self.world!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank: expected an integer in [0, {self.world}), got {self.rank!r}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This process's share of ``items``: every ``world``-th one from position ``rank`` (round robin)."""
        return list(items)[self.rank :: self.world]

    def barrier(self) -> None:
        """Wait until every process has reached this point (nothing to do for one process)."""
        if self.world > 1:
            torch.distributed.barrier()


def launched_world_size() -> int:
    """The number of processes a launcher started (1 when not launched by torchrun, accelerate or MPI)."""
    for name in _SIZE_VARIABLES:
        value = os.environ.get(name)
        if value:
            return int(value)
    return 1


def launched_rank() -> int:
    """This process's rank as the launcher set it (0 when not launched), readable before any process group
    exists (e.g. to print progress on process 0 only)."""
    for name in _RANK_VARIABLES:
        value = os.environ.get(name)
        if value:
            return int(value)
    return 0


def current_processes() -> Processes:
    """This process's rank and the world size, initialising the (gloo) process group on first use when launched
    with several processes."""
    if launched_world_size() <= 1:
        return Processes()
    try:
        from accelerate import PartialState
    except ImportError as e:
        raise ImportError("several processes need accelerate for their process group: pip install 'oal[train]'") from e
    state = PartialState(cpu=True, timeout=BARRIER_TIMEOUT)
    return Processes(state.process_index, state.num_processes)
