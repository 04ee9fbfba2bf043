"""The decode benchmark (`oal bench decode`): per-token latency and memory of cached generation against the
context length, for the original model and its conversion (default: SmolLM2-135M with OAL on layers 3–26).

Every (model, N) point runs in a fresh interpreter (``python -m oal.bench.decode --point SPEC --result PATH``):

1. load the model (and convert it, or load a converted directory); ``torch.set_num_threads(threads)``;
2. an untimed first prompt of ``prompt_warmup`` random tokens into a cache thrown away (``first_call_s``: what a
   process pays once, the kernels' libraries, the thread pool and the weights' first touch, beside a short prompt;
   without it SmolLM2's recipe read 0.86× the original's 1k prefill speed, with it 0.99×, stop 49);
3. prefill N random tokens (seeded) into a fresh :class:`oal.models.KernelCache` (``logits_to_keep=1``), timed;
4. ``warmup`` greedy decode steps, then ``steps`` timed ones, each a forward of one token on the cache
   (``time.perf_counter``, device synchronised); ``ms_per_token`` is their median.

Memory: ``cache_mb`` is the bytes the cache holds after the last step (keys and values of softmax layers,
kernel states of converted ones: :func:`oal.models.state_cache.cache_nbytes`); ``peak_rss_mb`` the process's peak
resident set during the prefill (VmHWM reset after the model's load and the first prompt, whose own peak is
``load_peak_rss_mb``: in bf16 transformers' cast of the weights, above any prefill's; on CUDA the allocator's peak;
``--prompt-warmup 0``: a fresh process's first prompt, whose weights page in during it), ``heap_kept_mb`` how much of
the resident set at that point is freed heap glibc keeps (no data: fragmentation), ``decode_peak_mb`` the peak
above the resident memory before the decode steps, during them, and ``run_peak_rss_mb`` the process's peak over
both (memory the prefill returned to the system that the decode steps take again counts). Converted OAL layers
use synthetic groups when no ``groups``/``calibrated`` file is given (the last two dimensions of each head in a
second group): the recurrent OAL step costs the same for any grouping, since its packed state and coefficients
have fixed sizes.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from ..io import provenance, write_json, write_text
from ..ops.quadratic.cpu import PATH_FLAGS
from .devices import PROC_STATUS, get_device, heap_kept_bytes
from .machine import parse_dtype
from .op import _child_env, _describe_failure

SCHEMA = "oal.bench.decode/1"
RESULT_FILE = "decode.json"
REPORT_FILE = "decode.md"
FULL_SIZES = (1024, 2048, 4096, 8192)
QUICK_SIZES = (256, 512)
METHODS = ("original", "converted")
MB = 2**20


@dataclass(frozen=True)
class DecodeConfig:
    """What a point measures. ``converted``: a directory written by `oal convert` (then ``kernel``, ``layers``,
    ``groups`` and ``calibrated`` are not used)."""

    model: str = "smollm2-135m"
    kernel: str = "oal"
    layers: str = "3-26"
    groups: str | None = None
    calibrated: str | None = None
    converted: str | None = None
    batch: int = 1
    steps: int = 32
    warmup: int = 2
    prompt_warmup: int = 64
    dtype: str = "fp32"
    device: str = "cpu"
    threads: int = 1
    seed: int = 0
    point_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("batch", "steps", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("warmup", "prompt_warmup", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
        parse_dtype(self.dtype)
        get_device(self.device)
        for name in ("groups", "calibrated", "converted"):
            path = getattr(self, name)
            if path is not None and not Path(path).exists():
                raise FileNotFoundError(f"{name}: no such file or directory: {path}")

    @classmethod
    def from_dict(cls, data: dict) -> DecodeConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def synthetic_groups(num_heads: int, head_dim: int) -> torch.Tensor:
    """``(Hq, d)`` group ids with the last two dimensions of every head in group 1, the rest in group 0."""
    groups = torch.zeros(num_heads, head_dim, dtype=torch.long)
    groups[:, -2:] = 1
    return groups


def build_model(method: str, config: DecodeConfig) -> torch.nn.Module:
    """The original model or its conversion, in eval mode on the configured device and dtype."""
    from ..conversion import convert_model, parse_layers
    from ..models import attention_spec, load_model

    dtype, device = parse_dtype(config.dtype), get_device(config.device).device
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if method == "converted" and config.converted is not None:
        return load_model(config.converted, dtype=dtype, device=device)
    model = load_model(config.model, dtype=dtype, device=device)
    if method == "original":
        return model
    groups = config.groups
    if config.kernel == "oal" and groups is None and config.calibrated is None:
        spec = attention_spec(model)
        ids = synthetic_groups(spec.num_heads, spec.head_dim)
        groups = {i: ids for i in parse_layers(config.layers, spec.num_layers)}
    return convert_model(
        model, config.kernel, layers=config.layers, groups=groups, calibrated=config.calibrated, seed=config.seed
    )


def check_buildable(config: DecodeConfig, methods: tuple[str, ...] = METHODS) -> None:
    """Build the sweep's model once in this process (CPU, fp32: only to validate), so that bad input (a missing
    model, an unsupported architecture, layers out of range, groups of another model) fails before any point runs
    and before ``decode.json`` is touched, instead of as a failed point in every fresh process."""
    method = "converted" if "converted" in methods else "original"
    build_model(method, replace(config, device="cpu", dtype="fp32"))


def _process_peak_bytes(kind: str, device: torch.device) -> int:
    if kind == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    for line in PROC_STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{PROC_STATUS} has no VmHWM line")


def run_point(method: str, n: int, config: DecodeConfig) -> dict[str, object]:
    """Measure one point in this process (call it in a fresh one; see the module docstring)."""
    from ..models import KernelCache
    from ..models.prefill import release_freed_heap
    from ..models.state_cache import cache_nbytes

    torch.set_num_threads(config.threads)
    device = get_device(config.device)
    model = build_model(method, config)
    gen = torch.Generator().manual_seed(config.seed)
    ids = torch.randint(model.config.vocab_size, (config.batch, n), generator=gen).to(device.device)
    first_call_s = None
    if config.prompt_warmup:
        warm = torch.randint(model.config.vocab_size, (config.batch, config.prompt_warmup), generator=gen)
        with torch.no_grad():
            start = time.perf_counter()
            model(warm.to(device.device), cache=KernelCache(model), logits_to_keep=1)
            device.synchronize()
            first_call_s = time.perf_counter() - start
        # what the throwaway prompt freed goes back before the peak is reset, so that it does not count
        gc.collect()
        release_freed_heap()
    cache = KernelCache(model)
    # the load's own peak (in bf16 transformers' cast of the fp32 weights, above any prefill's), then the peak
    # measured from the prefill's start where the high-water mark can be reset
    load_peak = _process_peak_bytes(device.kind, device.device)
    from_prefill = device.reset_peak()
    with torch.no_grad():
        start = time.perf_counter()
        out = model(ids, cache=cache, logits_to_keep=1)
        device.synchronize()
        prefill_s = time.perf_counter() - start
        peak_rss = _process_peak_bytes(device.kind, device.device)
        kept = heap_kept_bytes() if device.kind == "cpu" else None
        token = out.logits[:, -1:].argmax(-1)
        times: list[float] = []

        def decode() -> None:
            nonlocal token
            for step in range(config.warmup + config.steps):
                t0 = time.perf_counter()
                logits = model(token, cache=cache).logits
                token = logits[:, -1:].argmax(-1)
                device.synchronize()
                if step >= config.warmup:
                    times.append(time.perf_counter() - t0)

        memory = device.peak_during(decode)
    median = statistics.median(times)
    return {
        "method": method,
        "n": n,
        "context_end": n + config.warmup + config.steps,
        "prefill_s": prefill_s,
        "first_call_s": first_call_s,
        "ms_per_token": median * 1e3,
        "mean_ms_per_token": statistics.fmean(times) * 1e3,
        "min_ms_per_token": min(times) * 1e3,
        "tokens_per_s": 1.0 / median,
        "cache_mb": cache_nbytes(cache) / MB,
        "peak_rss_mb": peak_rss / MB,
        "load_peak_rss_mb": load_peak / MB,
        "peak_from_prefill": from_prefill,
        "heap_kept_mb": None if kept is None else kept / MB,
        "decode_peak_mb": memory.peak_bytes / MB,
        "run_peak_rss_mb": max(peak_rss, memory.baseline_bytes + memory.peak_bytes) / MB,
        "times_ms": [t * 1e3 for t in times],
        "device": device.kind,
        "threads": torch.get_num_threads(),
    }


def run_point_subprocess(method: str, n: int, config: DecodeConfig) -> dict[str, object]:
    """One point in a fresh interpreter; a failure becomes a point with an ``error``."""
    spec = json.dumps({"method": method, "n": n, "config": asdict(config)})
    with tempfile.TemporaryDirectory(prefix="oal-decode-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "oal.bench.decode", "--point", spec, "--result", str(result)]
        try:
            proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=config.point_timeout_s)
        except subprocess.TimeoutExpired:
            return {"method": method, "n": n, "error": f"timed out after {config.point_timeout_s:.0f} s"}
        if proc.returncode != 0 or not result.is_file():
            return {"method": method, "n": n, "error": _describe_failure(proc)}
        return json.loads(result.read_text())


DEFINITIONS = {
    "prefill_s": "wall-clock seconds of the prefill forward over N random tokens into a fresh KernelCache, after "
    "the untimed first prompt if any",
    "first_call_s": "wall-clock seconds of the point's first forward, an untimed prompt of `prompt_warmup` tokens "
    "before the prefill (null without it): a short prompt plus what a process pays once",
    "ms_per_token": "median wall-clock time of one greedy decode step (a one-token forward on the cache, device "
    "synchronised), over `steps` steps after `warmup` untimed ones",
    "tokens_per_s": "1000 / ms_per_token",
    "cache_mb": "bytes held by the cache after the last step: keys and values of softmax layers, recurrent "
    "states of converted ones",
    "peak_rss_mb": "peak resident set of the point's process during the prefill (VmHWM, reset after the model's "
    "load and the first prompt when peak_from_prefill; the model and inputs resident count), up to its end; on CUDA "
    "torch.cuda.max_memory_allocated. After a first prompt the weights are resident before the prefill: a "
    "process's later prompts; with prompt_warmup 0 a fresh process's first, whose weights page in during it",
    "load_peak_rss_mb": "peak resident set of the point's process up to the prefill's start: the model's load (and the "
    "first prompt)",
    "decode_peak_mb": "peak memory above the resident memory before the decode steps, during them",
    "run_peak_rss_mb": "peak resident set of the point's process over the prefill and the decode steps: the larger "
    "of peak_rss_mb and the resident memory before the decode steps plus decode_peak_mb (memory a prefill "
    "returned to the system and the decode steps took again counts)",
    "heap_kept_mb": "freed heap glibc's malloc keeps at the end of the prefill (mallinfo2 fordblks; CPU, glibc): "
    "resident memory inside peak_rss_mb that holds no data; it differs between runs of the same model by tens of MB "
    "(the order of past allocations), so peak RSS differences of that size are allocator noise",
}


# fields of a point that the summary over repeats takes the median of
_MEDIAN_FIELDS = (
    "prefill_s",
    "first_call_s",
    "ms_per_token",
    "mean_ms_per_token",
    "min_ms_per_token",
    "cache_mb",
    "peak_rss_mb",
    "decode_peak_mb",
    "run_peak_rss_mb",
    "load_peak_rss_mb",
    "heap_kept_mb",
)


def summarize(runs: list[dict[str, object]]) -> list[dict[str, object]]:
    """One point per (method, N) from the repeated ``runs`` (in first-seen order): the median of each measured
    field over the repeats that did not fail, ``tokens_per_s`` from the median latency, the repeats' range of
    prefill and latency, ``repeats`` the count; an ``error`` when every repeat failed."""
    groups: dict[tuple[str, int], list[dict[str, object]]] = {}
    for run in runs:
        groups.setdefault((run["method"], run["n"]), []).append(run)
    points = []
    for (method, n), group in groups.items():
        ok = [r for r in group if not r.get("error")]
        if not ok:
            points.append({"method": method, "n": n, "error": group[-1]["error"], "repeats": 0})
            continue
        point = {k: v for k, v in ok[0].items() if k not in _MEDIAN_FIELDS and k not in ("times_ms", "round")}
        for name in _MEDIAN_FIELDS:
            if all(r.get(name) is not None for r in ok):
                point[name] = statistics.median(float(r[name]) for r in ok)
        point["tokens_per_s"] = 1e3 / point["ms_per_token"]
        point["repeats"] = len(ok)
        point["prefill_s_range"] = [min(r["prefill_s"] for r in ok), max(r["prefill_s"] for r in ok)]
        point["ms_per_token_range"] = [min(r["ms_per_token"] for r in ok), max(r["ms_per_token"] for r in ok)]
        points.append(point)
    return points


def point_of(run: dict[str, object]) -> dict[str, object]:
    """A one-round sweep's point: the run without its ``round``."""
    return {k: v for k, v in run.items() if k != "round"}


def run_sweep(
    config: DecodeConfig,
    sizes: list[int],
    out_dir: Path,
    *,
    methods: tuple[str, ...] = METHODS,
    repeats: int = 1,
    on_point: Callable[[dict[str, object], int, int], None] | None = None,
    runner: Callable[[str, int, DecodeConfig], dict[str, object]] = run_point_subprocess,
) -> dict[str, object]:
    """Measure ``methods × sizes`` (N ascending), ``repeats`` rounds of it one after the other (so that the
    methods of a size share the machine's load swings; every other round runs them in reverse order, so that
    neither model always runs first), writing ``decode.json`` after every point and the
    Markdown report at the end; returns the result document: ``runs`` every point measured (with its ``round``),
    ``points`` one per (method, N) — the point itself for one round, else :func:`summarize`'s medians.
    ``runner`` exists for tests."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"methods: expected names from {METHODS}, got {list(methods)}")
    if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"sizes: expected positive integers, got {sizes!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected a positive integer, got {repeats!r}")
    doc: dict[str, object] = {
        "schema": SCHEMA,
        "config": asdict(config),
        "repeats": repeats,
        "provenance": provenance(),
        "device": get_device(config.device).describe(),
        "definitions": DEFINITIONS,
        "points": [],
        "runs": [],
    }
    todo = [(r, m, n) for r in range(repeats) for n in sorted(sizes) for m in (methods[::-1] if r % 2 else methods)]
    for index, (rnd, method, n) in enumerate(todo, 1):
        point = runner(method, n, config)
        doc["runs"].append({**point, "round": rnd})
        doc["points"] = [point_of(r) for r in doc["runs"]] if repeats == 1 else summarize(doc["runs"])
        write_json(out_dir / RESULT_FILE, doc)
        if on_point:
            on_point(point, index, len(todo))
    write_text(out_dir / REPORT_FILE, markdown(doc))
    return doc


def _fmt(x: object, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def table_rows(doc: dict) -> list[list[str]]:
    """Rows of the report table: N, model, prefill s, ms/token, tokens/s, cache MB, peak RSS MB, decode peak MB,
    run peak RSS MB, kept heap MB (an error in place of the numbers for a failed point)."""
    rows = []
    for p in doc["points"]:
        if p.get("error"):
            rows.append([str(p["n"]), p["method"], f"failed: {p['error']}", *[""] * (len(HEADER) - 3)])
            continue
        rows.append(
            [
                str(p["n"]),
                p["method"],
                _fmt(p["prefill_s"], 2),
                _fmt(p["ms_per_token"], 2),
                _fmt(p["tokens_per_s"], 1),
                _fmt(p["cache_mb"], 1),
                _fmt(p["peak_rss_mb"], 0),
                _fmt(p["decode_peak_mb"], 1),
                _fmt(p.get("run_peak_rss_mb"), 0),
                _fmt(p.get("heap_kept_mb"), 0),
            ]
        )
    return rows


HEADER = [
    "N",
    "model",
    "prefill s",
    "ms/token",
    "tokens/s",
    "cache MB",
    "peak RSS MB",
    "decode peak MB",
    "run peak RSS MB",
    "kept heap MB",
]
RATIO_HEADER = [
    "N",
    "prefill speed-up",
    "decode speed-up",
    "cache ratio",
    "peak RSS ratio",
    "run peak RSS ratio",
    "peak − kept heap ratio",
]


def _live_ratio(original: dict, converted: dict) -> str:
    if original.get("heap_kept_mb") is None or converted.get("heap_kept_mb") is None:
        return "–"
    live = [p["peak_rss_mb"] - p["heap_kept_mb"] for p in (original, converted)]
    return f"{live[1] / live[0]:.3f}×"


def _run_peak_ratio(original: dict, converted: dict) -> str:
    if original.get("run_peak_rss_mb") is None or converted.get("run_peak_rss_mb") is None:
        return "–"  # a record from before the field
    return f"{converted['run_peak_rss_mb'] / original['run_peak_rss_mb']:.3f}×"


def round_speedups(runs: list[dict[str, object]]) -> dict[int, dict[str, list[float]]]:
    """Per N, each round's own original / converted ratios of prefill time (``prefill``) and decode latency
    (``decode``), in round order, over the rounds where both models' points succeeded."""
    ok = {(r["round"], r["method"], r["n"]): r for r in runs if not r.get("error")}
    out: dict[int, dict[str, list[float]]] = {}
    for rnd, method, n in sorted(ok, key=lambda key: (key[2], key[0])):
        if method != "original" or (rnd, "converted", n) not in ok:
            continue
        o, c = ok[rnd, "original", n], ok[rnd, "converted", n]
        ratios = out.setdefault(n, {"prefill": [], "decode": []})
        ratios["prefill"].append(o["prefill_s"] / c["prefill_s"])
        ratios["decode"].append(o["ms_per_token"] / c["ms_per_token"])
    return out


def _speedup(median: float, rounds: list[float] | None) -> str:
    """A speed-up of the medians, with the range of the rounds' own ones where more than one round has both."""
    if not rounds or len(rounds) < 2:
        return f"{median:.2f}×"
    return f"{median:.2f}× ({min(rounds):.2f}–{max(rounds):.2f})"


def ratio_rows(doc: dict) -> list[list[str]]:
    """Per N with both models measured: original / converted prefill time and decode latency (> 1: the converted
    model is faster; over repeated rounds the ratio of the medians, then the range of the rounds' own ratios),
    converted / original cache, peak RSS (of the prefill; of prefill and decode) and peak RSS less the kept heap
    (< 1: it holds less; the last, where both points measured the kept heap, is what the processes held, without
    allocator slack)."""
    pts = {(p["method"], p["n"]): p for p in doc["points"] if not p.get("error")}
    per_round = round_speedups(doc.get("runs", [])) if doc.get("repeats", 1) > 1 else {}
    rows = []
    for n in sorted({n for _, n in pts}):
        o, c = pts.get(("original", n)), pts.get(("converted", n))
        if o is None or c is None:
            continue
        rounds = per_round.get(n, {})
        rows.append(
            [
                str(n),
                _speedup(o["prefill_s"] / c["prefill_s"], rounds.get("prefill")),
                _speedup(o["ms_per_token"] / c["ms_per_token"], rounds.get("decode")),
                f"{c['cache_mb'] / o['cache_mb']:.2f}×",
                f"{c['peak_rss_mb'] / o['peak_rss_mb']:.3f}×",
                _run_peak_ratio(o, c),
                _live_ratio(o, c),
            ]
        )
    return rows


def _device_words(dev: dict) -> str:
    """The device's name, with the CPU flags that choose the kernels' paths where the record has them (records
    before stop 50 have none)."""
    isa = dev.get("isa")
    if isa is None:
        return dev.get("name", "")
    return f"{dev.get('name', '')}; {', '.join(isa) if isa else 'none of ' + ', '.join(PATH_FLAGS)}"


def markdown(doc: dict) -> str:
    config, dev = doc["config"], doc["device"]
    what = (
        f"converted directory `{config['converted']}`"
        if config.get("converted")
        else f"`{config['kernel']}` on layers {config['layers']}"
    )
    lines = [
        "# Decode benchmark",
        "",
        f"Model `{config['model']}`; converted: {what}. Batch {config['batch']}, {config['dtype']}, "
        f"{config['device']} ({_device_words(dev)}), {config['threads']} thread(s); {config['steps']} timed steps "
        f"after {config['warmup']} warm-up steps"
        + (
            f"; the timed prefill after an untimed {config['prompt_warmup']}-token first prompt."
            if config.get("prompt_warmup")
            else "."
        ),
        f"Command: `{doc['provenance']['command']}` ({doc['provenance']['time_utc']}).",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(doc)]
    ratios = ratio_rows(doc)
    if ratios:
        lines += ["", "| " + " | ".join(RATIO_HEADER) + " |", "|" + "---|" * len(RATIO_HEADER)]
        lines += ["| " + " | ".join(row) + " |" for row in ratios]
    repeats = doc.get("repeats", 1)
    if repeats > 1:
        lines += [
            "",
            f"Each figure is the median over {repeats} rounds (all of `methods × sizes` per round, each point in a "
            "fresh process, the models' order reversed every other round); a speed-up in parentheses is the range "
            "of the rounds' own ratios. Every round's point is in decode.json under `runs`.",
        ]
    lines += ["", "Definitions:", ""] + [f"- `{k}`: {v}" for k, v in doc["definitions"].items()]
    return "\n".join(lines) + "\n"


def _child_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m oal.bench.decode", description="Run one decode point.")
    parser.add_argument("--point", required=True, help='JSON {"method", "n", "config"}')
    parser.add_argument("--result", required=True, type=Path, help="where to write the result JSON")
    args = parser.parse_args(argv)
    spec = json.loads(args.point)
    result = run_point(spec["method"], int(spec["n"]), DecodeConfig.from_dict(spec["config"]))
    write_json(args.result, result)


if __name__ == "__main__":
    _child_main()
