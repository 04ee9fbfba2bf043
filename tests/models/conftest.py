"""Tiny random decoder models of the three supported families, built offline from configs."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny_model(
    arch: str = "llama",
    num_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    layers: int = 3,
    qk_gain: float = 1.0,
    **extra,
) -> torch.nn.Module:
    """A random causal LM in eval mode; ``qk_gain`` scales W_q, W_k so attention logits are not all tiny."""
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        **extra,
    )
    model = model_cls(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_gain)
            layer.self_attn.k_proj.weight.mul_(qk_gain)
    return model


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A lossless byte-level tokenizer (one token per byte, no merges) that needs no files."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private OAL cache for the test."""
    path = tmp_path / "oal-cache"
    monkeypatch.setenv("OAL_CACHE_DIR", str(path))
    return path


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture
def tokenizer():
    return byte_tokenizer()
