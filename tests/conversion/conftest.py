"""Tiny random decoder models of the supported families (built offline from configs) and a byte tokenizer."""

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
VOCAB = 256  # the byte tokenizer's; id 0 doubles as the pad token


def tiny_model(
    arch: str = "llama", num_heads: int = 6, num_kv_heads: int = 2, layers: int = 4, qk_gain: float = 3.0
) -> torch.nn.Module:
    """A random causal LM (head_dim 8, fp32, eval mode); ``qk_gain`` scales W_q, W_k so that attention logits
    are not all tiny and the kernels' outputs differ visibly from softmax."""
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
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
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=backend.id_to_token(0))


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread; on a loaded machine, thread pools spin and are up to 40x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
