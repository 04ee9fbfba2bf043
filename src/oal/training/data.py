"""Training and validation blocks, and the block order shared by every method.

WikiText-2's train split is not available offline, so adaptation reads the **valid** split (``oal.data.blocks``
cut into ``block_len``-token blocks): its last ``val_blocks`` blocks are the fixed validation set, all earlier
blocks are the training set (disjoint by construction); the test split stays untouched for the final evaluation.

The order in which training blocks are visited depends only on the seed and the number of training blocks (never
on the method or model): a fresh permutation per pass over the training blocks, drawn from one generator seeded
with ``seed``. Under data parallelism with P processes, global update s gives process r the block
``order[s, r]``, so processes see distinct blocks and a global batch of P.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .config import FinetuneConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The split adaptation reads; TODO(lead): WikiText-103 train where it is available (the paper's setting).
TRAIN_SPLIT = "valid"
DATA_NOTE = (
    "WikiText-2 has no train split offline: training uses the first {n_train} blocks of the {split} split, "
    "validation its last {n_val} blocks (disjoint); the test split is kept for evaluation."
)


def tensor_sha256(x: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (contiguous, on the CPU), for recording exactly which data was used."""
    return hashlib.sha256(x.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


class FinetuneData(NamedTuple):
    """``train (n_train, L)`` and ``val (n_val, L)`` int64 token blocks and a JSON-friendly description."""

    train: torch.Tensor
    val: torch.Tensor
    description: dict[str, Any]

    @classmethod
    def from_blocks(cls, ids: torch.Tensor, val_blocks: int, *, source: str, split: str = "valid") -> FinetuneData:
        """Hold out the last ``val_blocks`` of ``ids (n, L)`` for validation, train on the rest."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"ids: expected an integer tensor of shape (n_blocks, block_len), got {got}")
        n = ids.shape[0]
        if n < val_blocks + 1:
            raise ValueError(
                f"val_blocks: the {split} split gives {n} blocks of {ids.shape[1]} tokens, but {val_blocks} "
                "validation blocks plus at least one training block are needed"
            )
        ids = ids.long()
        train, val = ids[: n - val_blocks], ids[n - val_blocks :]
        description = {
            "split": split,
            "source": source,
            "block_len": ids.shape[1],
            "blocks": n,
            "train_blocks": [0, n - val_blocks],
            "val_blocks": [n - val_blocks, n],
            "train_tokens_sha256": tensor_sha256(train),
            "val_tokens_sha256": tensor_sha256(val),
            "note": DATA_NOTE.format(n_train=n - val_blocks, n_val=val_blocks, split=split),
        }
        return cls(train, val, description)


def prepare_data(
    tokenizer: PreTrainedTokenizerBase,
    config: FinetuneConfig,
    *,
    data_dir: str | os.PathLike | None = None,
) -> FinetuneData:
    """Blocks of the valid split (:func:`oal.data.blocks`), split into training and validation blocks."""
    from ..data import blocks

    tb = blocks(tokenizer, TRAIN_SPLIT, config.block_len, data_dir=data_dir, source=config.data_source)
    return FinetuneData.from_blocks(tb.ids, config.val_blocks, source=tb.source, split=TRAIN_SPLIT)


def training_order(num_blocks: int, updates: int, seed: int, num_processes: int = 1) -> torch.Tensor:
    """``(updates, num_processes)`` training-block indices: update s, process r reads block ``[s, r]``.

    Consecutive passes over the ``num_blocks`` blocks, each a permutation from one ``torch.Generator`` seeded
    with ``seed``; a function of (num_blocks, updates, seed, num_processes) only.
    """
    for name, value in (("num_blocks", num_blocks), ("updates", updates), ("num_processes", num_processes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    g = torch.Generator().manual_seed(seed)
    need = updates * num_processes
    passes = [torch.randperm(num_blocks, generator=g) for _ in range(-(-need // num_blocks))]
    return torch.cat(passes)[:need].view(updates, num_processes)
