"""Timing of one layer's OAL calibration on synthetic tensors of a given shape (default: SmolLM2-135M,
Hq 9, Hkv 3, d 64, N 4096, 8 training and 2 validation sequences).

    python -m oal.calibration.benchmark [--groups 3] [--full] [--threads 2] [--layers 1]

Phase columns are wall seconds. On a shared machine, ``--threads 1`` and the process CPU seconds give a
load-independent measure of the work. ``--full`` disables early stopping (patience ≥ max updates), the
worst case: every initialisation runs all its updates. Queries and keys get a few large-magnitude
dimensions, as in pretrained models (§3), so the fit is not trivially easy; the timings do not depend on
the values otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from rich.console import Console
from rich.table import Table

from ..kernels import OALKernel
from .config import QKV, CalibrationConfig
from .layer import calibrate_layer


def synthetic_layer(S: int, Hq: int, Hkv: int, N: int, d: int, gen: torch.Generator) -> QKV:
    """Q/K/V with a few outlier dimensions (scaled ×4–8) shared by queries and keys of a KV group."""
    q = torch.randn(S, Hq, N, d, generator=gen)
    k = torch.randn(S, Hkv, N, d, generator=gen)
    v = torch.randn(S, Hkv, N, d, generator=gen)
    boost = torch.ones(Hkv, d)
    for h in range(Hkv):
        boost[h, torch.randperm(d, generator=gen)[:3]] = torch.tensor([4.0, 6.0, 8.0])
    k = k * boost[None, :, None, :]
    q = q * boost.repeat_interleave(Hq // Hkv, 0)[None, :, None, :] * 0.6
    return QKV(q, k, v)


def synthetic_groups(Hq: int, d: int, G: int, gen: torch.Generator) -> torch.Tensor:
    """A large bulk group 0 and G-1 small tail groups of 1–3 dimensions each (the shape §4.2 produces)."""
    groups = torch.zeros(Hq, d, dtype=torch.long)
    for h in range(Hq):
        perm = torch.randperm(d, generator=gen)
        start = 0
        for g in range(1, G):
            size = int(torch.randint(1, 4, (1,), generator=gen))
            groups[h, perm[start : start + size]] = g
            start += size
    return groups


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--train", type=int, default=8)
    ap.add_argument("--val", type=int, default=2)
    ap.add_argument("--groups", type=int, default=3, help="groups per head (G)")
    ap.add_argument("--train-pool", type=int, default=CalibrationConfig.train_pool, help="0 = all positions")
    ap.add_argument("--val-positions", type=int, default=CalibrationConfig.val_positions, help="0 = all")
    ap.add_argument("--full", action="store_true", help="no early stopping: all updates of every init")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int, default=1, help="layers to time (different synthetic data)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = CalibrationConfig(
        train_pool=args.train_pool or None,
        val_positions=args.val_positions or None,
    )
    if args.full:
        cfg = dataclasses.replace(cfg, patience=cfg.max_updates)
    console = Console(width=150)
    table = Table(title=f"OAL calibration per layer (threads={args.threads}, G={args.groups}, full={args.full})")
    cols = ("layer", "wall s", "cpu s", "val stats", "train stats", "global fit", "oal fit", "updates g/oal", "val MSE")
    for col in cols:
        table.add_column(col)
    for layer in range(args.layers):
        gen = torch.Generator().manual_seed(layer)
        Hq, Hkv, d, N = args.heads, args.kv_heads, args.head_dim, args.seq_len
        train = synthetic_layer(args.train, Hq, Hkv, N, d, gen)
        val = synthetic_layer(args.val, Hq, Hkv, N, d, gen)
        kernel = OALKernel(synthetic_groups(Hq, d, args.groups, gen), Hkv, num_groups=args.groups)
        t, c = time.perf_counter(), time.process_time()
        res = calibrate_layer(kernel, train, val, config=cfg, layer=layer)
        total, cpu = time.perf_counter() - t, time.process_time() - c
        tm = res.timings
        table.add_row(
            str(layer),
            f"{total:.1f}",
            f"{cpu:.1f}",
            f"{tm['val_stats']:.1f}",
            f"{tm['train_stats']:.1f}",
            f"{tm['global_fit']:.1f}",
            f"{tm['oal_fit']:.1f}",
            f"{int(res.global_stage.updates.max())}/{int(res.updates.max())}",
            f"{float(res.val_mse.mean()):.3e}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
