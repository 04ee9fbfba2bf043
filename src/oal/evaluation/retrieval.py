"""In-context retrieval: the passkey task and its multi-key (associative recall) variant.

Passkey (as in Landmark Attention / LongLoRA): a random 5-digit key is hidden at a uniformly random depth of a
haystack of filler sentences; at the end the model is asked for it and decodes greedily. A trial is correct when
the first number in the continuation is the key. Multi-key: ``n_keys`` sentences "The pass key for <word> is
<number>." at independent random depths; the model is asked for one of them, so copying the wrong (or the last)
key fails.

Prompts are built at token level so that each trial has exactly the requested context length in tokens
(``length`` counts the whole prompt, question included): whole filler sentences are repeated until the next would
not fit, then the needle(s) are inserted between sentences. Each trial's key, depth and queried word come from a
generator seeded with ``(seed, length, trial)``, so two models are asked exactly the same prompts.

Haystacks: the default one is the classic repeated filler (three sentences, as in the literature); any list of
sentences can be given instead (e.g. running text, see :func:`sentences_from_text`).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.progress import Progress
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ..models.state_cache import cache_nbytes
from .utils import mean_stderr, model_device

__all__ = [
    "FILLER",
    "INTRO",
    "RETRIEVAL_TASKS",
    "RetrievalPrompt",
    "build_prompt",
    "evaluate_retrieval",
    "greedy_continuation",
    "retrieval_results",
    "sentences_from_text",
]

RETRIEVAL_TASKS = ("passkey", "multikey")
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
WORDS = (
    "apple", "river", "candle", "forest", "violin", "planet", "garden", "rocket", "silver", "island",
    "mirror", "tiger", "window", "pencil", "desert", "bridge", "castle", "dragon", "meadow", "harbor",
)  # fmt: skip
_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class RetrievalPrompt:
    """One trial: ``ids`` (the prompt's token ids, exactly the requested length), the expected ``answer``
    (digits), the needle's relative ``depth`` in [0, 1] (the queried needle's for multikey), the token span
    ``needle`` (start, stop) of the queried needle's answer digits within ids, the span ``sentence`` of the
    whole queried needle, and ``question``, the position where the question starts."""

    ids: list[int]
    answer: str
    depth: float
    needle: tuple[int, int]
    sentence: tuple[int, int]
    question: int
    query: str | None = None


def sentences_from_text(text: str, *, min_chars: int = 20) -> list[str]:
    """Sentences of running text (split after ``.``, ``!`` or ``?`` followed by a space), stripped, of at least
    ``min_chars`` characters: a natural-text haystack."""
    parts = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    out = [p.strip() for p in parts if len(p.strip()) >= min_chars]
    if not out:
        raise ValueError("text: expected running text with sentences, found none")
    return out


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_prompt(
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    rng: random.Random,
    *,
    task: str = "passkey",
    n_keys: int = 4,
    haystack: Sequence[str] = FILLER,
) -> RetrievalPrompt:
    """A prompt of exactly ``length`` tokens for ``task`` (``passkey`` or ``multikey``), drawn from ``rng``.

    The haystack's sentences are used in order, cycling; the remainder after the last whole sentence is filled
    with the start of the next sentence's tokens, so the length is exact."""
    if task not in RETRIEVAL_TASKS:
        raise ValueError(f"task: expected one of {RETRIEVAL_TASKS}, got {task!r}")
    if task == "multikey" and not 2 <= n_keys <= len(WORDS):
        raise ValueError(f"n_keys: expected an int in [2, {len(WORDS)}] for multikey, got {n_keys!r}")
    if not haystack:
        raise ValueError("haystack: expected at least one sentence")
    n_needles = 1 if task == "passkey" else n_keys
    keys = [str(rng.randint(10000, 99999)) for _ in range(n_needles)]
    words = rng.sample(WORDS, n_needles) if task == "multikey" else [None]
    target = rng.randrange(n_needles)
    if task == "passkey":
        needles = [(f" The pass key is {keys[0]}. Remember it. {keys[0]} is the pass key.", f" {keys[0]}")]
        question = " What is the pass key? The pass key is"
    else:
        needles = [
            (f" The pass key for {w} is {key}. Remember it. {key} is the pass key for {w}.", f" {key}")
            for w, key in zip(words, keys, strict=True)
        ]
        question = f" What is the pass key for {words[target]}? The pass key for {words[target]} is"
    intro, q_ids = _encode(tokenizer, INTRO), _encode(tokenizer, question)
    needle_ids = [_encode(tokenizer, text) for text, _ in needles]
    budget = length - len(intro) - len(q_ids) - sum(map(len, needle_ids))
    if budget < 1:
        raise ValueError(
            f"length: {length} tokens leave no room for a haystack (the instructions, needles and question take "
            f"{length - budget})"
        )
    filler: list[list[int]] = []
    n = 0
    i = rng.randrange(len(haystack))
    while True:
        s = _encode(tokenizer, " " + haystack[i % len(haystack)].strip())
        if n + len(s) > budget:
            tail = s[: budget - n]
            break
        filler.append(s)
        n += len(s)
        i += 1
    # needle positions: between whole sentences (0 … len(filler)), independent uniform depths
    slots = sorted(rng.randint(0, len(filler)) for _ in range(n_needles))
    ids = list(intro)
    needle_span, sentence, depth = (0, 0), (0, 0), 0.0
    k = 0
    for j in range(len(filler) + 1):
        while k < n_needles and slots[k] == j:
            start = len(ids)
            ids.extend(needle_ids[k])
            if k == target:
                # the answer digits sit after "... is" in the needle's first clause
                first = _locate(needle_ids[k], tokenizer, keys[k])
                needle_span = (start + first[0], start + first[1])
                sentence = (start, start + len(needle_ids[k]))
                depth = j / max(len(filler), 1)
            k += 1
        if j < len(filler):
            ids.extend(filler[j])
    ids.extend(tail)
    question_start = len(ids)
    ids.extend(q_ids)
    if len(ids) != length:
        raise AssertionError(f"built {len(ids)} tokens, expected {length}")
    return RetrievalPrompt(ids, keys[target], depth, needle_span, sentence, question_start, words[target])


def _locate(ids: list[int], tokenizer: PreTrainedTokenizerBase, key: str) -> tuple[int, int]:
    """The first token span of ``ids`` whose decoding holds ``key``: the needle's answer digits."""
    for start in range(len(ids)):
        for stop in range(start + 1, len(ids) + 1):
            if key in tokenizer.decode(ids[start:stop]):
                # shrink from the left to the minimal span
                while key in tokenizer.decode(ids[start + 1 : stop]):
                    start += 1
                return start, stop
    raise ValueError(f"key {key} is not in the needle's tokens")


@torch.inference_mode()
def greedy_continuation(
    model: PreTrainedModel, ids: Sequence[int], max_new_tokens: int
) -> tuple[list[int], float, int]:
    """Greedy continuation of one prompt with a fresh cache (converted layers keep their recurrent state):
    ``(new token ids, prefill seconds, cache bytes after the prefill)``."""
    device = model_device(model)
    x = torch.tensor([list(ids)], device=device)
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    out = model(input_ids=x, cache=cache, use_cache=True)
    prefill_s = time.perf_counter() - start
    nbytes = cache_nbytes(cache)
    new: list[int] = []
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(max_new_tokens):
        new.append(int(nxt))
        if len(new) == max_new_tokens:
            break
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return new, prefill_s, nbytes


def evaluate_retrieval(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    task: str = "passkey",
    lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    trials: int = 20,
    n_keys: int = 4,
    seed: int = 0,
    haystack: Sequence[str] = FILLER,
    max_new_tokens: int = 8,
    progress: bool = True,
) -> dict:
    """Accuracy of greedy retrieval per context length. Returns ``{"task", "per_length": {L: {"acc",
    "acc_stderr", "correct", "n", "prefill_s"}}, "trials": [...]}``; every trial records its answer, the
    continuation, its depth and whether it was correct."""
    if task not in RETRIEVAL_TASKS:
        raise ValueError(f"task: expected one of {RETRIEVAL_TASKS}, got {task!r}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials: expected an int >= 1, got {trials!r}")
    lengths = list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 16 for n in lengths):
        raise ValueError(f"lengths: expected context lengths (ints >= 16) in tokens, got {lengths!r}")
    records = []
    with Progress(disable=not progress) as bar:
        job = bar.add_task(task, total=len(lengths) * trials)
        for length in lengths:
            for t in range(trials):
                rng = random.Random(f"{seed}/{task}/{length}/{t}")
                p = build_prompt(tokenizer, length, rng, task=task, n_keys=n_keys, haystack=haystack)
                new, prefill_s, nbytes = greedy_continuation(model, p.ids, max_new_tokens)
                text = tokenizer.decode(new, skip_special_tokens=True)
                m = _NUMBER.search(text)
                records.append(
                    {
                        "length": length,
                        "trial": t,
                        "answer": p.answer,
                        "query": p.query,
                        "depth": round(p.depth, 4),
                        "continuation": text,
                        "correct": m is not None and m.group() == p.answer,
                        "prefill_s": round(prefill_s, 3),
                        "cache_mib": round(nbytes / 2**20, 3),
                    }
                )
                bar.advance(job)
    return retrieval_results(task, records, n_keys=n_keys if task == "multikey" else None)


def retrieval_results(task: str, records: list[dict], *, n_keys: int | None = None) -> dict:
    """Per-length accuracy (with its binomial standard error) from trial records."""
    per_length = {}
    for length in sorted({r["length"] for r in records}):
        rs = [r for r in records if r["length"] == length]
        n, correct = len(rs), sum(r["correct"] for r in rs)
        per_length[str(length)] = {
            "acc": correct / n,
            "acc_stderr": mean_stderr([float(r["correct"]) for r in rs]),
            "correct": correct,
            "n": n,
            "prefill_s": sum(r["prefill_s"] for r in rs) / n,
            "cache_mib": max(r.get("cache_mib", 0.0) for r in rs),
        }
    return {"task": task, "n_keys": n_keys, "per_length": per_length, "trials": records}
