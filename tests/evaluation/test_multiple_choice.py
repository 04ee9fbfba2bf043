from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from oal.evaluation import ItemScores, MultipleChoiceItem, accuracy_metrics, encode_pair, loglikelihoods, score_items

REQUESTS = [
    ("Question: How do I boil water?\nAnswer:", " Put it in a pot."),
    ("Question: How do I boil water?\nAnswer:", " 42"),
    ("Roof shingle removal: A man is sitting on a roof. he", " starts pulling up roofing on a roof."),
    ("Question: Which gas do plants take in?\nAnswer:", " carbon dioxide"),
    ("the cat ", "sat"),  # trailing context space moves into the continuation
]


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_encode_pair_is_whole_minus_context(tokenizer):
    for context, continuation in REQUESTS[:4]:
        ctx, cont = encode_pair(tokenizer, context, continuation)
        whole = _encode(tokenizer, context + continuation)
        assert ctx == _encode(tokenizer, context) and ctx + cont == whole
    ctx, cont = encode_pair(tokenizer, "the cat ", "sat")
    assert ctx == _encode(tokenizer, "the cat") and ctx + cont == _encode(tokenizer, "the cat sat")


def test_encode_pair_bad_input(tokenizer):
    with pytest.raises(ValueError, match="context"):
        encode_pair(tokenizer, "", " x")
    with pytest.raises(ValueError, match="continuation"):
        encode_pair(tokenizer, "abc", "")


@pytest.fixture(scope="module")
def hand_loglikelihoods(model, tokenizer, prefix_logprob):
    out = []
    for context, continuation in REQUESTS:
        ctx, cont = encode_pair(tokenizer, context, continuation)
        ids = ctx + cont
        out.append((sum(prefix_logprob(model, ids, j) for j in range(len(ctx), len(ids))), len(cont)))
    return out


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_loglikelihoods_match_hand_computation(model, tokenizer, hand_loglikelihoods, batch_size):
    got = loglikelihoods(model, tokenizer, REQUESTS, batch_size=batch_size, progress=False)
    for (expected, n_tokens), ll in zip(hand_loglikelihoods, got, strict=True):
        assert ll.n_tokens == n_tokens
        assert ll.logprob == pytest.approx(expected, rel=1e-5, abs=1e-5)


class KeepSpy(torch.nn.Module):
    """Passes through to a transformers model, recording how many positions' logits were asked for."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.kept: list[tuple[int, int]] = []

    def forward(self, input_ids: torch.Tensor, use_cache: bool | None = None, logits_to_keep: int = 0):
        self.kept.append((input_ids.shape[1], logits_to_keep))
        return self.inner(input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep)


def test_only_scored_positions_get_logits(model, tokenizer, hand_loglikelihoods):
    spy = KeepSpy(model)
    got = loglikelihoods(spy, tokenizer, REQUESTS, batch_size=2, progress=False)
    assert all(0 < keep < width for width, keep in spy.kept)
    for (expected, _), ll in zip(hand_loglikelihoods, got, strict=True):
        assert ll.logprob == pytest.approx(expected, rel=1e-5, abs=1e-5)


class BigramLM(torch.nn.Module):
    """Toy causal LM: the logits at a position are a fixed row picked by the token there."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids: torch.Tensor, use_cache: bool | None = None) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])


def test_bigram_loglikelihood_and_is_greedy(tokenizer):
    context, good, bad = "the dog", " sat on a mat", " ate 42"
    ctx, cont = encode_pair(tokenizer, context, good)
    pairs = list(zip((ctx + cont)[len(ctx) - 1 : -1], cont, strict=True))
    assert len(cont) > 1 and len({prev for prev, _ in pairs}) == len(pairs), "pick a continuation without repeats"
    table = torch.randn(len(tokenizer), len(tokenizer))
    for prev, nxt in pairs:
        table[prev, nxt] = 20.0  # the continuation is the greedy one
    model = BigramLM(table)
    lls = loglikelihoods(model, tokenizer, [(context, good), (context, bad)], batch_size=2, progress=False)
    assert lls[0].is_greedy and not lls[1].is_greedy
    for continuation, ll in zip((good, bad), lls, strict=True):
        ctx, cont = encode_pair(tokenizer, context, continuation)
        ids = ctx + cont
        expected = sum(table[ids[j - 1]].double().log_softmax(-1)[ids[j]].item() for j in range(len(ctx), len(ids)))
        assert ll.logprob == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_prediction_and_normalisations():
    # acc: option 0 (-4 > -5); per token: -4/1 < -5/4 -> option 1; per char: -4/4 > -5/2 -> option 0
    s = ItemScores(logprobs=(-4.0, -5.0), n_tokens=(1, 4), n_chars=(4, 2), gold=1)
    assert s.prediction() == 0 and s.prediction("tokens") == 1 and s.prediction("chars") == 0
    tie = ItemScores(logprobs=(-2.0, -2.0, -3.0), n_tokens=(1, 1, 1), n_chars=(1, 1, 1), gold=0)
    assert tie.prediction() == 0  # first maximum, as np.argmax
    with pytest.raises(ValueError, match="norm"):
        s.prediction("bytes")


def test_accuracy_metrics_and_lm_eval_stderr():
    right = ItemScores((-1.0, -2.0), (1, 1), (1, 1), gold=0)
    wrong = ItemScores((-1.0, -2.0), (1, 1), (1, 1), gold=1)
    scores = [right, right, right, wrong, wrong]
    m = accuracy_metrics(scores, "tokens")
    assert m["acc"] == m["acc_norm"] == m["acc_norm_tokens"] == m["acc_norm_chars"] == pytest.approx(0.6)
    assert m["acc_stderr"] == pytest.approx(math.sqrt(0.6 * 0.4 / 4))
    split = ItemScores(logprobs=(-4.0, -5.0), n_tokens=(1, 4), n_chars=(4, 2), gold=1)
    assert accuracy_metrics([split], "tokens")["acc_norm"] == 1.0
    m = accuracy_metrics([split], "chars")
    assert m["acc_norm"] == 0.0 and m["acc_norm_tokens"] == 1.0 and math.isnan(m["acc_norm_stderr"])
    with pytest.raises(ValueError, match="norm"):
        accuracy_metrics(scores, "words")
    with pytest.raises(ValueError, match="scores"):
        accuracy_metrics([], "tokens")


def test_score_items_by_hand(model, tokenizer, prefix_logprob):
    items = [
        MultipleChoiceItem("Question: How do I boil water?\nAnswer:", ("Put it in a pot.", "42", "the dog"), 0),
        MultipleChoiceItem("Roof shingle removal: A man is sitting on a roof. he", ("starts pulling", "ate bones"), 1),
    ]
    scores = score_items(model, tokenizer, items, batch_size=2, progress=False)
    hits = {"acc": 0, "tokens": 0, "chars": 0}
    for item, s in zip(items, scores, strict=True):
        lls, counts = [], []
        for choice in item.choices:
            ctx, cont = encode_pair(tokenizer, item.context, " " + choice)
            lls.append(sum(prefix_logprob(model, ctx + cont, j) for j in range(len(ctx), len(ctx + cont))))
            counts.append(len(cont))
        assert s.logprobs == pytest.approx(tuple(lls), rel=1e-5, abs=1e-5)
        assert s.n_tokens == tuple(counts) and s.n_chars == tuple(len(c) for c in item.choices)
        best = {
            "acc": max(range(len(lls)), key=lambda i: lls[i]),
            "tokens": max(range(len(lls)), key=lambda i: lls[i] / counts[i]),
            "chars": max(range(len(lls)), key=lambda i: lls[i] / len(item.choices[i])),
        }
        for k, v in best.items():
            hits[k] += v == item.gold
    m = accuracy_metrics(scores, "chars")
    assert m["acc"] == hits["acc"] / 2
    assert m["acc_norm"] == m["acc_norm_chars"] == hits["chars"] / 2
    assert m["acc_norm_tokens"] == hits["tokens"] / 2
