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
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..data import blocks as wikitext_blocks
from .multiple_choice import accuracy_metrics, score_items
from .perplexity import check_block_args, perplexity, text_blocks
from .retrieval import RETRIEVAL_TASKS, evaluate_retrieval
from .tasks import TASKS, Source, load_task
from .utils import check_limit, mean_stderr, model_device

logger = logging.getLogger(__name__)

ALL_TASKS = ("wikitext", "piqa", "hellaswag", "arc_easy")
#: every task ``evaluate`` knows: the F.3 suite (the default) and in-context retrieval
KNOWN_TASKS = ALL_TASKS + RETRIEVAL_TASKS
RETRIEVAL_LENGTHS = (1024, 2048, 4096, 8192)
PAPER_BLOCK_LEN = 4096
NORM_DESCRIPTION = {
    "tokens": "log-likelihood / continuation token count (F.3)",
    "chars": "log-likelihood / option-text character count, leading space excluded (F.3; = lm-eval acc_norm)",
}


def check_tasks(tasks: Sequence[str]) -> list[str]:
    tasks = list(tasks)
    unknown = [t for t in tasks if t not in KNOWN_TASKS]
    if not tasks or unknown:
        raise ValueError(f"tasks: expected a non-empty subset of {KNOWN_TASKS}, got {tasks}")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"tasks: expected each task once, got {tasks}")
    return tasks


def _metric_entries(task: str, metrics: dict[str, float]) -> dict:
    # lm-eval writes "N/A" where a standard error cannot be computed (n < 2)
    entries = {f"{k},none": ("N/A" if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}
    return {"alias": task, **entries}


def _ppl_entries(task: str, ppl: dict) -> dict:
    keys = ("n_tokens", "n_blocks")
    return {"alias": task, "perplexity,none": ppl["ppl"], "nll_mean,none": ppl["nll_mean"], **{k: ppl[k] for k in keys}}


def _retrieval_entries(task: str, res: dict) -> dict:
    """Overall accuracy over every trial, then per context length (``acc@<L>,none``)."""
    correct = [float(r["correct"]) for r in res["trials"]]
    stderr = mean_stderr(correct)
    out = {
        "alias": task,
        "acc,none": sum(correct) / len(correct),
        "acc_stderr,none": "N/A" if math.isnan(stderr) else stderr,
    }
    for length, r in res["per_length"].items():
        out[f"acc@{length},none"] = r["acc"]
        out[f"acc_stderr@{length},none"] = "N/A" if math.isnan(r["acc_stderr"]) else r["acc_stderr"]
        out[f"prefill_s@{length},none"] = r["prefill_s"]
        out[f"cache_mib@{length},none"] = r["cache_mib"]
    return out


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
    texts: Sequence[str | os.PathLike] = (),
    retrieval_lengths: Sequence[int] = RETRIEVAL_LENGTHS,
    trials: int = 20,
    n_keys: int = 4,
    seed: int = 0,
) -> dict:
    """Run ``tasks`` (subset of ``wikitext``, ``piqa``, ``hellaswag``, ``arc_easy`` per App. F.3, and the
    retrieval tasks ``passkey`` / ``multikey`` of :mod:`oal.evaluation.retrieval`), then the perplexity of each
    local text file in ``texts`` (task ``text:<file stem>``, same blocks as WikiText).

    ``limit`` keeps the first N items of each multiple-choice task; ``max_blocks`` the first N blocks of
    ``block_len`` tokens. ``batch_size`` counts (context, option) sequences per forward, ``ppl_batch_size`` blocks.
    Retrieval: ``trials`` prompts per context length in ``retrieval_lengths``, ``n_keys`` pairs for multikey,
    prompts drawn from ``seed``. Returns ``{"results", "config", "n-samples"}``; ``config["time_s"]`` has each
    task's wall time.
    """
    tasks = check_tasks(tasks) if tasks or not texts else []
    text_files = [Path(t) for t in texts]
    for f in text_files:
        if not f.is_file():
            raise FileNotFoundError(f"texts: no such file: {f}")
    names = [f"text:{f.stem}" for f in text_files]
    if len(set(names)) != len(names):
        raise ValueError(f"texts: expected files with distinct names (stems), got {[str(f) for f in text_files]}")
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
    samples: dict[str, list] = {}
    for task in tasks:
        start = time.perf_counter()
        if task == "wikitext":
            stream = wikitext_blocks(tokenizer, "test", block_len, data_dir=data_dir, source=source)
            sources[task] = stream.source
            n_all = stream.ids.shape[0]
            blocks = stream.ids[:max_blocks]
            ppl = perplexity(model, blocks, batch_size=ppl_batch_size, device=device, progress=progress)
            results[task] = _ppl_entries(task, ppl)
            n_samples[task] = {"original": n_all, "effective": ppl["n_blocks"]}
        elif task in RETRIEVAL_TASKS:
            res = evaluate_retrieval(
                model,
                tokenizer,
                task=task,
                lengths=retrieval_lengths,
                trials=trials,
                n_keys=n_keys,
                seed=seed,
                progress=progress,
            )
            results[task] = _retrieval_entries(task, res)
            samples[task] = res["trials"]
            sources[task] = (
                f"synthetic:{task} (seed {seed}, filler haystack{f', {n_keys} keys' if task == 'multikey' else ''})"
            )
            n_samples[task] = {"original": len(res["trials"]), "effective": len(res["trials"])}
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
    for name, f in zip(names, text_files, strict=True):
        start = time.perf_counter()
        ids, n_all = text_blocks(tokenizer, f.read_text(encoding="utf-8"), block_len, what=f"texts: {f}")
        ppl = perplexity(model, ids[:max_blocks], batch_size=ppl_batch_size, device=device, progress=progress)
        results[name] = _ppl_entries(name, ppl)
        n_samples[name] = {"original": n_all, "effective": ppl["n_blocks"]}
        sources[name] = f"file:{f}"
        timings[name] = time.perf_counter() - start
    config = {
        "model": model_name,
        "model_dtype": str(next(model.parameters()).dtype),
        "device": str(device),
        "protocol": "App. F.3: zero-shot, no chat template, no BOS/EOS",
        "limit": limit,
        "block_len": block_len if "wikitext" in tasks or names else None,
        "max_blocks": max_blocks if "wikitext" in tasks or names else None,
        "batch_size": batch_size,
        "data_source": sources,
        "headline": {
            **{
                t: "perplexity,none" if t == "wikitext" else "acc,none" if t in RETRIEVAL_TASKS else "acc_norm,none"
                for t in tasks
            },
            **{name: "perplexity,none" for name in names},
        },
        "retrieval": {"lengths": list(retrieval_lengths), "trials": trials, "n_keys": n_keys, "seed": seed}
        if any(t in RETRIEVAL_TASKS for t in tasks)
        else None,
        "acc_norm": {t: NORM_DESCRIPTION[TASKS[t].norm] for t in tasks if t in TASKS},
        "time_s": timings,
    }
    out = {"results": results, "config": config, "n-samples": n_samples}
    if samples:
        out["samples"] = samples
    return out
