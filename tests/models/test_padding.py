"""Padded batches through converted layers (oal.models.hooks): left padding in generate and right padding in
scoring give each row what that sequence alone gives, for every converted kind; what stays refused."""

from __future__ import annotations

import pytest
import torch
from tiny import convert_tiny

from oal.models import KernelCache
from oal.models.state_cache import RowStates, cache_nbytes

KINDS = ["oal", "sink_window", "exact"]


def converted(make_model, kind):
    model = make_model("llama", num_heads=6, num_kv_heads=2, qk_gain=3.0)
    return convert_tiny(model, window=None if kind == "oal" else 3, exact={1: [1]} if kind == "exact" else None)


PROMPTS = [[5, 17, 3, 99, 42, 8, 8, 61, 2], [7, 7, 1], [30, 31, 32, 33, 34, 35]]


def left_padded(prompts, pad=0):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_generate_equals_each_prompt_alone(make_model, kind):
    model = converted(make_model, kind)
    kw = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **kw)
        scores = model.generate(ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **kw)
        for row, prompt in enumerate(PROMPTS):
            alone = model.generate(torch.tensor([prompt]), output_scores=True, return_dict_in_generate=True, **kw)
            assert batch[row, ids.shape[1] :].tolist() == alone.sequences[0, len(prompt) :].tolist()
            for s_batch, s_alone in zip(scores.scores, alone.scores, strict=True):
                torch.testing.assert_close(s_batch[row], s_alone[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_right_padded_scoring_equals_one_at_a_time(make_model, kind):
    model = converted(make_model, kind)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in PROMPTS])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in PROMPTS])
    with torch.no_grad():
        for use_cache in (False, True):
            batch = torch.log_softmax(model(ids, attention_mask=mask, use_cache=use_cache).logits, -1)
            for row, prompt in enumerate(PROMPTS):
                alone = torch.log_softmax(model(torch.tensor([prompt]), use_cache=False).logits, -1)
                torch.testing.assert_close(batch[row, : len(prompt)], alone[0], rtol=1e-4, atol=1e-5)


def test_padded_cache_keeps_per_row_states_and_refuses_to_extend_right_padding(make_model):
    model = converted(make_model, "sink_window")
    ids, mask = left_padded(PROMPTS)
    cache = KernelCache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    state = cache.layers[1].state
    assert isinstance(state, RowStates) and state.seen == tuple(map(len, PROMPTS))
    assert cache_nbytes(cache) > 0
    cache.layers[1].reorder_cache(torch.tensor([2, 0, 0]))
    assert cache.layers[1].state.seen == (6, 9, 9)
    width = max(map(len, PROMPTS))
    right = torch.tensor([p + [0] * (width - len(p)) for p in PROMPTS])
    rmask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in PROMPTS])
    cache = KernelCache(model)
    with torch.no_grad():
        model(right, attention_mask=rmask, cache=cache)
        more = torch.cat([rmask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        with pytest.raises(ValueError, match="neither causal nor causal with padding"):
            model(torch.ones(3, 1, dtype=torch.long), attention_mask=more, cache=cache)


def test_packed_sequences_are_refused(make_model):
    model = converted(make_model, "oal")
    n = 6
    causal = torch.ones(n, n).tril().bool()
    packed = causal.clone()
    packed[3:, :3] = False  # two sequences of 3 in one row
    with torch.no_grad(), pytest.raises(ValueError, match="packed sequences or a sliding window"):
        model(torch.arange(n)[None], attention_mask=packed[None, None], use_cache=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_generate_on_cuda_equals_each_prompt_alone(make_model, kind):
    """The same on CUDA, where the kernels' forward takes the Triton path."""
    model = converted(make_model, kind).cuda()
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        batch = model.generate(ids.cuda(), attention_mask=mask.cuda(), **kw).cpu()
        for row, prompt in enumerate(PROMPTS):
            alone = model.generate(torch.tensor([prompt]).cuda(), **kw).cpu()
            assert batch[row, ids.shape[1] :].tolist() == alone[0, len(prompt) :].tolist()
