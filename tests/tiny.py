"""Test helpers shared by every test directory: a byte-level tokenizer and tiny random causal LMs, built offline.

Importable as ``from tiny import ...`` in any test module or conftest: pytest's default (prepend) import mode puts
``tests/`` on ``sys.path`` because ``tests/conftest.py`` lives there. A subprocess that imports a conftest which
uses these helpers needs ``tests/`` on its own path.
"""

from __future__ import annotations

import random

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

#: architecture name -> (config class, causal-LM class) of the supported decoder families
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def byte_tokenizer(*, pad: bool = False) -> PreTrainedTokenizerFast:
    """A lossless byte-level tokenizer (one token per byte, 256 ids, no merges) that needs no files; ``pad`` makes
    the id-0 token the pad token."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    extra = {"pad_token": backend.id_to_token(0)} if pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **extra)


def tiny_causal_lm(
    arch: str = "llama",
    *,
    vocab_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    layers: int,
    hidden_size: int = 48,
    intermediate_size: int = 64,
    max_position_embeddings: int,
    qk_gain: float = 1.0,
    seed: int | None = None,
    **extra_config,
) -> torch.nn.Module:
    """A random fp32 causal LM of family ``arch`` (a key of ``ARCHS``) in eval mode.

    ``qk_gain`` multiplies W_q and W_k (not their biases), so attention logits are not all tiny and kernels differ
    visibly from softmax. ``seed=None`` draws the weights from torch's global generator as it stands; an integer
    draws them under ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng()``, leaving the global generator as
    it was. ``extra_config`` goes to the config class (token ids, ``attention_bias``, ``initializer_range``, ...).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {sorted(ARCHS)}, got {arch!r}")
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        **extra_config,
    )
    if seed is None:
        model = model_cls(config).eval()
    else:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = model_cls(config).eval()
    if qk_gain != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(qk_gain)
                layer.self_attn.k_proj.weight.mul_(qk_gain)
    return model


def word_text(seed: int, n_bytes: int) -> str:
    """At least ``n_bytes`` of WikiText-like lines (`` w w ... w . \\n``, 5-15 words of a 12-word vocabulary), the
    same text for the same ``seed``."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "music", "north", "the", "of", "and", "a"]
    lines, size = [], 0
    while size < n_bytes:
        line = " " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + " . \n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


def convert_tiny(
    model: torch.nn.Module,
    *,
    window: int | None = None,
    n_sink: int = 2,
    exact: dict[int, list[int]] | None = None,
    layers: str = "1-2",
    seed: int = 0,
) -> torch.nn.Module:
    """Convert a tiny model in place: OAL with 3 random dimension groups on ``layers``; with ``window``, each inside
    ``n_sink`` sinks + a ``window``-token window; with ``exact`` ({layer: KV heads}) those heads kept exact; the
    kernel parameters moved off their initialisation so that they matter. Returns the model."""
    from oal.conversion import convert_model
    from oal.conversion.heads import add_exact_heads
    from oal.kernels import SinkWindowKernel
    from oal.models import attach_kernel, attached_kernels, attention_spec, num_layers

    spec = attention_spec(model)
    g = torch.Generator().manual_seed(seed)
    groups = {i: torch.randint(0, 3, (spec.num_heads, spec.head_dim), generator=g) for i in range(num_layers(model))}
    convert_model(model, "oal", layers=layers, groups=groups)
    if window is not None:
        for i, k in attached_kernels(model).items():
            attach_kernel(model, i, SinkWindowKernel(k, n_sink=n_sink, window=window))
    if exact:
        add_exact_heads(model, exact)
    with torch.no_grad():
        for k in attached_kernels(model).values():
            for p in k.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model
