"""The App. F.3 evaluation suite on one model, with results in lm-eval's JSON shape.

``results[task]`` holds ``"<metric>,none"`` values as lm-eval writes them. The headline numbers are
``perplexity,none`` for ``wikitext`` and ``acc_norm,none`` for the multiple-choice tasks, where ``acc_norm`` is
F.3's normalisation (per token for PIQA/HellaSwag, per character for ARC-E). Because lm-eval's own ``acc_norm``
is per character for every task, ``acc_norm_chars,none`` is reported too (equal to lm-eval's ``acc_norm``), and
``acc_norm_tokens,none`` for symmetry.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..data import blocks as wikitext_blocks
from .multiple_choice import accuracy_metrics, score_items
from .perplexity import check_block_args, perplexity
from .tasks import TASKS, Source, load_task
from .utils import check_limit, model_device

logger = logging.getLogger(__name__)

ALL_TASKS = ("wikitext", "piqa", "hellaswag", "arc_easy")
PAPER_BLOCK_LEN = 4096
NORM_DESCRIPTION = {
    "tokens": "log-likelihood / continuation token count (F.3)",
    "chars": "log-likelihood / option-text character count, leading space excluded (F.3; = lm-eval acc_norm)",
}


def check_tasks(tasks: Sequence[str]) -> list[str]:
    tasks = list(tasks)
    unknown = [t for t in tasks if t not in ALL_TASKS]
    if not tasks or unknown:
        raise ValueError(f"tasks: expected a non-empty subset of {ALL_TASKS}, got {tasks}")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"tasks: expected each task once, got {tasks}")
    return tasks


def _metric_entries(task: str, metrics: dict[str, float]) -> dict:
    # lm-eval writes "N/A" where a standard error cannot be computed (n < 2)
    entries = {f"{k},none": ("N/A" if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}
    return {"alias": task, **entries}


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[str] = ALL_TASKS,
    *,
    limit: int | None = None,
    block_len: int = PAPER_BLOCK_LEN,
    max_blocks: int | None = None,
    data_dir: str | os.PathLike | None = None,
    source: Source = "auto",
    batch_size: int = 8,
    ppl_batch_size: int = 1,
    device: str | torch.device | None = None,
    progress: bool = True,
    model_name: str = "",
) -> dict:
    """Run ``tasks`` (subset of ``wikitext``, ``piqa``, ``hellaswag``, ``arc_easy``) per App. F.3.

    ``limit`` keeps the first N items of each multiple-choice task; ``max_blocks`` the first N WikiText blocks of
    ``block_len`` tokens. ``batch_size`` counts (context, option) sequences per forward, ``ppl_batch_size`` blocks.
    Returns ``{"results", "config", "n-samples"}``; ``config["time_s"]`` has each task's wall time.
    """
    tasks = check_tasks(tasks)
    check_limit(limit)
    check_block_args(block_len, max_blocks)
    for name, value in (("batch_size", batch_size), ("ppl_batch_size", ppl_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    device = torch.device(device) if device is not None else model_device(model)
    results: dict[str, dict] = {}
    n_samples: dict[str, dict] = {}
    sources: dict[str, str] = {}
    timings: dict[str, float] = {}
    for task in tasks:
        start = time.perf_counter()
        if task == "wikitext":
            stream = wikitext_blocks(tokenizer, "test", block_len, data_dir=data_dir, source=source)
            sources[task] = stream.source
            n_all = stream.ids.shape[0]
            blocks = stream.ids[:max_blocks]
            ppl = perplexity(model, blocks, batch_size=ppl_batch_size, device=device, progress=progress)
            results[task] = {
                "alias": task,
                "perplexity,none": ppl["ppl"],
                "nll_mean,none": ppl["nll_mean"],
                "n_tokens": ppl["n_tokens"],
                "n_blocks": ppl["n_blocks"],
            }
            n_samples[task] = {"original": n_all, "effective": ppl["n_blocks"]}
        else:
            data = load_task(task, data_dir=data_dir, source=source, limit=limit)
            sources[task] = data.source
            scores = score_items(
                model, tokenizer, data.items, batch_size=batch_size, device=device, progress=progress, description=task
            )
            results[task] = _metric_entries(task, accuracy_metrics(scores, TASKS[task].norm))
            n_samples[task] = {"original": data.n_original, "effective": len(data.items)}
        timings[task] = time.perf_counter() - start
        logger.info("%s done in %.1f s", task, timings[task])
    config = {
        "model": model_name,
        "model_dtype": str(next(model.parameters()).dtype),
        "device": str(device),
        "protocol": "App. F.3: zero-shot, no chat template, no BOS/EOS",
        "limit": limit,
        "block_len": block_len if "wikitext" in tasks else None,
        "max_blocks": max_blocks if "wikitext" in tasks else None,
        "batch_size": batch_size,
        "data_source": sources,
        "headline": {t: "perplexity,none" if t == "wikitext" else "acc_norm,none" for t in tasks},
        "acc_norm": {t: NORM_DESCRIPTION[TASKS[t].norm] for t in tasks if t in TASKS},
        "time_s": timings,
    }
    return {"results": results, "config": config, "n-samples": n_samples}
