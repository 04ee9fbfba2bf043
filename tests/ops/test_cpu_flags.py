"""The CPU flags that choose the fused kernels' paths (oal.ops.quadratic.cpu), as benchmarks record them."""

from __future__ import annotations

from oal.bench.devices import get_device
from oal.ops.quadratic import cpu as cpu_kernel

CPUINFO = """processor\t: 0
flags\t\t: fpu sse2 avx2 fma avx512f amx_tile
bogus line without a colon
processor\t: 1
flags\t\t: fpu sse2 avx2 fma avx512f amx_tile avx512_bf16
"""


def test_flags_of_reads_every_flags_line():
    assert cpu_kernel.flags_of(CPUINFO) == {"fpu", "sse2", "avx2", "fma", "avx512f", "amx_tile", "avx512_bf16"}
    assert cpu_kernel.flags_of("processor : 0\nmodel name : x\n") == frozenset()
    assert cpu_kernel.flags_of("flags : amx_bf16x\n") == {"amx_bf16x"}  # whole words, not prefixes


def test_path_flags_keep_their_order_and_drop_the_rest(monkeypatch):
    monkeypatch.delenv("OAL_CPU_AMX", raising=False)
    monkeypatch.setattr(cpu_kernel, "cpu_flags", lambda: cpu_kernel.flags_of(CPUINFO))
    assert cpu_kernel.path_flags() == ("avx2", "fma", "avx512f", "avx512_bf16")
    assert cpu_kernel.amx_bf16() is False  # amx_tile is not amx_bf16
    monkeypatch.setattr(cpu_kernel, "cpu_flags", lambda: frozenset({"amx_bf16", "sse2"}))
    assert cpu_kernel.path_flags() == ("amx_bf16",)


def test_amx_bf16_follows_the_flag_unless_overridden(monkeypatch):
    monkeypatch.delenv("OAL_CPU_AMX", raising=False)
    monkeypatch.setattr(cpu_kernel, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert cpu_kernel.amx_bf16() is True
    monkeypatch.setattr(cpu_kernel, "cpu_flags", lambda: frozenset())
    assert cpu_kernel.amx_bf16() is False
    monkeypatch.setenv("OAL_CPU_AMX", "1")
    assert cpu_kernel.amx_bf16() is True


def test_the_cpu_description_lists_this_machines_path_flags():
    isa = get_device("cpu").describe()["isa"]
    assert isa == list(cpu_kernel.path_flags())
    assert set(isa) <= set(cpu_kernel.PATH_FLAGS) and set(isa) <= cpu_kernel.cpu_flags()
