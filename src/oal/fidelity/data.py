"""The data protocol of the frozen-attention experiments (App. B "Coefficient-calibration settings", App. C, A.2)
and its offline substitute.

The paper fits kernel coefficients on WikiText-2 raw *train* blocks 16–23 (validation 24–25) of 4096 tokens and
evaluates on blocks 0–15 "of the same token stream". The train split is not available offline
(/work/shared/data/SOURCES.md), so here:

* fitting uses ``wiki.valid.raw`` blocks 16–23, validation ``wiki.valid.raw`` blocks 24–25;
* evaluation (``oal fidelity``, ``oal intervene``) uses ``wiki.test.raw`` blocks 0–15,

which keeps fitting and evaluation disjoint (different splits). Every output records this description.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .capture import format_indices

FIT_SPLIT = "valid"
TRAIN_BLOCKS = tuple(range(16, 24))
VAL_BLOCKS = (24, 25)
EVAL_SPLIT = "test"
EVAL_BLOCKS = tuple(range(16))
PAPER_NOTE = (
    "the paper fits on WikiText-2 train blocks 16-23 / validates on 24-25 and evaluates on blocks 0-15 of the same "
    "stream; the train split is absent offline, so fitting uses the valid split and evaluation the test split"
)


@dataclass(frozen=True)
class FitData:
    """Which blocks fit and validate a calibration."""

    split: str
    text_source: str
    seq_len: int
    train_blocks: tuple[int, ...]
    val_blocks: tuple[int, ...]

    def __post_init__(self) -> None:
        overlap = set(self.train_blocks) & set(self.val_blocks)
        if overlap:
            raise ValueError(
                f"val_blocks: expected blocks disjoint from the training blocks, both hold {sorted(overlap)}"
            )
        if not self.train_blocks or not self.val_blocks:
            raise ValueError("train_blocks, val_blocks: expected at least one block each")

    def describe(self) -> str:
        return (
            f"fit: {self.text_source} blocks {format_indices(self.train_blocks)} (train) / "
            f"{format_indices(self.val_blocks)} (validation), N={self.seq_len}; {PAPER_NOTE}"
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["train_blocks"] = list(self.train_blocks)
        d["val_blocks"] = list(self.val_blocks)
        d["description"] = self.describe()
        return d


def eval_description(text_source: str, blocks: list[int], seq_len: int) -> str:
    return f"evaluation: {text_source} blocks {format_indices(blocks)}, N={seq_len}; {PAPER_NOTE}"


def check_enough_blocks(available: int, wanted: list[int] | tuple[int, ...], split: str, seq_len: int) -> None:
    """Blocks ``wanted`` must exist in a split that has ``available`` full blocks of ``seq_len`` tokens."""
    if max(wanted) >= available:
        raise ValueError(
            f"blocks: the {split} split has {available} blocks of {seq_len} tokens, but blocks up to {max(wanted)} "
            f"were asked for; use a shorter --seq-len or other blocks"
        )
