"""``oal finetune``: LoRA adaptation (App. F.2) of a converted model, resumable by re-running the same command."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..errors import cli_errors
from .config import PRESETS

logger = logging.getLogger(__name__)
console = Console()


def random_groups(num_heads: int, head_dim: int, num_groups: int, *, seed: int, layer: int) -> torch.Tensor:
    """``(Hq, d)`` uniformly random group ids (a stand-in for ``oal group`` output in demos and timings)."""
    g = torch.Generator().manual_seed(seed * 100_003 + layer)
    return torch.randint(0, num_groups, (num_heads, head_dim), generator=g)


def prepare_model(
    model_name: str,
    *,
    kernel: str | None = None,
    layers: str | None = None,
    groups: Path | None = None,
    calibrated: Path | None = None,
    num_random_groups: int | None = None,
    kernel_seed: int = 0,
):
    """``(model, tokenizer)``: a converted model directory as saved, or the backbone converted on the fly with
    ``kernel`` (:func:`oal.conversion.convert_model`: calibrated parameters if given, else the kernel's own
    initialisation), or, without ``kernel``, the plain backbone (the LoRA softmax reference). OAL's groups come
    from an ``oal group`` file or, for demos and timings, ``num_random_groups`` random groups."""
    from ..conversion import convert_model, default_layers, is_converted_dir, parse_layers
    from ..models import attention_spec, load_model, load_tokenizer

    if kernel is None and any(x is not None for x in (layers, groups, calibrated, num_random_groups)):
        raise ValueError("kernel: --layers/--groups/--calibrated/--random-groups need --kernel")
    if kernel is not None and is_converted_dir(model_name):
        raise ValueError(f"kernel: {model_name} is already converted; drop --kernel")
    if num_random_groups is not None and (kernel != "oal" or groups is not None):
        raise ValueError("random_groups: only for --kernel oal without --groups")
    model, tokenizer = load_model(model_name), load_tokenizer(model_name)
    if kernel is not None:
        group_arg = groups
        if num_random_groups is not None:
            spec = attention_spec(model)
            chosen = parse_layers(layers, spec.num_layers) if layers is not None else default_layers(model)
            group_arg = {
                layer: random_groups(spec.num_heads, spec.head_dim, num_random_groups, seed=kernel_seed, layer=layer)
                for layer in chosen
            }
        convert_model(model, kernel, layers=layers, calibrated=calibrated, groups=group_arg, seed=kernel_seed)
    return model, tokenizer


def run_with_progress(model, tokenizer, config, out: Path, *, data_dir: Path | None = None, fsdp: bool = False) -> dict:
    """:func:`oal.training.finetune` with a rich progress bar showing loss, lr and the latest validation NLL
    (process 0 only when launched with several processes)."""
    from ..distributed import launched_rank
    from .trainer import finetune

    columns = (
        TextColumn("[bold]finetune"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, disable=launched_rank() != 0) as progress:
        task = progress.add_task("updates", total=config.updates, status="")
        last_val: dict[str, float] = {}

        def on_step(record: dict) -> None:
            if "val_nll" in record:
                last_val["nll"] = record["val_nll"]
            status = f"loss {record['loss']:.3f} lr {record['lr']:.2e}"
            if last_val:
                status += f" val {last_val['nll']:.3f}"
            progress.update(task, completed=record["step"], status=status)

        return finetune(model, config, out, tokenizer=tokenizer, data_dir=data_dir, on_step=on_step, fsdp=fsdp).summary


def register(app: typer.Typer) -> None:
    @app.command("finetune")
    @cli_errors
    def finetune_cmd(
        model: str = typer.Option("smollm2-135m", help="Model name, directory or Hub id (or a converted model)."),
        preset_name: str = typer.Option("cpu", "--preset", help=f"Budget preset: {', '.join(PRESETS)}."),
        out: Path = typer.Option(..., help="Run directory; re-running the same command resumes it."),
        kernel: str | None = typer.Option(None, help="Convert on the fly: kernel name (oal, global, dijiang, …)."),
        layers: str | None = typer.Option(None, help="Layers to convert with --kernel, e.g. 3-26."),
        groups: Path | None = typer.Option(None, help="OAL groups from `oal group` (groups.json)."),
        calibrated: Path | None = typer.Option(None, help="Calibrated kernel parameters from `oal calibrate`."),
        random_groups_: int | None = typer.Option(None, "--random-groups", help="OAL: G random groups (demo)."),
        kernel_seed: int = typer.Option(0, help="Seed of the baselines' fixed random projections."),
        updates: int | None = typer.Option(None, help="Override the preset's number of updates."),
        block_len: int | None = typer.Option(None, help="Override the preset's tokens per block."),
        val_every: int | None = typer.Option(None, help="Override: validate every K updates."),
        val_blocks: int | None = typer.Option(None, help="Override: number of validation blocks."),
        checkpoint_every: int | None = typer.Option(None, help="Also checkpoint every C updates."),
        grad_accum: int | None = typer.Option(
            None, help="Blocks per process and update (gradient accumulation; global batch = processes x this)."
        ),
        seed: int | None = typer.Option(None, help="Override the training seed (42)."),
        bf16: bool = typer.Option(False, "--bf16", help="bf16 autocast (accelerate mixed precision)."),
        fsdp: bool = typer.Option(
            False, "--fsdp", help="Shard the model over the launched processes (torch FSDP2) instead of DDP."
        ),
        threads: int | None = typer.Option(None, help="torch CPU threads (1 is often faster on a loaded box)."),
        data_dir: Path | None = typer.Option(None, help="Data directory (default: $OAL_DATA_DIR)."),
        export: Path | None = typer.Option(
            None,
            "--export",
            help="Also write the best result as a converted model directory (adapter merged; loads with "
            "AutoModelForCausalLM after `import oal`). Must be new or empty.",
        ),
    ) -> None:
        """LoRA + kernel-parameter adaptation of App. F.2 on the WikiText-2 valid split (last blocks held out)."""
        from ..distributed import launched_rank
        from .config import preset

        if threads is not None:
            torch.set_num_threads(threads)
        overrides = {
            "updates": updates,
            "block_len": block_len,
            "val_every": val_every,
            "val_blocks": val_blocks,
            "checkpoint_every": checkpoint_every,
            "grad_accum": grad_accum,
            "seed": seed,
            "mixed_precision": "bf16" if bf16 else None,
        }
        if export is not None and export.exists() and (not export.is_dir() or any(export.iterdir())):
            raise typer.BadParameter(f"{export} exists and is not an empty directory", param_hint="--export")
        # bad input and damaged checkpoints end in one error line (cli_errors)
        config = preset(preset_name, **{k: v for k, v in overrides.items() if v is not None})
        model_, tokenizer = prepare_model(
            model,
            kernel=kernel,
            layers=layers,
            groups=groups,
            calibrated=calibrated,
            num_random_groups=random_groups_,
            kernel_seed=kernel_seed,
        )
        summary = run_with_progress(model_, tokenizer, config, out, data_dir=data_dir, fsdp=fsdp)
        if launched_rank() != 0:
            return
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
        if export is not None:
            from .export import save_finetuned_model

            save_finetuned_model(out, export)
            console.print(f"exported the best result as a converted model: {export}")
