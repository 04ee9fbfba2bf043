"""Fused C++ CPU kernels, compiled on first use: the chunked operator's forward, its parallel form for a fresh
segment up to ~2k tokens and its backward, the reverse chunk scan (``chunk.cpp``), the in-place decode step of a
converted layer (``decode.cpp``, used by :mod:`oal.kernels.decode`) and the exact part of the sink/window operator
over a prompt with its backward (``window.cpp``, used by :mod:`oal.ops.sink_window.utils`).

The torch-level chunk loop spends about as long around its two state GEMMs as in them (features, query weights,
within-chunk squares, normalisation, each a separate pass and a Python dispatch), and MKL's sgemm reaches 60–70 %
of the FMA peak on the AMD CPU we measure on (``benchmarks/cpu_peak.py``, ``docs/results/bench/README.md``).
``chunk.cpp`` does the same arithmetic in one register-tiled kernel of its own, with each thread owning a slice of
the state and the features generated block by block in cache, not written out. It is built with
``torch.utils.cpp_extension.load`` (a C++ compiler and ninja are needed; the build is cached by torch, about a
minute the first time) and used automatically by :func:`oal.ops.quadratic.chunk.chunk_quadratic_attention` when
the inputs are CPU fp32 / bf16 / fp16 and a :class:`~oal.ops.quadratic.utils.KernelFactor` is given (with
gradients also for fp64: the forward then runs on the torch loop, the backward in fp64). If a build fails, a
warning is logged once and the torch path runs.
``OAL_CPU_KERNEL=0`` disables it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = {kind: Path(__file__).with_name(f"{kind}.cpp") for kind in ("chunk", "decode", "window")}
# headers the sources include: helpers of decode.cpp and window.cpp, the tile product of chunk.cpp and window.cpp
HEADERS = tuple(Path(__file__).with_name(name) for name in ("common.h", "tiles.h"))
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


def load(kind: str = "chunk") -> ModuleType | None:
    """The compiled extension ``kind`` (``"chunk"``, ``"decode"`` or ``"window"``), building it on the first
    call; None if disabled or if the build failed."""
    if not _enabled[0]:
        return None
    if kind not in _state:
        from torch.utils.cpp_extension import load as build

        source = SOURCES[kind]
        log.info("building the fused CPU kernel %s (first use: about a minute)", source.name)
        prefix = "oal_quadratic_cpu" if kind == "chunk" else f"oal_{kind}_cpu"
        # torch rebuilds when a source or a flag changes, not a header: the shared headers' hash is a flag
        common = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
        try:
            _state[kind] = build(
                # -march=native: one build per instruction set, so a shared cache never runs foreign code
                name=f"{prefix}_{torch.backends.cpu.get_cpu_capability().lower()}",
                sources=[str(source)],
                # -ffp-contract=fast: the tile kernel's `acc += s * b` must compile to fused multiply-adds
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", f"-DOAL_COMMON_H={common}"],
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(HEADERS[0].parent)],
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
            log.warning("fused CPU kernel %s unavailable, using the torch path: %s", source.name, exc)
            _state[kind] = None
    return _state[kind]


def preload() -> None:
    """Load (building on first use) every fused kernel now, so that the first forward of a converted model on CPU
    does not pay for it (~50 ms, or the builds); a no-op for kernels already loaded, and when disabled."""
    for kind in SOURCES:
        load(kind)


def usable(q: torch.Tensor, factor: object) -> bool:
    """Whether a call with these arguments can run on the fused kernel (before building it)."""
    return (
        _enabled[0]
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and factor is not None
    )
