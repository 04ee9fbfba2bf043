"""Tiny random decoder models of the three supported families, built offline from configs."""

from __future__ import annotations

import pytest
import torch
from tiny import byte_tokenizer, tiny_causal_lm


def tiny_model(
    arch: str = "llama",
    num_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    layers: int = 3,
    qk_gain: float = 1.0,
    **extra,
) -> torch.nn.Module:
    """A random causal LM in eval mode (vocab 101, weights from the global generator); ``qk_gain`` scales W_q, W_k
    so attention logits are not all tiny."""
    return tiny_causal_lm(
        arch,
        vocab_size=101,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layers=layers,
        max_position_embeddings=256,
        qk_gain=qk_gain,
        **extra,
    )


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
