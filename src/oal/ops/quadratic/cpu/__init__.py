"""Fused C++ CPU kernels, compiled on first use: the chunked operator's forward, its parallel form for a fresh
segment up to ~2k tokens (also for queries that are the last of the keys: a prompt's later chunk over the
keys kept before it) and its backward, the reverse chunk scan (``chunk.cpp``), the in-place decode step of a
converted layer (``decode.cpp``, used by :mod:`oal.kernels.decode`) and the exact part of the sink/window operator
over a prompt with its backward (``window.cpp``, used by :mod:`oal.ops.sink_window.utils`).

The torch-level chunk loop spends about as long around its two state GEMMs as in them (features, query weights,
within-chunk squares, normalisation, each a separate pass and a Python dispatch), and MKL's sgemm reaches 60–70 %
of the FMA peak on the AMD CPU we measure on (``benchmarks/cpu_peak.py``, ``docs/results/bench/README.md``).
``chunk.cpp`` does the same arithmetic in one register-tiled kernel of its own, with each thread owning a slice of
the state and the features generated block by block in cache, not written out. It is built with
``torch.utils.cpp_extension.load`` (a C++ compiler and ninja are needed; about a minute the first time) into a
directory named by a hash of its sources, headers, flags and the torch version; later processes import the built
library directly, without ``torch.utils.cpp_extension`` (whose import alone adds ~4 MB of resident memory and
setuptools to every process running a converted model). It is used automatically by
:func:`oal.ops.quadratic.chunk.chunk_quadratic_attention` when the inputs are CPU fp32 / bf16 / fp16 and a
:class:`~oal.ops.quadratic.utils.KernelFactor` is given (with gradients also for fp64: the forward then runs on the
torch loop, the backward in fp64). If a build fails, a warning is logged once and the torch path runs.
``OAL_CPU_KERNEL=0`` disables it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = {kind: Path(__file__).with_name(f"{kind}.cpp") for kind in ("chunk", "decode", "window")}
# headers the sources include: helpers of decode.cpp and window.cpp, the tile product of chunk.cpp and window.cpp
HEADERS = tuple(Path(__file__).with_name(name) for name in ("common.h", "simd.h", "tiles.h"))
# written into a build's directory once torch's build returned: a library without it may be half-written
BUILT_MARKER = "oal-built"
_state: dict[str, ModuleType | None] = {}
_enabled = [os.environ.get("OAL_CPU_KERNEL", "1") != "0"]


@contextmanager
def disabled() -> Iterator[None]:
    """Run the body on the torch chunk loop (the fused kernel off), then restore the previous setting."""
    previous = _enabled[0]
    _enabled[0] = False
    try:
        yield
    finally:
        _enabled[0] = previous


def amx_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices on AMX tiles (the ``amx_bf16`` flag of Linux's /proc/cpuinfo;
    ``OAL_CPU_AMX=1`` / ``0`` overrides). There torch's bf16 matrix products and SDPA run on the tiles (oneDNN):
    on a 2-core Xeon with AMX, bf16 SDPA ran the exact heads' causal prompt attention 2.8–4× faster than
    ``window.cpp``'s AVX-512 kernel (docs/results/bench/model, stop 35)."""
    forced = os.environ.get("OAL_CPU_AMX")
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"OAL_CPU_AMX: expected 0 or 1, got {forced!r}")
        return forced == "1"
    return "amx_bf16" in cpu_flags()


#: the instruction-set flags that choose this package's CPU paths: the fused kernels' SIMD width (AVX2 + FMA or
#: AVX-512), bf16 pair products (AVX512_BF16) and the exact heads' prompt on AMX tiles
PATH_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux's /proc/cpuinfo lists them (empty where there is none)."""
    try:
        return flags_of(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def flags_of(cpuinfo: str) -> frozenset[str]:
    """The flags of a /proc/cpuinfo text: the words after ``flags :`` on its ``flags`` lines."""
    lines = (line.split(":", 1) for line in cpuinfo.splitlines() if line.startswith("flags"))
    return frozenset(flag for parts in lines if len(parts) == 2 for flag in parts[1].split())


def path_flags() -> tuple[str, ...]:
    """Those of :data:`PATH_FLAGS` this CPU has, in that order (the hardware a CPU benchmark's figures depend on)."""
    return tuple(flag for flag in PATH_FLAGS if flag in cpu_flags())


def _root() -> Path:
    """Where builds go: ``TORCH_EXTENSIONS_DIR`` if set (as torch reads it), else ``~/.cache/torch_extensions``."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torch_extensions"
    return base / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def build_spec(kind: str) -> tuple[str, list[str]]:
    """The extension's module name and compiler flags. The name ends in a hash of the source, the shared headers,
    the flags and the torch version, so that a changed header (which torch's own check does not see) or another
    checkout's sources never reuse a build, and a present build of this name is this code's."""
    prefix = "oal_quadratic_cpu" if kind == "chunk" else f"oal_{kind}_cpu"
    # -march=native: one build per instruction set, so a shared cache never runs foreign code;
    # -ffp-contract=fast: the tile kernel's `acc += s * b` must compile to fused multiply-adds
    flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
    digest = hashlib.sha256(SOURCES[kind].read_bytes())
    for header in HEADERS:
        digest.update(header.read_bytes())
    digest.update(" ".join([*flags, torch.__version__]).encode())
    cap = torch.backends.cpu.get_cpu_capability().lower()
    return f"{prefix}_{cap}_{digest.hexdigest()[:12]}", flags


def _import_built(name: str, directory: Path) -> ModuleType | None:
    """The library built earlier under ``directory`` (its completion marker present), imported without
    ``torch.utils.cpp_extension``; None if there is none."""
    library = directory / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"  # as torch names it
    if not (directory / BUILT_MARKER).is_file() or not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(kind: str, name: str, flags: list[str], directory: Path) -> ModuleType:
    from torch.utils.cpp_extension import load as build

    log.info("building the fused CPU kernel %s (first use: about a minute)", SOURCES[kind].name)
    directory.mkdir(parents=True, exist_ok=True)
    module = build(
        name=name,
        sources=[str(SOURCES[kind])],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(HEADERS[0].parent)],
        build_directory=str(directory),
        verbose=False,
    )
    (directory / BUILT_MARKER).touch()
    return module


def load(kind: str = "chunk") -> ModuleType | None:
    """The compiled extension ``kind`` (``"chunk"``, ``"decode"`` or ``"window"``), building it on the first
    call; None if disabled or if the build failed."""
    if not _enabled[0]:
        return None
    if kind not in _state:
        name, flags = build_spec(kind)
        directory = _root() / name
        try:
            _state[kind] = _import_built(name, directory) or _build(kind, name, flags, directory)
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
            log.warning("fused CPU kernel %s unavailable, using the torch path: %s", SOURCES[kind].name, exc)
            _state[kind] = None
    return _state[kind]


def preload(kinds: Iterable[str] | None = None) -> None:
    """Load (building on first use) the fused kernels ``kinds`` (default: all of :data:`SOURCES`) now, so that the
    first forward of a converted model on CPU does not pay for it (~50 ms, or the builds); a no-op for kernels
    already loaded, and when disabled."""
    kinds = list(SOURCES) if kinds is None else sorted(kinds)
    unknown = [kind for kind in kinds if kind not in SOURCES]
    if unknown:
        raise ValueError(f"kinds: expected names from {sorted(SOURCES)}, got {unknown}")
    for kind in kinds:
        load(kind)


def usable(q: torch.Tensor, factor: object) -> bool:
    """Whether a call with these arguments can run on the fused kernel (before building it)."""
    return (
        _enabled[0]
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and factor is not None
    )
