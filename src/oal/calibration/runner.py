"""Resumable calibration over the layers of a model, and loading the results back into kernels.

Output directory layout::

    run.json                      kernel name, protocol config, data description (checked on resume)
    layers/layer_{i:03d}.safetensors   calibrated state of layer i (keys: the kernel's state_dict names)
    layers/layer_{i:03d}.global.safetensors   OAL only: the learned global quadratic calibrated on the way
    layers/layer_{i:03d}.json          per-head summary of layer i; written last, it marks the layer done
    params.safetensors            all finished layers, keys ``layers.{i}.{name}``
    summary.json                  all finished layers' summaries, plus kernel, config and data
    global/params.safetensors, global/summary.json   OAL only: the same for the learned global quadratic

Every file is written to a temporary name and moved into place with ``os.replace``, so a killed run
leaves either the previous or the new version; a restarted run skips the layers whose JSON exists.
Each layer draws from its own seeded generator, so a resumed run reproduces an uninterrupted one.
Every safetensors file records the sha256 of each tensor (:func:`oal.io.save_tensors`); reading a truncated or
altered file raises :class:`oal.io.IntegrityError` instead of loading it.

Several processes (``torchrun``/``accelerate launch``, see :mod:`oal.distributed` and docs/distributed.md) share
the layers still to do round robin; each writes its own layers' files (distinct names), and after a barrier
process 0 alone writes ``params.safetensors`` and ``summary.json``. The output directory must be visible to
every process (one machine, or a shared filesystem). Since a layer's result depends only on (seed, layer), the
parameters do not depend on the number of processes.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from ..distributed import Processes
from ..io import load_tensors, save_tensors
from ..kernels import AttentionKernel
from ..kernels.registry import kernel_from_config
from .config import QKV, CalibrationConfig
from .layer import LayerResult, calibrate_layer

log = logging.getLogger(__name__)

FORMAT = "oal-calibration/1"


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _read_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    return load_tensors(path, prefix=prefix, what="calibration")[0]


def _shard(out: Path, layer: int, suffix: str) -> Path:
    return out / "layers" / f"layer_{layer:03d}{suffix}"


def _check_run(out: Path, header: dict[str, Any]) -> None:
    path = out / "run.json"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        (out / "layers").mkdir(exist_ok=True)
        _atomic_json(path, header)
        return
    old = json.loads(path.read_text())
    diff = sorted(k for k in set(old) | set(header) if old.get(k) != header.get(k))
    if diff:
        details = "; ".join(f"{k}: existing {old.get(k)!r} vs requested {header.get(k)!r}" for k in diff)
        raise ValueError(f"out_dir: {out} holds a run with different settings ({details}); use a new directory")
    (out / "layers").mkdir(exist_ok=True)


def _check_finished_layer(out: Path, layer: int, kernel: AttentionKernel) -> None:
    """A finished layer must have been calibrated for the same kernel structure (its buffers, e.g. groups)."""
    stored = _read_tensors(_shard(out, layer, ".safetensors"))
    for name, buf in kernel.named_buffers():
        if name in stored and (stored[name].shape != buf.shape or not torch.equal(stored[name], buf.cpu())):
            raise ValueError(
                f"out_dir: layer {layer} was calibrated with a different `{name}` than make_kernel({layer}) "
                f"returns; use a new directory"
            )


def _write_combined(out: Path, header: dict[str, Any], layers: list[int], suffix: str, sub: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    summaries: dict[str, Any] = {}
    for i in layers:
        for k, v in _read_tensors(_shard(out, i, suffix + ".safetensors")).items():
            tensors[f"layers.{i}.{k}"] = v
        summary = json.loads(_shard(out, i, ".json").read_text())
        summaries[str(i)] = summary if not suffix else summary["global_stage"]
    sub.mkdir(exist_ok=True)
    save_tensors(sub / "params.safetensors", tensors)
    kernel = header["kernel"] if not suffix else "global"
    _atomic_json(sub / "summary.json", {**header, "kernel": kernel, "layers": summaries})


def _finished(out: Path) -> list[int]:
    done = []
    for p in sorted((out / "layers").glob("layer_*.json")):
        done.append(int(p.stem.split("_")[1]))
    return done


def calibrate_layers(
    make_kernel: Callable[[int], AttentionKernel],
    get_layer_qkv: Callable[[int], tuple[QKV, QKV]],
    layers: Sequence[int],
    out_dir: str | os.PathLike,
    *,
    config: CalibrationConfig | None = None,
    data_description: str = "",
    target: Callable[[int], AttentionKernel | None] | None = None,
    progress: bool = True,
    block_bytes: int = 1 << 26,
    processes: Processes | None = None,
) -> dict[str, Any]:
    """Calibrate ``make_kernel(i)`` for every layer i in ``layers`` and write the results to ``out_dir``.

    Args:
        make_kernel: ``layer -> AttentionKernel`` (e.g. an OALKernel with that layer's groups).
        get_layer_qkv: ``layer -> (train, val)`` :class:`QKV`; called only for layers this process calibrates.
        layers: layer indices, calibrated in this order (each process takes every ``world``-th layer not done).
        out_dir: output directory (layout in the module docstring). An existing directory is resumed if
            its kernel, config and data description match; otherwise ValueError.
        config: protocol options.
        data_description: recorded in run.json / summary.json (e.g. "wikitext-2 train blocks 16-23 / 24-25").
        target: optional ``layer -> target kernel`` (default exact softmax).
        progress: show rich progress bars (layers, and updates of the current stage; process 0 only).
        processes: this process's rank and the world size (default: one process). Every process must call
            this function with the same arguments.

    Returns:
        The combined summary (the content of summary.json).
    """
    config = CalibrationConfig() if config is None else config
    processes = Processes() if processes is None else processes
    layers = list(layers)
    if not layers or len(set(layers)) != len(layers) or any(not isinstance(i, int) or i < 0 for i in layers):
        raise ValueError(f"layers: expected distinct layer indices ≥ 0, got {layers!r}")
    out = Path(out_dir)
    first = make_kernel(layers[0])
    header = {"format": FORMAT, "kernel": first.name, "config": config.to_dict(), "data": data_description}
    if processes.is_main:
        _check_run(out, header)
    processes.barrier()
    if not processes.is_main:
        _check_run(out, header)
    done = set(_finished(out))
    processes.barrier()  # every process has read the same finished layers before any new one appears
    for i in layers:
        if i in done:
            _check_finished_layer(out, i, make_kernel(i))
    mine = processes.shard([i for i in layers if i not in done])
    skipped = [i for i in layers if i in done]
    if skipped:
        log.info("layers %s: already calibrated in %s, skipped", skipped, out)

    bar = None
    if progress and processes.is_main:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with bar if bar is not None else nullcontext():
        layer_task = bar.add_task("layers", total=len(mine)) if bar else None
        update_task = bar.add_task("updates", total=config.max_updates) if bar else None
        for i in mine:

            def on_update(stage: str, n: int, total: int, i: int = i) -> None:
                bar.update(update_task, description=f"layer {i} {stage}", completed=n, total=total)

            train, val = get_layer_qkv(i)
            result = calibrate_layer(
                make_kernel(i),
                train,
                val,
                config=config,
                layer=i,
                target=None if target is None else target(i),
                progress=on_update if bar else None,
                block_bytes=block_bytes,
            )
            _write_layer(out, i, result)
            if processes.is_main:  # a killed run still leaves the layers finished so far combined
                _write_all_combined(out, header)
            log.info("layer %d: mean val MSE %.3e in %.1f s", i, float(result.val_mse.mean()), result.seconds)
            if bar:
                bar.advance(layer_task)
    processes.barrier()
    if processes.is_main:  # from the verified layer files: also repairs damaged combined files of a finished run
        _write_all_combined(out, header)
    processes.barrier()
    return json.loads((out / "summary.json").read_text())


def _write_all_combined(out: Path, header: dict[str, Any]) -> None:
    finished = _finished(out)
    _write_combined(out, header, finished, "", out)
    if any(_shard(out, i, ".global.safetensors").is_file() for i in finished):
        _write_combined(out, header, finished, ".global", out / "global")


def _write_layer(out: Path, layer: int, result: LayerResult) -> None:
    save_tensors(_shard(out, layer, ".safetensors"), result.state)
    if result.global_stage is not None:
        save_tensors(_shard(out, layer, ".global.safetensors"), result.global_stage.state)
    _atomic_json(_shard(out, layer, ".json"), result.summary())


def _params_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    f = p / "params.safetensors" if p.is_dir() else p
    if not f.is_file():
        raise ValueError(f"path: expected a calibration directory or its params.safetensors, got {path}")
    return f


def calibrated_layers(path: str | os.PathLike) -> set[int]:
    """The layers a calibration directory (or its params.safetensors) holds parameters for."""
    keys = load_tensors(_params_file(path), what="calibration")[0]
    return {int(k.split(".")[1]) for k in keys if k.startswith("layers.")}


def load_calibrated_state(path: str | os.PathLike, layer: int) -> dict[str, torch.Tensor]:
    """The calibrated ``state_dict`` of one layer from a calibration directory (or its params.safetensors;
    use ``<dir>/global`` for the learned global quadratic calibrated alongside OAL)."""
    state = _read_tensors(_params_file(path), f"layers.{layer}.")
    if not state:
        raise ValueError(f"layer: no calibrated parameters for layer {layer} in {path}")
    return state


def load_calibrated(path: str | os.PathLike, layer: int, kernel: AttentionKernel | None = None) -> AttentionKernel:
    """Load one layer's calibrated parameters into ``kernel`` (strictly) or, when ``kernel`` is None, into a
    kernel rebuilt from the stored registry config (``oal.kernels.registry.kernel_from_config``)."""
    state = load_calibrated_state(path, layer)
    if kernel is None:
        summary = json.loads((_params_file(path).parent / "summary.json").read_text())
        config = summary["layers"][str(layer)]["meta"].get("kernel_config")
        if config is None:
            raise ValueError(f"kernel: layer {layer} holds a kernel the registry cannot rebuild; pass an instance")
        kernel = kernel_from_config(config)
    kernel.load_state_dict(state, strict=True)
    return kernel
