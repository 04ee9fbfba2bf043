"""``oal reproduce``: the whole pipeline (analysis → grouping → calibration → Table 2 → conversion + LoRA →
evaluation → report) in one resumable command. Every preset field is an option (``--calib-max-updates`` …)."""

from __future__ import annotations

import inspect
import types
import typing
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from .presets import DEFAULT_PRESET, FIELDS, PAPER_METHODS, PRESETS, ReproducePreset

console = Console()
_HINTS = typing.get_type_hints(ReproducePreset)
#: preset fields with their own handling (``name`` is the preset itself, ``methods`` accepts ``paper``)
_SPECIAL = ("name", "methods")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kind(name: str) -> tuple[type, bool]:
    """(base type, optional) of a preset field."""
    hint = _HINTS[name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in args if a is not type(None)), True
    return hint, False


def parse_field(name: str, text: str):
    """The value of preset field ``name`` from its command-line text: ints, floats, index lists like
    ``16-23`` or ``4,12,20``, comma-separated names, ``none`` for optional fields."""
    from ..fidelity.capture import parse_indices

    base, optional = _kind(name)
    text = text.strip()
    if optional and text.lower() == "none":
        return None
    try:
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if base is str:
            return text
        if typing.get_args(base) == (int, ...):
            return tuple(parse_indices(text, name))
        return tuple(x.strip() for x in text.split(",") if x.strip())
    except ValueError:
        kind = {int: "an integer", float: "a number"}.get(base, "indices like '16-23' or '4,12,20'")
        raise ValueError(f"expected {kind}{' or none' if optional else ''}, got {text!r}") from None


def parse_methods(text: str) -> tuple[str, ...]:
    """Comma-separated method names; ``paper`` stands for Table 3's seven."""
    out: list[str] = []
    for part in (x.strip() for x in text.split(",")):
        out.extend(PAPER_METHODS if part == "paper" else [part] if part else [])
    return tuple(out)


def _metavar(name: str) -> str:
    base, optional = _kind(name)
    meta = {int: "INT", float: "FLOAT", str: "TEXT"}.get(
        base, "INTS" if typing.get_args(base) == (int, ...) else "NAMES"
    )
    return f"{meta}|none" if optional else meta


def _presets_values(name: str) -> str:
    """``paper: 4096; cpu: 4096; demo: 512`` (one value when all presets agree)."""
    values = {p: _show(getattr(PRESETS[p], name)) for p in PRESETS}
    if len(set(values.values())) == 1:
        return f"all presets: {next(iter(values.values()))}"
    return "; ".join(f"{p}: {v}" for p, v in values.items())


def _help(name: str) -> str:
    return f"{FIELDS[name].metadata['help']} [{_presets_values(name)}]"


def _show(value) -> str:
    if value == PAPER_METHODS:
        return "paper"
    if isinstance(value, tuple):
        from ..fidelity.capture import format_indices

        return format_indices(value) if value and isinstance(value[0], int) else ",".join(value)
    return str(value)


def _results_table(data: dict) -> Table:
    table = Table(title="Table 3 analogue (PPL; acc_norm %)")
    for col in ("method", "PPL", "PIQA", "HellaSwag", "ARC-E"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for m, v in data["methods"].items():
        table.add_row(m, f"{v['ppl']:.2f}", *(f"{100 * v[k]:.2f}" for k in ("piqa", "hellaswag", "arc_easy")))
    return table


def register(app: typer.Typer) -> None:
    """Add ``oal reproduce`` to ``app``."""

    def reproduce(**kw) -> None:
        """End-to-end reproduction of §5 (Tables 2 and 3), resumable: analysis, grouping, calibration, frozen
        fidelity, conversion + LoRA per method, evaluation, report.md + reproduce.json. Preset values are listed
        per option as [paper; cpu; demo]."""
        import torch

        from .pipeline import ReproduceConflict, Reproduction
        from .presets import preset

        if kw["threads"] is not None:
            if kw["threads"] < 1:
                raise typer.BadParameter(f"expected a positive integer, got {kw['threads']}", param_hint="--threads")
            torch.set_num_threads(kw["threads"])
        overrides = {}
        for name in FIELDS:
            text = kw.get(name)
            if text is None:
                continue
            try:
                overrides[name] = parse_methods(text) if name == "methods" else parse_field(name, text)
            except ValueError as e:
                raise typer.BadParameter(str(e), param_hint=_option(name)) from None
        try:
            chosen = preset(kw["preset"], **overrides)
            run = Reproduction(
                chosen,
                model=kw["model"],
                out=kw["out"],
                data_dir=kw["data"],
                cache=kw["cache"],
                progress=kw["progress"],
            )
            run.prepare()
        except ReproduceConflict as e:
            console.print(f"[red]Error:[/red] {e}")
            raise typer.Exit(1) from None
        except (ValueError, FileNotFoundError, OSError) as e:
            raise typer.BadParameter(str(e)) from None
        try:
            data = run.run()
        except (ValueError, FileNotFoundError) as e:
            console.print(f"[red]Error:[/red] {e}")
            raise typer.Exit(1) from None
        except ReproduceConflict as e:
            console.print(f"[red]Error:[/red] {e}")
            raise typer.Exit(1) from None
        console.print(_results_table(data))
        console.print(f"wrote {run.out / 'report.md'} and {run.out / 'reproduce.json'}")

    fixed = [
        ("preset", str, typer.Option(DEFAULT_PRESET, "--preset", help=f"Budget preset: {', '.join(PRESETS)}.")),
        (
            "out",
            Path,
            typer.Option(Path("runs/reproduce"), "--out", help="Output directory (resumed if it holds the same run)."),
        ),
        ("model", str, typer.Option("smollm2-135m", "--model", help="Model name, local directory or Hub id.")),
        (
            "data",
            Path | None,
            typer.Option(
                None,
                "--data",
                help="Data folder (wikitext-2-raw/, piqa/, hellaswag/, arc-easy/; default $OAL_DATA_DIR).",
            ),
        ),
        (
            "cache",
            Path,
            typer.Option(
                Path("runs/qkv"), "--cache", help="Q/K/V capture cache root (shared with oal calibrate/fidelity)."
            ),
        ),
        ("threads", int | None, typer.Option(None, "--threads", help="torch CPU threads.")),
        ("progress", bool, typer.Option(True, "--progress/--no-progress", help="Show progress bars.")),
        (
            "methods",
            str | None,
            typer.Option(
                None,
                "--methods",
                help=f"Comma-separated methods; 'paper' = {','.join(PAPER_METHODS)}; "
                "extra registry names such as oal+sink+window are calibrated from the plain kernel (--init-from). "
                f"[{_presets_values('methods')}]",
            ),
        ),
    ]
    params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=t) for n, t, d in fixed]
    for name in FIELDS:
        if name in _SPECIAL:
            continue
        option = typer.Option(None, _option(name), help=_help(name), metavar=_metavar(name), show_default=False)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=str | None))
    reproduce.__signature__ = inspect.Signature(params)
    reproduce.__annotations__ = {p.name: p.annotation for p in params}
    app.command("reproduce")(reproduce)
