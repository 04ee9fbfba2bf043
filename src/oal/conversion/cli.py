"""`oal convert`, `oal generate` and `oal bench decode`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

_OPTION_OF = {
    "kernel": "--kernel",
    "layers": "--layers",
    "calibrated": "--calibrated",
    "groups": "--groups",
    "out_dir": "--out",
    "name_or_path": "--model",
    "model": "--model",
    "path": "--model",
    "prompt": "--prompt",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "sizes": "--sizes",
    "methods": "--methods",
    "steps": "--steps",
    "warmup": "--warmup",
    "prompt_warmup": "--prompt-warmup",
    "batch": "--batch",
    "threads": "--threads",
    "seed": "--seed",
    "dtype": "--dtype",
    "device": "--device",
    "recipe": "--recipe",
    "out": "--out",
}


def _bad(err: Exception) -> typer.BadParameter:
    """A usage error whose option is the argument the message starts with (``"groups: …"`` -> ``--groups``)."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    m = re.match(r"(\w+):", message)
    return typer.BadParameter(message, param_hint=_OPTION_OF.get(m[1]) if m else None)


def convert(
    out: Annotated[Path, typer.Option("--out", help="Directory for the converted model (must be new or empty).")],
    model: Annotated[str, typer.Option("--model", help="Model name, directory or Hub id.")] = "smollm2-135m",
    kernel: Annotated[
        str,
        typer.Option(
            "--kernel", help="Kernel name from oal.kernels.KERNELS, or a sink/window name (from its calibration)."
        ),
    ] = "oal",
    layers: Annotated[
        str, typer.Option("--layers", help="Layers to convert, e.g. '3-26' or '3,5,8-10' (default: App. F range).")
    ] = "",
    calibrated: Annotated[
        Path | None, typer.Option("--calibrated", help="Calibrated parameters: params.safetensors or its directory.")
    ] = None,
    groups: Annotated[Path | None, typer.Option("--groups", help="Dimension groups JSON (`oal group`).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the baselines' random projections.")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty --out directory.")] = False,
    recipe: Annotated[
        str | None,
        typer.Option(
            "--recipe",
            help="Run a whole conversion recipe (calibration, exact heads; oal.conversion.recipe) instead: "
            "'retrieval' (the default recipe), 'retrieval-fulldecode' (without its decode budget), "
            "'retrieval-int8kv' (its exact keys/values in int8), "
            "'retrieval-fp32kv' (in fp32), "
            "'retrieval-copy' / 'retrieval-bf16kv' (copy-score heads only: no 8k retrieval) or 'kernel-only'. "
            "--kernel/--layers/--calibrated/--groups then do not apply.",
        ),
    ] = None,
    data: Annotated[Path | None, typer.Option("--data", help="With --recipe: data folder (default $OAL_DATA_DIR).")] = (
        None
    ),
    exact_kv_dtype: Annotated[
        str | None,
        typer.Option(
            "--exact-kv-dtype",
            help="Re-store an already converted --model's exact heads' keys and values in 'bfloat16', 'int8' (the "
            "8-bit exact cache) or 'model' (its dtype) and save it to --out; nothing else changes or runs.",
        ),
    ] = None,
    exact_decode_budget: Annotated[
        int | None,
        typer.Option(
            "--exact-decode-budget",
            help="Re-save an already converted --model with a decode budget for its exact heads: a decode step over "
            "more keys attends to this many, in the pages whose key bounds promise the highest scores (page 0 and "
            "the recent pages always; 0: every key, the default); prompts stay exact. Combines with "
            "--exact-kv-dtype.",
        ),
    ] = None,
    exact_decode_page: Annotated[
        int, typer.Option("--exact-decode-page", help="With --exact-decode-budget: keys per page.")
    ] = 64,
) -> None:
    """Replace the attention of a layer range by a kernel and save the converted model (loads with
    `oal.models.load_model(DIR)`), run a whole conversion recipe (`--recipe retrieval`), or re-store a converted
    model's exact keys and values in another dtype (`--exact-kv-dtype int8`) or with a decode budget
    (`--exact-decode-budget 1024`)."""
    if exact_kv_dtype is not None or exact_decode_budget is not None:
        hint = "--exact-kv-dtype" if exact_kv_dtype is not None else "--exact-decode-budget"
        if recipe is not None or layers or calibrated is not None or groups is not None or kernel != "oal":
            raise typer.BadParameter(
                f"{hint} re-saves a converted model as it is; leave --recipe/--kernel/--layers/--calibrated/--groups "
                "out",
                param_hint=hint,
            )
        _restore(model, out, exact_kv_dtype, exact_decode_budget, exact_decode_page, overwrite)
        return
    if recipe is not None:
        from .recipe import RECIPES, run_recipe

        if recipe not in RECIPES:
            raise typer.BadParameter(f"expected one of {', '.join(RECIPES)}, got {recipe!r}", param_hint="--recipe")
        if layers or calibrated is not None or groups is not None or kernel != "oal":
            raise typer.BadParameter(
                "--recipe fixes the kernel, layers and calibration; leave --kernel/--layers/--calibrated/--groups out",
                param_hint="--recipe",
            )
        try:
            record = run_recipe(recipe, out, model_name=model, data_dir=data, overwrite=overwrite)
        except (ValueError, FileNotFoundError, FileExistsError) as err:
            raise _bad(err) from err
        Console(stderr=True).print(
            f"recipe {recipe!r}: {sum(map(len, record['exact_heads'].values()))} exact KV heads, stages "
            f"{record['seconds']} s; wrote {out}"
        )
        return
    from ..kernels import KERNELS
    from ..kernels.registry import SINK_WINDOW_KERNELS
    from ..models import load_model, load_tokenizer
    from .convert import convert_model, save_converted

    names = KERNELS + SINK_WINDOW_KERNELS
    if kernel not in names:
        raise typer.BadParameter(f"expected one of {', '.join(names)}, got {kernel!r}", param_hint="--kernel")
    for name, path in (("--calibrated", calibrated), ("--groups", groups)):
        if path is not None and not path.exists():
            raise typer.BadParameter(f"no such file or directory: {path}", param_hint=name)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise typer.BadParameter(f"{out} exists and is not an empty directory (pass --overwrite)", param_hint="--out")
    console = Console(stderr=True)
    try:
        with console.status(f"loading {model}"):
            base = load_model(model)
            tokenizer = load_tokenizer(model)
        convert_model(base, kernel, layers=layers or None, calibrated=calibrated, groups=groups, seed=seed)
        with console.status(f"writing {out}"):
            save_converted(base, out, tokenizer=tokenizer, overwrite=overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        raise _bad(err) from err
    info = base.config.oal_conversion
    layer_list = info["layers"]
    console.print(
        f"converted {len(layer_list)} layers ({layer_list[0]}–{layer_list[-1]}) of {model} to {kernel!r}"
        f"{' from calibrated parameters' if calibrated else ''}; wrote {out}"
    )


def _restore(model: str, out: Path, kv_dtype: str | None, budget: int | None, page: int, overwrite: bool) -> None:
    """``oal convert --exact-kv-dtype / --exact-decode-budget``: :func:`oal.conversion.recipe.restore_converted`
    of ``model`` to ``out`` with its exact keys and values in ``kv_dtype`` and / or with a decode budget (0: none)."""
    import torch

    from ..ops.page_select import check_budget
    from .recipe import KEEP, restore_converted

    dtypes = {"bfloat16": torch.bfloat16, "int8": torch.int8, "model": None}
    if kv_dtype is not None and kv_dtype not in dtypes:
        raise typer.BadParameter(
            f"expected one of {', '.join(dtypes)}, got {kv_dtype!r}", param_hint="--exact-kv-dtype"
        )
    if budget is not None:
        try:
            check_budget(budget or None, page)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--exact-decode-budget") from err
    console = Console(stderr=True)
    try:
        with console.status(f"re-storing {model} to {out}"):
            layers = restore_converted(
                model,
                out,
                kv_dtype=KEEP if kv_dtype is None else dtypes[kv_dtype],
                decode_budget=KEEP if budget is None else budget or None,
                decode_page=page,
                overwrite=overwrite,
            )
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        raise _bad(err) from err
    what = [f"keys and values in {kv_dtype}"] if kv_dtype is not None else []
    if budget is not None:
        what.append(f"decode budget {budget or 'none'} (pages of {page})")
    console.print(f"exact heads of {layers} layers of {model}: {', '.join(what)}; wrote {out}")


def generate(
    model: Annotated[
        str, typer.Option("--model", help="Converted model directory, an `oal finetune` run, or any model name.")
    ],
    prompt: Annotated[str, typer.Option("--prompt", help="Text to continue.")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate at most.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0: greedy; > 0: sampling.")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    device: Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")] = "cpu",
    threads: Annotated[int, typer.Option("--threads", help="torch CPU threads (0: torch's default).")] = 0,
) -> None:
    """Continue a prompt with cached generation (converted layers keep their recurrent state); prints the text
    and the speed."""
    import torch

    from ..evaluation.loading import load_model_and_tokenizer
    from .generate import generate_text

    if max_new_tokens < 1:
        raise typer.BadParameter(f"expected a positive integer, got {max_new_tokens}", param_hint="--max-new-tokens")
    if threads < 0:
        raise typer.BadParameter(f"expected a non-negative integer, got {threads}", param_hint="--threads")
    if threads:
        torch.set_num_threads(threads)
    console = Console(stderr=True)
    try:
        with console.status(f"loading {model}"):
            lm, tokenizer = load_model_and_tokenizer(model, device=device)
        result = generate_text(lm, tokenizer, prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    except (ValueError, FileNotFoundError, OSError) as err:
        raise _bad(err) from err
    typer.echo(prompt + result.text)
    console.print(
        f"{result.new_tokens} tokens in {result.total_s:.2f} s ({result.tokens_per_s:.1f} tokens/s; "
        f"prompt of {result.prompt_tokens} tokens + first token {result.first_token_s:.2f} s, then "
        f"{result.decode_tokens_per_s:.1f} tokens/s)"
    )


def bench_decode(
    out: Annotated[Path, typer.Option("--out", help="Output folder (decode.json, decode.md).")] = Path(
        "runs/bench_decode"
    ),
    model: Annotated[str, typer.Option("--model", help="Base model.")] = "smollm2-135m",
    converted: Annotated[
        Path | None, typer.Option("--converted", help="Converted model directory (default: convert here).")
    ] = None,
    kernel: Annotated[str, typer.Option("--kernel")] = "oal",
    layers: Annotated[str, typer.Option("--layers")] = "3-26",
    groups: Annotated[Path | None, typer.Option("--groups", help="Groups JSON (default: synthetic groups).")] = None,
    calibrated: Annotated[Path | None, typer.Option("--calibrated")] = None,
    sizes: Annotated[str, typer.Option("--sizes", help="Comma-separated context lengths.")] = "1024,2048,4096,8192",
    methods: Annotated[str, typer.Option("--methods", help="original, converted or both.")] = "original,converted",
    quick: Annotated[bool, typer.Option("--quick", help="Smoke preset: N = 256, 512 and 4 decode steps.")] = False,
    steps: Annotated[int, typer.Option("--steps", help="Timed decode steps per point.")] = 32,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed decode steps first.")] = 2,
    prompt_warmup: Annotated[
        int,
        typer.Option(
            "--prompt-warmup",
            help="Tokens of an untimed first prompt before the timed prefill (0: none): what a process pays once.",
        ),
    ] = 64,
    batch: Annotated[int, typer.Option("--batch")] = 1,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32, bf16 or fp16.")] = "fp32",
    device: Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")] = "cpu",
    threads: Annotated[int, typer.Option("--threads", help="torch threads per point.")] = 1,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before a point's process is stopped.")] = 3600.0,
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats",
            help="Rounds of the whole sweep (the models' order reversed every other round); the report takes "
            "each figure's median and gives the rounds' own speed-ups.",
        ),
    ] = 1,
) -> None:
    """Decode latency and memory against the context length, original against converted model; each point in a
    fresh process, the sweep repeated ``--repeats`` times (medians, with the ratios per context)."""
    from ..bench.decode import (
        HEADER,
        QUICK_SIZES,
        RATIO_HEADER,
        DecodeConfig,
        check_buildable,
        ratio_rows,
        run_sweep,
        table_rows,
    )

    try:
        config = DecodeConfig(
            model=model,
            kernel=kernel,
            layers=layers,
            groups=None if groups is None else str(groups),
            calibrated=None if calibrated is None else str(calibrated),
            converted=None if converted is None else str(converted),
            batch=batch,
            steps=4 if quick else steps,
            warmup=1 if quick else warmup,
            prompt_warmup=prompt_warmup,
            dtype=dtype,
            device=device,
            threads=threads,
            seed=seed,
            point_timeout_s=timeout,
        )
        n_list = list(QUICK_SIZES) if quick else [int(x) for x in sizes.split(",") if x.strip()]
        method_list = tuple(m.strip() for m in methods.split(",") if m.strip())
        if not n_list or any(n < 1 for n in n_list):
            raise ValueError(f"sizes: expected positive integers, got {sizes!r}")
        if repeats < 1:
            raise ValueError(f"repeats: expected a positive integer, got {repeats}")
        check_buildable(config, method_list)
    except (ValueError, FileNotFoundError) as err:
        raise _bad(err) from err
    console = Console(stderr=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("decode points", total=len(n_list) * len(method_list) * repeats)

        def on_point(point: dict, index: int, total: int) -> None:
            progress.update(task, completed=index)

        try:
            doc = run_sweep(config, n_list, out, methods=method_list, repeats=repeats, on_point=on_point)
        except ValueError as err:
            raise _bad(err) from err
    table = Table(title="decode: per-token latency and memory")
    for name in HEADER:
        table.add_column(name, justify="right")
    for row in table_rows(doc):
        table.add_row(*row)
    Console().print(table)
    ratios = ratio_rows(doc)
    if ratios:
        table = Table(title="converted against original")
        for name in RATIO_HEADER:
            table.add_column(name, justify="right")
        for row in ratios:
            table.add_row(*row)
        Console().print(table)
    console.print(f"wrote {out / 'decode.json'}, {out / 'decode.md'}")


def register(app: typer.Typer) -> None:
    """Add `oal convert`, `oal generate` and `oal bench decode` (to the `bench` group of `oal.bench.cli`)."""
    from ..bench.cli import bench_app
    from ..errors import cli_errors

    app.command("convert")(cli_errors(convert))
    app.command("generate")(cli_errors(generate))
    bench_app.command("decode")(cli_errors(bench_decode))
