"""Conversion of a pretrained causal LM (§5.2, App. F): the attention of a range of layers is replaced by a kernel
of :mod:`oal.kernels.registry`, keeping the native q/k/v/o projections, RoPE and the GQA mapping.

A converted model is an ordinary transformers model with kernels attached (:func:`oal.models.attach_kernel`,
``model.model.layers[i].self_attn.oal_kernel``) and a record of the conversion in ``config.oal_conversion``::

    {"format": "oal-conversion/1", "kernel": "oal", "layers": [3, …, 26], "seed": 0,
     "kernel_configs": {"3": kernel_config(kernel_3), …}, "groups": {...} | None, "calibrated": {...} | None,
     "base_model": "smollm2-135m", "oal_version": "0.1.0"}

:func:`save_converted` writes it with ``save_pretrained`` (safetensors; the kernels' parameters and buffers are part
of the state dict), :func:`load_converted` rebuilds the base model, re-attaches kernels from the recorded configs and
loads every tensor, checking the saved kernel tensors against the configs.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import __version__
from ..grouping import GroupAssignment
from ..io import load_tensors, read_json
from ..kernels import KERNELS, AttentionKernel, build_kernel, kernel_config
from ..kernels.registry import SINK_WINDOW_KERNELS
from ..models import AttentionSpec, attach_kernel, attached_kernels, attention_spec
from ..models.converted import (
    CONFIG_KEY,
    FORMAT,
    KERNEL_TENSOR,
    KERNELS_FILE,
    conversion_info,
    is_converted_dir,
    load_converted,
    load_kernel_state,
)
from ..models.hf import as_oal_model, base_model_type, set_auto_map, write_remote_code
from .card import write_model_card

__all__ = [
    "CONFIG_KEY",
    "FORMAT",
    "check_supported",
    "conversion_info",
    "convert_model",
    "default_layers",
    "is_converted_dir",
    "load_converted",
    "load_kernel_state",
    "parse_layers",
    "read_calibrated",
    "save_converted",
]

#: Softmax layers kept at each end by default (LoLCATs-style hybrid; App. F uses 3 for Qwen2.5-0.5B).
KEEP_SOFTMAX = 3
#: App. F replacement ranges (zero-based, inclusive), matched against the model's name or path.
PAPER_LAYERS = {"qwen2.5-0.5b": (3, 20), "llama-3.2-1b": (1, 14)}
_CALIBRATED_TENSOR = re.compile(r"layers\.(\d+)\.(.+)")


# ---------------------------------------------------------------------------------------------------- inputs


def check_supported(model: object) -> AttentionSpec:
    """The attention geometry of a supported model: a causal LM whose decoder layers are
    ``model.model.layers[i].self_attn`` with q/k/v/o projections and rotary position embeddings."""
    config = getattr(model, "config", None)
    what = f"model type {getattr(config, 'model_type', None)!r} ({type(model).__name__})"
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    try:
        spec = attention_spec(model)
    except ValueError as e:
        raise ValueError(
            f"model: conversion supports Llama/Qwen2/Mistral-style causal LMs (model.model.layers[i].self_attn with "
            f"q/k/v/o projections and rotary embeddings); got {what}: {e}"
        ) from None
    if getattr(getattr(model, "model", None), "rotary_emb", None) is None:
        raise ValueError(f"model: conversion needs rotary position embeddings (model.model.rotary_emb); got {what}")
    return spec


def default_layers(model: PreTrainedModel) -> list[int]:
    """The App. F replacement range for Qwen2.5-0.5B (3–20) and Llama-3.2-1B (1–14), otherwise all layers but
    the first and last :data:`KEEP_SOFTMAX` (SmolLM2-135M: 3–26)."""
    n = check_supported(model).num_layers
    name = Path(str(getattr(model.config, "_name_or_path", "") or "")).name.lower()
    for key, (first, last) in PAPER_LAYERS.items():
        if key in name and last < n:
            return list(range(first, last + 1))
    if n <= 2 * KEEP_SOFTMAX:
        raise ValueError(
            f"layers: the default keeps the first and last {KEEP_SOFTMAX} layers in softmax, which leaves nothing "
            f"to convert in a model of {n} layers; pass layers explicitly"
        )
    return list(range(KEEP_SOFTMAX, n - KEEP_SOFTMAX))


def parse_layers(layers: str | int | Iterable[int], num_layers: int) -> list[int]:
    """Layer indices from ``"3-26"`` (inclusive), ``"3,5,8-10"``, an int or a sequence of ints; sorted, each
    in ``[0, num_layers)``, no duplicates."""
    if isinstance(layers, str):
        out: list[int] = []
        for part in (p.strip() for p in layers.split(",")):
            m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
            if m is None:
                raise ValueError(f"layers: expected ranges like '3-26' or '3,5,8-10', got {layers!r}")
            first, last = int(m[1]), int(m[2] if m[2] is not None else m[1])
            if last < first:
                raise ValueError(f"layers: range {part!r} ends before it starts")
            out.extend(range(first, last + 1))
    elif isinstance(layers, int) and not isinstance(layers, bool):
        out = [layers]
    elif isinstance(layers, Iterable):
        out = list(layers)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in out):
            raise ValueError(f"layers: expected integer layer indices, got {out!r}")
    else:
        raise ValueError(f"layers: expected a range string, an int or a list of ints, got {layers!r}")
    if not out:
        raise ValueError("layers: expected at least one layer")
    bad = sorted({i for i in out if not 0 <= i < num_layers})
    if bad:
        raise ValueError(
            f"layers: expected indices in [0, {num_layers}) (the model has {num_layers} layers), got {bad}"
        )
    if len(set(out)) != len(out):
        raise ValueError(f"layers: expected distinct layers, got {sorted(out)}")
    return sorted(out)


def _load_groups(
    groups: GroupAssignment | Mapping[int, torch.Tensor] | str | os.PathLike, spec: AttentionSpec, layers: list[int]
) -> tuple[dict[int, torch.Tensor], dict[str, Any]]:
    """Group ids ``(Hq, d)`` per converted layer, and a summary for the conversion record."""
    if isinstance(groups, Mapping):
        missing = [i for i in layers if i not in groups]
        if missing:
            raise ValueError(f"groups: no group ids for the converted layers {missing}")
        for i in layers:
            ids = groups[i]
            if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (spec.num_heads, spec.head_dim):
                got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
                raise ValueError(
                    f"groups: layer {i}: expected ({spec.num_heads}, {spec.head_dim}) group ids, got {got}"
                )
        return {i: groups[i] for i in layers}, {"source": None, "model_id": None, "params": {}}
    source = None
    if isinstance(groups, (str, os.PathLike)):
        source = Path(groups)
        if not source.is_file():
            raise FileNotFoundError(f"groups: no such file: {source}")
        try:
            groups = GroupAssignment.load(source, head_dim=spec.head_dim, num_heads=spec.num_heads)
        except ValueError as e:
            raise ValueError(f"groups: {e}") from None
    elif not isinstance(groups, GroupAssignment):
        raise ValueError(
            "groups: expected a GroupAssignment, its JSON file or a mapping layer -> (Hq, d) group ids, got "
            f"{type(groups).__name__}"
        )
    elif (groups.num_heads, groups.head_dim) != (spec.num_heads, spec.head_dim):
        raise ValueError(
            f"groups: made for {groups.num_heads} heads of size {groups.head_dim} ({groups.model_id!r}), but the model "
            f"has {spec.num_heads} heads of size {spec.head_dim}"
        )
    missing = [i for i in layers if i not in groups.layers]
    if missing:
        raise ValueError(
            f"groups: no groups for the converted layers {missing} ({groups.model_id!r} has groups for layers "
            f"{sorted(groups.layers)})"
        )
    summary = {
        "source": None if source is None else str(source),
        "model_id": groups.model_id,
        "params": groups.params,
        "num_groups": {str(i): groups.num_groups(i) for i in layers},
    }
    return {i: groups.group_ids(i) for i in layers}, summary


def read_calibrated(path: str | os.PathLike) -> tuple[dict[int, dict[str, torch.Tensor]], dict | None, Path]:
    """Calibrated kernel tensors ``{layer: {name: tensor}}`` from a safetensors file with keys
    ``layers.{i}.{name}`` (or a calibration directory holding ``params.safetensors``), the ``summary.json`` beside
    it (None if absent) and the file read."""
    p = Path(path)
    file = p / "params.safetensors" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"calibrated: no such file: {file}")
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in load_tensors(file, what="calibrated")[0].items():  # checksums verified
        m = _CALIBRATED_TENSOR.fullmatch(key)
        if m is None:
            raise ValueError(f"calibrated: {file} holds the key {key!r}; expected keys 'layers.<i>.<name>'")
        by_layer.setdefault(int(m[1]), {})[m[2]] = tensor
    if not by_layer:
        raise ValueError(f"calibrated: {file} holds no tensors")
    summary_file = file.with_name("summary.json")
    summary = read_json(summary_file, what="calibrated") if summary_file.is_file() else None
    return by_layer, summary, file


# ------------------------------------------------------------------------------------------------- conversion


def convert_model(
    model: PreTrainedModel,
    kernel: str,
    *,
    layers: str | int | Iterable[int] | None = None,
    calibrated: str | os.PathLike | None = None,
    groups: GroupAssignment | Mapping[int, torch.Tensor] | str | os.PathLike | None = None,
    seed: int = 0,
    **kernel_kw: Any,
) -> PreTrainedModel:
    """Replace the attention of ``layers`` (default :func:`default_layers`) by ``kernel`` (a name in
    :data:`oal.kernels.KERNELS`, or a sink/window name such as ``"oal+sink+window"``), in place; returns the model.

    Args:
        model: a supported causal LM (:func:`check_supported`), not converted yet.
        kernel: the kernel name; each layer gets ``build_kernel(kernel, …, layer_idx=i, seed=seed, **kernel_kw)``.
        layers: ``"3-26"``, ``"3,5,8-10"`` or a list of layer indices.
        calibrated: calibrated kernel parameters (:func:`read_calibrated`), loaded into every converted layer's
            kernel; they must cover exactly the converted layers. Without them kernels start from their default
            initialisation (OAL: the second-order Taylor kernel).
        groups: OAL's dimension groups: a :class:`oal.grouping.GroupAssignment`, its JSON file, or a mapping
            layer -> ``(Hq, d)`` group ids; for ``"oal"`` they default to the ``groups`` tensors of ``calibrated``.
        seed: seed of the baselines' fixed random projections.

    Sink/window kernels are converted from their calibration only (``oal calibrate --kernel oal+sink+window
    --init-from …``): each layer's kernel, with its groups, sink count and window, is rebuilt from the
    recorded config, so ``groups`` and ``kernel_kw`` must not be given.

    Everything is validated and every kernel built before the model is touched.
    """
    spec = check_supported(model)
    if conversion_info(model) is not None or attached_kernels(model):
        raise ValueError("model: it already has kernels attached; convert a freshly loaded model")
    if kernel not in KERNELS + SINK_WINDOW_KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS + SINK_WINDOW_KERNELS}, got {kernel!r}")
    sink_window = kernel in SINK_WINDOW_KERNELS
    if sink_window and (calibrated is None or groups is not None or kernel_kw):
        raise ValueError(
            f"calibrated: the {kernel!r} kernel is converted from its calibration directory alone (without groups= "
            f"or kernel options), got calibrated={calibrated!r}, groups={groups!r}, options {sorted(kernel_kw)}"
        )
    if "groups" in kernel_kw:
        raise ValueError("kernel_kw: pass the dimension groups as groups= (a GroupAssignment or its JSON file)")
    layer_list = default_layers(model) if layers is None else parse_layers(layers, spec.num_layers)
    if groups is not None and kernel != "oal":
        raise ValueError(f"groups: only the 'oal' kernel takes dimension groups, not {kernel!r}")

    calib, calibrated_record = None, None
    if calibrated is not None:
        calib, summary, file = read_calibrated(calibrated)
        if summary is not None and summary.get("kernel") not in (None, kernel):
            raise ValueError(f"calibrated: {file} holds parameters of the {summary['kernel']!r} kernel, not {kernel!r}")
        missing, extra = [i for i in layer_list if i not in calib], sorted(set(calib) - set(layer_list))
        if missing or extra:
            raise ValueError(
                f"calibrated: {file} must cover exactly the converted layers {layer_list}; it has layers "
                f"{sorted(calib)} (missing {missing}, not converted {extra})"
            )
        calibrated_record = {"source": str(file), "summary": summary is not None}

    group_ids, groups_record = None, None
    if groups is not None:
        group_ids, groups_record = _load_groups(groups, spec, layer_list)
    elif kernel == "oal" and not sink_window:
        if calib is None or any("groups" not in calib[i] for i in layer_list):
            raise ValueError(
                "groups: the 'oal' kernel needs dimension groups: pass groups= (a GroupAssignment or its JSON file) "
                "or calibrated parameters that include them"
            )
        group_ids = {i: calib[i]["groups"] for i in layer_list}
        groups_record = {"source": calibrated_record["source"], "model_id": None, "params": {}}

    kernels: dict[int, AttentionKernel] = {}
    for i in layer_list:
        if sink_window:
            from ..calibration import load_calibrated

            built = load_calibrated(calibrated, i)
            if built.name != kernel:
                raise ValueError(f"calibrated: layer {i} holds a {built.name!r} kernel, not {kernel!r}")
            kernels[i] = built
            continue
        kw = dict(kernel_kw)
        if group_ids is not None:
            kw["groups"] = group_ids[i]
            if calib is not None and "L" in calib[i] and "num_groups" not in kw:
                kw["num_groups"] = calib[i]["L"].shape[-1] - 1
        built = build_kernel(
            kernel,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            layer_idx=i,
            seed=seed,
            **kw,
        )
        if calib is not None:
            load_kernel_state(built, calib[i], where=f"calibrated: layer {i}")
        kernels[i] = built
    for i, built in kernels.items():
        attach_kernel(model, i, built)
    setattr(
        model.config,
        CONFIG_KEY,
        {
            "format": FORMAT,
            "kernel": kernel,
            "layers": layer_list,
            "seed": seed,
            "kernel_configs": {str(i): kernel_config(k) for i, k in kernels.items()},
            "groups": groups_record,
            "calibrated": calibrated_record,
            "base_model": str(getattr(model.config, "_name_or_path", "") or ""),
            "oal_version": __version__,
        },
    )
    # the model becomes its converted class (model_type oal_<base>), so any save of it keeps the kernels
    as_oal_model(model.get_base_model() if hasattr(model, "get_base_model") else model)
    return model


def record_conversion(model: PreTrainedModel) -> dict:
    """Give a model whose kernels were attached directly (``attach_kernel``, e.g. a fine-tuning run's merged
    backbone) the conversion record :func:`convert_model` writes, and make it its converted class, so that it
    saves as a converted model. A model that already has a record keeps it. Returns the record."""
    info = conversion_info(model)
    if info is not None:
        return info
    kernels = attached_kernels(model)
    if not kernels:
        raise ValueError("model: no kernels are attached; nothing to record as a conversion")
    names = sorted({kernel_config(k)["name"] for k in kernels.values()})
    info = {
        "format": FORMAT,
        "kernel": names[0] if len(names) == 1 else "mixed",
        "layers": sorted(kernels),
        "seed": None,
        "kernel_configs": {str(i): kernel_config(k) for i, k in sorted(kernels.items())},
        "groups": None,
        "calibrated": None,
        "base_model": str(getattr(model.config, "_name_or_path", "") or ""),
        "oal_version": __version__,
    }
    setattr(model.config, CONFIG_KEY, info)
    as_oal_model(model)
    return info


# ----------------------------------------------------------------------------------------------- save / load


def save_converted(
    model: PreTrainedModel,
    out_dir: str | os.PathLike,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    overwrite: bool = False,
    base_weights: str | None = None,
    measurements: Sequence[Mapping[str, str]] = (),
) -> Path:
    """Write a converted model (``save_pretrained``: config with the conversion record, safetensors weights
    including the kernels, generation config), the tokenizer if given, and a model card (README.md, with the
    measured ``measurements`` rows of :func:`oal.conversion.card.model_card`) to ``out_dir``. The config's model
    type is the converted one (``oal_<base>``, :mod:`oal.models.hf`) and ``modeling_oal.py`` is written beside it
    for ``trust_remote_code`` loading.

    ``base_weights`` (e.g. ``"smollm2-135m"``, a Hub id or a directory, as :func:`oal.models.load_model` takes
    it): write only the kernels' tensors (``kernels.safetensors``, a few MB) and the config, recording that the
    unchanged base weights come from ``base_weights``; :func:`load_converted` then loads them from there and
    checks that their architecture matches the saved config.

    The directory is written next to its target and renamed into place, so an interrupted save leaves nothing
    half-written. A non-empty ``out_dir`` is replaced only with ``overwrite=True``."""
    info = conversion_info(model)
    if info is None:
        raise ValueError("model: not a converted model (no config.oal_conversion); call convert_model first")
    kernels = attached_kernels(model)
    if sorted(kernels) != info["layers"]:
        raise ValueError(
            f"model: the conversion record lists layers {info['layers']}, but kernels are attached to {sorted(kernels)}"
        )
    # Refresh the configs: a kernel may have been replaced (e.g. after fine-tuning) since convert_model.
    info = {**info, "kernel_configs": {str(i): kernel_config(k) for i, k in sorted(kernels.items())}}
    info.pop("base_weights", None)
    if base_weights is not None:
        if not isinstance(base_weights, str) or not base_weights:
            raise ValueError(f"base_weights: expected a model name, Hub id or directory, got {base_weights!r}")
        info["base_weights"] = base_weights
    setattr(model.config, CONFIG_KEY, info)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: expected a directory, got the file {out}")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"out_dir: {out} is not empty; choose another directory or pass overwrite=True")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result should look like any new directory
    try:
        if base_weights is None:
            model.save_pretrained(tmp)
        else:
            set_auto_map(model.config)
            model.config.save_pretrained(tmp)
            write_remote_code(tmp, base_model_type(model.config))
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            state = {
                key: t.detach().cpu().contiguous()
                for key, t in model.state_dict().items()
                if KERNEL_TENSOR.fullmatch(key) is not None
            }
            save_file(state, str(tmp / KERNELS_FILE), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_model_card(tmp, measurements=measurements)
        if out.exists():
            stale = out.with_name(f".{out.name}.stale-{os.getpid()}")
            os.replace(out, stale)
            os.replace(tmp, out)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
