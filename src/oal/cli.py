"""The ``oal`` command line. Each command lives beside the code it drives and registers itself here."""

from __future__ import annotations

import logging

import typer
from rich.logging import RichHandler

app = typer.Typer(
    name="oal",
    help="Outlier-Aware Attention Linearization: analyse, group, calibrate, convert and benchmark.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    # plain click error output: one "Error: ..." line per bad input, not a wrapped rich panel
    rich_markup_mode=None,
)


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(show_path=False, rich_tracebacks=False)],
    )


def _register_commands() -> None:
    from .analysis.cli import register as analysis
    from .bench.cli import register as bench
    from .conversion.cli import register as conversion
    from .demo.cli import register as demo
    from .evaluation.cli import register as evaluation
    from .fidelity.cli import register as fidelity
    from .reproduce.cli import register as reproduce
    from .training.cli import register as training

    for register in (demo, analysis, bench, conversion, evaluation, fidelity, training, reproduce):
        register(app)


_register_commands()
