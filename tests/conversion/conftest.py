"""Tiny random decoder models of the supported families (built offline from configs) and a byte tokenizer."""

from __future__ import annotations

import pytest
import torch
from tiny import byte_tokenizer, tiny_causal_lm

VOCAB = 256  # the byte tokenizer's; id 0 doubles as the pad token


def tiny_model(
    arch: str = "llama", num_heads: int = 6, num_kv_heads: int = 2, layers: int = 4, qk_gain: float = 3.0
) -> torch.nn.Module:
    """A random causal LM (head_dim 8, fp32, eval mode); ``qk_gain`` scales W_q, W_k so that attention logits
    are not all tiny and the kernels' outputs differ visibly from softmax."""
    return tiny_causal_lm(
        arch,
        vocab_size=VOCAB,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=8,
        layers=layers,
        max_position_embeddings=512,
        qk_gain=qk_gain,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture
def tokenizer():
    return byte_tokenizer(pad=True)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread; on a loaded machine, thread pools spin and are up to 40x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
