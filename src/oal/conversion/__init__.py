"""Conversion of pretrained causal LMs to kernel attention (§5.2, App. F), saving and loading converted models,
and generation with recurrent kernel state (:class:`oal.models.KernelCache`)."""

from ..models.state_cache import KernelCache, KernelStateLayer, cache_nbytes
from .convert import (
    CONFIG_KEY,
    FORMAT,
    check_supported,
    conversion_info,
    convert_model,
    default_layers,
    is_converted_dir,
    load_converted,
    load_kernel_state,
    parse_layers,
    read_calibrated,
    record_conversion,
    save_converted,
)

__all__ = [
    "CONFIG_KEY",
    "FORMAT",
    "KernelCache",
    "KernelStateLayer",
    "cache_nbytes",
    "check_supported",
    "conversion_info",
    "convert_model",
    "default_layers",
    "is_converted_dir",
    "load_converted",
    "load_kernel_state",
    "parse_layers",
    "read_calibrated",
    "record_conversion",
    "save_converted",
]
