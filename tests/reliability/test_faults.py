"""Faults: damaged files are detected (sha256 per tensor, or the checkpoint manifest) and reported in one line, never
loaded; a SIGKILL at a random point of `oal calibrate` / `oal finetune` followed by the same command gives exactly
the result of an uninterrupted run."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from reliability_world import CALIBRATE_FAST, OAL, N, small_llama, subprocess_env
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from oal.calibration import QKV, CalibrationConfig, calibrate_layers, load_calibrated
from oal.cli import app
from oal.conversion.convert import read_calibrated
from oal.fidelity.capture import CacheKey, QKVCache
from oal.io import CHECKSUM_KEY, IntegrityError, load_tensors
from oal.kernels import OALKernel


def flip_last_byte(path: Path) -> None:
    """Alter one byte of the last tensor's data (the end of a safetensors file)."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))


def truncate(path: Path, n: int = 8) -> None:
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - n)


CFG = CalibrationConfig(
    max_updates=20, val_every=10, patience=10, train_pool=24, positions_per_update=8, val_positions=8
)


def _calibrate(out: Path) -> None:
    gen = torch.Generator().manual_seed(1)

    def qkv(S):
        return QKV(torch.randn(S, 3, 24, 8, generator=gen), torch.randn(S, 1, 24, 8, generator=gen),
                   torch.randn(S, 1, 24, 8, generator=gen))  # fmt: skip

    data = {i: (qkv(2), qkv(1)) for i in range(2)}
    groups = torch.randint(0, 2, (3, 8), generator=gen)
    calibrate_layers(
        lambda i: OALKernel(groups, 1, num_groups=2), data.__getitem__, [0, 1], out, config=CFG, progress=False
    )


def test_damaged_calibration_files_are_refused_and_repaired(tmp_path, caplog):
    out = tmp_path / "cal"
    _calibrate(out)
    good = (out / "params.safetensors").read_bytes()
    assert CHECKSUM_KEY in load_tensors(out / "params.safetensors")[1]
    flip_last_byte(out / "params.safetensors")
    with pytest.raises(IntegrityError, match="does not match its sha256"):
        load_calibrated(out, 1)
    with pytest.raises(IntegrityError, match="params.safetensors"):
        read_calibrated(out)  # what `oal convert --calibrated` reads
    _calibrate(out)  # resuming the finished run rewrites the combined file from the (verified) layer files
    assert (out / "params.safetensors").read_bytes() == good
    truncate(out / "layers" / "layer_001.safetensors")
    with pytest.raises(IntegrityError, match="layer_001.safetensors is not a readable safetensors file"):
        _calibrate(out)
    # a file written before checksums existed still loads, with a warning
    legacy = tmp_path / "legacy.safetensors"
    save_file({"layers.0.L": torch.eye(3)[None]}, str(legacy))
    with caplog.at_level(logging.WARNING, logger="oal.io"):
        assert torch.equal(load_tensors(legacy)[0]["layers.0.L"], torch.eye(3)[None])
    assert "no checksums" in caplog.text


def test_damaged_qkv_cache_block_is_refused(tmp_path):
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    key = CacheKey("tiny", "local:tiny", "random", "valid", 16, None)
    cache = QKVCache(tmp_path, key, ids)
    cache.ensure(small_llama(), [0, 1, 2], [0, 1], progress=False)
    assert torch.isfinite(cache.layer(1, [0, 1, 2], outputs=True).o).all()
    flip_last_byte(cache.path(1))
    with pytest.raises(IntegrityError, match=r"block_0001.safetensors does not match its sha256.*delete"):
        cache.layer(1, [0, 1, 2], outputs=True)
    truncate(cache.path(2))
    with pytest.raises(IntegrityError, match="block_0002.safetensors is not a readable safetensors file"):
        cache.missing([0, 1, 2], [0, 1])


def _one_error_line(result, expect: str, code: int = 1) -> None:
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and expect in errors[0], result.output


def test_damaged_files_end_commands_with_one_error_line(world, tmp_path):
    cache = tmp_path / "qkv"
    args = ["calibrate", "--kernel", "oal", "--groups", world["groups"], "--model", world["model"], "--seq-len", N,
            "--layers", "1", "--data", world["data"], "--cache", cache, *CALIBRATE_FAST]  # fmt: skip
    ok = CliRunner().invoke(app, [*map(str, args), "--out", str(tmp_path / "cal")])
    assert ok.exit_code == 0, ok.output
    flip_last_byte(next(cache.rglob("block_0016.safetensors")))
    again = CliRunner().invoke(app, [*map(str, args), "--out", str(tmp_path / "cal2")])
    _one_error_line(again, "block_0016.safetensors does not match its sha256")

    flip_last_byte(tmp_path / "cal" / "params.safetensors")
    fid = CliRunner().invoke(
        app,
        ["fidelity", "-m", f"oal={tmp_path / 'cal'}", "--model", str(world["model"]), "--seq-len", str(N),
         "--layers", "1", "--blocks", "0", "--data", str(world["data"]), "--cache", str(cache),
         "--out", str(tmp_path / "fid")],
    )  # fmt: skip
    _one_error_line(fid, "params.safetensors does not match its sha256")

    chi = tmp_path / "analyze" / "chi.safetensors"
    chi.parent.mkdir()
    chi.write_bytes(world["chi"].read_bytes())
    (chi.parent / "analysis.json").write_text("{}")
    flip_last_byte(chi)
    grp = CliRunner().invoke(app, ["group", "--chi", str(chi), "--out", str(tmp_path / "grp"), "--layer", "1"])
    _one_error_line(grp, "chi.safetensors does not match its sha256")


def test_damaged_finetune_checkpoint_ends_the_command_with_one_error_line(world, tmp_path):
    args = ["finetune", "--model", str(world["model"]), "--preset", "smoke", "--out", str(tmp_path / "ft"),
            "--updates", "2", "--block-len", "32", "--threads", "1", "--data-dir", str(world["data"])]  # fmt: skip
    assert CliRunner().invoke(app, args).exit_code == 0
    ckpt = next((tmp_path / "ft" / "checkpoints").iterdir())
    flip_last_byte(ckpt / "trainable.safetensors")
    _one_error_line(CliRunner().invoke(app, args), "trainable.safetensors does not match its sha256")


# --------------------------------------------------------------------------------------------- SIGKILL


def _kill_after(cmd: list[str], env: dict, first, second, rng: random.Random, units: float) -> float:
    """Start ``cmd``; once ``second()`` holds (some progress is on disk), SIGKILL it after a random delay of up to
    ``units`` times the time between ``first()`` and ``second()`` becoming true (one unit of work, e.g. one layer:
    so the kill lands in the remaining work whatever the machine's speed). Returns the delay; fails if the
    command finished before the kill."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        times = []
        for mark in (first, second):
            while not mark():
                assert proc.poll() is None, f"exited ({proc.returncode}) early: {proc.stderr.read()[-2000:]}"
                assert time.monotonic() < deadline, "no progress in 600 s"
                time.sleep(0.02)
            times.append(time.monotonic())
        delay = rng.uniform(0.0, units * (times[1] - times[0]))
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL, "the run finished before the kill: give it more work"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return delay


def _run(cmd: list[str], env: dict) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _strip_times(summary: dict) -> dict:
    for layer in summary["layers"].values():
        for entry in (layer, layer.get("global_stage") or {}):
            entry.pop("seconds", None)
            entry.pop("timings", None)
    return summary


@pytest.mark.slow
def test_sigkill_calibrate_then_resume_equals_uninterrupted(world, tmp_path):
    env = subprocess_env(world)
    base = [*OAL, "calibrate", "--kernel", "oal", "--groups", str(world["groups"]), "--model", str(world["model"]),
            "--seq-len", str(N), "--layers", "0-2", "--data", str(world["data"]), "--threads", "1",
            "--max-updates", "600", "--patience", "600", "--train-pool", "32", "--val-positions", "16"]  # fmt: skip
    run, cache = tmp_path / "run", tmp_path / "qkv-run"
    cmd = [*base, "--out", str(run), "--cache", str(cache)]

    def captured() -> bool:  # the fit starts once the 10 fitting blocks are in the cache
        return len(list(cache.rglob("block_*.safetensors"))) == 10

    # killed within the next 1.5 layers' time: in layer 1 or the first half of layer 2
    delay = _kill_after(cmd, env, captured, (run / "layers" / "layer_000.json").is_file, random.Random(), 1.5)
    done = sorted(p.name for p in (run / "layers").glob("*.json"))
    _run(cmd, env)
    _run([*base, "--out", str(tmp_path / "ref"), "--cache", str(tmp_path / "qkv-ref")], env)
    a, b = load_file(tmp_path / "ref" / "params.safetensors"), load_file(run / "params.safetensors")
    note = f"killed {delay:.2f} s after layer 0 finished (layer files then: {done})"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), note
    ga, gb = (load_file(d / "global" / "params.safetensors") for d in (tmp_path / "ref", run))
    assert all(torch.equal(ga[k], gb[k]) for k in ga), note
    sa, sb = (_strip_times(json.loads((d / "summary.json").read_text())) for d in (tmp_path / "ref", run))
    assert sa == sb, note


@pytest.mark.slow
def test_sigkill_finetune_then_resume_equals_uninterrupted(world, tmp_path):
    env = subprocess_env(world)
    base = [*OAL, "finetune", "--model", str(world["model"]), "--preset", "smoke", "--kernel", "oal",
            "--random-groups", "3", "--layers", "1-2", "--updates", "40", "--block-len", "32", "--val-every", "10",
            "--checkpoint-every", "1", "--threads", "1", "--data-dir", str(world["data"])]  # fmt: skip
    run = tmp_path / "run"
    log = run / "train_log.jsonl"

    def updates(n: int):
        return lambda: log.is_file() and len(log.read_text().splitlines()) >= n

    # killed within the time of 30 more updates (of 40): anywhere in the rest of the run
    delay = _kill_after([*base, "--out", str(run)], env, updates(1), updates(2), random.Random(), 30)
    killed_at = len(log.read_text().splitlines())
    _run([*base, "--out", str(run)], env)
    _run([*base, "--out", str(tmp_path / "ref")], env)
    note = f"killed {delay:.2f} s after update 2, after update {killed_at}"

    def lines(d):
        return [{k: v for k, v in json.loads(x).items() if k != "time"} for x in (d / "train_log.jsonl").open()]

    assert lines(run) == lines(tmp_path / "ref"), note
    ckpt = {d: max((d / "checkpoints").iterdir()) for d in (run, tmp_path / "ref")}
    a, b = (load_file(c / "trainable.safetensors") for c in ckpt.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), note
    ka, kb = (load_file(d / "best" / "kernels.safetensors") for d in (run, tmp_path / "ref"))
    assert all(torch.equal(ka[k], kb[k]) for k in ka), note
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (run, tmp_path / "ref"))
    assert sa["best"] == sb["best"] and sa["resumed_at"] and not sb["resumed_at"], note
