"""``oal finetune``: LoRA adaptation (App. F.2) of a converted model, resumable by re-running the same command."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .config import PRESETS

logger = logging.getLogger(__name__)
console = Console()


def parse_layers(text: str) -> list[int]:
    """``"3-26"``, ``"3,5,7"`` or ``"3-5,9"`` -> sorted distinct layer indices."""
    layers: set[int] = set()
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            start, stop = int(lo), int(hi) if dash else int(lo)
            if start < 0 or stop < start:
                raise ValueError
            layers.update(range(start, stop + 1))
    except ValueError:
        raise ValueError(f"layers: expected ranges like '3-26' or '3,5,7', got {text!r}") from None
    return sorted(layers)


def random_groups(num_heads: int, head_dim: int, num_groups: int, *, seed: int, layer: int) -> torch.Tensor:
    """``(Hq, d)`` uniformly random group ids (a stand-in for ``oal group`` output in demos and timings)."""
    g = torch.Generator().manual_seed(seed * 100_003 + layer)
    return torch.randint(0, num_groups, (num_heads, head_dim), generator=g)


def attach_uncalibrated(
    model,
    kernel: str,
    layers: list[int],
    *,
    groups_file: Path | None = None,
    num_random_groups: int | None = None,
    seed: int = 0,
) -> None:
    """Attach freshly initialised kernels (OAL/global: Taylor initialisation, baselines: their defaults) to
    ``layers``; OAL takes its groups from an ``oal group`` file or random groups.

    TODO(lead): once ``oal.conversion`` lands, converted models come with calibrated kernels (Eq. 20) and this
    stand-in is only for demos and timings.
    """
    from ..grouping import GroupAssignment
    from ..kernels.registry import build_kernel
    from ..models import attach_kernel, attention_spec

    spec = attention_spec(model)
    assignment = None
    if kernel == "oal":
        if (groups_file is None) == (num_random_groups is None):
            raise ValueError("groups: the 'oal' kernel needs exactly one of --groups FILE or --random-groups G")
        if groups_file is not None:
            assignment = GroupAssignment.load(groups_file, head_dim=spec.head_dim, num_heads=spec.num_heads)
    elif groups_file is not None or num_random_groups is not None:
        raise ValueError(f"groups: --groups/--random-groups only apply to the 'oal' kernel, not {kernel!r}")
    for layer in layers:
        kw = {}
        if assignment is not None:
            kw = {"groups": assignment.group_ids(layer), "num_groups": assignment.num_groups(layer)}
        elif num_random_groups is not None:
            ids = random_groups(spec.num_heads, spec.head_dim, num_random_groups, seed=seed, layer=layer)
            kw = {"groups": ids, "num_groups": num_random_groups}
        k = build_kernel(
            kernel,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            layer_idx=layer,
            seed=seed,
            **kw,
        )
        attach_kernel(model, layer, k)


def load_converted(path: str):
    """``(model, tokenizer)`` of a converted model directory, or None when ``path`` is not one.

    TODO(lead): this assumes ``oal.conversion.load_converted(path) -> (model, tokenizer) | None`` (calibrated
    kernels attached); adjust the call to the API ``oal.conversion`` ends up with.
    """
    try:
        from ..conversion import load_converted as load
    except ImportError:
        return None
    return load(path)


def prepare_model(
    model_name: str,
    *,
    kernel: str | None = None,
    layers: str | None = None,
    groups: Path | None = None,
    num_random_groups: int | None = None,
    kernel_seed: int = 0,
):
    """``(model, tokenizer)``: a converted model as saved, or the backbone with ``kernel`` attached to ``layers``
    (none: the LoRA softmax reference). Bad combinations raise ValueError."""
    from ..models import load_model, load_tokenizer

    converted = load_converted(model_name)
    if converted is not None:
        if kernel is not None:
            raise ValueError(f"kernel: {model_name} is already converted; drop --kernel/--layers")
        return converted
    if kernel is None and (layers is not None or groups is not None or num_random_groups is not None):
        raise ValueError("kernel: --layers/--groups/--random-groups need --kernel")
    if kernel is not None and layers is None:
        raise ValueError("layers: --kernel needs --layers (e.g. 3-26)")
    model, tokenizer = load_model(model_name), load_tokenizer(model_name)
    if kernel is not None:
        attach_uncalibrated(
            model,
            kernel,
            parse_layers(layers),
            groups_file=groups,
            num_random_groups=num_random_groups,
            seed=kernel_seed,
        )
    return model, tokenizer


def run_with_progress(model, tokenizer, config, out: Path, *, data_dir: Path | None = None) -> dict:
    """:func:`oal.training.finetune` with a rich progress bar showing loss, lr and the latest validation NLL."""
    from .trainer import finetune

    columns = (
        TextColumn("[bold]finetune"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("updates", total=config.updates, status="")
        last_val: dict[str, float] = {}

        def on_step(record: dict) -> None:
            if "val_nll" in record:
                last_val["nll"] = record["val_nll"]
            status = f"loss {record['loss']:.3f} lr {record['lr']:.2e}"
            if last_val:
                status += f" val {last_val['nll']:.3f}"
            progress.update(task, completed=record["step"], status=status)

        return finetune(model, config, out, tokenizer=tokenizer, data_dir=data_dir, on_step=on_step).summary


def register(app: typer.Typer) -> None:
    @app.command("finetune")
    def finetune_cmd(
        model: str = typer.Option("smollm2-135m", help="Model name, directory or Hub id (or a converted model)."),
        preset_name: str = typer.Option("cpu", "--preset", help=f"Budget preset: {', '.join(PRESETS)}."),
        out: Path = typer.Option(..., help="Run directory; re-running the same command resumes it."),
        kernel: str | None = typer.Option(None, help="Convert on the fly: kernel name (oal, global, dijiang, …)."),
        layers: str | None = typer.Option(None, help="Layers to convert with --kernel, e.g. 3-26."),
        groups: Path | None = typer.Option(None, help="OAL groups from `oal group` (groups.json)."),
        random_groups_: int | None = typer.Option(None, "--random-groups", help="OAL: G random groups (demo)."),
        kernel_seed: int = typer.Option(0, help="Seed of the baselines' fixed random projections."),
        updates: int | None = typer.Option(None, help="Override the preset's number of updates."),
        block_len: int | None = typer.Option(None, help="Override the preset's tokens per block."),
        val_every: int | None = typer.Option(None, help="Override: validate every K updates."),
        val_blocks: int | None = typer.Option(None, help="Override: number of validation blocks."),
        checkpoint_every: int | None = typer.Option(None, help="Also checkpoint every C updates."),
        seed: int | None = typer.Option(None, help="Override the training seed (42)."),
        bf16: bool = typer.Option(False, "--bf16", help="bf16 autocast (accelerate mixed precision)."),
        threads: int | None = typer.Option(None, help="torch CPU threads (1 is often faster on a loaded box)."),
        data_dir: Path | None = typer.Option(None, help="Data directory (default: $OAL_DATA_DIR)."),
    ) -> None:
        """LoRA + kernel-parameter adaptation of App. F.2 on the WikiText-2 valid split (last blocks held out)."""
        from .checkpoint import CheckpointError
        from .config import preset

        if threads is not None:
            torch.set_num_threads(threads)
        overrides = {
            "updates": updates,
            "block_len": block_len,
            "val_every": val_every,
            "val_blocks": val_blocks,
            "checkpoint_every": checkpoint_every,
            "seed": seed,
            "mixed_precision": "bf16" if bf16 else None,
        }
        try:
            config = preset(preset_name, **{k: v for k, v in overrides.items() if v is not None})
            model_, tokenizer = prepare_model(
                model,
                kernel=kernel,
                layers=layers,
                groups=groups,
                num_random_groups=random_groups_,
                kernel_seed=kernel_seed,
            )
        except ValueError as err:
            raise typer.BadParameter(str(err)) from err
        try:
            summary = run_with_progress(model_, tokenizer, config, out, data_dir=data_dir)
        except CheckpointError as err:
            console.print(f"[red]checkpoint problem:[/red] {err}")
            raise typer.Exit(1) from err
        table = Table(title=f"finetune → {out}")
        for col in ("best update", "val NLL", "val PPL", "updates", "train s", "layers converted"):
            table.add_column(col)
        best = summary["best"]
        table.add_row(
            str(best["step"]),
            f"{best['val_nll']:.4f}",
            f"{best['val_ppl']:.2f}",
            str(summary["updates"]),
            f"{summary['train_seconds']:.0f}",
            str(len(summary["model"]["converted_layers"])),
        )
        console.print(table)
        console.print(summary["data"]["note"])
