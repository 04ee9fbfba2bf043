"""LoRA adaptation of converted models (App. F.2): resumable, checksummed, ``accelerate``-ready.

Typical use::

    from oal.training import finetune, preset, load_finetuned

    result = finetune(converted_model, preset("cpu"), "runs/finetune/oal", tokenizer=tokenizer)
    model = load_finetuned(load_model("smollm2-135m"), "runs/finetune/oal", merge=True)
"""

from .checkpoint import CheckpointError, latest_checkpoint, load_training_state, verify_checked_dir
from .config import PRESETS, FinetuneConfig, preset
from .data import FinetuneData, prepare_data, training_order
from .export import export_finetuned, load_finetuned
from .lora import apply_lora, trainable_parameters
from .schedule import build_optimizer, build_scheduler, lr_factor
from .trainer import FinetuneResult, finetune, model_fingerprint, validation_nll

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
    "load_finetuned",
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
