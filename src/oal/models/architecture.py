"""Architecture access for decoder-only LMs whose layers are ``model.model.layers[i].self_attn`` with
``q_proj``/``k_proj``/``v_proj``/``o_proj`` (Llama, Qwen2, Mistral and their relatives in transformers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class AttentionSpec:
    """Attention geometry shared by all layers of a model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    scaling: float

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads


def _is_linear(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Linear) or isinstance(getattr(module, "base_layer", None), nn.Linear)


def get_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks ``model.model.layers`` (a CausalLM, its base model, or either wrapped by PEFT)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    layers = getattr(getattr(model, "model", model), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"model: expected a decoder with `model.layers[i].self_attn` (Llama/Qwen2/Mistral style), got "
            f"{type(model).__name__}"
        )
    return layers


def get_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The ``self_attn`` module of every decoder layer, in layer order (a CausalLM, its base model, or either
    wrapped by PEFT, whose LoRA layers keep the original linear as ``base_layer``)."""
    layers = get_decoder_layers(model)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(_is_linear(getattr(attn, p, None)) for p in _PROJECTIONS):
            raise ValueError(
                f"model: layer {i} of {type(model).__name__} has no `self_attn` with q/k/v/o_proj linear layers"
            )
        if getattr(attn, "layer_idx", None) != i:
            raise ValueError(f"model: layer {i}'s attention has layer_idx={getattr(attn, 'layer_idx', None)}")
        modules.append(attn)
    return modules


def num_layers(model: nn.Module) -> int:
    return len(get_attention_modules(model))


def attention_spec(model: nn.Module) -> AttentionSpec:
    """Head counts from the config, head size and softmax scaling from the attention modules."""
    modules = get_attention_modules(model)
    config = model.config
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dims = {m.head_dim for m in modules}
    scalings = {float(m.scaling) for m in modules}
    if len(head_dims) != 1 or len(scalings) != 1:
        raise ValueError(f"model: expected one head_dim and scaling for all layers, got {head_dims}, {scalings}")
    return AttentionSpec(
        num_layers=len(modules),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dims.pop(),
        hidden_size=config.hidden_size,
        scaling=scalings.pop(),
    )


def check_layer(model: nn.Module, layer: int, *, name: str = "layer") -> int:
    n = num_layers(model)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
        raise ValueError(f"{name}: expected a layer index in [0, {n}), got {layer!r}")
    return layer


def output_projection(model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``W_o`` ``(hidden, Hq·dv)`` and its bias ``(hidden,)`` or None, of one layer (the frozen output
    projection of the fidelity metric). These are the live parameters, not copies."""
    o_proj = get_attention_modules(model)[check_layer(model, layer)].o_proj
    return o_proj.weight, o_proj.bias


def apply_output_projection(model: nn.Module, layer: int, o: torch.Tensor) -> torch.Tensor:
    """Map an attention output ``(B, Hq, N, dv)`` (the kernel layout) through the layer's ``W_o``:
    ``(B, N, hidden)``, exactly what the attention block adds to the residual stream."""
    weight, bias = output_projection(model, layer)
    if o.dim() != 4 or o.shape[1] * o.shape[3] != weight.shape[1]:
        raise ValueError(f"o: expected shape (B, Hq, N, dv) with Hq·dv = {weight.shape[1]}, got {tuple(o.shape)}")
    B, _, N, _ = o.shape
    flat = o.transpose(1, 2).reshape(B, N, -1).to(weight.dtype)
    return F.linear(flat, weight, bias)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention ``(B, Hq, N, dv)`` of captured q ``(B, Hq, N, d)``, k ``(B, Hkv, N, d)``,
    v ``(B, Hkv, N, dv)`` (query head h reads KV head h // (Hq/Hkv)); ``scale`` defaults to 1/√d.

    This is the same SDPA call transformers makes for an unpadded causal prefill, so on the same device and
    dtype it reproduces the model's attention output exactly.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v: expected 4-D tensors, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"k: expected Hkv dividing Hq={q.shape[1]} and equal to v's, got {k.shape[1]}, {v.shape[1]}")
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(f"q, k, v: expected one sequence length, got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
