"""Tiny converted models and token blocks for the training tests (no files, no downloads)."""

from __future__ import annotations

import pytest
import tiny
import torch
from transformers import PreTrainedTokenizerFast

from oal.kernels.registry import build_kernel
from oal.models import attach_kernel
from oal.training import FinetuneConfig, FinetuneData

VOCAB = 97


def tiny_converted(
    kernels: dict[int, str] | None = None, *, num_heads: int = 6, num_kv_heads: int = 2, layers: int = 3
) -> torch.nn.Module:
    """A random 3-layer Llama (the same weights on every call) with kernels attached: by default OAL with 3 groups
    on layer 1 and DiJiang on layer 2, layer 0 softmax."""
    kernels = {1: "oal", 2: "dijiang"} if kernels is None else kernels
    head_dim = 8
    with torch.random.fork_rng():  # one seeded stream: the kernels' own draws follow the model's
        torch.manual_seed(1234)
        model = tiny.tiny_causal_lm(
            vocab_size=VOCAB,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            layers=layers,
            max_position_embeddings=256,
        )
        g = torch.Generator().manual_seed(5)
        for layer, name in kernels.items():
            kw = {}
            if name == "oal":
                kw = {"groups": torch.randint(0, 3, (num_heads, head_dim), generator=g), "num_groups": 3}
            kernel = build_kernel(
                name, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, layer_idx=layer, **kw
            )
            with torch.no_grad():  # move the kernel parameters off their init so they are distinguishable
                for p in kernel.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
            attach_kernel(model, layer, kernel)
    return model


def tiny_data(*, block_len: int = 16, blocks: int = 10, val_blocks: int = 2, seed: int = 3) -> FinetuneData:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (blocks, block_len), generator=g)
    return FinetuneData.from_blocks(ids, val_blocks, source="random:test")


def tiny_config(**kw) -> FinetuneConfig:
    return FinetuneConfig(**{"updates": 6, "block_len": 16, "val_every": 2, "val_blocks": 2, **kw})


@pytest.fixture
def converted():
    return tiny_converted


@pytest.fixture
def data():
    return tiny_data


@pytest.fixture
def config():
    return tiny_config


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run ~50x faster on one thread than on two contended ones; exact comparisons need a fixed
    thread count anyway."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (256 ids), no files needed."""
    return tiny.byte_tokenizer()
