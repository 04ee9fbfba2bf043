"""benchmarks/prefill_rss.py: the resident memory split by mapping adds up to VmRSS and names what maps it; bad
--models are refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_rss.py"

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")


@pytest.fixture(scope="module")
def rss_module(load_benchmark):
    return load_benchmark("prefill_rss")


def test_mappings_add_up_to_the_resident_set(rss_module):
    split = rss_module.mappings()
    assert set(split) == {"libtorch", "oal_kernels", "files", "heap", "anonymous", "other"}
    assert all(v >= 0 for v in split.values())
    assert split["libtorch"] > 1  # torch is imported: its library's code is resident
    rss = rss_module.status()["VmRSS"]
    assert sum(split.values()) == pytest.approx(rss, rel=0.05)


def test_mappings_see_a_new_anonymous_tensor(rss_module):
    before = rss_module.mappings()
    x = torch.ones(64 * 2**20 // 4)  # 64 MB, mmapped by malloc: anonymous or heap, resident once written
    after = rss_module.mappings()
    grown = after["anonymous"] + after["heap"] - before["anonymous"] - before["heap"]
    assert grown > 60
    del x


def test_unknown_model_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "original,other"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "--models: expected names from original, recipe, plain; got other" in proc.stderr
