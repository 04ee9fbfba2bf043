"""``oal calibrate``, ``oal fidelity`` and ``oal intervene``: coefficient calibration on frozen Q/K/V (Eq. 20,
App. B), the frozen-attention fidelity table (Table 2, App. C) and the high-contribution intervention (Table 1,
App. A.2), on the embedded SmolLM2 by default. Data protocol: :mod:`oal.fidelity.data`."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

from ..errors import cli_errors
from ..io import provenance, write_json, write_text
from .capture import format_indices, open_cache, parse_indices
from .data import (
    EVAL_BLOCKS,
    EVAL_SPLIT,
    FIT_SPLIT,
    TRAIN_BLOCKS,
    VAL_BLOCKS,
    FitData,
    check_enough_blocks,
    eval_description,
)

logger = logging.getLogger(__name__)
console = Console()

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CACHE = Path("runs/qkv")


def _load(model_name: str):
    from ..models import attention_spec, load_model, load_tokenizer

    model = load_model(model_name)
    tok = load_tokenizer(model_name)
    return model, tok, attention_spec(model)


def _check_sizes(**values: int | None) -> None:
    """Sizes given on the command line must be positive (None: not given)."""
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise typer.BadParameter(
                f"expected a positive integer, got {value!r}", param_hint=f"--{name.replace('_', '-')}"
            )


def _check_layers(layers: list[int], num_layers: int) -> None:
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise typer.BadParameter(f"expected layers in [0, {num_layers}), got {bad}", param_hint="--layers")


def _machine_state() -> dict:
    la = os.getloadavg()
    return {"load_average_1_5_15": [round(x, 2) for x in la], "torch_threads": torch.get_num_threads()}


class _Clock:
    """Wall and process-CPU seconds of a block of work."""

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.t0, time.process_time() - self.c0

    def to_dict(self) -> dict:
        return {"wall_s": round(self.wall, 2), "cpu_s": round(self.cpu, 2)}


# ------------------------------------------------------------------------------------------------- calibrate


def run_calibrate(
    model_name: str = DEFAULT_MODEL,
    *,
    kernel: str,
    layers: list[int],
    out: Path,
    groups_path: Path | None = None,
    seq_len: int = 4096,
    data_dir: Path | None = None,
    cache: Path = DEFAULT_CACHE,
    split: str = FIT_SPLIT,
    train_blocks: list[int] | None = None,
    val_blocks: list[int] | None = None,
    seed: int = 0,
    n_sink: int | None = None,
    window: int | None = None,
    init_from: Path | None = None,
    threads: int | None = None,
    config_overrides: dict | None = None,
    progress: bool = True,
) -> dict:
    """Capture (cached) and calibrate ``kernel`` on ``layers``; returns the dict written to ``calibrate.json``.

    ``init_from`` (sink/window kernels only): a calibration directory of the inner kernel (``oal``, or
    ``<oal dir>/global`` / a ``global`` run); its factor initialises L and β starts from
    :meth:`SinkWindowKernel.match_beta_` on the training blocks. Without it, and for layers it does not hold,
    the registry's initial values (Taylor factor, β = 0) are the initialisation.

    Under ``torchrun``/``accelerate launch`` with several processes (:func:`oal.distributed.current_processes`)
    the blocks to capture and the layers to calibrate are shared out round robin; process 0 writes the combined
    results (docs/distributed.md). The parameters are the same as with one process.
    """
    from ..calibration import QKV, CalibrationConfig, calibrate_layers, calibrated_layers, load_calibrated
    from ..distributed import current_processes
    from ..kernels import SinkWindowKernel
    from .methods import Geometry, build, check_name, has_trainable, init_sink_window_from, load_groups, needs_groups

    check_name(kernel)
    if kernel == "softmax":
        raise typer.BadParameter("softmax is the reference; it has nothing to calibrate", param_hint="--kernel")
    if init_from is not None and "+" not in kernel:
        raise typer.BadParameter("only sink/window kernels take --init-from", param_hint="--init-from")
    _check_sizes(seq_len=seq_len, threads=threads)
    if threads is not None:
        torch.set_num_threads(threads)
    train_blocks = list(TRAIN_BLOCKS if train_blocks is None else train_blocks)
    val_blocks = list(VAL_BLOCKS if val_blocks is None else val_blocks)
    config = CalibrationConfig.from_dict({**CalibrationConfig().to_dict(), "seed": seed, **(config_overrides or {})})
    start_state = _machine_state()
    processes = current_processes()
    say = console.print if processes.is_main else (lambda *_a, **_k: None)

    model, tok, spec = _load(model_name)
    geom = Geometry(spec.num_heads, spec.num_kv_heads, spec.head_dim)
    _check_layers(layers, spec.num_layers)
    groups = None
    if needs_groups(kernel):
        if groups_path is None:
            raise typer.BadParameter(f"kernel {kernel!r} needs --groups", param_hint="--groups")
        groups = load_groups(groups_path, num_heads=spec.num_heads, head_dim=spec.head_dim)
        missing = [i for i in layers if i not in groups.layers]
        if missing:
            raise typer.BadParameter(f"{groups_path} has no groups for layers {missing}", param_hint="--groups")

    qkv = open_cache(cache, model_name, tok, split, seq_len, data_dir=data_dir, model_source=str(model.oal_source))
    check_enough_blocks(qkv.ids.shape[0], train_blocks + val_blocks, split, seq_len)
    fit = FitData(split, qkv.key.text_source, seq_len, tuple(train_blocks), tuple(val_blocks))
    say(
        f"[bold]{kernel}[/] on layers {format_indices(layers)}; {fit.describe()}"
        + (f"; process {processes.rank} of {processes.world}" if processes.world > 1 else "")
    )

    with _Clock() as capture_clock:
        capture = qkv.ensure(model, train_blocks + val_blocks, layers, progress=progress, processes=processes)
    del model
    say(
        f"capture: {len(capture.captured)} blocks captured ({capture.wall_s:.1f} s wall, {capture.cpu_s:.1f} s CPU), "
        f"{len(capture.reused)} reused from {qkv.dir}"
    )

    kernels: dict[int, object] = {}
    init_layers = set() if init_from is None else calibrated_layers(init_from)
    if init_from is not None and not init_layers & set(layers):
        raise typer.BadParameter(f"{init_from} holds none of the layers {layers}", param_hint="--init-from")

    def layer_data(i: int) -> tuple[QKV, QKV]:
        tr, va = qkv.layer(i, train_blocks), qkv.layer(i, val_blocks)
        return QKV(tr.q, tr.k, tr.v), QKV(va.q, va.k, va.v)

    def make_kernel(i: int):
        if i not in kernels:
            k = build(kernel, geom, i, groups=groups, seed=seed, n_sink=n_sink, window=window)
            if init_from is not None and isinstance(k, SinkWindowKernel) and i in init_layers:
                init_sink_window_from(k, load_calibrated(init_from, i))
                tr = qkv.layer(i, train_blocks)
                gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
                pos = torch.randperm(seq_len, generator=gen)[: min(64, seq_len)].sort().values  # bounded memory
                k.match_beta_(tr.q, tr.k, pos)
            kernels[i] = k
        return kernels[i]

    trainable = has_trainable(make_kernel(layers[0]))
    with _Clock() as fit_clock:
        summary = calibrate_layers(
            make_kernel,
            layer_data,
            layers,
            out,
            config=config,
            data_description=fit.describe(),
            progress=progress,
            processes=processes,
        )
    per_layer = {
        i: {
            "seconds": round(summary["layers"][str(i)]["seconds"], 2),
            "mean_val_mse": sum(h["val_mse"] for h in summary["layers"][str(i)]["heads"])
            / len(summary["layers"][str(i)]["heads"]),
        }
        for i in layers
        if str(i) in summary["layers"]
    }
    result = {
        "provenance": provenance(model=model_name, data=fit.describe(), seed=seed),
        "kernel": kernel,
        "trainable": trainable,
        "layers": layers,
        "groups": None if groups_path is None else str(groups_path),
        "init_from": None if init_from is None else str(init_from),
        "sink_window": None if "+" not in kernel else {"n_sink": n_sink, "window": window},
        "data": fit.to_dict(),
        "config": config.to_dict(),
        "cache": str(qkv.dir),
        "timings": {
            "capture": {**capture.to_dict(), **capture_clock.to_dict()},
            "fit": fit_clock.to_dict(),
            "total_wall_s": round(capture_clock.wall + fit_clock.wall, 2),
            "note": "fit times exclude layers already calibrated in a previous run (resumed); capture times "
            "cover only blocks captured now; with several processes, times are process 0's",
        },
        "machine": {"start": start_state, "end": _machine_state()},
        "processes": processes.world,
        "per_layer": per_layer,
    }
    if not processes.is_main:
        return result
    write_json(out / "calibrate.json", result)
    write_text(out / "calibrate.md", _calibrate_markdown(result))
    console.print(
        f"calibrated {kernel} on {len(per_layer)} layers: capture {capture_clock.wall:.1f} s wall, fit "
        f"{fit_clock.wall:.1f} s wall / {fit_clock.cpu:.1f} s CPU (load average at start "
        f"{start_state['load_average_1_5_15'][0]}); wrote {out}"
    )
    return result


def _calibrate_markdown(r: dict) -> str:
    t = r["timings"]
    lines = [
        f"# Calibration: {r['kernel']}",
        "",
        f"Command: `{r['provenance']['command']}`  ",
        f"Time: {r['provenance']['time_utc']}  ",
        f"Data: {r['data']['description']}  ",
        f"Seed: {r['config']['seed']}; layers {format_indices(r['layers'])}",
        "",
        f"Capture: {len(t['capture']['captured'])} blocks captured in {t['capture']['wall_s']:.1f} s wall / "
        f"{t['capture']['cpu_s']:.1f} s CPU, {len(t['capture']['reused'])} reused. Fit: {t['fit']['wall_s']:.1f} s "
        f"wall / {t['fit']['cpu_s']:.1f} s CPU. Load average (1 min) at start / end: "
        f"{r['machine']['start']['load_average_1_5_15'][0]} / {r['machine']['end']['load_average_1_5_15'][0]} "
        f"on {os.cpu_count()} CPUs, {r['machine']['start']['torch_threads']} torch threads.",
        "",
        "| layer | seconds | mean validation MSE |",
        "|---:|---:|---:|",
    ]
    for i, v in r["per_layer"].items():
        lines.append(f"| {i} | {v['seconds']:.1f} | {v['mean_val_mse']:.4e} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------- fidelity

DEFAULT_METHODS = ("softmax", "performer", "spectraformer", "dijiang", "taylorshift", "global", "oal")
DEFAULT_CALIBRATED = Path("runs/calibrate")


def resolve_methods(specs: list[str], calibrated_root: Path | None) -> list[tuple[str, str, str | None]]:
    """``[LABEL:]name``, ``[LABEL:]name=DIR`` or ``[LABEL:]name=init`` -> ``(label, name, source)`` with source a
    calibration directory, ``"init"`` (the kernel's initial values) or None (decided when the kernel is built: only
    methods without trainable parameters may go without a source). A bare ``name`` uses
    ``<calibrated_root>/<name>`` if that directory exists (``global`` also ``<calibrated_root>/oal/global``).
    The label (default: the name) keys the results, so one kernel can appear with several calibrations
    (e.g. ``oal+sink+window`` with different sink and window sizes)."""
    from .methods import check_name

    out: list[tuple[str, str, str | None]] = []
    for spec in specs:
        left, _, src = spec.partition("=")
        label, _, name = left.rpartition(":")
        name = check_name(name.strip())
        label = label.strip() or name
        if not src and calibrated_root is not None:
            for cand in (calibrated_root / name, calibrated_root / "oal" / "global" if name == "global" else None):
                if cand is not None and (cand / "params.safetensors").is_file():
                    src = str(cand)
                    break
        if any(lab == label for lab, _, _ in out):
            raise ValueError(f"methods: {label!r} is given twice (give each a distinct LABEL:name=DIR)")
        out.append((label, name, src or None))
    return out


def run_fidelity(
    model_name: str = DEFAULT_MODEL,
    *,
    methods: list[str] | None = None,
    layers: list[int] | None = None,
    blocks: list[int] | None = None,
    seq_len: int = 4096,
    out: Path = Path("runs/fidelity"),
    split: str = EVAL_SPLIT,
    groups_path: Path | None = None,
    calibrated_root: Path | None = DEFAULT_CALIBRATED,
    data_dir: Path | None = None,
    cache: Path = DEFAULT_CACHE,
    seed: int = 0,
    n_sink: int | None = None,
    window: int | None = None,
    threads: int | None = None,
    progress: bool = True,
) -> dict:
    """Table 2: MSE / RelMSE (Eq. 21–22) before and after W_o for every method; returns fidelity.json's dict."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..calibration import load_calibrated
    from ..kernels import SoftmaxKernel
    from ..models import output_projection
    from .evaluate import SINK_COLUMNS, evaluate_fidelity, markdown_table
    from .methods import (
        STOCHASTIC,
        Geometry,
        build,
        calibration_info,
        check_disjoint,
        has_trainable,
        load_groups,
        needs_groups,
    )

    _check_sizes(seq_len=seq_len, threads=threads)
    if threads is not None:
        torch.set_num_threads(threads)
    layers = [4, 12, 20] if layers is None else layers
    blocks = list(EVAL_BLOCKS if blocks is None else blocks)
    resolved = resolve_methods(list(DEFAULT_METHODS if methods is None else methods), calibrated_root)
    start_state = _machine_state()
    model, tok, spec = _load(model_name)
    geom = Geometry(spec.num_heads, spec.num_kv_heads, spec.head_dim)
    _check_layers(layers, spec.num_layers)
    groups = None if groups_path is None else load_groups(groups_path, num_heads=spec.num_heads, head_dim=spec.head_dim)

    kernels: dict[str, dict[int, object]] = {}
    params: dict[str, str] = {}
    for label, name, src in resolved:
        per_layer = {}
        for layer in layers:
            if name == "softmax":
                kern = SoftmaxKernel(geom.num_heads, geom.num_kv_heads, geom.head_dim)
            elif src is None or src == "init":
                if needs_groups(name) and groups is None:
                    raise typer.BadParameter(f"{name}=init needs --groups", param_hint="--groups")
                kern = build(name, geom, layer, groups=groups, seed=seed, n_sink=n_sink, window=window)
                if src is None and has_trainable(kern):
                    raise typer.BadParameter(
                        f"{name} has trainable parameters: give {name}=<calibration dir> (or {name}=init for its "
                        f"initial values), or calibrate it into {calibrated_root}/{name}",
                        param_hint="--method",
                    )
            else:
                kern = load_calibrated(src, layer)
                if kern.name != name:
                    raise typer.BadParameter(
                        f"{src} holds a {kern.name!r} calibration, not {name!r}", param_hint="--method"
                    )
            if layer == layers[0]:
                trainable = has_trainable(kern)
            per_layer[layer] = kern.eval().requires_grad_(False)
        kernels[label] = per_layer
        if name == "softmax":
            params[label] = "exact reference (SDPA)"
        elif src not in (None, "init"):
            info = calibration_info(src)
            check_disjoint(info, split, blocks, seq_len, f"{label} ({src})")
            params[label] = f"calibrated: {src}" + (f" ({info['data']['description']})" if info.get("data") else "")
        else:
            params[label] = "initial values" if trainable else "no trainable parameters"
        if name in STOCHASTIC:
            params[label] += f"; fixed random projections of seed {per_layer[layers[0]].seed} (per layer, F.1)"

    qkv = open_cache(cache, model_name, tok, split, seq_len, data_dir=data_dir, model_source=str(model.oal_source))
    check_enough_blocks(qkv.ids.shape[0], blocks, split, seq_len)
    desc = eval_description(qkv.key.text_source, blocks, seq_len)
    console.print(f"methods {[lab for lab, _, _ in resolved]} on layers {layers}; {desc}")
    with _Clock() as capture_clock:
        capture = qkv.ensure(model, blocks, layers, progress=progress)
    projections = {}
    for layer in layers:
        W, bias = output_projection(model, layer)
        projections[layer] = (W.detach().float().clone(), None if bias is None else bias.detach().float().clone())
    del model

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=not progress
    )
    with bar, _Clock() as eval_clock:
        task = bar.add_task("evaluating (block, layer)", total=len(blocks) * len(layers))
        run = evaluate_fidelity(
            lambda layer, b: qkv.layer(layer, [b], outputs=True),
            kernels,
            projections,
            layers,
            blocks,
            on_step=lambda: bar.advance(task),
        )
    table = {label: run.acc.metrics(label) for label, _, _ in resolved}
    result = {
        "methods": {
            name: {**m, "params": params[name], "kernel_seconds": round(run.seconds[name], 2)}
            for name, m in table.items()
        },
        "config": {
            "model": model_name,
            "layers": layers,
            "blocks": blocks,
            "split": split,
            "seq_len": seq_len,
            "text_source": qkv.key.text_source,
            "data": desc,
            "seed": seed,
            "groups": None if groups_path is None else str(groups_path),
            "num_heads": spec.num_heads,
            "metric": "Eq. 21-22: per sequence, all evaluated layers and heads in one tensor; after W_o: heads "
            "concatenated in original order through each layer's frozen o_proj (bias included if any)",
        },
        "diagnostics": {
            "softmax_mass": {
                str(layer): {c: run.sink[layer][:, j].tolist() for j, c in enumerate(SINK_COLUMNS)} for layer in layers
            },
            "softmax_mass_layer_mean": {
                str(layer): {c: float(run.sink[layer][:, j].mean()) for j, c in enumerate(SINK_COLUMNS)}
                for layer in layers
            },
            "max_abs_sdpa_minus_captured_output": {str(k): v for k, v in run.capture_check.items()},
        },
        "timings": {"capture": {**capture.to_dict(), **capture_clock.to_dict()}, "evaluate": eval_clock.to_dict()},
        "machine": {"start": start_state, "end": _machine_state()},
        "provenance": provenance(model=model_name, data=desc, seed=seed),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "fidelity.json", result)
    from .plots import plot_fidelity

    result["figures"] = {"relmse": str(plot_fidelity(result, out / "fidelity.png"))}
    write_json(out / "fidelity.json", result)
    write_text(out / "fidelity.md", _fidelity_markdown(result, markdown_table))
    t = Table(title=f"Frozen-attention fidelity, layers {layers}, {len(blocks)} blocks of {seq_len}")
    for col in ("method", "MSE before", "RelMSE before", "MSE after", "RelMSE after"):
        t.add_column(col, justify="right")
    for name, m in table.items():
        t.add_row(
            name, *(f"{m[k]:.4g}" for k in ("mse_before_wo", "relmse_before_wo", "mse_after_wo", "relmse_after_wo"))
        )
    console.print(t)
    console.print(f"wrote {out / 'fidelity.json'}, {out / 'fidelity.md'}")
    return result


def _fidelity_markdown(r: dict, markdown_table) -> str:
    cfg = r["config"]
    lines = [
        f"# Frozen-attention fidelity (Table 2 analogue): {cfg['model']}",
        "",
        f"Command: `{r['provenance']['command']}`  ",
        f"Time: {r['provenance']['time_utc']}  ",
        f"Data: {cfg['data']}  ",
        f"Layers {cfg['layers']}, all {cfg['num_heads']} query heads; seed {cfg['seed']}; "
        f"evaluation {r['timings']['evaluate']['wall_s']:.0f} s wall / {r['timings']['evaluate']['cpu_s']:.0f} s CPU.",
        "",
        markdown_table(r["methods"]),
        "",
        "## Per layer (RelMSE before / after W_o)",
        "",
        "| Method | " + " | ".join(f"L{layer}" for layer in cfg["layers"]) + " |",
        "|---|" + "---:|" * len(cfg["layers"]),
    ]
    for name, m in r["methods"].items():
        pl = m["per_layer"]
        cells = [f"{pl[str(i)]['relmse_before_wo']:.3f} / {pl[str(i)]['relmse_after_wo']:.3f}" for i in cfg["layers"]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Parameters", ""]
    lines += [f"- **{name}**: {m['params']}" for name, m in r["methods"].items()]
    lines += [
        "",
        "## Softmax attention mass on the first positions (mean over queries, heads and blocks)",
        "",
        "| layer | key 0 | keys 0-3 |",
        "|---:|---:|---:|",
    ]
    for layer, v in r["diagnostics"]["softmax_mass_layer_mean"].items():
        lines.append(f"| {layer} | {v['position_0']:.3f} | {v['positions_0_3']:.3f} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------- intervene

INTERVENE_METHODS = ("performer", "spectraformer", "dijiang", "taylorshift")


def run_intervene(
    model_name: str = DEFAULT_MODEL,
    *,
    groups_path: Path,
    methods: list[str] | None = None,
    layers: list[int] | None = None,
    blocks: list[int] | None = None,
    seq_len: int = 4096,
    split: str = EVAL_SPLIT,
    out: Path = Path("runs/intervene"),
    data_dir: Path | None = None,
    cache: Path = DEFAULT_CACHE,
    positions: int = 32,
    seeds: list[int] | None = None,
    controls: int = 1000,
    control_blocks: int | None = None,
    gaussian: bool = True,
    gauss_prompts: int = 40,
    gauss_prompt_len: int = 64,
    batch: int = 4,
    seed: int = 0,
    threads: int | None = None,
    progress: bool = True,
) -> dict:
    """Table 1: retained-error ratios R_S (Eq. 8–14), Gaussian controls and the matched-control randomization
    test (Eq. 15); returns intervene.json's dict. Methods are ``name`` (initial parameters; stochastic baselines
    over ``seeds``) or ``name=DIR`` (calibrated parameters: the calibrated draw only)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..calibration import load_calibrated
    from .intervention import evaluate_intervention, gaussian_groups, subset_mask
    from .methods import STOCHASTIC, Geometry, build, calibration_info, check_disjoint, load_groups

    _check_sizes(seq_len=seq_len, positions=positions, batch=batch, threads=threads)
    if controls < 0:
        raise typer.BadParameter(f"expected an integer >= 0, got {controls}", param_hint="--controls")
    if threads is not None:
        torch.set_num_threads(threads)
    layers = [4, 12, 20] if layers is None else layers
    blocks = list(EVAL_BLOCKS if blocks is None else blocks)
    seeds = [0, 1, 2, 3, 4] if seeds is None else seeds
    control_blocks = len(blocks) if control_blocks is None else min(control_blocks, len(blocks))
    specs = []
    for spec in INTERVENE_METHODS if methods is None else methods:
        name, _, src = spec.partition("=")
        if name not in INTERVENE_METHODS:
            raise typer.BadParameter(f"expected one of {INTERVENE_METHODS}, got {name!r}", param_hint="--method")
        specs.append((name, src or None))
    start_state = _machine_state()
    model, tok, spec_ = _load(model_name)
    geom = Geometry(spec_.num_heads, spec_.num_kv_heads, spec_.head_dim)
    _check_layers(layers, spec_.num_layers)
    groups = load_groups(groups_path, num_heads=spec_.num_heads, head_dim=spec_.head_dim)
    missing = [i for i in layers if i not in groups.layers]
    if missing:
        raise typer.BadParameter(f"{groups_path} has no groups for layers {missing}", param_hint="--groups")
    masks = {layer: subset_mask(groups, layer) for layer in layers}
    g_masks = None
    if gaussian:
        g_groups = gaussian_groups(groups, layers, spec_.num_kv_heads, [gauss_prompt_len] * gauss_prompts, seed)
        g_masks = {layer: subset_mask(g_groups, layer) for layer in layers}

    qkv = open_cache(cache, model_name, tok, split, seq_len, data_dir=data_dir, model_source=str(model.oal_source))
    check_enough_blocks(qkv.ids.shape[0], blocks, split, seq_len)
    desc = eval_description(qkv.key.text_source, blocks, seq_len)
    with _Clock() as capture_clock:
        capture = qkv.ensure(model, blocks, layers, progress=progress)
    del model

    def fraction(m: dict) -> dict:
        sizes = torch.stack([x.sum(-1) for x in m.values()])  # (L, Hq)
        return {
            "dims": int(sizes.sum()),
            "heads": int(sizes.numel()),
            "fraction": float(sizes.sum()) / (sizes.numel() * geom.head_dim),
            "per_layer_sizes": {str(layer): m[layer].sum(-1).tolist() for layer in layers},
        }

    results: dict = {}
    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=not progress
    )
    with bar:
        for name, src in specs:
            if src is not None:
                info = calibration_info(src)
                check_disjoint(info, split, blocks, seq_len, f"{name} ({src})")
                kern_seeds = [0]
                params = f"calibrated: {src} (its own fixed draw only)"

                def make(s, layer, src=src):
                    return load_calibrated(src, layer).eval().requires_grad_(False)
            else:
                kern_seeds = seeds if name in STOCHASTIC else [seeds[0]]
                params = "initial values" + (
                    f"; fixed random projections of seeds {kern_seeds}" if name in STOCHASTIC else "; deterministic"
                )

                def make(s, layer, name=name):
                    return build(name, geom, layer, seed=s).eval().requires_grad_(False)

            task = bar.add_task(f"{name} (layer, block)", total=len(layers) * len(blocks))
            with _Clock() as clock:
                errs = evaluate_intervention(
                    lambda layer, b: qkv.layer(layer, [b]),
                    make,
                    kern_seeds,
                    masks,
                    layers,
                    blocks,
                    positions=positions,
                    seed=seed,
                    gaussian_masks=g_masks,
                    controls=controls,
                    control_blocks=control_blocks,
                    batch=batch,
                    on_step=lambda task=task: bar.advance(task),
                )
            results[name] = {**errs.summary(layers), "params": params, "kernel_seeds": kern_seeds, **clock.to_dict()}
            console.print(
                f"{name}: R_S = {100 * results[name]['R_S']:.1f} %"
                + (f", Gaussian {100 * results[name]['R_S_gaussian']:.1f} %" if gaussian else "")
                + (f", p = {results[name]['controls']['p_value']:.4g}" if "controls" in results[name] else "")
            )
    result = {
        "methods": results,
        "subsets": {"pretrained": fraction(masks), **({"gaussian": fraction(g_masks)} if g_masks else {})},
        "config": {
            "model": model_name,
            "groups": str(groups_path),
            "grouping_params": groups.params,
            "layers": layers,
            "blocks": blocks,
            "split": split,
            "seq_len": seq_len,
            "text_source": qkv.key.text_source,
            "data": desc,
            "positions_per_sequence_and_layer": positions,
            "seeds": seeds,
            "controls": controls,
            "control_blocks": blocks[:control_blocks] if controls else [],
            "gaussian": gaussian,
            "gaussian_grouping": (
                f"chi (Eq. 2) of i.i.d. N(0,1) q/k with the calibration prompts' shapes ({gauss_prompts} prompts x "
                f"{gauss_prompt_len} tokens, Hq={geom.num_heads}, Hkv={geom.num_kv_heads}, d={geom.head_dim}), grouped "
                f"with the same App. B procedure and parameters as {groups_path}; evaluation q/k i.i.d. N(0,1) of the "
                f"evaluation sequences' shapes, pretrained v"
            )
            if gaussian
            else None,
            "seed": seed,
            "aggregation": "MSE over heads, positions, output dims (Eq. 12-13); averaged over kernel seeds; ratio per "
            "(layer, sequence); macro-average over layers and sequences",
        },
        "timings": {"capture": {**capture.to_dict(), **capture_clock.to_dict()}},
        "machine": {"start": start_state, "end": _machine_state()},
        "provenance": provenance(model=model_name, data=desc, seed=seed),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "intervene.json", result)
    from .plots import plot_intervention

    result["figures"] = {"retained_error": str(plot_intervention(result, out / "intervene.png"))}
    write_json(out / "intervene.json", result)
    write_text(out / "intervene.md", _intervene_markdown(result))
    console.print(f"wrote {out / 'intervene.json'}, {out / 'intervene.md'}")
    return result


def _intervene_markdown(r: dict) -> str:
    cfg = r["config"]
    sub = r["subsets"]["pretrained"]
    B = cfg["controls"]
    lines = [
        f"# High-contribution intervention (Table 1 analogue): {cfg['model']}",
        "",
        f"Command: `{r['provenance']['command']}`  ",
        f"Time: {r['provenance']['time_utc']}  ",
        f"Data: {cfg['data']}  ",
        f"Layers {cfg['layers']}, all query heads; {cfg['positions_per_sequence_and_layer']} sampled query positions "
        f"per sequence and layer; seed {cfg['seed']}; kernel seeds {cfg['seeds']} for stochastic baselines.",
        "",
        f"Selected subsets S_h (union of non-bulk groups of {cfg['groups']}): {sub['dims']} dimensions over "
        f"{sub['heads']} heads = {100 * sub['fraction']:.2f} % of the head dimensions"
        + (
            f"; Gaussian control subsets: {r['subsets']['gaussian']['dims']} dimensions "
            f"({100 * r['subsets']['gaussian']['fraction']:.2f} %)."
            if "gaussian" in r["subsets"]
            else "."
        ),
        "",
        f"| Method | High-contrib. R_S (%) | Gaussian control (%) | matched controls: mean R_b (%) | p (B = {B}) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in r["methods"].items():
        c = m.get("controls")
        g = f"{100 * m['R_S_gaussian']:.1f}" if "R_S_gaussian" in m else "—"
        ctrl = f"{100 * c['R_controls_mean']:.1f}" if c else "—"
        p = f"{c['p_value']:.4g}" if c else "—"
        lines.append(f"| {name} | {100 * m['R_S']:.1f} | {g} | {ctrl} | {p} |")
    if B:
        lines += [
            "",
            f"Matched controls: {B} random subsets per layer, for each head |S_h| dimensions drawn from its bulk "
            f"group, "
            f"evaluated on blocks {format_indices(cfg['control_blocks'])} with the same seeds and aggregation; the "
            f"p-value (Eq. 15) compares them with R_S on the same blocks.",
        ]
    lines += ["", "## Per layer R_S (%)", "", "| Method | " + " | ".join(f"L{x}" for x in cfg["layers"]) + " |"]
    lines.append("|---|" + "---:|" * len(cfg["layers"]))
    for name, m in r["methods"].items():
        lines.append(
            f"| {name} | " + " | ".join(f"{100 * m['per_layer'][str(x)]['R_S']:.1f}" for x in cfg["layers"]) + " |"
        )
    lines += ["", "## Parameters", ""] + [f"- **{n}**: {m['params']}" for n, m in r["methods"].items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------- register


def _indices(text: str, name: str) -> list[int]:
    try:
        return parse_indices(text, name)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=f"--{name.replace('_', '-')}") from None


def register(app: typer.Typer) -> None:
    @app.command()
    @cli_errors
    def calibrate(
        kernel: str = typer.Option(
            ...,
            help="Kernel registry name: oal, global, performer, spectraformer, dijiang, "
            "taylorshift, oal+sink+window, global+sink+window, ...",
        ),
        model: str = typer.Option(DEFAULT_MODEL, help="Model name, local directory or hub id."),
        groups: Path | None = typer.Option(None, help="groups.json from `oal group` (OAL kernels)."),
        layers: str = typer.Option("3-26", help="Layers, e.g. '3-26' or '4,12,20'."),
        seq_len: int = typer.Option(4096, help="Block length N."),
        out: Path = typer.Option(..., help="Output directory (resumed if it holds the same run)."),
        data: Path | None = typer.Option(None, "--data", help="Directory with wikitext-2-raw/ (else $OAL_DATA_DIR)."),
        cache: Path = typer.Option(DEFAULT_CACHE, help="Q/K/V capture cache root."),
        train_blocks: str = typer.Option("16-23", help="Fitting blocks of the valid split (paper: train split)."),
        val_blocks: str = typer.Option("24-25", help="Validation blocks of the valid split."),
        seed: int = typer.Option(0, help="Protocol seed (schedules, perturbations) and baseline projection seed."),
        n_sink: int | None = typer.Option(None, help="Sink/window kernels: exact sinks (default 4)."),
        window: int | None = typer.Option(None, help="Sink/window kernels: exact window (default 64)."),
        init_from: Path | None = typer.Option(None, help="Sink/window kernels: calibrated inner kernel directory."),
        max_updates: int = typer.Option(1000, help="Updates per initialisation (paper: 1000)."),
        patience: int = typer.Option(400, help="Early-stopping patience in updates (paper: 400)."),
        train_pool: int = typer.Option(256, help="Eligible positions per training sequence (0: all)."),
        val_positions: int = typer.Option(256, help="Validation positions per sequence (0: all)."),
        threads: int | None = typer.Option(None, help="torch intra-op threads."),
    ) -> None:
        """Fit kernel parameters by output matching on frozen Q/K/V (Eq. 20, App. B), layer by layer, resumable."""
        run_calibrate(
            model,
            kernel=kernel,
            layers=_indices(layers, "layers"),
            out=out,
            groups_path=groups,
            seq_len=seq_len,
            data_dir=data,
            cache=cache,
            train_blocks=_indices(train_blocks, "train_blocks"),
            val_blocks=_indices(val_blocks, "val_blocks"),
            seed=seed,
            n_sink=n_sink,
            window=window,
            init_from=init_from,
            threads=threads,
            config_overrides={
                "max_updates": max_updates,
                "patience": patience,
                "train_pool": train_pool or None,
                "val_positions": val_positions or None,
            },
        )

    @app.command()
    @cli_errors
    def fidelity(
        method: list[str] = typer.Option(
            list(DEFAULT_METHODS),
            "--method",
            "-m",
            help="Method: [LABEL:]name, [LABEL:]name=CALIBRATION_DIR or [LABEL:]name=init (initial values); "
            "the label keys the results. Repeat for several.",
        ),
        model: str = typer.Option(DEFAULT_MODEL, help="Model name, local directory or hub id."),
        layers: str = typer.Option("4,12,20", help="Evaluated layers (all query heads)."),
        blocks: str = typer.Option("0-15", help="Held-out blocks of --split (paper: 16 blocks)."),
        seq_len: int = typer.Option(4096, help="Block length N."),
        split: str = typer.Option(EVAL_SPLIT, help="Evaluation split (disjoint from the fitting data)."),
        groups: Path | None = typer.Option(None, help="groups.json (only for OAL methods given as name=init)."),
        calibrated: Path | None = typer.Option(DEFAULT_CALIBRATED, help="Root of <name>/ calibration directories."),
        out: Path = typer.Option(Path("runs/fidelity"), help="Output directory."),
        data: Path | None = typer.Option(None, "--data", help="Directory with wikitext-2-raw/ (else $OAL_DATA_DIR)."),
        cache: Path = typer.Option(DEFAULT_CACHE, help="Q/K/V capture cache root."),
        seed: int = typer.Option(0, help="Seed of the fixed random projections of uncalibrated baselines (F.1)."),
        n_sink: int | None = typer.Option(None, help="Sink/window methods given as name=init: exact sinks."),
        window: int | None = typer.Option(None, help="Sink/window methods given as name=init: exact window."),
        threads: int | None = typer.Option(None, help="torch intra-op threads."),
    ) -> None:
        """Frozen-attention fidelity (Table 2, App. C): MSE and RelMSE before and after W_o on held-out blocks."""
        run_fidelity(
            model,
            methods=method,
            layers=_indices(layers, "layers"),
            blocks=_indices(blocks, "blocks"),
            seq_len=seq_len,
            out=out,
            split=split,
            groups_path=groups,
            calibrated_root=calibrated,
            data_dir=data,
            cache=cache,
            seed=seed,
            n_sink=n_sink,
            window=window,
            threads=threads,
        )

    @app.command()
    @cli_errors
    def intervene(
        groups: Path = typer.Option(..., help="groups.json from `oal group` (S_h = non-bulk groups)."),
        method: list[str] = typer.Option(
            list(INTERVENE_METHODS), "--method", "-m", help="Baseline, or name=CALIBRATION_DIR. Repeat for several."
        ),
        model: str = typer.Option(DEFAULT_MODEL, help="Model name, local directory or hub id."),
        layers: str = typer.Option("4,12,20", help="Evaluated layers (all query heads)."),
        blocks: str = typer.Option("0-15", help="Evaluation blocks of --split (A.2: 16 sequences)."),
        seq_len: int = typer.Option(4096, help="Block length N."),
        split: str = typer.Option(EVAL_SPLIT, help="Evaluation split."),
        positions: int = typer.Option(32, help="Sampled causal query positions per sequence and layer."),
        seeds: str = typer.Option("0-4", help="Seeds of the stochastic baselines' fixed projections."),
        controls: int = typer.Option(1000, help="Matched random subsets B for the randomization test (0: none)."),
        control_blocks: int | None = typer.Option(None, help="Evaluate the controls on the first n blocks only."),
        gaussian: bool = typer.Option(True, help="Also run the Gaussian control."),
        batch: int = typer.Option(4, help="Control subsets evaluated per kernel call."),
        out: Path = typer.Option(Path("runs/intervene"), help="Output directory."),
        data: Path | None = typer.Option(None, "--data", help="Directory with wikitext-2-raw/ (else $OAL_DATA_DIR)."),
        cache: Path = typer.Option(DEFAULT_CACHE, help="Q/K/V capture cache root."),
        seed: int = typer.Option(0, help="Seed of positions, controls and Gaussian draws."),
        threads: int | None = typer.Option(None, help="torch intra-op threads."),
    ) -> None:
        """High-contribution intervention (Table 1, App. A.2): retained-error ratios, Gaussian control and the
        matched-control randomization test."""
        run_intervene(
            model,
            groups_path=groups,
            methods=method,
            layers=_indices(layers, "layers"),
            blocks=_indices(blocks, "blocks"),
            seq_len=seq_len,
            split=split,
            out=out,
            data_dir=data,
            cache=cache,
            positions=positions,
            seeds=_indices(seeds, "seeds"),
            controls=controls,
            control_blocks=control_blocks,
            gaussian=gaussian,
            batch=batch,
            seed=seed,
            threads=threads,
        )
