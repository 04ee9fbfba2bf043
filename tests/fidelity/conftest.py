"""A tiny Llama (byte tokenizer, random weights) saved as a local model directory, a small WikiText-like data
directory and a group file for it, so the commands run end to end offline in seconds."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from oal.grouping import group_heads

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 6, 2, 8, 3


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def tiny_llama(seed: int = 0, *, bias: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        attention_bias=bias,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits than the default init, so kernels differ visibly from softmax
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def tiny_env(tmp_path_factory):
    """A private OAL cache (token ids), the tiny model directory, the data directory and a group file."""
    root = tmp_path_factory.mktemp("tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OAL_CACHE_DIR", str(root / "oal-cache"))
        model_dir = root / "tiny-llama"
        tiny_llama().save_pretrained(model_dir)
        byte_tokenizer().save_pretrained(model_dir)
        data = root / "data"
        (data / "wikitext-2-raw").mkdir(parents=True)
        (data / "wikitext-2-raw" / "wiki.valid.raw").write_text(_text(1, 26 * 64 + 300))
        (data / "wikitext-2-raw" / "wiki.test.raw").write_text(_text(2, 20 * 64 + 300))
        gen = torch.Generator().manual_seed(3)
        chi = torch.rand(LAYERS, 12, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
        chi[..., 0] *= 8  # a clear outlier dimension in every head
        groups = root / "groups.json"
        group_heads(chi, model_id="tiny", alpha=0.5, gamma=0.5, n_boot=50).save(groups)
        yield {"root": root, "model": model_dir, "data": data, "groups": groups}


def _text(seed: int, n_bytes: int) -> str:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "music", "north", "the", "of", "and", "a"]
    lines = []
    size = 0
    while size < n_bytes:
        line = " " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + " . \n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama()
