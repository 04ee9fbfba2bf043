"""``oal demo``: measure the original and the converted model on the same inputs and write one report.

Per model (loaded once, in this process, ``threads`` torch threads):

1. perplexity on ``ppl_blocks`` blocks of ``block_len`` tokens of two held-out texts — WikiText-2 **test** and the
   Python reference topics (``oal.data.domains``; neither calibration nor head scoring read them);
2. passkey retrieval (:func:`oal.evaluation.retrieval.evaluate_retrieval`) at ``passkey_lengths``, ``trials``
   prompts each, the same prompts for both models;
3. decode: a prefill of ``n`` seeded random tokens into a fresh cache (timed), 2 untimed then ``decode_steps``
   timed greedy steps (median ms/token), and the cache's bytes, at each of ``decode_lengths``;
4. greedy continuations of :data:`PROMPTS`.

Every stage's result is written atomically to ``out/<model>/<stage>.json`` with the config it was measured under;
a rerun with the same config reuses it (resume), a changed config recomputes it. ``report.md``, ``report.json``
and ``demo.png`` are written from the stage files.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..io import provenance, read_json, write_json

log = logging.getLogger(__name__)

PROMPTS = (
    "The capital of France is",
    "Here is a short recipe for pancakes:",
    "def fibonacci(n):",
)
MODELS = ("original", "converted")
MB = 2**20


@dataclass(frozen=True)
class DemoConfig:
    """What the demo measures (the defaults take about 6 minutes on the 2-core CPU; ``gpu()`` for a GPU)."""

    original: str = "smollm2-135m"
    converted: str = "docs/results/conversion/model"
    block_len: int = 1024
    ppl_blocks: int = 8
    passkey_lengths: tuple[int, ...] = (1024, 4096)
    trials: int = 10
    decode_lengths: tuple[int, ...] = (1024, 8192)
    decode_steps: int = 16
    max_new_tokens: int = 40
    prompts: tuple[str, ...] = PROMPTS
    threads: int = 2
    device: str = "cpu"
    seed: int = 0
    data_dir: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("block_len", "ppl_blocks", "trials", "decode_steps", "max_new_tokens", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("passkey_lengths", "decode_lengths"):
            value = getattr(self, name)
            if not value or any(isinstance(n, bool) or not isinstance(n, int) or n < 16 for n in value):
                raise ValueError(f"{name}: expected context lengths (ints >= 16), got {value!r}")

    @classmethod
    def gpu(cls, **kw) -> DemoConfig:
        """A preset for one CUDA GPU: longer contexts, more trials and blocks."""
        base = dict(
            device="cuda",
            ppl_blocks=32,
            passkey_lengths=(1024, 4096, 8192),
            trials=40,
            decode_lengths=(1024, 8192, 16384),
            decode_steps=64,
        )
        return cls(**{**base, **kw})


def _load(name: str, config: DemoConfig):
    from ..models import load_model, load_tokenizer

    path = config.original if name == "original" else config.converted
    model = load_model(path, device=config.device)
    return model.eval(), load_tokenizer(path)


def _stage(out: Path, model: str, stage: str, key: dict, compute: Callable[[], dict], seconds: dict) -> dict:
    """Result of one (model, stage), reused from ``out/model/stage.json`` when it was measured under ``key``;
    the seconds it took when measured go into ``seconds[f"{model}/{stage}"]``."""
    path = out / model / f"{stage}.json"
    if path.is_file():
        saved = read_json(path, what=f"{model} {stage} result")
        if saved.get("key") == key:
            log.info("%s %s: reusing %s", model, stage, path)
            seconds[f"{model}/{stage}"] = saved["seconds"]
            return saved["result"]
    start = time.perf_counter()
    result = compute()
    took = time.perf_counter() - start
    write_json(path, {"key": key, "result": result, "seconds": took})
    log.info("%s %s: %.1f s", model, stage, took)
    seconds[f"{model}/{stage}"] = took
    return result


def _perplexities(model, tokenizer, config: DemoConfig) -> dict:
    from ..data.domains import domain_text
    from ..data.tokens import blocks
    from ..evaluation.perplexity import perplexity, text_blocks

    wiki = blocks(tokenizer, "test", config.block_len, data_dir=config.data_dir, max_blocks=config.ppl_blocks)
    pydoc, _ = text_blocks(tokenizer, domain_text("pydoc"), config.block_len, what="pydoc")
    out = {}
    for name, ids, source in (
        ("wikitext-2 test", wiki.ids, wiki.source),
        ("python docs", pydoc[: config.ppl_blocks], "pydoc_data.topics"),
    ):
        r = perplexity(model, ids, progress=True)
        out[name] = {**r, "source": source}
    return out


def _passkey(model, tokenizer, config: DemoConfig) -> dict:
    from ..evaluation.retrieval import evaluate_retrieval

    r = evaluate_retrieval(
        model, tokenizer, task="passkey", lengths=config.passkey_lengths, trials=config.trials, seed=config.seed
    )
    return {"per_length": r["per_length"], "trials": r["trials"]}


@torch.no_grad()
def _decode(model, config: DemoConfig) -> dict:
    from ..models import KernelCache
    from ..models.state_cache import cache_nbytes

    out = {}
    device = torch.device(config.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for n in config.decode_lengths:
        gen = torch.Generator().manual_seed(config.seed)
        ids = torch.randint(model.config.vocab_size, (1, n), generator=gen).to(device)
        cache = KernelCache(model)
        start = time.perf_counter()
        logits = model(ids, cache=cache, logits_to_keep=1).logits
        sync()
        prefill = time.perf_counter() - start
        token = logits[:, -1:].argmax(-1)
        times = []
        for step in range(2 + config.decode_steps):
            t0 = time.perf_counter()
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
            sync()
            if step >= 2:
                times.append(time.perf_counter() - t0)
        out[str(n)] = {
            "prefill_s": prefill,
            "ms_per_token": statistics.median(times) * 1e3,
            "cache_mb": cache_nbytes(cache) / MB,
            "steps": config.decode_steps,
        }
        del cache
        gc.collect()
    return out


def _continuations(model, tokenizer, config: DemoConfig) -> dict:
    from ..conversion.generate import generate_text

    return {p: generate_text(model, tokenizer, p, max_new_tokens=config.max_new_tokens).text for p in config.prompts}


def run_demo(out: str | Path, config: DemoConfig = DemoConfig()) -> dict:
    """Measure both models (resuming finished stages), write ``report.json``, ``report.md`` and ``demo.png`` into
    ``out``, and return the report."""
    from .report import write_report

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(config.threads)
    started = time.perf_counter()
    results: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    for name in MODELS:
        model, tokenizer = _load(name, config)
        base = {"model": config.original if name == "original" else config.converted, "device": config.device}
        results[name] = {
            "perplexity": _stage(
                out,
                name,
                "perplexity",
                {**base, "block_len": config.block_len, "blocks": config.ppl_blocks},
                lambda m=model, t=tokenizer: _perplexities(m, t, config),
                seconds,
            ),
            "passkey": _stage(
                out,
                name,
                "passkey",
                {**base, "lengths": list(config.passkey_lengths), "trials": config.trials, "seed": config.seed},
                lambda m=model, t=tokenizer: _passkey(m, t, config),
                seconds,
            ),
            "decode": _stage(
                out,
                name,
                "decode",
                {
                    **base,
                    "lengths": list(config.decode_lengths),
                    "steps": config.decode_steps,
                    "threads": config.threads,
                    "seed": config.seed,
                },
                lambda m=model: _decode(m, config),
                seconds,
            ),
            "continuations": _stage(
                out,
                name,
                "continuations",
                {**base, "prompts": list(config.prompts), "max_new_tokens": config.max_new_tokens},
                lambda m=model, t=tokenizer: _continuations(m, t, config),
                seconds,
            ),
        }
        del model
        gc.collect()
    report = {
        "config": {k: v for k, v in asdict(config).items() if k != "extra"},
        "results": results,
        "stage_seconds": seconds,
        "provenance": provenance(),
        "wall_s": time.perf_counter() - started,
    }
    write_report(out, report)
    return report
