"""Model loading for evaluation, through :func:`oal.models.load_model` (embedded SmolLM2, local or converted
model directories, hub ids) or :func:`oal.training.load_finetuned_model` (an ``oal finetune`` run or its
``best/``)."""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..models import load_model, load_tokenizer
from ..training.checkpoint import is_finetuned_dir
from .utils import default_device, parse_dtype


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    base_model: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM in eval mode on ``device`` (default: CUDA if available) and its tokenizer.

    ``name_or_path``: a model directory (e.g. a converted OAL model), a Hub id, ``"smollm2-135m"``, or a fine-tuning
    run (``oal finetune --out``) or its ``best/``: that loads onto ``base_model`` (default: the one the run recorded)
    with the LoRA adapter merged.
    """
    name = os.fspath(name_or_path)
    if not name:
        raise ValueError("name_or_path: expected a model name or directory, got ''")
    dtype = parse_dtype(dtype)
    device = torch.device(device) if device is not None else default_device()
    if is_finetuned_dir(name):
        from ..training.export import load_finetuned_model  # needs peft (the `train` extra)

        return load_finetuned_model(name, base_model=base_model, dtype=dtype, device=device)
    if base_model is not None:
        raise ValueError(f"base_model: only used with a fine-tuning run directory, and {name!r} is not one")
    return load_model(name, dtype=dtype, device=device), load_tokenizer(name)
