"""``oal eval``: WikiText perplexity and zero-shot PIQA / HellaSwag / ARC-Easy per App. F.3."""

from __future__ import annotations

import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..errors import cli_errors
from .loading import load_model_and_tokenizer
from .perplexity import check_block_args
from .retrieval import RETRIEVAL_TASKS
from .runner import ALL_TASKS, KNOWN_TASKS, PAPER_BLOCK_LEN, RETRIEVAL_LENGTHS, check_tasks, evaluate
from .tasks import SOURCES
from .utils import check_limit, default_device, parse_dtype, write_json_atomic

logger = logging.getLogger(__name__)


def _results_table(out: dict) -> Table:
    table = Table(title="App. F.3 evaluation (headline: PPL, acc_norm)")
    for col in ("task", "n", "headline", "acc", "acc_norm_chars", "source", "time"):
        table.add_column(col, justify="left" if col in ("task", "source") else "right")
    for task, res in out["results"].items():
        n = out["n-samples"][task]["effective"]
        t = f"{out['config']['time_s'][task]:.0f} s"
        src = out["config"]["data_source"][task].split(",")[0]
        if "perplexity,none" in res:
            table.add_row(task, f"{n} blk", f"PPL {res['perplexity,none']:.3f}", "", "", src, t)
        elif task in RETRIEVAL_TASKS:
            per = ", ".join(
                f"{k.split('@')[1].split(',')[0]}: {100 * v:.0f}%" for k, v in res.items() if k.startswith("acc@")
            )
            table.add_row(task, str(n), f"acc {100 * res['acc,none']:.1f}%", per, "", src, t)
        else:
            table.add_row(
                task,
                str(n),
                f"{100 * res['acc_norm,none']:.2f} ± {100 * res['acc_norm_stderr,none']:.2f}",
                f"{100 * res['acc,none']:.2f}",
                f"{100 * res['acc_norm_chars,none']:.2f}",
                src,
                t,
            )
    return table


def register(app: typer.Typer) -> None:
    """Add ``oal eval`` to ``app``."""

    @app.command("eval")
    @cli_errors
    def eval_command(
        model: Annotated[
            str,
            typer.Option(
                "--model",
                help="Model directory (e.g. a converted OAL model), Hub id, smollm2-135m, or an `oal finetune` run.",
            ),
        ] = "smollm2-135m",
        base_model: Annotated[
            str | None,
            typer.Option("--base-model", help="With a fine-tuning run: the backbone (default: the one it recorded)."),
        ] = None,
        tasks: Annotated[
            str,
            typer.Option(
                "--tasks",
                help=f"Comma-separated subset of {','.join(KNOWN_TASKS)} ('' with --text: only the text files).",
            ),
        ] = ",".join(ALL_TASKS),
        text: Annotated[
            list[Path] | None,
            typer.Option("--text", help="A local text file for perplexity (task text:<stem>), repeatable."),
        ] = None,
        lengths: Annotated[
            str, typer.Option("--lengths", help="Retrieval context lengths in tokens, comma-separated.")
        ] = ",".join(map(str, RETRIEVAL_LENGTHS)),
        trials: Annotated[int, typer.Option("--trials", help="Retrieval prompts per context length.")] = 20,
        n_keys: Annotated[int, typer.Option("--n-keys", help="Key-value pairs per multikey prompt.")] = 4,
        seed: Annotated[int, typer.Option("--seed", help="Seed of the retrieval prompts.")] = 0,
        limit: Annotated[
            int | None, typer.Option("--limit", help="First N items of each multiple-choice task (default: all).")
        ] = None,
        block_len: Annotated[
            int, typer.Option("--block-len", help="WikiText block length in tokens (paper: 4096).")
        ] = PAPER_BLOCK_LEN,
        max_blocks: Annotated[
            int | None, typer.Option("--max-blocks", help="First N WikiText blocks (default: all).")
        ] = None,
        data: Annotated[
            Path | None, typer.Option("--data", help="Data folder (default: $OAL_DATA_DIR; else the Hub).")
        ] = None,
        source: Annotated[str, typer.Option("--source", help=f"Data source: {', '.join(SOURCES)}.")] = "auto",
        out: Annotated[Path | None, typer.Option("--out", help="Results JSON (lm-eval shape), written atomically.")] = (
            None
        ),
        device: Annotated[str | None, typer.Option("--device", help="cpu, cuda, cuda:N (default: cuda if any).")] = (
            None
        ),
        dtype: Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16.")] = "float32",
        batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per forward (multiple choice).")] = 8,
        progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
    ) -> None:
        """Evaluate a causal LM per App. F.3: WikiText PPL and zero-shot PIQA / HellaSwag / ARC-E."""
        console = Console()
        task_list = [t.strip() for t in tasks.split(",") if t.strip()]
        if task_list or not text:
            task_list = check_tasks(task_list)
        try:
            length_list = [int(x) for x in lengths.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(
                f"expected comma-separated integers, got {lengths!r}", param_hint="--lengths"
            ) from None
        if any(n < 16 for n in length_list) or not length_list:
            raise typer.BadParameter(f"expected lengths >= 16 tokens, got {lengths!r}", param_hint="--lengths")
        if trials < 1:
            raise typer.BadParameter(f"expected an int >= 1, got {trials}", param_hint="--trials")
        for f in text or []:
            if not f.is_file():
                raise typer.BadParameter(f"no such file: {f}", param_hint="--text")
        torch_dtype = parse_dtype(dtype)
        check_limit(limit)
        check_block_args(block_len, max_blocks)
        if batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size}")
        if source not in SOURCES:
            raise typer.BadParameter(f"expected one of {SOURCES}, got {source!r}", param_hint="--source")
        dev = device or str(default_device())
        net, tokenizer = load_model_and_tokenizer(model, dtype=torch_dtype, device=dev, base_model=base_model)
        results = evaluate(
            net,
            tokenizer,
            task_list,
            limit=limit,
            block_len=block_len,
            max_blocks=max_blocks,
            data_dir=data,
            source=source,  # type: ignore[arg-type]
            batch_size=batch_size,
            device=dev,
            progress=progress,
            model_name=model,
            texts=text or [],
            retrieval_lengths=length_list,
            trials=trials,
            n_keys=n_keys,
            seed=seed,
        )
        results["config"]["command"] = shlex.join(["oal", *sys.argv[1:]])
        console.print(_results_table(results))
        if out is not None:
            write_json_atomic(out, results)
            console.print(f"results written to {out}")
        else:
            console.print_json(json.dumps(results))
