"""LoRA adaptation of converted models (App. F.2): resumable, checksummed, ``accelerate``-ready.

Typical use::

    from oal.training import finetune, preset, load_finetuned

    result = finetune(converted_model, preset("cpu"), "runs/finetune/oal", tokenizer=tokenizer)
    model = load_finetuned(load_model("smollm2-135m"), "runs/finetune/oal", merge=True)
"""

from importlib import import_module
from typing import Any

# Exports load on first use: importing ``oal.training.cli`` (done by the ``oal`` command line) must stay cheap and
# must not need peft/accelerate, which are the optional ``train`` extra.
_EXPORTS = {
    "CheckpointError": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "load_training_state": "checkpoint",
    "verify_checked_dir": "checkpoint",
    "PRESETS": "config",
    "FinetuneConfig": "config",
    "preset": "config",
    "FinetuneData": "data",
    "prepare_data": "data",
    "training_order": "data",
    "export_finetuned": "export",
    "is_finetuned_dir": "checkpoint",
    "load_finetuned": "export",
    "load_finetuned_model": "export",
    "save_finetuned_model": "export",
    "apply_lora": "lora",
    "trainable_parameters": "lora",
    "build_optimizer": "schedule",
    "build_scheduler": "schedule",
    "lr_factor": "schedule",
    "FinetuneResult": "trainer",
    "finetune": "trainer",
    "model_fingerprint": "trainer",
    "validation_nll": "trainer",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "PRESETS",
    "CheckpointError",
    "FinetuneConfig",
    "FinetuneData",
    "FinetuneResult",
    "apply_lora",
    "build_optimizer",
    "build_scheduler",
    "export_finetuned",
    "finetune",
    "latest_checkpoint",
    "is_finetuned_dir",
    "load_finetuned",
    "load_finetuned_model",
    "save_finetuned_model",
    "load_training_state",
    "lr_factor",
    "model_fingerprint",
    "prepare_data",
    "preset",
    "trainable_parameters",
    "training_order",
    "validation_nll",
    "verify_checked_dir",
]
