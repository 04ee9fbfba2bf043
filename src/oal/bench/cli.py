"""`oal bench …` commands: `oal bench op`, the operator benchmark (runtime and memory against N)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..errors import cli_errors

bench_app = typer.Typer(help="Benchmarks: the attention operator's runtime and memory.", no_args_is_help=True)


def _split(text: str, name: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise typer.BadParameter(f"expected a comma-separated list, got {text!r}", param_hint=name)
    return items


def _describe(point: dict) -> str:
    head = f"{point['method']:>10} {point['dtype']} N={point['n']:>6}"
    if point.get("skipped"):
        return f"{head}: [yellow]skipped[/] {point['skipped']}"
    if point.get("error"):
        return f"{head}: [red]failed[/] {point['error']}"
    gf = point.get("gflop_s")
    rate = f", {gf:.1f} GFLOP/s" if gf is not None else ""
    reused = " [dim](already measured)[/]" if point.get("reused") else ""
    return f"{head}: {point['ms']:10.1f} ms, peak {point['peak_mb']:8.1f} MB{rate}{reused}"


@bench_app.command("op")
@cli_errors
def op(
    out: Annotated[Path, typer.Option("--out", help="Output folder (op.json, op.md, op.png).")] = Path("runs/bench_op"),
    quick: Annotated[
        bool, typer.Option("--quick", help="Smoke preset: N = 1024, 2048 and one timed call per point.")
    ] = False,
    sizes: Annotated[str, typer.Option("--sizes", help="Comma-separated N (default: the preset's).")] = "",
    max_n: Annotated[int, typer.Option("--max-n", help="Drop sizes above this N (0: keep all).")] = 0,
    dtypes: Annotated[str, typer.Option("--dtypes", help="Comma-separated: fp32, bf16, fp16.")] = "fp32,bf16",
    methods: Annotated[
        str, typer.Option("--methods", help="Comma-separated method names.")
    ] = "sdpa,sdpa_math,oal,global",
    device: Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")] = "cpu",
    threads: Annotated[int, typer.Option("--threads", help="torch threads (0: all usable cores).")] = 0,
    batch: Annotated[int, typer.Option("--batch")] = 1,
    heads_q: Annotated[int, typer.Option("--heads-q")] = 9,
    heads_kv: Annotated[int, typer.Option("--heads-kv")] = 3,
    head_dim: Annotated[int, typer.Option("--head-dim")] = 64,
    value_dim: Annotated[int, typer.Option("--value-dim", help="0: same as --head-dim.")] = 0,
    budget: Annotated[float, typer.Option("--budget", help="Seconds of timed calls per point (full preset).")] = 10.0,
    min_repeats: Annotated[int, typer.Option("--min-repeats")] = 3,
    max_repeats: Annotated[int, typer.Option("--max-repeats")] = 50,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before a point's process is stopped.")] = 3600.0,
    mem_fraction: Annotated[
        float, typer.Option("--mem-fraction", help="Memory guard: largest share of free memory.")
    ] = 0.8,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Re-measure everything, replacing earlier results.")] = False,
    imports: Annotated[
        list[str] | None, typer.Option("--import", help="Module registering extra methods (repeatable).")
    ] = None,
) -> None:
    """Forward causal attention: SDPA against OAL and the other registered methods, runtime and peak memory
    against N, each point in a fresh process. Resumes: points already in OUT/op.json are kept."""
    from .methods import METHODS
    from .op import FULL_SIZES, QUICK_SIZES, BenchConfig, quick_config, run_sweep
    from .report import target_checks, write_report

    common = {
        "batch": batch,
        "heads_q": heads_q,
        "heads_kv": heads_kv,
        "head_dim": head_dim,
        "value_dim": value_dim or head_dim,
        "device": device,
        "threads": threads,
        "seed": seed,
        "point_timeout_s": timeout,
        "mem_fraction": mem_fraction,
    }
    # a bad value raises ValueError("<argument>: ..."), reported against its option by cli_errors
    if quick:
        config = quick_config(**common)
    else:
        config = BenchConfig(**common, warmup=1, min_repeats=min_repeats, max_repeats=max_repeats, budget_s=budget)
    n_list = [int(x) for x in _split(sizes, "--sizes")] if sizes else list(QUICK_SIZES if quick else FULL_SIZES)
    if max_n:
        n_list = [n for n in n_list if n <= max_n]
    if not n_list:
        raise typer.BadParameter(f"no size left at or below {max_n}", param_hint="--max-n")
    method_list, dtype_list = _split(methods, "--methods"), _split(dtypes, "--dtypes")
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])

    console = Console(stderr=True)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("machine block", total=None)

        def on_start(method: str, n: int, dtype: str, index: int, total: int) -> None:
            progress.update(task, description=f"{method} {dtype} N={n}", total=total, completed=index - 1)

        def on_point(point: dict, index: int, total: int) -> None:
            progress.console.print(_describe(point))
            progress.update(task, completed=index)

        try:
            doc = run_sweep(
                config,
                methods=method_list,
                sizes=n_list,
                dtypes=dtype_list,
                out_dir=out,
                force=force,
                command=command,
                imports=tuple(imports or ()),
                on_start=on_start,
                on_point=on_point,
            )
        except ValueError as err:
            if "methods" in str(err) and METHODS:
                raise typer.BadParameter(str(err), param_hint="--methods") from err
            raise typer.BadParameter(str(err)) from err
    md, png = write_report(doc, out)
    for check in target_checks(doc):
        console.print(check.line().replace("**", ""))
    console.print(f"wrote {out / 'op.json'}, {md}, {png}")


@bench_app.command("report")
@cli_errors
def report(
    out: Annotated[Path, typer.Option("--out", help="Folder holding op.json.")] = Path("runs/bench_op"),
) -> None:
    """Rewrite op.md and op.png from OUT/op.json (for example after an interrupted sweep)."""
    from .op import RESULT_FILE, load_results
    from .report import write_report

    doc = load_results(out / RESULT_FILE)
    if doc is None:
        raise typer.BadParameter(f"no {RESULT_FILE} in {out}", param_hint="--out")
    md, png = write_report(doc, out)
    Console(stderr=True).print(f"wrote {md}, {png}")


def register(app: typer.Typer) -> None:
    """Add the `bench` command group (`oal bench op`) to the `oal` CLI."""
    app.add_typer(bench_app, name="bench")
