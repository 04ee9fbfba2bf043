"""Passkey / multikey prompts, greedy continuation, accuracy bookkeeping, the runner's retrieval tasks and the
perplexity of local text files, on the tiny model."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

import oal.evaluation.retrieval as retrieval
from oal.evaluation.perplexity import perplexity, text_blocks
from oal.evaluation.retrieval import FILLER, build_prompt, evaluate_retrieval, greedy_continuation, sentences_from_text
from oal.evaluation.runner import evaluate


@pytest.mark.parametrize("length", [260, 301, 480])
def test_passkey_prompt_has_the_exact_length_and_marks_the_needle(tokenizer, length):
    p = build_prompt(tokenizer, length, random.Random(3))
    assert len(p.ids) == length and re.fullmatch(r"\d{5}", p.answer) and 0 <= p.depth <= 1
    assert tokenizer.decode(p.ids[p.needle[0] : p.needle[1]]).strip() == p.answer
    sentence = tokenizer.decode(p.ids[p.sentence[0] : p.sentence[1]])
    assert sentence.strip() == f"The pass key is {p.answer}. Remember it. {p.answer} is the pass key."
    assert tokenizer.decode(p.ids[p.question :]) == " What is the pass key? The pass key is"
    assert p.sentence[0] <= p.needle[0] < p.needle[1] <= p.sentence[1] <= p.question
    text = tokenizer.decode(p.ids)
    assert text.startswith(retrieval.INTRO) and text.count(p.answer) == 2 and "The grass is green." in text
    assert build_prompt(tokenizer, length, random.Random(3)) == p
    assert build_prompt(tokenizer, length, random.Random(4)).answer != p.answer


def test_multikey_prompt_asks_for_one_of_its_keys(tokenizer):
    for seed in range(5):
        p = build_prompt(tokenizer, 500, random.Random(seed), task="multikey", n_keys=3)
        text = tokenizer.decode(p.ids)
        pairs = dict(re.findall(r"The pass key for (\w+) is (\d+)\. Remember", text))
        assert len(pairs) == 3 and p.query in pairs and pairs[p.query] == p.answer
        assert text.endswith(f" What is the pass key for {p.query}? The pass key for {p.query} is")
        assert tokenizer.decode(p.ids[p.needle[0] : p.needle[1]]).strip() == p.answer
        assert len(p.ids) == 500


def test_natural_haystack(tokenizer):
    hay = sentences_from_text("One two three four five. Six seven eight nine ten! Short. Eleven twelve thirteen?")
    assert hay == ["One two three four five.", "Six seven eight nine ten!", "Eleven twelve thirteen?"]
    p = build_prompt(tokenizer, 300, random.Random(0), haystack=hay)
    assert "Six seven" in tokenizer.decode(p.ids) and "grass" not in tokenizer.decode(p.ids)
    with pytest.raises(ValueError, match="text"):
        sentences_from_text("no")


def test_bad_prompt_arguments(tokenizer):
    with pytest.raises(ValueError, match="length: 50 tokens leave no room"):
        build_prompt(tokenizer, 50, random.Random(0))
    with pytest.raises(ValueError, match="task"):
        build_prompt(tokenizer, 300, random.Random(0), task="needle")
    with pytest.raises(ValueError, match="n_keys"):
        build_prompt(tokenizer, 300, random.Random(0), task="multikey", n_keys=1)
    with pytest.raises(ValueError, match="haystack"):
        build_prompt(tokenizer, 300, random.Random(0), haystack=[])


def test_greedy_continuation_is_the_argmax_of_full_forwards(model, tokenizer):
    ids = build_prompt(tokenizer, 200, random.Random(1)).ids
    new, prefill_s, nbytes = greedy_continuation(model, ids, 6)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    assert new == seq[len(ids) :] and prefill_s > 0
    # a softmax model's cache after the prefill: keys and values of 2 layers x 2 KV heads x 200 tokens x 8 dims
    assert nbytes == 2 * 2 * 2 * 200 * 8 * 4


def test_accuracy_bookkeeping_on_known_answers(tokenizer, model, monkeypatch):
    """A stand-in model that answers trials 0 and 2 correctly and the others with a wrong key."""

    def fake(model, ids, max_new_tokens):
        key = re.search(r"The pass key is (\d+)\.", tokenizer.decode(ids)).group(1)
        trial = fake.calls % 4
        fake.calls += 1
        text = f" {key}. Remember" if trial in (0, 2) else " 12345 is"
        return tokenizer(text)["input_ids"], 0.5, 3 * 2**20

    fake.calls = 0
    monkeypatch.setattr(retrieval, "greedy_continuation", fake)
    res = evaluate_retrieval(model, tokenizer, lengths=[220, 260], trials=4, progress=False)
    assert [r["correct"] for r in res["trials"]] == [True, False, True, False] * 2
    for length in ("220", "260"):
        per = res["per_length"][length]
        assert per["acc"] == 0.5 and per["correct"] == 2 and per["n"] == 4
        assert per["acc_stderr"] == pytest.approx(math.sqrt(0.25 / 3))
        assert per["prefill_s"] == 0.5 and per["cache_mib"] == 3.0
    assert res["trials"][1]["continuation"] == " 12345 is"


def test_runner_retrieval_and_text_files(model, tokenizer, tmp_path, prefix_logprob):
    text = " ".join(FILLER * 12)
    f = tmp_path / "fill.txt"
    f.write_text(text)
    out = evaluate(
        model,
        tokenizer,
        ["passkey"],
        texts=[f],
        block_len=16,
        max_blocks=2,
        retrieval_lengths=[220],
        trials=2,
        progress=False,
    )
    pk = out["results"]["passkey"]
    assert pk["acc,none"] == pk["acc@220,none"] and pk["acc,none"] in (0.0, 0.5, 1.0)
    assert len(out["samples"]["passkey"]) == 2 and out["config"]["headline"]["passkey"] == "acc,none"
    res = out["results"]["text:fill"]
    blocks, n = text_blocks(tokenizer, text, 16)
    assert res["perplexity,none"] == pytest.approx(perplexity(model, blocks[:2], progress=False)["ppl"])
    # hand reference: one forward per scored token
    nll = [-prefix_logprob(model, blocks[b].tolist(), j) for b in range(2) for j in range(1, 16)]
    assert res["perplexity,none"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert out["n-samples"]["text:fill"] == {"original": n, "effective": 2}
    only = evaluate(model, tokenizer, [], texts=[f], block_len=16, max_blocks=1, progress=False)
    assert list(only["results"]) == ["text:fill"]
    with pytest.raises(FileNotFoundError, match="texts"):
        evaluate(model, tokenizer, [], texts=[tmp_path / "missing.txt"], progress=False)
    with pytest.raises(ValueError, match="fewer than one block"):
        evaluate(model, tokenizer, [], texts=[f], block_len=100_000, progress=False)
