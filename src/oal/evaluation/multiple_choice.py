"""Zero-shot multiple choice by conditional log-likelihood (App. F.3), scored the way lm-eval scores it.

Each option is the continuation ``" " + choice`` of the item's context. Its log-likelihood is the sum of the
log-probabilities of the continuation tokens only (context tokens are not scored). Metrics, per item
(argmax ties go to the first option, as ``np.argmax``):

* ``acc``: argmax of the summed log-likelihood (lm-eval's ``acc``);
* ``acc_norm_tokens``: argmax of log-likelihood / continuation token count (F.3 for PIQA and HellaSwag);
* ``acc_norm_chars``: argmax of log-likelihood / character count of the option text without the added space
  (F.3 for ARC-E; lm-eval's ``acc_norm`` for every task);
* ``acc_norm``: the F.3 normalisation of the task, the headline number.

Tokenisation follows lm-eval's causal-LM path: trailing spaces of the context move to the continuation,
``whole = encode(context + continuation)``, ``context_enc = encode(context)`` and the continuation tokens are
``whole[len(context_enc):]``, all without special tokens (F.3: no BOS/EOS). With byte-level BPE tokenizers such as
SmolLM2's the space opens a new pre-token, so ``context_enc`` is a prefix of ``whole`` and the split is exact.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from rich.progress import track
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .tasks import MultipleChoiceItem
from .utils import mean_stderr, model_device

Norm = Literal["tokens", "chars"]
NORMS = ("tokens", "chars")
TARGET_DELIMITER = " "


@dataclass(frozen=True)
class LogLikelihood:
    """Summed log-probability of a continuation, its token count, and whether greedy decoding produces it."""

    logprob: float
    n_tokens: int
    is_greedy: bool


@dataclass(frozen=True)
class ItemScores:
    """Per-option log-likelihoods, continuation token counts and option-text character counts of one item."""

    logprobs: tuple[float, ...]
    n_tokens: tuple[int, ...]
    n_chars: tuple[int, ...]
    gold: int

    def prediction(self, norm: Norm | None = None) -> int:
        """Chosen option: unnormalised (``None``), per token (``"tokens"``) or per character (``"chars"``)."""
        if norm is None:
            values = self.logprobs
        elif norm in NORMS:
            lengths = self.n_tokens if norm == "tokens" else self.n_chars
            values = tuple(lp / n for lp, n in zip(self.logprobs, lengths, strict=True))
        else:
            raise ValueError(f"norm: expected None or one of {NORMS}, got {norm!r}")
        return max(range(len(values)), key=values.__getitem__)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_pair(tokenizer: PreTrainedTokenizerBase, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation token ids, split the lm-eval way (see the module docstring)."""
    if not context:
        raise ValueError("context: expected a non-empty string (no BOS is added, so nothing would condition)")
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = _encode(tokenizer, context + continuation)
    context_enc = _encode(tokenizer, context)
    continuation_enc = whole[len(context_enc) :]
    if not context_enc or not continuation_enc:
        raise ValueError(f"continuation: {continuation!r} after {context[-40:]!r} encodes to no tokens of its own")
    return context_enc, continuation_enc


@torch.inference_mode()
def loglikelihoods(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    requests: Sequence[tuple[str, str]],
    *,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
    description: str = "loglikelihood",
) -> list[LogLikelihood]:
    """Log-likelihood of each ``(context, continuation)`` request, continuation tokens only, in request order.

    The model reads ``(context + continuation)[:-1]``. Requests are sorted by length (longest first) and
    ``batch_size`` of them go through one forward, right-padded: under causal attention the padded tail cannot
    reach earlier positions, so no attention mask is passed (which also suits kernels that take none), and
    position ids stay 0..T-1 as in an unpadded forward. Models whose forward takes ``logits_to_keep``
    (transformers' causal LMs) compute logits only from the batch's first scored position on.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    device = torch.device(device) if device is not None else model_device(model)
    encoded = [encode_pair(tokenizer, ctx, cont) for ctx, cont in requests]
    inputs = [(ctx + cont)[:-1] for ctx, cont in encoded]
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    results: list[LogLikelihood | None] = [None] * len(inputs)
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
    for batch in track(batches, description=description, disable=not progress, total=len(batches)):
        width = len(inputs[batch[0]])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(inputs[i])] = torch.tensor(inputs[i])
        first = min(len(inputs[i]) - len(encoded[i][1]) for i in batch)
        kwargs = {"logits_to_keep": width - first} if keep_logits else {}
        logits = model(input_ids=ids.to(device), use_cache=False, **kwargs).logits
        offset = width - logits.shape[1]  # sequence position of logits[:, 0]
        for row, i in enumerate(batch):
            target = torch.tensor(encoded[i][1], device=logits.device)
            stop = len(inputs[i]) - offset
            logp = logits[row, stop - len(target) : stop].float().log_softmax(-1)
            results[i] = LogLikelihood(
                logprob=logp.gather(-1, target[:, None]).double().sum().item(),
                n_tokens=len(target),
                is_greedy=bool((logp.argmax(-1) == target).all()),
            )
    return results  # type: ignore[return-value]


def score_items(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    items: Sequence[MultipleChoiceItem],
    *,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
    description: str = "multiple choice",
) -> list[ItemScores]:
    """Score every option of every item (one request per option, batched across items)."""
    requests = [(item.context, TARGET_DELIMITER + choice) for item in items for choice in item.choices]
    lls = iter(
        loglikelihoods(
            model, tokenizer, requests, batch_size=batch_size, device=device, progress=progress, description=description
        )
    )
    scores = []
    for item in items:
        option = [next(lls) for _ in item.choices]
        scores.append(
            ItemScores(
                logprobs=tuple(o.logprob for o in option),
                n_tokens=tuple(o.n_tokens for o in option),
                n_chars=tuple(len(c) for c in item.choices),
                gold=item.gold,
            )
        )
    return scores


def accuracy_metrics(scores: Sequence[ItemScores], norm: Norm) -> dict[str, float]:
    """``acc``, ``acc_norm`` (F.3 normalisation ``norm``), ``acc_norm_tokens``, ``acc_norm_chars``, each with its
    ``*_stderr`` (lm-eval's: sample standard error of the mean, sqrt(p (1 - p) / (n - 1)))."""
    if norm not in NORMS:
        raise ValueError(f"norm: expected one of {NORMS}, got {norm!r}")
    if not scores:
        raise ValueError("scores: expected at least one scored item, got none")
    hits = {
        "acc": [float(s.prediction() == s.gold) for s in scores],
        "acc_norm": [float(s.prediction(norm) == s.gold) for s in scores],
        "acc_norm_tokens": [float(s.prediction("tokens") == s.gold) for s in scores],
        "acc_norm_chars": [float(s.prediction("chars") == s.gold) for s in scores],
    }
    out: dict[str, float] = {}
    for name, values in hits.items():
        out[name] = sum(values) / len(values)
        out[f"{name}_stderr"] = mean_stderr(values)
    return out
