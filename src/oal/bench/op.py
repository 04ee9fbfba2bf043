"""The operator benchmark (`oal bench op`): forward-only causal attention, runtime and peak memory against N.

Every (method, N, dtype) point runs in a fresh interpreter (``python -m oal.bench.op --point SPEC --result
PATH``), so its peak memory is not polluted by earlier points. Inside the point:

1. a primer call at N = min(N, 256) starts the thread pools and library buffers;
2. the method is built and q, k, v are allocated in the point's dtype (resident inputs);
3. one cold call is measured for peak memory (see :class:`oal.bench.devices.BenchDevice`) and timed;
4. ``warmup`` more calls, then ``R`` timed calls, ``R = clamp(budget_s / t_warm, min_repeats, max_repeats)``;
   ``ms`` is their median (``time.perf_counter``, device synchronised).

All calls run under ``torch.no_grad()`` with ``torch.set_num_threads(threads)``. Results go to
``<out>/op.json`` after every point (written to a temporary file, then renamed); a rerun with the same
configuration skips the points already measured. A memory guard skips a point whose peak, extrapolated from the
same method's smaller points, would exceed a fraction of the free memory, and says so in the point.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from .devices import get_device
from .flops import AttnShape
from .machine import DTYPES, machine_info, parse_dtype, repeat_times, time_call
from .methods import get_method

__all__ = [
    "DTYPES",
    "FULL_SIZES",
    "QUICK_SIZES",
    "BenchConfig",
    "estimate_peak_bytes",
    "guard_reason",
    "load_results",
    "make_inputs",
    "plan",
    "quick_config",
    "run_point",
    "run_point_subprocess",
    "run_sweep",
    "write_atomic",
    "write_json_atomic",
]

SCHEMA = 1
RESULT_FILE = "op.json"
FULL_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_SIZES = (1024, 2048)
PRIMER_N = 256
MB = 2**20


@dataclass(frozen=True)
class BenchConfig:
    """Everything that decides what a point measures; a rerun resumes only under an identical config."""

    batch: int = 1
    heads_q: int = 9
    heads_kv: int = 3
    head_dim: int = 64
    value_dim: int = 64
    device: str = "cpu"
    threads: int = 0  # 0: all usable cores (resolved by :meth:`resolved`)
    seed: int = 0
    warmup: int = 1
    min_repeats: int = 3
    max_repeats: int = 50
    budget_s: float = 10.0
    point_timeout_s: float = 3600.0
    mem_fraction: float = 0.8

    def __post_init__(self) -> None:
        self.shape(1)  # validates the head layout
        for name in ("warmup", "threads", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
        if not (1 <= self.min_repeats <= self.max_repeats):
            raise ValueError(
                f"min_repeats, max_repeats: expected 1 ≤ min ≤ max, got {self.min_repeats}, {self.max_repeats}"
            )
        if not (0 < self.mem_fraction <= 1):
            raise ValueError(f"mem_fraction: expected a number in (0, 1], got {self.mem_fraction!r}")
        if not (self.budget_s >= 0 and self.point_timeout_s > 0):
            raise ValueError(
                f"budget_s, point_timeout_s: expected ≥ 0 and > 0, got {self.budget_s}, {self.point_timeout_s}"
            )

    def shape(self, n: int) -> AttnShape:
        return AttnShape(self.batch, self.heads_q, self.heads_kv, n, self.head_dim, self.value_dim)

    def resolved(self) -> BenchConfig:
        """The same config with ``threads`` made explicit."""
        if self.threads:
            return self
        return BenchConfig(**{**asdict(self), "threads": len(os.sched_getaffinity(0))})

    def identity(self) -> dict[str, object]:
        """What a stored result must match to be reused: the config (less the point timeout and the guard's
        fraction, which change no measurement), the host and the torch version."""
        ident = asdict(self.resolved())
        del ident["point_timeout_s"], ident["mem_fraction"]
        return {**ident, "host": platform.node(), "torch": torch.__version__}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> BenchConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def quick_config(**overrides: object) -> BenchConfig:
    """One timed call per point and no warm-up: a smoke test, not a measurement."""
    return BenchConfig(**{"warmup": 0, "min_repeats": 1, "max_repeats": 1, "budget_s": 0.0, **overrides})


# ----------------------------------------------------------------------------------------------- one point (child)


def make_inputs(shape: AttnShape, dtype: torch.dtype, device: torch.device, seed: int):
    """q ``(B, Hq, N, d)``, k ``(B, Hkv, N, d)``, v ``(B, Hkv, N, dv)``, standard normal, created in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    s = shape
    q = torch.randn(s.batch, s.heads_q, s.n, s.head_dim, generator=gen, dtype=dtype)
    k = torch.randn(s.batch, s.heads_kv, s.n, s.head_dim, generator=gen, dtype=dtype)
    v = torch.randn(s.batch, s.heads_kv, s.n, s.value_dim, generator=gen, dtype=dtype)
    return q.to(device), k.to(device), v.to(device)


def run_point(method_name: str, n: int, dtype_name: str, config: BenchConfig) -> dict[str, object]:
    """Measure one point in this process (call it in a fresh one; see the module docstring)."""
    config = config.resolved()
    torch.set_num_threads(config.threads)
    device = get_device(config.device)
    method = get_method(method_name)
    dtype = parse_dtype(dtype_name)
    shape = config.shape(n)
    with torch.no_grad():
        primer = config.shape(min(n, PRIMER_N))
        primer_fn = method.build(primer, device.device, config.seed)
        primer_fn(*make_inputs(primer, dtype, device.device, config.seed))
        del primer_fn

        fn = method.build(shape, device.device, config.seed)
        q, k, v = make_inputs(shape, dtype, device.device, config.seed)
        inputs_bytes = sum(t.numel() * t.element_size() for t in (q, k, v))
        cold: list[float] = []

        def cold_call() -> torch.Tensor:
            start = time.perf_counter()
            out = fn(q, k, v)
            device.synchronize()
            cold.append(time.perf_counter() - start)
            return out

        memory = device.peak_during(cold_call)
        last = cold[0]
        for _ in range(config.warmup):
            last = time_call(lambda: fn(q, k, v), device)
        times = repeat_times(
            lambda: fn(q, k, v), device, last, budget_s=config.budget_s, lo=config.min_repeats, hi=config.max_repeats
        )
    median = statistics.median(times)
    flops = method.flops(shape) if method.flops else None
    return {
        "method": method_name,
        "n": n,
        "dtype": dtype_name,
        "device": device.kind,
        "ms": median * 1e3,
        "min_ms": min(times) * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3,
        "cold_ms": cold[0] * 1e3,
        "repeats": len(times),
        "times_ms": [t * 1e3 for t in times],
        "peak_mb": memory.peak_bytes / MB,
        "inputs_mb": inputs_bytes / MB,
        "peak_total_mb": (memory.peak_bytes + inputs_bytes) / MB,
        "blind_mb": memory.blind_bytes / MB,
        "gflop": None if flops is None else flops / 1e9,
        "gflop_s": None if flops is None else flops / median / 1e9,
        "threads": torch.get_num_threads(),
    }


def measure_machine(config: BenchConfig, dtypes: list[str]) -> dict[str, object]:
    """The machine block, measured in this process with the points' thread setting."""
    config = config.resolved()
    torch.set_num_threads(config.threads)
    return machine_info(get_device(config.device), dtypes)


# ------------------------------------------------------------------------------------------------ subprocesses


def _child_env() -> dict[str, str]:
    """The parent's environment with this package's source root first on PYTHONPATH (works uninstalled)."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return env


def _describe_failure(proc: subprocess.CompletedProcess) -> str:
    rc = proc.returncode
    what = f"exit status {rc}"
    if rc < 0:
        what = f"killed by signal {-rc}" + (" (out of memory?)" if rc == -9 else "")
    tail = [line for line in (proc.stderr or "").strip().splitlines() if line.strip()][-3:]
    return what + (": " + " | ".join(tail) if tail else "")


def _run_child(args: list[str], timeout_s: float) -> tuple[dict[str, object] | None, str | None]:
    """Run ``python -m oal.bench.op ARGS --result FILE``; returns (result, None) or (None, error message)."""
    with tempfile.TemporaryDirectory(prefix="oal-bench-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "oal.bench.op", *args, "--result", str(result)]
        try:
            proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout_s:.0f} s"
        if proc.returncode != 0 or not result.is_file():
            return None, _describe_failure(proc)
        return json.loads(result.read_text()), None


def _empty_point(method: str, n: int, dtype: str, config: BenchConfig) -> dict[str, object]:
    kind = get_device(config.device).kind
    return {"method": method, "n": n, "dtype": dtype, "device": kind, "ms": None, "peak_mb": None}


def run_point_subprocess(
    method: str, n: int, dtype: str, config: BenchConfig, imports: tuple[str, ...] = ()
) -> dict[str, object]:
    """One point in a fresh interpreter; a failure becomes a point with an ``error`` and ``ms = None``.

    ``imports``: modules the child imports first, to register methods that are not built in."""
    spec = json.dumps({"method": method, "n": n, "dtype": dtype, "config": asdict(config), "imports": list(imports)})
    result, error = _run_child(["--point", spec], config.point_timeout_s)
    if result is None:
        return {**_empty_point(method, n, dtype, config), "error": error}
    return result


def measure_machine_subprocess(config: BenchConfig, dtypes: list[str]) -> dict[str, object]:
    spec = json.dumps({"config": asdict(config), "dtypes": dtypes})
    result, error = _run_child(["--machine", spec], config.point_timeout_s)
    if result is None:
        raise RuntimeError(f"measuring the machine failed: {error}")
    return result


# ------------------------------------------------------------------------------------------------- memory guard


def estimate_peak_bytes(history: list[tuple[int, float]], n: int) -> float | None:
    """Extrapolate a method's total peak (inputs + call) to ``n`` from its measured smaller points.

    ``history``: ``(n_i, bytes_i)`` ascending in n, all below ``n``. The growth exponent comes from the last two
    points, clamped to [1, 2] (inputs grow linearly, no method here grows faster than N²); with one point it is
    taken as 2, the safe side. None without history: the first point always runs.
    """
    if not history:
        return None
    n1, m1 = history[-1]
    if n1 >= n:
        raise ValueError(f"history: expected sizes below n={n}, got {n1}")
    exponent = 2.0
    if len(history) >= 2:
        n0, m0 = history[-2]
        if m0 > 0 and m1 > 0 and n1 > n0:
            exponent = min(2.0, max(1.0, math.log(m1 / m0) / math.log(n1 / n0)))
    return m1 * (n / n1) ** exponent


def guard_reason(estimate: float | None, free_bytes: int, fraction: float) -> str | None:
    """Why a point is skipped, or None to run it: the estimate must stay within ``fraction`` of free memory."""
    if estimate is None or estimate <= fraction * free_bytes:
        return None
    return f"memory guard: estimated peak {estimate / MB:.0f} MB > {fraction:.0%} of the {free_bytes / MB:.0f} MB free"


# -------------------------------------------------------------------------------------------------------- sweep


def point_key(point: dict[str, object]) -> tuple[str, int, str, str]:
    return (str(point["method"]), int(point["n"]), str(point["dtype"]), str(point["device"]))


def is_measured(point: dict[str, object]) -> bool:
    return point.get("ms") is not None and not point.get("error") and not point.get("skipped")


def load_results(path: Path) -> dict[str, object] | None:
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA or not isinstance(doc.get("points"), list):
        raise ValueError(f"out: {path} is not an `oal bench op` result (schema {SCHEMA})")
    return doc


def write_atomic(path: Path, save: Callable[[str], None]) -> None:
    """``save(tmp)`` writes a temporary file beside ``path``, which is then renamed over ``path``, so readers
    never see half a file and an interrupted run leaves the previous one intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.with_name(f".{path.name}.{os.getpid()}.tmp"))  # opened normally: the umask applies
    try:
        save(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: object) -> None:
    write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1) + "\n"))


def _config_mismatch(stored: dict[str, object], current: dict[str, object]) -> str:
    keys = sorted(set(stored) | set(current))
    return ", ".join(
        f"{k}: {stored.get(k)!r} there vs {current.get(k)!r} now" for k in keys if stored.get(k) != current.get(k)
    )


def definitions(config: BenchConfig) -> dict[str, str]:
    device = get_device(config.device)
    return {
        "ms": "median wall-clock time of the timed calls (time.perf_counter, device synchronised), after a cold "
        "call and `warmup` warm-up calls; the number of timed calls is clamp(budget_s / t_warm, min_repeats, "
        "max_repeats); torch.no_grad()",
        "peak_mb": device.memory_definition,
        "peak_total_mb": "inputs_mb + peak_mb",
        "inputs_mb": "q, k, v bytes in the point's dtype",
        "gflop": "analytical FLOPs of one call (oal.bench.flops): SDPA causal B·Hq·N²·(d+dv); chunked quadratic "
        "operator per KV head and chunk of n tokens 2·g·n·D·(dv+1) + 2·g·R·n²·(d+1) + 2·g·n²·(dv+1) + "
        "2·D·n·(dv+1), g = Hq/Hkv, D = (d+1)(d+2)/2, R = G+1; matrix products only",
        "gflop_s": "gflop / (ms / 1000)",
        "machine.matmul": "median GFLOP/s of a square (s,s)@(s,s) GEMM in each dtype, 2·s³ FLOPs",
        "machine.copy_gb_s": "tensor copy bandwidth, bytes read + written",
    }


def plan(methods: Iterable[str], sizes: Iterable[int], dtypes: Iterable[str]) -> list[tuple[str, int, str]]:
    """Points in run order: dtype, then N ascending, then method (the guard needs each method's smaller N)."""
    return [(m, n, dt_) for dt_ in dtypes for n in sorted(sizes) for m in methods]


def run_sweep(
    config: BenchConfig,
    *,
    methods: list[str],
    sizes: list[int],
    dtypes: list[str],
    out_dir: Path,
    force: bool = False,
    command: str = "",
    on_start: Callable[[str, int, str, int, int], None] | None = None,
    on_point: Callable[[dict[str, object], int, int], None] | None = None,
    imports: tuple[str, ...] = (),
    runner: Callable[[str, int, str, BenchConfig], dict[str, object]] | None = None,
    machine_fn: Callable[[BenchConfig, list[str]], dict[str, object]] = measure_machine_subprocess,
    free_bytes: Callable[[], int] | None = None,
) -> dict[str, object]:
    """Run the missing points of ``methods × sizes × dtypes`` and return the result document.

    ``on_start(method, n, dtype, index, total)`` is called before each planned point and ``on_point(point,
    index, total)`` after it (measured, reused, skipped or failed; a reused point carries ``reused = True``).
    ``imports`` names modules that register extra methods (imported here and in every point's process).
    ``runner``, ``machine_fn`` and ``free_bytes`` exist for tests; by default each point and the machine block
    are measured in subprocesses and the free memory is the device's.
    """
    for module in imports:
        importlib.import_module(module)
    if runner is None:

        def runner(method: str, n: int, dtype: str, config: BenchConfig) -> dict[str, object]:
            return run_point_subprocess(method, n, dtype, config, imports)

    for name in methods:
        get_method(name)
    for name in dtypes:
        parse_dtype(name)
    for n in sizes:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"sizes: expected positive integers, got {n!r}")
    config = config.resolved()
    device = get_device(config.device)
    free_bytes = free_bytes or device.free_bytes
    path = out_dir / RESULT_FILE
    identity = config.identity()
    doc = None if force else load_results(path)
    if doc is not None and doc["config"] != identity:
        raise ValueError(
            f"out: {path} holds results of another configuration ({_config_mismatch(doc['config'], identity)}); "
            "choose another --out or pass --force to replace them"
        )
    if doc is None:
        doc = {"schema": SCHEMA, "config": identity, "definitions": definitions(config)}
        doc |= {"machine": None, "runs": [], "points": []}
    doc["runs"].append({"command": command, "date": dt.datetime.now().astimezone().isoformat(timespec="seconds")})
    described = doc.setdefault("methods", {})
    for name in methods:
        method = get_method(name)
        described[name] = {"label": method.label, "description": method.description}

    machine = doc["machine"]
    if machine is None or any(d not in machine["matmul"] for d in dtypes):
        doc["machine"] = machine_fn(config, sorted(set(dtypes) | set((machine or {}).get("matmul", {}))))
    write_json_atomic(path, doc)

    points = {point_key(p): p for p in doc["points"]}
    todo = plan(methods, sizes, dtypes)
    for index, (method, n, dtype) in enumerate(todo, 1):
        if on_start:
            on_start(method, n, dtype, index, len(todo))
        key = (method, n, dtype, device.kind)
        if key in points and is_measured(points[key]):
            if on_point:
                on_point({**points[key], "reused": True}, index, len(todo))
            continue
        smaller = sorted(
            (p for k, p in points.items() if k[0] == method and k[2] == dtype and k[3] == device.kind and k[1] < n),
            key=lambda p: p["n"],
        )
        if smaller and not is_measured(smaller[-1]):
            below = smaller[-1]
            why = below.get("skipped") or below.get("error")
            point = {
                **_empty_point(method, n, dtype, config),
                "skipped": f"not run: N={below['n']} was not measured ({why})",
            }
        else:
            history = [(int(p["n"]), p["peak_total_mb"] * MB) for p in smaller if is_measured(p)]
            estimate = estimate_peak_bytes(history, n)
            reason = guard_reason(estimate, free_bytes(), config.mem_fraction)
            if reason is None:
                point = runner(method, n, dtype, config)
            else:
                point = {
                    **_empty_point(method, n, dtype, config),
                    "skipped": reason,
                    "estimated_peak_mb": estimate / MB,
                }
        points[key] = point
        doc["points"] = sorted(points.values(), key=lambda p: (p["dtype"], p["n"], p["method"]))
        write_json_atomic(path, doc)
        if on_point:
            on_point(point, index, len(todo))
    return doc


# ------------------------------------------------------------------------------------------------ child entry


def _child_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m oal.bench.op", description="Run one benchmark point.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--point", help='JSON {"method", "n", "dtype", "config"}')
    what.add_argument("--machine", help='JSON {"config", "dtypes"}')
    parser.add_argument("--result", required=True, type=Path, help="where to write the result JSON")
    args = parser.parse_args(argv)
    if args.point:
        spec = json.loads(args.point)
        for module in spec.get("imports", []):
            importlib.import_module(module)
        config = BenchConfig.from_dict(spec["config"])
        result = run_point(spec["method"], int(spec["n"]), spec["dtype"], config)
    else:
        spec = json.loads(args.machine)
        result = measure_machine(BenchConfig.from_dict(spec["config"]), list(spec["dtypes"]))
    write_json_atomic(args.result, result)


if __name__ == "__main__":
    _child_main()
