"""The LoRA adaptation protocol of App. F.2 as one config object, and the named presets.

Every number of the protocol is a field with the paper's value as its default; :data:`PRESETS` only change the
budget (updates, block length, validation schedule): ``paper`` is F.2 as written, ``cpu`` is sized for one method
on a 2-core CPU, ``smoke`` is a few tiny updates for tests and demos.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

MIXED_PRECISION = ("no", "bf16")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")


def _nonnegative_float(name: str, value: Any, *, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(
            f"{name}: expected a {'positive' if positive else 'non-negative'} finite number, got {value!r}"
        )


@dataclass(frozen=True)
class FinetuneConfig:
    """App. F.2: LoRA (rank 8, α 16, dropout 0.05) on q/k/v/o of every layer, kernel parameters trained jointly,
    AdamW (5e-4, wd 0.01, β (0.9, 0.999), ε 1e-8), linear warmup over 5 % of the updates then cosine decay to 0,
    grad-norm clip 1.0, batch 1 per process without accumulation, seed 42, validation NLL on ``val_blocks`` fixed
    blocks every ``val_every`` updates (and after the last), best checkpoint by validation NLL.

    ``grad_accum``: blocks each process reads per update (gradient accumulation; the paper: 1). The global batch
    is ``processes × grad_accum``, so one process with ``grad_accum=P`` reproduces a P-process run (same blocks,
    same dropout masks; equal up to floating-point summation order).

    ``checkpoint_every``: resumable checkpoints every that many updates (None: at validation points only; the last
    update is always checkpointed). ``data_source``: where the text comes from (:func:`oal.data.load_text`).
    ``mixed_precision``: ``"no"`` (fp32) or ``"bf16"`` autocast through accelerate.
    """

    updates: int = 512
    block_len: int = 4096
    val_every: int = 128
    val_blocks: int = 32
    checkpoint_every: int | None = None
    grad_accum: int = 1
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    train_kernels: bool = True
    lr: float = 5e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_ratio: float = 0.05
    max_grad_norm: float = 1.0
    seed: int = 42
    mixed_precision: str = "no"
    data_source: str = "auto"
    preset: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("updates", "block_len", "val_every", "val_blocks", "lora_rank", "grad_accum"):
            _positive_int(name, getattr(self, name))
        if self.checkpoint_every is not None:
            _positive_int("checkpoint_every", self.checkpoint_every)
        if self.block_len < 2:
            raise ValueError(f"block_len: expected at least 2 tokens (next-token targets), got {self.block_len}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: expected a non-negative integer, got {self.seed!r}")
        _nonnegative_float("lora_alpha", self.lora_alpha, positive=True)
        _nonnegative_float("lr", self.lr, positive=True)
        _nonnegative_float("weight_decay", self.weight_decay)
        _nonnegative_float("adam_eps", self.adam_eps, positive=True)
        _nonnegative_float("max_grad_norm", self.max_grad_norm, positive=True)
        if not (isinstance(self.lora_dropout, (int, float)) and 0 <= self.lora_dropout < 1):
            raise ValueError(f"lora_dropout: expected a number in [0, 1), got {self.lora_dropout!r}")
        if not (isinstance(self.warmup_ratio, (int, float)) and 0 <= self.warmup_ratio <= 1):
            raise ValueError(f"warmup_ratio: expected a number in [0, 1], got {self.warmup_ratio!r}")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"betas: expected two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        targets = tuple(self.lora_targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"lora_targets: expected a non-empty list of module names, got {self.lora_targets!r}")
        object.__setattr__(self, "lora_targets", targets)
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision: expected one of {MIXED_PRECISION}, got {self.mixed_precision!r}")

    @property
    def warmup_updates(self) -> int:
        """``ceil(warmup_ratio · updates)``, as transformers' Trainer derives warmup steps from a ratio."""
        return math.ceil(self.warmup_ratio * self.updates)

    def is_validation_step(self, step: int) -> bool:
        """Whether validation runs after update ``step`` (1-based): every ``val_every`` and after the last."""
        return step % self.val_every == 0 or step == self.updates

    def is_checkpoint_step(self, step: int) -> bool:
        """Whether a resumable checkpoint is written after update ``step`` (1-based)."""
        every = self.checkpoint_every
        return self.is_validation_step(step) or (every is not None and step % every == 0)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["lora_targets"] = list(self.lora_targets)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FinetuneConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"config: unknown fields {unknown}; expected a subset of {sorted(names)}")
        d = dict(data)
        for key in ("lora_targets", "betas"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)

    def protocol(self) -> dict[str, Any]:
        """Everything that determines the training result (``preset`` is only a label): compared on resume.
        ``grad_accum`` is left out at its default 1, so checkpoints written before it existed still resume."""
        d = self.to_dict()
        d.pop("preset")
        if d["grad_accum"] == 1:
            d.pop("grad_accum")
        return d


PRESETS: dict[str, dict[str, Any]] = {
    # App. F.2 as written: 512 updates × 4096 tokens = 2,097,152 training tokens; meant for a GPU.
    "paper": {"updates": 512, "block_len": 4096, "val_every": 128, "val_blocks": 32},
    # One method on a 2-core CPU in roughly 15 minutes: SmolLM2-135M with OAL on layers 3-26, fp32, 1 thread on a
    # loaded machine (load ~7) takes ~14-17 s per 256-token update and ~4 s per validation block, so
    # 48 · 15 s + 3 · 4 · 4 s ≈ 13 min (at 1024 tokens an update took 61-144 s and ~8.5 GB; bf16 autocast was
    # 6-11x slower than fp32 on this AVX2-only CPU).
    "cpu": {"updates": 48, "block_len": 256, "val_every": 16, "val_blocks": 4},
    # A few tiny updates: tests and demos.
    "smoke": {"updates": 4, "block_len": 128, "val_every": 2, "val_blocks": 2},
}


def preset(name: str, **overrides: Any) -> FinetuneConfig:
    """The config of a named preset (``paper``, ``cpu``, ``smoke``) with fields overridden by keyword."""
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return FinetuneConfig(**{**PRESETS[name], "preset": name, **overrides})
