"""Where a benchmark point runs: synchronisation, peak-memory reading and free memory, per device kind.

The CPU reads the process's resident set from ``/proc/self/status`` (Linux); CUDA reads PyTorch's allocator.
Both report the peak *above* what was resident just before the measured call (inputs, parameters, libraries),
so the number is the memory the call itself needs.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..io import provenance
from ..ops.quadratic.cpu import path_flags

PROC_STATUS = Path("/proc/self/status")
PROC_MEMINFO = Path("/proc/meminfo")
CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class MemoryReading:
    """Peak bytes above the baseline during one call; ``blind_bytes`` > 0 when peaks below that many bytes
    above the baseline could not be seen (a high-water mark that could not be reset)."""

    peak_bytes: int
    baseline_bytes: int
    blind_bytes: int = 0


class BenchDevice(ABC):
    """One device kind; ``memory_definition`` says what :meth:`peak_during` measures."""

    kind: str
    memory_definition: str

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def free_bytes(self) -> int:
        """Memory a new allocation can still get, for the memory guard."""

    @abstractmethod
    def peak_during(self, fn: Callable[[], object]) -> MemoryReading:
        """Run ``fn`` once and measure its peak memory above what is resident before it."""

    @abstractmethod
    def reset_peak(self) -> bool:
        """Reset the peak memory to what is resident now; False where the system refuses it."""

    @abstractmethod
    def describe(self) -> dict[str, object]: ...


def _status_kb(field: str) -> int:
    for line in PROC_STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{PROC_STATUS} has no {field} line")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_kept_bytes() -> int | None:
    """Bytes of freed heap that glibc's malloc keeps in this process (``mallinfo2().fordblks``, all arenas): part
    of the resident set that holds no data, how much depends on the order of past allocations (fragmentation),
    not on what the process holds. None without glibc ≥ 2.33."""
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)  # the C library already loaded in this process
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


class CPUDevice(BenchDevice):
    kind = "cpu"
    memory_definition = (
        "peak RSS above resident inputs: VmHWM during one cold call (after a small primer call that starts the "
        "thread pools and library buffers; VmHWM reset through /proc/self/clear_refs) minus VmRSS just before the "
        "call, with inputs and method parameters resident; includes the output tensor"
    )

    def __init__(self, device: torch.device | None = None) -> None:
        if not PROC_STATUS.is_file():
            raise RuntimeError("device: CPU memory measurement needs Linux /proc/self/status")
        super().__init__(device or torch.device("cpu"))

    def synchronize(self) -> None:
        pass

    def free_bytes(self) -> int:
        for line in PROC_MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{PROC_MEMINFO} has no MemAvailable line")

    def reset_peak(self) -> bool:
        """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux ≥ 4.0); some sandboxes refuse it."""
        try:
            CLEAR_REFS.write_text("5")
        except OSError:
            return False
        return True

    def peak_during(self, fn: Callable[[], object]) -> MemoryReading:
        gc.collect()
        rss = _status_kb("VmRSS") * 1024
        reset = self.reset_peak()
        hwm_before = _status_kb("VmHWM") * 1024
        out = fn()
        hwm = _status_kb("VmHWM") * 1024
        del out
        blind = 0 if reset else max(hwm_before - rss, 0)
        return MemoryReading(peak_bytes=max(hwm - rss, 0), baseline_bytes=rss, blind_bytes=blind)

    def describe(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "name": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "isa": list(path_flags()),
            "memory_total_mb": round(_meminfo_total() / 2**20, 1),
        }


def _meminfo_total() -> int:
    for line in PROC_MEMINFO.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{PROC_MEMINFO} has no MemTotal line")


class CUDADevice(BenchDevice):
    kind = "cuda"
    memory_definition = (
        "peak allocated tensor memory above resident inputs: torch.cuda.max_memory_allocated during one cold call "
        "minus torch.cuda.memory_allocated just before it (peak_total_mb adds the resident inputs back, as the "
        "paper's Fig. 3 reports); includes the output tensor"
    )

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise ValueError(f"device: expected an available CUDA device, got {device} with CUDA unavailable")
        super().__init__(device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def free_bytes(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[0])

    def reset_peak(self) -> bool:
        torch.cuda.reset_peak_memory_stats(self.device)
        return True

    def peak_during(self, fn: Callable[[], object]) -> MemoryReading:
        gc.collect()
        self.synchronize()
        base = torch.cuda.memory_allocated(self.device)
        self.reset_peak()
        out = fn()
        self.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        del out
        return MemoryReading(peak_bytes=max(peak - base, 0), baseline_bytes=base)

    def describe(self) -> dict[str, object]:
        props = torch.cuda.get_device_properties(self.device)
        return {
            "kind": self.kind,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_total_mb": round(props.total_memory / 2**20, 1),
            "cuda": torch.version.cuda,
            "host_cpu": cpu_model(),
        }


def machine_record(device: str = "cpu") -> dict[str, object]:
    """``{"machine": {"provenance": …, "device": …}}``: the first line of a benchmark script's JSON-lines output, so
    that its figures say what ran them (the command, time and versions, and the device with its CPU flags)."""
    return {"machine": {"provenance": provenance(), "device": get_device(device).describe()}}


def get_device(name: str) -> BenchDevice:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {name!r}") from err
    if device.type == "cpu":
        return CPUDevice(device)
    if device.type == "cuda":
        return CUDADevice(device)
    raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {name!r}")
