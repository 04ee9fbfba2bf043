"""Loading the fused CPU kernels (oal.ops.quadratic.cpu): builds named by their code, later processes importing
the built library without torch.utils.cpp_extension."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from oal.ops.quadratic import cpu as cpu_kernel

BUILT = {kind: cpu_kernel.load(kind) for kind in cpu_kernel.SOURCES}
pytestmark = pytest.mark.skipif(
    any(m is None for m in BUILT.values()), reason="a fused CPU kernel did not build (no C++ compiler?)"
)


def test_a_built_kernel_loads_without_cpp_extension():
    code = (
        "import sys\n"
        "from oal.ops.quadratic import cpu\n"
        "mods = [cpu.load(k) for k in cpu.SOURCES]\n"
        "print(all(m is not None for m in mods), 'torch.utils.cpp_extension' in sys.modules,"
        " 'setuptools' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=os.environ.copy(), capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "False", "False"]


def test_the_loaded_library_is_the_build_named_by_this_code():
    for kind, module in BUILT.items():
        name, _ = cpu_kernel.build_spec(kind)
        assert module.__name__ == name
        assert os.path.dirname(module.__file__) == str(cpu_kernel._root() / name)


def test_the_name_changes_with_a_header_source_or_flag(tmp_path, monkeypatch):
    name, flags = cpu_kernel.build_spec("decode")
    assert cpu_kernel.build_spec("decode") == (name, flags)
    header = tmp_path / "common.h"
    header.write_bytes(cpu_kernel.HEADERS[0].read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(cpu_kernel, "HEADERS", (header, *cpu_kernel.HEADERS[1:]))
    changed, _ = cpu_kernel.build_spec("decode")
    assert changed != name and changed.rsplit("_", 1)[0] == name.rsplit("_", 1)[0]
    monkeypatch.undo()
    source = tmp_path / "decode.cpp"
    source.write_bytes(cpu_kernel.SOURCES["decode"].read_bytes() + b"\n")
    monkeypatch.setitem(cpu_kernel.SOURCES, "decode", source)
    assert cpu_kernel.build_spec("decode")[0] not in (name, changed)


def test_a_build_without_its_completion_marker_is_not_imported(tmp_path):
    name, _ = cpu_kernel.build_spec("decode")
    directory = tmp_path / name
    directory.mkdir()
    (directory / f"{name}.so").write_bytes(b"half-written")
    assert cpu_kernel._import_built(name, directory) is None
