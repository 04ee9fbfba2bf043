"""Loading of converted models (the reading half of :mod:`oal.conversion`): a directory written by
:func:`oal.conversion.save_converted` holds the base model's config with the conversion record
(``config.oal_conversion``) and either the full weights with the kernels' tensors, or, with ``base_weights``, only
the kernels' tensors (``kernels.safetensors``) and the name of the unchanged base weights.

It lives in :mod:`oal.models` so that :func:`oal.models.load_model` can load converted directories without
importing :mod:`oal.conversion` (which builds on this package).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import logging as hf_logging

from ..io import read_json
from ..kernels import AttentionKernel, kernel_from_config
from .hooks import attach_kernel

__all__ = [
    "CONFIG_KEY",
    "FORMAT",
    "KERNELS_FILE",
    "KERNEL_TENSOR",
    "conversion_info",
    "is_converted_dir",
    "load_converted",
    "load_kernel_state",
]

FORMAT = "oal-conversion/1"
#: model types of converted models are ``oal_<base model type>`` (:mod:`oal.models.hf`)
MODEL_TYPE_PREFIX = "oal_"
CONFIG_KEY = "oal_conversion"
#: the kernels' tensors of a directory saved with ``base_weights`` (the base weights are not copied)
KERNELS_FILE = "kernels.safetensors"
#: state-dict keys of attached kernels: ``…layers.<i>.self_attn.oal_kernel.<name>``
KERNEL_TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.self_attn\.oal_kernel\.(.+)")


def conversion_info(model: PreTrainedModel) -> dict | None:
    """The conversion record of a converted model (``config.oal_conversion``), or None."""
    return getattr(model.config, CONFIG_KEY, None)


def load_kernel_state(kernel: AttentionKernel, state: Mapping[str, torch.Tensor], *, where: str) -> None:
    """Load ``state`` into ``kernel`` strictly: the same tensor names and shapes as the kernel's state dict, and
    integer buffers (group maps, permutations) equal to the kernel's own, which its configuration fixes. Floating
    tensors are copied into the kernel's (keeping its dtype)."""
    own = kernel.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"{where}: expected the tensors {sorted(own)} of the {kernel.name!r} kernel, got {sorted(state)} "
            f"(missing {missing}, unexpected {unexpected})"
        )
    for name, mine in own.items():
        got = state[name]
        if tuple(got.shape) != tuple(mine.shape):
            raise ValueError(f"{where}: {name!r} has shape {tuple(got.shape)}, expected {tuple(mine.shape)}")
        if not mine.is_floating_point() and not torch.equal(got.to(mine.device, mine.dtype), mine):
            raise ValueError(
                f"{where}: {name!r} differs from the kernel's own {name!r} (its configuration, e.g. the dimension "
                "groups, does not match these tensors)"
            )
    kernel.load_state_dict(dict(state), strict=True)


def is_converted_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding a converted model (its config.json has a conversion record)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return CONFIG_KEY in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def _weight_files(path: Path) -> list[Path]:
    if (path / KERNELS_FILE).is_file():
        return [path / KERNELS_FILE]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(read_json(index, what="weights index")["weight_map"].values()))]
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"path: {path} holds no model.safetensors (nor a sharded index)")
    return [single]


def _saved_kernel_tensors(path: Path) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118
                m = KERNEL_TENSOR.fullmatch(key)
                if m is not None:
                    out.setdefault(int(m[1]), {})[m[2]] = fh.get_tensor(key)
    return out


def _check_record(info: object, where: str) -> dict:
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        got = info.get("format") if isinstance(info, dict) else type(info).__name__
        raise ValueError(f"{where}: expected a conversion record of format {FORMAT!r}, got {got!r}")
    layers, configs = info.get("layers"), info.get("kernel_configs")
    if not isinstance(layers, list) or not isinstance(configs, dict) or sorted(configs) != sorted(map(str, layers)):
        raise ValueError(f"{where}: the conversion record's layers and kernel_configs do not match")
    return info


def _load_full(path: Path, saved: dict, *, dtype: torch.dtype, attn_implementation: str | None) -> PreTrainedModel:
    """The base model from the weights saved beside the kernels (``save_pretrained``), with the base class even
    for a converted model type (``oal_<base>``), so that the kernels are checked and loaded here."""
    kwargs: dict[str, Any] = {"dtype": dtype, "output_loading_info": True}
    model_type = str(saved.get("model_type", ""))
    if model_type.startswith(MODEL_TYPE_PREFIX):
        base = model_type.removeprefix(MODEL_TYPE_PREFIX)
        if base not in CONFIG_MAPPING:
            raise ValueError(f"{path}: unknown base model type {base!r} of the converted model type {model_type!r}")
        fields = {k: v for k, v in saved.items() if k not in ("model_type", "auto_map", "architectures")}
        kwargs["config"] = CONFIG_MAPPING[base].from_dict(fields)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    # The kernel tensors are unknown to the base architecture: transformers would report them as unexpected
    # keys; they are checked and loaded by load_converted instead.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        cls = AutoModelForCausalLM
        if "config" in kwargs:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(kwargs["config"])]
        model, loading = cls.from_pretrained(path, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    unexpected = {k for k in loading["unexpected_keys"] if KERNEL_TENSOR.fullmatch(k) is None}
    if loading["missing_keys"] or loading["mismatched_keys"] or unexpected:
        raise ValueError(
            f"{path}: the saved weights do not match the base architecture (missing {sorted(loading['missing_keys'])},"
            f" unexpected {sorted(unexpected)}, mismatched {sorted(map(str, loading['mismatched_keys']))})"
        )
    return model


#: config fields that must agree between a kernels-only directory and the base weights it names
_ARCH_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rope_theta",
    "tie_word_embeddings",
)


def _load_base(
    path: Path, base: str, saved: dict, *, dtype: torch.dtype, attn_implementation: str | None
) -> PreTrainedModel:
    """The unchanged base model a kernels-only directory names, checked against its saved config ``saved``."""
    from .loading import load_model  # loading imports this module

    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = load_model(base, dtype=dtype, **kwargs)
    ours = model.config.to_dict()
    # a converted config names its model type oal_<base> (oal.models.hf); the base weights have <base>
    saved = {**saved, "model_type": str(saved.get("model_type", "")).removeprefix(MODEL_TYPE_PREFIX)}
    differ = [f for f in _ARCH_FIELDS if f in saved and saved.get(f) != ours.get(f)]
    if differ:
        raise ValueError(
            f"{path}: the base weights {base!r} do not match the saved config in {differ} "
            f"(saved {[saved.get(f) for f in differ]}, base {[ours.get(f) for f in differ]})"
        )
    return model


def load_converted(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Load a model written by :func:`save_converted`: the base model in ``dtype`` (from the directory, or from
    the recorded ``base_weights`` of a kernels-only directory), the kernels (fp32 or their own dtype) rebuilt from
    the recorded configs and loaded from the saved tensors; in eval mode on ``device``.

    Raises ValueError when the saved kernel tensors do not match the recorded configs (names, shapes, groups)
    or the base weights do not match the architecture."""
    path = Path(path)
    where = str(path)
    saved = read_json(path / "config.json", what="model config")
    info = _check_record(saved.get(CONFIG_KEY), where)
    if info.get("base_weights") is not None:
        model = _load_base(path, info["base_weights"], saved, dtype=dtype, attn_implementation=attn_implementation)
        setattr(model.config, CONFIG_KEY, info)
    else:
        model = _load_full(path, saved, dtype=dtype, attn_implementation=attn_implementation)
    tensors = _saved_kernel_tensors(path)

    if sorted(tensors) != sorted(info["layers"]):
        raise ValueError(
            f"{where}: the saved weights hold kernels for layers {sorted(tensors)}, but config.json records the "
            f"conversion of layers {info['layers']}"
        )
    kernels = {}
    for i in info["layers"]:
        try:
            kernel = kernel_from_config(info["kernel_configs"][str(i)])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: layer {i}: the recorded kernel config is invalid ({e})") from None
        load_kernel_state(kernel, tensors[i], where=f"{where}: layer {i}")
        kernels[i] = kernel
    for i, kernel in kernels.items():
        try:
            attach_kernel(model, i, kernel)
        except ValueError as e:
            raise ValueError(f"{where}: layer {i}: the recorded kernel does not fit the model ({e})") from None
    from .hf import as_oal_model  # hf builds on this module

    return as_oal_model(model).to(device).eval()
