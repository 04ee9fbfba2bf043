"""``oal demo``: measure the original and the converted model on the same inputs and write one report.

Per model (loaded once, in this process, ``threads`` torch threads):

1. perplexity on ``ppl_blocks`` blocks of ``block_len`` tokens of two held-out texts — WikiText-2 **test** and the
   Python reference topics (``oal.data.domains``; neither calibration nor head scoring read them);
2. passkey retrieval (:func:`oal.evaluation.retrieval.evaluate_retrieval`) at ``passkey_lengths``, ``trials``
   prompts each, the same prompts for both models;
3. greedy continuations of :data:`PROMPTS`.

Then speed, with both models loaded in this process and measured side by side (:func:`speed`; this machine's speed
swings ±30 % between minutes, so figures taken minutes apart do not compare): after one untimed prompt per model
(the shortest context), at each of ``decode_lengths`` rounds of one timed prefill of ``n`` seeded random tokens into a
fresh cache per model (the order reversed every round; ``speed_rounds`` rounds, more at short contexts so that each
model prefills ``prefill_tokens`` tokens in all: :meth:`DemoConfig.prefill_rounds`), then from the last round's caches 2
untimed and ``decode_steps`` timed greedy steps per model taken in turn (the order reversed every step), and the
caches' bytes.

Every stage's result is written atomically to ``out/<model>/<stage>.json`` (``out/speed.json`` for speed) with the
config it was measured under; a rerun with the same config reuses it (resume), a changed config recomputes it, and
a model is loaded only for stages that are computed. ``report.md``, ``report.json`` and ``demo.png`` are written
from the stage files.
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
    """What the demo measures (the defaults take about 11 minutes on the 2-core CPU, 3 of them the side-by-side
    prefill rounds at 8k; ``gpu()`` for a GPU). ``speed_rounds``: prefill rounds per context at least;
    ``prefill_tokens``: the tokens each model prefills per context in all, for more rounds at short contexts
    (:meth:`prefill_rounds`)."""

    original: str = "smollm2-135m"
    converted: str = "docs/results/conversion/model"
    block_len: int = 1024
    ppl_blocks: int = 8
    passkey_lengths: tuple[int, ...] = (1024, 4096)
    trials: int = 10
    decode_lengths: tuple[int, ...] = (1024, 8192)
    decode_steps: int = 32
    speed_rounds: int = 3
    prefill_tokens: int = 8192
    max_new_tokens: int = 40
    prompts: tuple[str, ...] = PROMPTS
    threads: int = 2
    device: str = "cpu"
    seed: int = 0
    data_dir: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive = ("block_len", "ppl_blocks", "trials", "decode_steps", "speed_rounds", "prefill_tokens")
        for name in (*positive, "max_new_tokens", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("passkey_lengths", "decode_lengths"):
            value = getattr(self, name)
            if not value or any(isinstance(n, bool) or not isinstance(n, int) or n < 16 for n in value):
                raise ValueError(f"{name}: expected context lengths (ints >= 16), got {value!r}")

    def prefill_rounds(self, n: int) -> int:
        """Prefill rounds at context ``n``: ``speed_rounds``, or as many as ``prefill_tokens`` tokens take where that
        is more (a 1k prompt's time swings most: 8 rounds at 1k, 3 at 8k by default; one demo's 3 rounds at 1k
        gave ratios 1.03–1.31 where benchmarks/prefill_ab.py's 6–8 gave medians 0.89–1.04 in five processes)."""
        return max(self.speed_rounds, -(-self.prefill_tokens // n))

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


def _stage(path: Path, label: str, key: dict, compute: Callable[[], dict], seconds: dict) -> dict:
    """Result of one stage, reused from ``path`` when it was measured under ``key``; the seconds it took when
    measured go into ``seconds[label]``."""
    if path.is_file():
        saved = read_json(path, what=f"{label} result")
        if saved.get("key") == key:
            log.info("%s: reusing %s", label, path)
            seconds[label] = saved["seconds"]
            return saved["result"]
    start = time.perf_counter()
    result = compute()
    took = time.perf_counter() - start
    write_json(path, {"key": key, "result": result, "seconds": took})
    log.info("%s: %.1f s", label, took)
    seconds[label] = took
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


def _quartiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3


@torch.no_grad()
def speed(models: dict[str, torch.nn.Module], config: DemoConfig, progress: bool = True) -> dict:
    """Prefill and decode of ``models`` (name → model, measured in this order first) side by side, after one
    untimed prompt of the shortest context per model, at each of ``config.decode_lengths``: per context, per model
    ``prefill_s`` (the median of :meth:`DemoConfig.prefill_rounds` rounds, the order of the models reversed every round;
    ``prefill_rounds`` each), ``ms_per_token`` (the median of ``decode_steps`` greedy steps from the last round's
    cache, the models taken in turn and the order reversed every step, after 2 untimed steps each; ``step_ms``
    each) and ``cache_mb``; with two models, ``ratios``: the second's over the first's prefill per round and decode
    per step pair (a ratio above 1 is slower)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..models import KernelCache
    from ..models.state_cache import cache_nbytes

    device = torch.device(config.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    names = list(models)
    vocabs = {m.config.vocab_size for m in models.values()}
    if len(vocabs) != 1:
        raise ValueError(f"models: expected one vocabulary size for the same prompts, got {sorted(vocabs)}")
    vocab = vocabs.pop()
    out = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not progress) as bar:
        total = sum(config.prefill_rounds(n) for n in config.decode_lengths) * len(names)
        task = bar.add_task("speed", total=total)
        # an untimed prompt per model first: a process's first prompt pages the weights in and loads the kernels
        warm = torch.randint(vocab, (1, min(config.decode_lengths)), generator=torch.Generator().manual_seed(0))
        for name in names:
            bar.update(task, description=f"warm-up prompt, {name}")
            models[name](warm.to(device), cache=KernelCache(models[name]), logits_to_keep=1)
            sync()
        for n in config.decode_lengths:
            gen = torch.Generator().manual_seed(config.seed)
            ids = torch.randint(vocab, (1, n), generator=gen).to(device)
            prefill: dict[str, list[float]] = {name: [] for name in names}
            state: dict[str, tuple] = {}
            for r in range(config.prefill_rounds(n)):
                for name in names if r % 2 == 0 else names[::-1]:
                    bar.update(task, description=f"prefill {n} tokens, {name}, round {r + 1}")
                    state.pop(name, None)
                    gc.collect()
                    cache = KernelCache(models[name])
                    sync()
                    start = time.perf_counter()
                    logits = models[name](ids, cache=cache, logits_to_keep=1).logits
                    sync()
                    prefill[name].append(time.perf_counter() - start)
                    state[name] = (cache, logits[:, -1:].argmax(-1))
                    # the model's previous cache is freed before its next prompt, not kept by these names
                    del cache, logits
                    bar.advance(task)
            bar.update(task, description=f"decode at {n} tokens")
            steps: dict[str, list[float]] = {name: [] for name in names}
            for i in range(2 + config.decode_steps):
                for name in names if i % 2 == 0 else names[::-1]:
                    cache, token = state[name]
                    t0 = time.perf_counter()
                    token = models[name](token, cache=cache).logits[:, -1:].argmax(-1)
                    sync()
                    if i >= 2:
                        steps[name].append(1e3 * (time.perf_counter() - t0))
                    state[name] = (cache, token)
            point: dict = {
                name: {
                    "prefill_s": statistics.median(prefill[name]),
                    "prefill_rounds": prefill[name],
                    "ms_per_token": statistics.median(steps[name]),
                    "step_ms": steps[name],
                    "cache_mb": cache_nbytes(state[name][0]) / MB,
                }
                for name in names
            }
            if len(names) == 2:
                a, b = names
                point["ratios"] = {
                    "prefill_rounds": [y / x for x, y in zip(prefill[a], prefill[b], strict=True)],
                    "decode_step_quartiles": _quartiles([y / x for x, y in zip(steps[a], steps[b], strict=True)]),
                }
            out[str(n)] = point
            del state
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
    paths = {"original": config.original, "converted": config.converted}
    for name in MODELS:
        loaded: list = []

        def model_and_tokenizer(name=name, loaded=loaded):
            if not loaded:
                loaded.extend(_load(name, config))
            return loaded

        base = {"model": paths[name], "device": config.device}
        stages = {
            "perplexity": (
                {**base, "block_len": config.block_len, "blocks": config.ppl_blocks},
                lambda f=model_and_tokenizer: _perplexities(*f(), config),
            ),
            "passkey": (
                {**base, "lengths": list(config.passkey_lengths), "trials": config.trials, "seed": config.seed},
                lambda f=model_and_tokenizer: _passkey(*f(), config),
            ),
            "continuations": (
                {**base, "prompts": list(config.prompts), "max_new_tokens": config.max_new_tokens},
                lambda f=model_and_tokenizer: _continuations(*f(), config),
            ),
        }
        results[name] = {
            stage: _stage(out / name / f"{stage}.json", f"{name} {stage}", key, compute, seconds)
            for stage, (key, compute) in stages.items()
        }
        loaded.clear()
        gc.collect()
    speed_key = {
        "models": paths,
        "device": config.device,
        "lengths": list(config.decode_lengths),
        "steps": config.decode_steps,
        "rounds": config.speed_rounds,
        "prefill_tokens": config.prefill_tokens,
        "warm_up_tokens": min(config.decode_lengths),
        "threads": config.threads,
        "seed": config.seed,
    }
    side_by_side = _stage(
        out / "speed.json",
        "speed",
        speed_key,
        lambda: speed({name: _load(name, config)[0] for name in MODELS}, config),
        seconds,
    )
    gc.collect()
    report = {
        "config": {k: v for k, v in asdict(config).items() if k != "extra"},
        "results": results,
        "speed": side_by_side,
        "stage_seconds": seconds,
        "provenance": provenance(),
        "wall_s": time.perf_counter() - started,
    }
    write_report(out, report)
    return report
