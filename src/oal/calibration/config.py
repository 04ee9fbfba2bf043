"""Options of the coefficient-calibration protocol (App. B, "Coefficient-calibration settings") and the Q/K/V
container it consumes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import torch

GLOBAL_INITS = ("taylor", "taylor_perturbed")
OAL_INITS = ("global", "taylor", "global_perturbed")


class QKV(NamedTuple):
    """Frozen post-RoPE attention inputs of one layer for S sequences of equal length N:
    q ``(S, Hq, N, d)``, k ``(S, Hkv, N, d)``, v ``(S, Hkv, N, dv)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def check_qkv(x: QKV, name: str) -> QKV:
    """Validate shapes (GQA mapping included) and return the tensors as fp32 on the CPU."""
    if not (isinstance(x, tuple) and len(x) == 3 and all(isinstance(t, torch.Tensor) for t in x)):
        raise ValueError(f"{name}: expected a (q, k, v) tuple of tensors, got {type(x).__name__}")
    q, k, v = x
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{name}: expected q (S, Hq, N, d), k (S, Hkv, N, d), v (S, Hkv, N, dv), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    S, Hq, N, d = q.shape
    if k.shape[0] != S or k.shape[2:] != (N, d) or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"{name}: expected k (S={S}, Hkv, N={N}, d={d}) and v (S, Hkv, N, dv) matching q, got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if S < 1 or N < 1 or k.shape[1] < 1 or Hq % k.shape[1]:
        raise ValueError(f"{name}: expected S, N ≥ 1 and Hq={Hq} a multiple of Hkv={k.shape[1]}")
    if not all(t.is_floating_point() for t in (q, k, v)):
        raise ValueError(f"{name}: expected floating-point tensors, got {q.dtype}, {k.dtype}, {v.dtype}")
    return QKV(*(t.detach().to("cpu", torch.float32) for t in (q, k, v)))


@dataclass(frozen=True)
class CalibrationConfig:
    """Every number of the protocol, with the paper's value as default where the paper gives one.

    Protocol (App. B): Adam at ``lr`` (no scheduler), FP32 parameters, gradient norm clipped at ``grad_clip``
    (per query head for per-head parameters, jointly for shared ones), up to ``max_updates`` updates per
    initialisation, each update one sampled training sequence and ``positions_per_update`` sampled causal
    query positions, validation every ``val_every`` updates, early stopping after ``patience`` updates
    without improvement, best-validation checkpoint kept per head.

    Our choices (the paper does not fix them):
      * ``train_pool``: query positions of each training sequence eligible for sampling, drawn once per layer
        (seeded). ``None`` makes every position eligible (the paper's wording); a pool lets the fast path
        precompute output statistics once and reuse them across updates and initialisations. On SmolLM2
        layers 4/12/20 (N = 2048), pools of 64 and 256 and all positions gave held-out MSEs within ±1 % of
        each other, all positions costing 3–5× more (docs/calibration.md).
      * ``val_positions``: fixed seeded query positions per validation sequence (``None``: all positions),
        drawn before the pools so they do not depend on the training options.
      * ``global_inits``: initialisations of the learned global quadratic, from ``GLOBAL_INITS``.
      * ``oal_inits``: initialisations of OAL, from ``OAL_INITS`` (the paper's three are the default).
      * ``perturb_std``: Gaussian noise of the ``*_perturbed`` inits, relative: per head
        ``σ_h = perturb_std · ‖L_h‖_F / √(G+1)`` (the RMS row norm of the factor), on the lower triangle.
      * ``fast_path``: grouped kernels (OAL, global) use precomputed output statistics (exact, see
        ``stats.py``); ``False`` uses the generic ``AttentionKernel.at_positions`` path (for cross-checks).
      * ``seed``: base seed; layer ``i`` uses a generator derived from ``(seed, i)``.
    """

    lr: float = 0.02
    max_updates: int = 1000
    positions_per_update: int = 32
    val_every: int = 100
    patience: int = 400
    grad_clip: float = 10.0
    train_pool: int | None = 256
    val_positions: int | None = 256
    seed: int = 0
    global_inits: tuple[str, ...] = ("taylor", "taylor_perturbed", "taylor_perturbed")
    oal_inits: tuple[str, ...] = OAL_INITS
    perturb_std: float = 0.1
    fast_path: bool = True

    def __post_init__(self) -> None:
        for name in ("lr", "grad_clip"):
            val = getattr(self, name)
            if not (isinstance(val, (int, float)) and math.isfinite(val) and val > 0):
                raise ValueError(f"{name}: expected a positive finite number, got {val!r}")
        if not (isinstance(self.perturb_std, (int, float)) and math.isfinite(self.perturb_std)):
            raise ValueError(f"perturb_std: expected a finite number ≥ 0, got {self.perturb_std!r}")
        if self.perturb_std < 0:
            raise ValueError(f"perturb_std: expected a finite number ≥ 0, got {self.perturb_std!r}")
        for name in ("max_updates", "positions_per_update", "val_every"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected a positive integer, got {val!r}")
        if not isinstance(self.patience, int) or self.patience < 0:
            raise ValueError(f"patience: expected an integer ≥ 0, got {self.patience!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: expected an integer ≥ 0, got {self.seed!r}")
        for name in ("train_pool", "val_positions"):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
                raise ValueError(f"{name}: expected a positive integer or None, got {val!r}")
        if self.train_pool is not None and self.train_pool < self.positions_per_update:
            raise ValueError(
                f"train_pool: expected ≥ positions_per_update={self.positions_per_update}, got {self.train_pool}"
            )
        for name, allowed in (("global_inits", GLOBAL_INITS), ("oal_inits", OAL_INITS)):
            val = tuple(getattr(self, name))
            if not val or any(v not in allowed for v in val):
                raise ValueError(f"{name}: expected a non-empty sequence of {allowed}, got {val!r}")
            object.__setattr__(self, name, val)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["global_inits"] = list(self.global_inits)
        d["oal_inits"] = list(self.oal_inits)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CalibrationConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}")
        d = dict(d)
        for name in ("global_inits", "oal_inits"):
            if name in d:
                d[name] = tuple(d[name])
        return cls(**d)
