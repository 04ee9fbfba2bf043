"""oal.bench.devices.machine_record: the first line of the side-by-side benchmark scripts' output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from oal.bench.devices import machine_record
from oal.ops.quadratic.cpu import path_flags

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_record_names_the_command_versions_and_cpu_flags():
    rec = machine_record()["machine"]
    assert set(rec) == {"provenance", "device"}
    assert {"command", "time_utc", "torch", "python"} <= set(rec["provenance"])
    assert rec["device"]["kind"] == "cpu" and rec["device"]["isa"] == list(path_flags())
    json.dumps(rec)  # a JSON line as it is


def test_factorless_call_prints_it_first():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "factorless_call.py"), "--sizes", "64", "--repeats", "1", "--threads", "1"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    first, row = json.loads(out[0]), json.loads(out[1])
    assert first["machine"]["device"]["isa"] == list(path_flags())
    assert "--sizes 64" in first["machine"]["provenance"]["command"] and row["n"] == 64
