"""A run killed with SIGKILL at a random stage, and again in the middle of a fine-tuning, then resumed, writes the
same reproduce.json as an uninterrupted run (the ``reference`` fixture, same seeds, one thread)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import oal

SRC = Path(oal.__file__).resolve().parents[1]


def _command(setup, out: Path, cache: Path) -> list[str]:
    args = ["reproduce", "--preset", "demo", "--out", str(out), "--model", str(setup["model"])]
    args += ["--data", str(setup["data"]), "--cache", str(cache), "--threads", "1", "--no-progress"]
    return [sys.executable, "-c", "from oal.cli import app; app(prog_name='oal')", *args, *setup["micro_args"]]


def _run_until(cmd: list[str], env: dict, log: Path, condition, timeout: float = 600) -> bool:
    """Run ``cmd``; SIGKILL it as soon as ``condition()`` holds. True if killed, False if it finished first."""
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                if condition():
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return True
                if time.monotonic() > deadline:
                    raise AssertionError(f"{cmd} still running after {timeout} s")
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    return False


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_uninterrupted_result(reference, tiny_setup, tmp_path):
    _, expected = reference
    out, log = tmp_path / "run", tmp_path / "log.txt"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "OAL_CACHE_DIR": str(tmp_path / "oal-cache"),  # tokens and Q/K/V recomputed from scratch
        "OMP_NUM_THREADS": "1",
    }
    cmd = _command(tiny_setup, out, tmp_path / "qkv")
    stages = out / "stages"
    rng = random.Random()
    after = rng.randint(1, 17)  # finished stages before the first kill; finetune.oal is stage 20 of 22
    delay = rng.uniform(0, 0.3)
    note = f"killed after {after} stage records + {delay:.2f} s"

    def enough_stages() -> bool:
        if stages.is_dir() and len(list(stages.glob("*.json"))) >= after:
            time.sleep(delay)
            return True
        return False

    assert _run_until(cmd, env, log, enough_stages), note
    assert not (out / "reproduce.json").exists(), note
    done_at_kill = {p.name for p in stages.glob("*.json")}

    def mid_finetune() -> bool:  # a finished checkpoint of OAL's fine-tuning exists, the stage is not finished
        ckpt = out / "finetune" / "oal" / "checkpoints"
        saved = ckpt.is_dir() and any(p.name.startswith("step-") for p in ckpt.iterdir())
        return saved and not (stages / "finetune.oal.json").exists()

    assert _run_until(cmd, env, log, mid_finetune), note
    assert not (out / "reproduce.json").exists()
    assert not _run_until(cmd, env, log, lambda: False)
    assert json.loads((out / "reproduce.json").read_text()) == expected, note
    assert done_at_kill <= {p.name for p in stages.glob("*.json")}
    assert len(json.loads((out / "run.json").read_text())["invocations"]) == 3
    # OAL's fine-tuning continued from its checkpoint instead of starting over
    assert json.loads((out / "finetune" / "oal" / "summary.json").read_text())["resumed_at"]
