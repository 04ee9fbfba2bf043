"""Building the compared kernels by registry name for one layer of a model, with groups, seeds and calibrated
parameters, and describing where their parameters came from."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..grouping import GroupAssignment
from ..io import read_json
from ..kernels import AttentionKernel, SinkWindowKernel
from ..kernels.registry import BASELINES, KERNELS, SINK_WINDOW_KERNELS, build_kernel
from ..kernels.sink_window import split_sink_window_name

logger = logging.getLogger(__name__)

ALL_KERNELS = KERNELS + SINK_WINDOW_KERNELS
# Baselines whose kernel depends on a fixed random draw (A.2: five seeds for these; TaylorShift once).
STOCHASTIC = ("performer", "spectraformer", "dijiang")


def base_name(name: str) -> str:
    """``"oal+sink+window"`` -> ``"oal"``; other names unchanged."""
    return split_sink_window_name(name)[0] if name in SINK_WINDOW_KERNELS else name


def needs_groups(name: str) -> bool:
    return base_name(name) == "oal"


def check_name(name: str) -> str:
    if name not in ALL_KERNELS:
        raise ValueError(f"kernel: expected one of {list(ALL_KERNELS)}, got {name!r}")
    return name


def has_trainable(kernel: AttentionKernel) -> bool:
    return any(p.requires_grad for p in kernel.parameters())


def load_groups(path: str | os.PathLike, *, num_heads: int, head_dim: int) -> GroupAssignment:
    """The group file of ``oal group`` for a model with this geometry (errors start with ``groups:``)."""
    try:
        return GroupAssignment.load(Path(path), num_heads=num_heads, head_dim=head_dim)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"groups: {e}") from None
    except ValueError as e:
        raise ValueError(f"groups: {e}") from None


@dataclass(frozen=True)
class Geometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int


def build(
    name: str,
    geom: Geometry,
    layer: int,
    *,
    groups: GroupAssignment | None = None,
    seed: int = 0,
    n_sink: int | None = None,
    window: int | None = None,
) -> AttentionKernel:
    """``name``'s kernel for ``layer`` at its initial parameters (registry defaults). OAL names need ``groups``
    (that layer must be grouped); seeded baselines draw their fixed projections from ``(seed, layer)``;
    sink/window names take ``n_sink``/``window`` (registry defaults 4/64 when None)."""
    check_name(name)
    kw: dict = {}
    if needs_groups(name):
        if groups is None:
            raise ValueError(f"groups: kernel {name!r} needs a group file (--groups)")
        kw["groups"] = groups.group_ids(layer)
    if name in SINK_WINDOW_KERNELS:
        if n_sink is not None:
            kw["n_sink"] = n_sink
        if window is not None:
            kw["window"] = window
    elif n_sink is not None or window is not None:
        raise ValueError(f"n_sink, window: only sink/window kernels take them, not {name!r}")
    return build_kernel(
        name,
        num_heads=geom.num_heads,
        num_kv_heads=geom.num_kv_heads,
        head_dim=geom.head_dim,
        layer_idx=layer,
        seed=seed,
        **kw,
    )


def init_sink_window_from(kernel: SinkWindowKernel, inner: AttentionKernel) -> None:
    """Copy a calibrated inner kernel's factor (same kind, same groups) into a sink/window kernel."""
    if type(inner) is not type(kernel.inner) or inner.L.shape != kernel.inner.L.shape:
        got = tuple(inner.L.shape) if hasattr(inner, "L") else None
        raise ValueError(
            f"init_from: expected a calibrated {type(kernel.inner).__name__} with L of shape "
            f"{tuple(kernel.inner.L.shape)}, got {type(inner).__name__} with L of shape {got}"
        )
    if not torch.equal(inner.groups, kernel.inner.groups):
        raise ValueError("init_from: the calibrated kernel was fitted with other groups than --groups gives")
    with torch.no_grad():
        kernel.inner.L.copy_(inner.L)


def calibration_info(path: str | os.PathLike) -> dict:
    """What ``oal calibrate`` recorded about a calibration directory (``calibrate.json`` there or one level
    up for ``<dir>/global``); {} when it was made otherwise."""
    p = Path(path)
    for cand in (p / "calibrate.json", p.parent / "calibrate.json"):
        if cand.is_file():
            return read_json(cand, what="calibrate.json")
    return {}


def check_disjoint(info: dict, split: str, blocks: list[int], seq_len: int, what: str) -> None:
    """Refuse to evaluate on blocks a calibration was fitted or validated on."""
    data = info.get("data") or {}
    if not data:
        logger.warning("%s: no calibrate.json with its fitting data; cannot check it is disjoint from evaluation", what)
        return
    if data.get("split") != split:
        return
    if int(data.get("seq_len", -1)) != seq_len:
        logger.warning(
            "%s: fitted at N=%s on the %s split, evaluated at N=%d", what, data.get("seq_len"), split, seq_len
        )
        return
    used = set(data.get("train_blocks", [])) | set(data.get("val_blocks", []))
    overlap = sorted(used & set(blocks))
    if overlap:
        raise ValueError(
            f"blocks: {what} was fitted/validated on {split} blocks {overlap}, which are also evaluation blocks; "
            f"evaluation must use held-out blocks"
        )


__all__ = [
    "ALL_KERNELS",
    "BASELINES",
    "STOCHASTIC",
    "Geometry",
    "base_name",
    "build",
    "calibration_info",
    "check_disjoint",
    "check_name",
    "has_trainable",
    "init_sink_window_from",
    "load_groups",
    "needs_groups",
]
