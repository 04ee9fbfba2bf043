"""A tiny Llama (byte tokenizer, random weights) saved as a local model directory, a small WikiText-like data
directory and a group file for it, so the commands run end to end offline in seconds."""

from __future__ import annotations

import pytest
import torch
from tiny import byte_tokenizer, tiny_causal_lm, word_text

from oal.grouping import group_heads

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 6, 2, 8, 3


def tiny_llama(seed: int = 0, *, bias: bool = False) -> torch.nn.Module:
    """The tiny Llama; seeds torch's global generator (not a forked one), as the tests always did. qk_gain 4: larger
    logits than the default init, so kernels differ visibly from softmax."""
    torch.manual_seed(seed)
    return tiny_causal_lm(
        vocab_size=256,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        layers=LAYERS,
        max_position_embeddings=512,
        qk_gain=4.0,
        attention_bias=bias,
    )


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
        (data / "wikitext-2-raw" / "wiki.valid.raw").write_text(word_text(1, 26 * 64 + 300))
        (data / "wikitext-2-raw" / "wiki.test.raw").write_text(word_text(2, 20 * 64 + 300))
        gen = torch.Generator().manual_seed(3)
        chi = torch.rand(LAYERS, 12, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
        chi[..., 0] *= 8  # a clear outlier dimension in every head
        groups = root / "groups.json"
        group_heads(chi, model_id="tiny", alpha=0.5, gamma=0.5, n_boot=50).save(groups)
        yield {"root": root, "model": model_dir, "data": data, "groups": groups}


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama()
