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


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        out: Path = typer.Option(Path("runs/demo"), help="Output folder (report.md, report.json, demo.png)."),
        converted: str = typer.Option("docs/results/conversion/model", help="Converted model directory."),
        original: str = typer.Option("smollm2-135m", help="The original model."),
        preset: str = typer.Option("cpu", help="cpu (about 6 min on 2 cores) or gpu (one CUDA device)."),
        ppl_blocks: int = typer.Option(None, help="Override: perplexity blocks per text."),
        trials: int = typer.Option(None, help="Override: passkey prompts per length."),
        passkey_lengths: str = typer.Option(None, help="Override: passkey context lengths, e.g. 1024,4096."),
        decode_lengths: str = typer.Option(None, help="Override: decode context lengths, e.g. 1024,8192."),
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
        try:
            config = DemoConfig.gpu(**kw) if preset == "gpu" else DemoConfig(**kw)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
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
