"""Pretrained models: loading (embedded SmolLM2 GGUF, local directories, Hub ids), architecture access, the
``"oal"`` attention implementation for Q/K/V capture and per-layer kernel replacement, and the cache that keeps
attached kernels' recurrent state during generation."""

from .architecture import (
    AttentionSpec,
    apply_output_projection,
    attention_spec,
    exact_attention,
    get_attention_modules,
    get_decoder_layers,
    num_layers,
    output_projection,
)
from .converted import conversion_info, is_converted_dir, load_converted
from .hooks import (
    ATTN_IMPLEMENTATION,
    QKV,
    QKVRecorder,
    attach_kernel,
    attached_kernels,
    capture_qkv,
    detach_kernel,
    oal_attention_forward,
)
from .loading import (
    SMOLLM2_NAME,
    ModelSource,
    embedded_gguf_path,
    ensure_smollm2_cache,
    load_model,
    load_tokenizer,
    resolve_model,
    smollm2_cache_dir,
)
from .state_cache import KernelCache, KernelStateLayer, cache_nbytes

__all__ = [
    "ATTN_IMPLEMENTATION",
    "QKV",
    "SMOLLM2_NAME",
    "AttentionSpec",
    "KernelCache",
    "KernelStateLayer",
    "ModelSource",
    "QKVRecorder",
    "apply_output_projection",
    "attach_kernel",
    "attached_kernels",
    "attention_spec",
    "cache_nbytes",
    "capture_qkv",
    "conversion_info",
    "detach_kernel",
    "embedded_gguf_path",
    "ensure_smollm2_cache",
    "exact_attention",
    "get_attention_modules",
    "is_converted_dir",
    "load_converted",
    "get_decoder_layers",
    "load_model",
    "load_tokenizer",
    "num_layers",
    "oal_attention_forward",
    "output_projection",
    "resolve_model",
    "smollm2_cache_dir",
]
