from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from oal.evaluation import block_nll, perplexity


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_block_nll_matches_cross_entropy(chunk_size):
    logits = torch.randn(3, 7, 11, dtype=torch.bfloat16)
    ids = torch.randint(0, 11, (3, 7))
    expected = F.cross_entropy(logits[:, :-1].float().reshape(-1, 11), ids[:, 1:].reshape(-1), reduction="none").view(
        3, 6
    )
    got = block_nll(logits, ids, chunk_size=chunk_size)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected.sum(1).double(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_perplexity_matches_hand_computation(model, prefix_logprob, batch_size):
    blocks = torch.randint(1, model.config.vocab_size, (3, 9))
    nll = -sum(prefix_logprob(model, row, j) for row in blocks.tolist() for j in range(1, 9))
    out = perplexity(model, blocks, batch_size=batch_size, chunk_size=3, progress=False)
    assert out["n_tokens"] == 3 * 8 and out["n_blocks"] == 3
    assert out["nll_mean"] == pytest.approx(nll / 24, rel=1e-5)
    assert out["ppl"] == pytest.approx(math.exp(nll / 24), rel=1e-5)


def test_uniform_model_has_ppl_equal_to_vocab_size(model_factory):
    model = model_factory(97)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    out = perplexity(model, torch.randint(0, 97, (2, 6)), progress=False)
    assert out["ppl"] == pytest.approx(97, rel=1e-6)
    assert out["nll_mean"] == pytest.approx(math.log(97), rel=1e-6)


def test_perplexity_bad_input(model):
    with pytest.raises(ValueError, match="blocks"):
        perplexity(model, torch.zeros(8, dtype=torch.long), progress=False)
    with pytest.raises(ValueError, match="blocks"):
        perplexity(model, torch.zeros(2, 8), progress=False)
    with pytest.raises(ValueError, match="blocks"):
        perplexity(model, torch.zeros(2, 1, dtype=torch.long), progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        perplexity(model, torch.zeros(2, 8, dtype=torch.long), batch_size=0, progress=False)
