"""``oal demo``: the converted model against the original (the main job; ``make demo``)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=name) from None


def _check_inputs(config) -> None:
    """Bad paths and names fail here, before anything is measured or written, naming the option."""
    import os

    from ..models import is_converted_dir, resolve_model

    data = config.data_dir or os.environ.get("OAL_DATA_DIR")
    if data is None or not (Path(data) / "wikitext-2-raw").is_dir():
        raise typer.BadParameter(
            f"expected a data folder holding wikitext-2-raw/ (the held-out WikiText-2 test split), got {data!r}",
            param_hint="--data-dir",
        )
    try:
        resolve_model(config.original)
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e), param_hint="--original") from None
    if not is_converted_dir(config.converted):
        raise typer.BadParameter(
            f"expected a converted model directory (config.json with oal_conversion), got {config.converted!r}",
            param_hint="--converted",
        )


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        out: Path = typer.Option(Path("runs/demo"), help="Output folder (report.md, report.json, demo.png)."),
        converted: str = typer.Option("docs/results/conversion/model", help="Converted model directory."),
        original: str = typer.Option("smollm2-135m", help="The original model."),
        preset: str = typer.Option("cpu", help="cpu (about 11 min on 2 cores) or gpu (one CUDA device)."),
        ppl_blocks: int = typer.Option(None, help="Override: perplexity blocks per text."),
        trials: int = typer.Option(None, help="Override: passkey prompts per length."),
        passkey_lengths: str = typer.Option(None, help="Override: passkey context lengths, e.g. 1024,4096."),
        decode_lengths: str = typer.Option(None, help="Override: decode context lengths, e.g. 1024,8192."),
        speed_rounds: int = typer.Option(None, help="Override: prefill rounds per context at least, models in turn."),
        prefill_tokens: int = typer.Option(
            None, help="Override: tokens each model prefills per context in all (more rounds at short contexts)."
        ),
        threads: int = typer.Option(2, help="torch CPU threads."),
        data_dir: Path = typer.Option(None, help="Data directory (default: $OAL_DATA_DIR)."),
    ) -> None:
        """Measure the original and the converted model side by side: held-out perplexity, passkey accuracy,
        decode latency, prefill time, cache memory and greedy continuations; one report and one figure."""
        from .report import rows
        from .run import DemoConfig, run_demo

        if preset not in ("cpu", "gpu"):
            raise typer.BadParameter(f"expected cpu or gpu, got {preset!r}", param_hint="--preset")
        kw: dict = {"converted": converted, "original": original, "threads": threads}
        if data_dir is not None:
            kw["data_dir"] = str(data_dir)
        if ppl_blocks is not None:
            kw["ppl_blocks"] = ppl_blocks
        if trials is not None:
            kw["trials"] = trials
        if passkey_lengths is not None:
            kw["passkey_lengths"] = _ints(passkey_lengths, "--passkey-lengths")
        if decode_lengths is not None:
            kw["decode_lengths"] = _ints(decode_lengths, "--decode-lengths")
        if speed_rounds is not None:
            kw["speed_rounds"] = speed_rounds
        if prefill_tokens is not None:
            kw["prefill_tokens"] = prefill_tokens
        try:
            config = DemoConfig.gpu(**kw) if preset == "gpu" else DemoConfig(**kw)
        except ValueError as e:
            field = str(e).split(":")[0]
            raise typer.BadParameter(str(e), param_hint="--" + field.replace("_", "-")) from None
        _check_inputs(config)
        report = run_demo(out, config)
        table = Table(title=f"{converted} against {original}")
        for col in ("", "original", "converted", "converted / original"):
            table.add_column(col, justify="left" if not col else "right")
        for row in rows(report):
            table.add_row(*row)
        console.print(table)
        for prompt, text in report["results"]["original"]["continuations"].items():
            console.print(f"[bold]{prompt}[/bold]\n  original:  {text!r}")
            console.print(f"  converted: {report['results']['converted']['continuations'][prompt]!r}")
        console.print(f"wrote {out / 'report.md'}, {out / 'report.json'}, {out / 'demo.png'}")
