"""Model loading for evaluation, through :func:`oal.models.load_model` (embedded SmolLM2, local or converted
model directories, hub ids)."""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..models import load_model, load_tokenizer
from .utils import default_device, parse_dtype


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM in eval mode on ``device`` (default: CUDA if available) and its tokenizer.

    ``name_or_path``: a model directory (e.g. a converted OAL model), a Hub id, or ``"smollm2-135m"``.
    """
    name = os.fspath(name_or_path)
    if not name:
        raise ValueError("name_or_path: expected a model name or directory, got ''")
    dtype = parse_dtype(dtype)
    device = torch.device(device) if device is not None else default_device()
    return load_model(name, dtype=dtype, device=device), load_tokenizer(name)
