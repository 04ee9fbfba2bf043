"""Converted models as their own transformers model type, registered with the Auto classes when ``oal`` is imported.

A converted Llama / Mistral / Qwen2 is an ``OALLlamaForCausalLM`` (``OALMistralForCausalLM``, ``OALQwen2ForCausalLM``):
a subclass of the base class whose config (``OALLlamaConfig``, ``model_type: "oal_llama"``) carries the conversion
record ``oal_conversion``, and which attaches the recorded kernels when it is built. So every way of saving it —
:func:`oal.conversion.save_converted`, ``save_pretrained``, ``push_to_hub``, after PEFT's ``merge_and_unload`` —
writes ``model_type: "oal_<base>"``, and ``AutoModelForCausalLM.from_pretrained(DIR)`` after ``import oal``
rebuilds the kernels and loads their tensors with the other weights (a kernels-only directory, written with
``base_weights``, loads through :func:`oal.models.load_converted`). A plain base model class never loads such a
directory by accident: transformers does not know the model type.

Without ``import oal``: the saved ``config.json`` names a small module written beside the weights
(``modeling_oal.py``, ``auto_map``), so ``from_pretrained(DIR, trust_remote_code=True)`` imports ``oal`` from there
and loads the converted model; if ``oal`` is not installed it raises an ImportError that says so and how to
install it. Without ``trust_remote_code`` transformers refuses the unknown model type and asks for it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..io import read_json
from ..kernels import kernel_from_config
from .converted import CONFIG_KEY, KERNELS_FILE, MODEL_TYPE_PREFIX, conversion_info
from .hooks import attach_kernel
from .prefill import chunked_forward

__all__ = [
    "BASE_MODEL_TYPES",
    "REMOTE_CODE_FILE",
    "as_oal_model",
    "base_model_type",
    "oal_classes",
    "register",
    "remote_code",
    "set_auto_map",
    "write_remote_code",
]

#: base model types whose converted form is registered (the families of :mod:`oal.models.architecture`)
BASE_MODEL_TYPES = ("llama", "mistral", "qwen2")
PREFIX = MODEL_TYPE_PREFIX
REMOTE_CODE_FILE = "modeling_oal.py"
_CLASSES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {}
# what a kernels-only directory's from_pretrained accepts: the loading options it honours, and what the Auto
# classes pass along on their own (the config they already read, the remote-code switches, and since
# transformers 5.25 the hub download options, which a local directory does not use; a subfolder only empty)
_KERNELS_ONLY_KWARGS = {
    "dtype",
    "device_map",
    "attn_implementation",
    "trust_remote_code",
    "config",
    "_from_auto",
    "_commit_hash",
    "code_revision",
    "revision",
    "adapter_kwargs",
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "token",
    "subfolder",
}


def _attach_recorded_kernels(model: PreTrainedModel) -> None:
    """Build the kernels the config records and attach them (their tensors are loaded afterwards with the
    weights). Built on the CPU whatever device context transformers initialises the model under: a kernel's
    configuration (group ids) is data, not a placeholder."""
    info = conversion_info(model)
    if not isinstance(info, dict) or not isinstance(info.get("kernel_configs"), dict):
        raise ValueError(
            f"config: a {type(model.config).__name__} needs the conversion record {CONFIG_KEY!r} with kernel_configs"
        )
    with torch.device("cpu"):
        kernels = {int(i): kernel_from_config(c) for i, c in info["kernel_configs"].items()}
    for i, kernel in sorted(kernels.items()):
        attach_kernel(model, i, kernel)


def _make(base: str) -> tuple[type[PretrainedConfig], type[PreTrainedModel]]:
    base_config = CONFIG_MAPPING[base]
    base_model = MODEL_FOR_CAUSAL_LM_MAPPING[base_config]
    stem = base_model.__name__.removesuffix("ForCausalLM")
    config_cls = type(f"OAL{stem}Config", (base_config,), {"model_type": PREFIX + base, "__module__": __name__})

    def __init__(self, config: PretrainedConfig, *args, **kwargs) -> None:
        base_model.__init__(self, config, *args, **kwargs)
        _attach_recorded_kernels(self)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        path = Path(str(pretrained_model_name_or_path))
        if (path / KERNELS_FILE).is_file():
            # kernels-only directory: the base weights come from where the record says
            from .converted import load_converted

            if args or set(kwargs) - _KERNELS_ONLY_KWARGS or kwargs.get("subfolder"):
                raise ValueError(
                    f"{path}: a kernels-only converted directory loads with dtype, device_map and "
                    f"attn_implementation only, got {sorted(kwargs)}"
                )
            device = kwargs.get("device_map") or "cpu"
            if not isinstance(device, (str, torch.device)) or device == "auto":
                raise ValueError(
                    f"device_map: a kernels-only converted directory loads onto one device ('cpu', 'cuda', "
                    f"'cuda:N'), got {device!r}"
                )
            dtype = kwargs.get("dtype") or "auto"
            if dtype == "auto":  # the dtype the weights were saved in, as transformers' "auto" means
                dtype = getattr(torch, str(read_json(path / "config.json").get("dtype") or "float32"))
            elif isinstance(dtype, str):
                dtype = getattr(torch, dtype, None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"dtype: expected a torch dtype or its name, got {kwargs['dtype']!r}")
            model = load_converted(
                path, dtype=dtype, device=device, attn_implementation=kwargs.get("attn_implementation")
            )
            return as_oal_model(model)
        return super(model_cls, cls).from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @functools.wraps(base_model.forward)  # the signature generate inspects (logits_to_keep) stays the base's
    def forward(self, *args, **kwargs):
        return chunked_forward(base_model.forward, self, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        set_auto_map(self.config)
        base_model.save_pretrained(self, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_remote_code(save_directory, base)

    model_cls = type(
        f"OAL{stem}ForCausalLM",
        (base_model,),
        {
            "config_class": config_cls,
            "__init__": __init__,
            "from_pretrained": from_pretrained,
            "forward": forward,
            "save_pretrained": save_pretrained,
            "__module__": __name__,
            "__doc__": f"A converted {base_model.__name__}: the kernels recorded in ``config.{CONFIG_KEY}`` attached.",
        },
    )
    return config_cls, model_cls


def oal_classes(base: str) -> tuple[type[PretrainedConfig], type[PreTrainedModel]]:
    """``(config class, CausalLM class)`` of the converted form of base model type ``base``."""
    if base not in BASE_MODEL_TYPES:
        raise ValueError(f"base: expected one of {BASE_MODEL_TYPES}, got {base!r}")
    if base not in _CLASSES:
        _CLASSES[base] = _make(base)
        globals()[_CLASSES[base][0].__name__] = _CLASSES[base][0]
        globals()[_CLASSES[base][1].__name__] = _CLASSES[base][1]
    return _CLASSES[base]


def register() -> None:
    """Register every converted model type with AutoConfig and AutoModelForCausalLM (idempotent)."""
    for base in BASE_MODEL_TYPES:
        config_cls, model_cls = oal_classes(base)
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


def base_model_type(config: PretrainedConfig) -> str:
    """``"llama"`` for a LlamaConfig or an OALLlamaConfig."""
    mt = config.model_type
    return mt[len(PREFIX) :] if mt.startswith(PREFIX) else mt


def as_oal_model(model: PreTrainedModel) -> PreTrainedModel:
    """Make a base model with attached kernels and a conversion record an instance of its converted class, in
    place (the classes add no state; config and weights are untouched). A model already of it is returned as is."""
    if conversion_info(model) is None:
        raise ValueError("model: not a converted model (no config.oal_conversion)")
    base = base_model_type(model.config)
    config_cls, model_cls = oal_classes(base)
    if not isinstance(model.config, config_cls):
        if type(model.config) is not CONFIG_MAPPING[base]:
            raise ValueError(f"model: expected a {CONFIG_MAPPING[base].__name__}, got {type(model.config).__name__}")
        model.config.__class__ = config_cls
    if not isinstance(model, model_cls):
        if type(model) is not MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[base]]:
            raise ValueError(f"model: expected a {model_cls.__base__.__name__}, got {type(model).__name__}")
        model.__class__ = model_cls
    return model


def remote_code(base: str) -> str:
    """The text of :data:`REMOTE_CODE_FILE` for a converted ``base`` model."""
    config_cls, model_cls = oal_classes(base)
    return f'''"""transformers' trust_remote_code entry of a model converted by oal
(Outlier-Aware Attention Linearization). The model is a {model_cls.__base__.__name__} whose attention layers
run oal's kernels; the classes live in the oal package, imported here.
"""

try:
    from oal.models.hf import oal_classes
except ImportError as exc:
    raise ImportError(
        "This model was converted by oal (Outlier-Aware Attention Linearization); loading it needs the oal package. "
        "Install it with `pip install oal`, then `import oal` (or keep trust_remote_code=True)."
    ) from exc

{config_cls.__name__}, {model_cls.__name__} = oal_classes({base!r})
'''


def set_auto_map(config: PretrainedConfig) -> None:
    """Point the config's ``auto_map`` at :data:`REMOTE_CODE_FILE` (the trust_remote_code entry) and name the
    converted class in ``architectures``."""
    config_cls, model_cls = oal_classes(base_model_type(config))
    config.architectures = [model_cls.__name__]
    module = REMOTE_CODE_FILE.removesuffix(".py")
    config.auto_map = {
        "AutoConfig": f"{module}.{config_cls.__name__}",
        "AutoModelForCausalLM": f"{module}.{model_cls.__name__}",
    }


def write_remote_code(directory: str | os.PathLike, base: str) -> Path:
    """Write :data:`REMOTE_CODE_FILE` for a converted ``base`` model into ``directory``."""
    path = Path(directory) / REMOTE_CODE_FILE
    path.write_text(remote_code(base), encoding="utf-8")
    return path
