"""The fine-tuned result as a self-describing directory (``<run>/best/``), and loading it back into a model.

``best/`` holds

* ``adapter/``: the PEFT LoRA adapter (``save_pretrained`` format);
* ``kernels.safetensors``: the state dict of every attached kernel (trained parameters and fixed buffers such as
  OAL's groups), keys ``layers.{i}.{name}``;
* ``kernels.json``: ``{"layers": {i: kernel_config}}`` (:func:`oal.kernels.registry.kernel_config`), enough to
  rebuild the kernels on the plain backbone;
* ``info.json``: update, validation NLL/PPL, protocol and data of the run, and ``base_model`` (the name or
  directory the backbone was loaded from, used by :func:`load_finetuned_model`);
* ``manifest.json``: sha256 of every file, verified by :func:`load_finetuned`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch import nn

from ..io import read_json
from ..kernels.base import AttentionKernel
from ..kernels.registry import kernel_config, kernel_from_config
from ..models import attach_kernel, attached_kernels, load_model, load_tokenizer
from .checkpoint import (
    BEST_KIND,
    CheckpointError,
    resolve_finetuned_dir,
    verify_checked_dir,
    write_checked_dir,
)
from .lora import full_tensor, trainable_state


def _canonical(config: dict[str, Any]) -> Any:
    return json.loads(json.dumps(config))


def kernel_configs(kernels: dict[int, AttentionKernel]) -> dict[str, Any]:
    """``{str(layer): kernel_config}``, JSON-canonical."""
    return {str(layer): _canonical(kernel_config(k)) for layer, k in sorted(kernels.items())}


def export_state(
    model: PeftModel, kernels: dict[int, AttentionKernel], trainable: dict[str, torch.Tensor] | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors :func:`export_finetuned` writes, as whole CPU tensors: ``{"adapter": {parameter name: tensor},
    "kernels": {"layers.{i}.{name}": tensor}}``. ``trainable``: the model's current :func:`trainable_state` if the
    caller already has it (its LoRA tensors are reused). Under FSDP this gathers the shards: call it on every
    process."""
    trainable = trainable_state(model) if trainable is None else trainable
    tensors = {
        f"layers.{layer}.{name}": full_tensor(t.detach()).to("cpu", copy=True).contiguous()
        for layer, kernel in sorted(kernels.items())
        for name, t in kernel.state_dict().items()
    }
    return {"adapter": {name: t for name, t in trainable.items() if "lora_" in name}, "kernels": tensors}


def export_finetuned(
    model: PeftModel,
    kernels: dict[int, AttentionKernel],
    target: str | os.PathLike,
    info: dict[str, Any],
    state: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write the model's current adapter and kernels to ``target`` (atomically, with a manifest). ``state``: their
    tensors from :func:`export_state` (gathered on every process beforehand under FSDP; default: gathered here)."""
    if not isinstance(model, PeftModel):
        raise ValueError(f"model: expected a PeftModel, got {type(model).__name__}")
    state = export_state(model, kernels) if state is None else state

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp / "adapter", state_dict=state["adapter"])
        if state["kernels"]:
            save_file(state["kernels"], tmp / "kernels.safetensors")
        (tmp / "kernels.json").write_text(json.dumps({"layers": kernel_configs(kernels)}) + "\n", encoding="utf-8")
        (tmp / "info.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")

    return write_checked_dir(target, write, kind=BEST_KIND)


def load_finetuned(model: nn.Module, path: str | os.PathLike, *, merge: bool = False) -> nn.Module:
    """Load a fine-tuned result (a run directory or its ``best/``) into ``model`` and return the adapted model.

    ``model`` is the plain backbone, or the same backbone already converted (its attached kernels must then have
    the saved configurations). Missing kernels are rebuilt from ``kernels.json`` and attached; all kernel states
    are loaded; the LoRA adapter is applied. ``merge=True`` folds the adapters into the projections and returns
    the transformers model (kernels stay attached); otherwise a ``PeftModel`` is returned. The checkpoint's
    manifest is verified first (:class:`~oal.training.checkpoint.CheckpointError` if anything is off).
    """
    if isinstance(model, PeftModel):
        raise ValueError("model: expected the backbone without LoRA, got a PeftModel")
    path = resolve_finetuned_dir(path)
    verify_checked_dir(path, kind=BEST_KIND)
    return _apply_verified(model, path, merge=merge)


def _apply_verified(model: nn.Module, path: Path, *, merge: bool) -> nn.Module:
    """:func:`load_finetuned` after ``path`` (a ``best/`` directory) passed its manifest check."""
    saved = read_json(path / "kernels.json", what="kernel configs")["layers"]
    attached = attached_kernels(model)
    unexpected = sorted(set(attached) - {int(layer) for layer in saved})
    if unexpected:
        raise ValueError(f"model: kernels are attached to layers {unexpected}, which {path} does not convert")
    for key, config in saved.items():
        layer = int(key)
        if layer in attached:
            if _canonical(kernel_config(attached[layer])) != config:
                raise ValueError(f"model: the kernel attached to layer {layer} differs from the one in {path}")
        else:
            attach_kernel(model, layer, kernel_from_config(config))
    if saved:
        tensors = load_file(path / "kernels.safetensors")
        for layer, kernel in attached_kernels(model).items():
            prefix = f"layers.{layer}."
            kernel.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
    peft_model = PeftModel.from_pretrained(model, path / "adapter")
    return peft_model.merge_and_unload() if merge else peft_model


def load_finetuned_model(
    path: str | os.PathLike,
    *,
    base_model: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """Load a fine-tuned result as a plain model: its backbone, kernels and merged LoRA adapter, plus the tokenizer.

    ``base_model`` (default: the ``base_model`` recorded in ``info.json``) is loaded with
    :func:`oal.models.load_model`; the adapter is merged in fp32 before the cast to ``dtype``. Returns
    ``(model, tokenizer)`` with the model in eval mode on ``device``.
    """
    path = resolve_finetuned_dir(path)
    verify_checked_dir(path, kind=BEST_KIND)
    if base_model is None:
        base_model = read_json(path / "info.json", what="fine-tuning info").get("base_model") or None
        if base_model is None:
            raise CheckpointError(
                f"{path}: info.json does not record the base model (written by an older oal); pass it explicitly "
                "(--base-model, e.g. smollm2-135m)"
            )
    model = _apply_verified(load_model(base_model), path, merge=True)  # verified above: hash the files once
    return model.to(device=device, dtype=dtype).eval(), load_tokenizer(base_model)


def save_finetuned_model(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    base_model: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a fine-tuned result (a run or its ``best/``) as a shareable converted model directory: the backbone
    with the adapter merged and the trained kernels attached, saved by :func:`oal.conversion.save_converted`
    (converted model type, full safetensors weights, conversion record, tokenizer, model card), so that
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` after ``import oal`` loads it. Returns ``out_dir``."""
    from ..conversion import record_conversion, save_converted

    model, tokenizer = load_finetuned_model(path, base_model=base_model)
    record_conversion(model)
    return save_converted(model, out_dir, tokenizer=tokenizer, overwrite=overwrite)
