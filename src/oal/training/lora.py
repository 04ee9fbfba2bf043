"""LoRA on a converted model (App. F.2): adapters on q/k/v/o of every layer, softmax layers included, and the
parameters of attached kernels (OAL's ``L``, DiJiang's ``θ``, …) trained jointly; everything else frozen.

PEFT freezes every non-adapter parameter when it wraps a model; :func:`apply_lora` switches the kernel parameters
back on. Kernel buffers (OAL groups, fixed random projections) are not parameters and stay fixed. The wrapped
projections are called by the attention modules as before, so layers with a kernel still run the ``"oal"``
attention path. Note that ``oal.models`` helpers that look for ``nn.Linear`` projections (``attach_kernel``,
``capture_qkv``) do not accept the wrapped model: attach kernels before, or merge the adapters first.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..models import attached_kernels, get_attention_modules, get_decoder_layers
from ..models.hooks import KERNEL_ATTR
from .config import FinetuneConfig


def lora_config(config: FinetuneConfig) -> LoraConfig:
    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=list(config.lora_targets),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, config: FinetuneConfig) -> PeftModel:
    """Wrap a (converted) causal LM with LoRA adapters in place and return the ``PeftModel``.

    The adapters' ``A`` matrices are initialised from torch's global RNG (seed it first for a reproducible run),
    ``B`` is zero, so the wrapped model computes exactly what ``model`` computed. Raises ValueError if the model
    is already a PeftModel or if some layer lacks one of ``config.lora_targets`` (checked before wrapping).
    """
    if isinstance(model, PeftModel):
        raise ValueError("model: expected a plain transformers model, got a PeftModel (LoRA already applied)")
    kernels = attached_kernels(model)
    get_attention_modules(model)  # every block must hold the attention this wraps
    blocks = get_decoder_layers(model)
    targets = {}  # (layer, target) -> the module that must end up wrapped
    for layer, block in enumerate(blocks):
        for target in config.lora_targets:
            found = [m for name, m in block.named_modules() if name.rsplit(".", 1)[-1] == target]
            if len(found) != 1:
                raise ValueError(
                    f"lora_targets: expected one module named {target!r} in layer {layer}, found {len(found)}"
                )
            targets[layer, target] = found[0]
    peft_model = get_peft_model(model, lora_config(config))
    for (layer, target), module in targets.items():
        if not any(isinstance(m, LoraLayer) and m.get_base_layer() is module for m in blocks[layer].modules()):
            raise ValueError(f"lora_targets: {target!r} of layer {layer} was not wrapped by PEFT")
    for kernel in kernels.values():
        for p in kernel.parameters():
            p.requires_grad_(config.train_kernels)
    return peft_model


def is_kernel_parameter(name: str) -> bool:
    """Whether a parameter name belongs to an attached kernel (``….self_attn.oal_kernel.…``)."""
    return f".{KERNEL_ATTR}." in f".{name}"


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Name → parameter for every parameter with ``requires_grad``, in registration order."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or the whole tensor behind an FSDP2 shard (a DTensor). Gathering is a collective: under FSDP
    every process must make the same calls in the same order."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the whole trainable parameters (LoRA and kernel), keyed by parameter name (FSDP
    shards are gathered: call it on every process)."""
    return {name: full_tensor(p.detach()).to("cpu", copy=True) for name, p in trainable_parameters(model).items()}


def load_trainable_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` (whole tensors) into the trainable parameters; the names must be exactly the trainable set.
    Under FSDP every process loads the same ``state`` and keeps its shard."""
    params = trainable_parameters(model)
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"state: expected the {len(params)} trainable parameters of the model; missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            if tuple(state[name].shape) != tuple(p.shape):
                raise ValueError(f"state: {name} has shape {tuple(state[name].shape)}, expected {tuple(p.shape)}")
            value = state[name].to(device=p.device, dtype=p.dtype)
            if isinstance(p, DTensor):  # FSDP2: keep this process's shard of the whole tensor
                value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(value)
