"""Two CPU processes under `accelerate launch` (gloo), on the tiny world:

* `oal calibrate`: blocks and layers shared out, one params.safetensors gathered by process 0, resuming a run a
  single process began: the parameters are IDENTICAL to a one-process run (each layer's draws depend only on
  (seed, layer), never on the rank);
* `oal finetune`: DDP with global batch 2 against one process with ``--grad-accum 2`` (the same blocks and
  dropout masks): losses, gradient norms and validation NLL within 1e-5 relative, final LoRA and kernel
  parameters within 1e-6 (they differ only in floating-point summation order, if at all).

`accelerate launch --cpu --num_processes 2` starts ONE process (its CPU mode is a plain launch, or mpirun with
--mpirun_hostfile); two CPU processes need the multi-process launcher, ``--multi_gpu``, with
``ACCELERATE_USE_CPU=1`` so that the processes form a gloo group on the CPU (docs/distributed.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from reliability_world import OAL, N, free_port, small_llama, subprocess_env, without_times
from safetensors.torch import load_file


def accelerate_launch(tmp_path, processes: int = 2) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "-m", "oal"]  # fmt: skip


def _run(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_two_process_calibration_equals_one_process(world, tmp_path):
    env = subprocess_env(world, ACCELERATE_USE_CPU="1", HF_HOME=str(tmp_path / "hf"))
    args = ["calibrate", "--kernel", "oal", "--groups", str(world["groups"]), "--model", str(world["model"]),
            "--seq-len", str(N), "--data", str(world["data"]), "--threads", "1", "--max-updates", "60",
            "--patience", "30", "--train-pool", "32", "--val-positions", "16"]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    _run([*OAL, *args, "--layers", "0-2", "--out", str(one), "--cache", str(tmp_path / "qkv1")], env)
    # process 0 of an earlier single-process run finished layer 0 only; two processes resume and share 1 and 2
    _run([*OAL, *args, "--layers", "0", "--out", str(two), "--cache", str(tmp_path / "qkv2")], env)
    proc = _run([*accelerate_launch(tmp_path), *args, "--layers", "0-2", "--out", str(two), "--cache",
                 str(tmp_path / "qkv3")], env)  # fmt: skip
    for rel in ("params.safetensors", "global/params.safetensors"):
        a, b = load_file(one / rel), load_file(two / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel
    sa, sb = (without_times(json.loads((d / "summary.json").read_text())) for d in (one, two))
    assert sa == sb
    record = json.loads((two / "calibrate.json").read_text())
    assert record["processes"] == 2 and record["timings"]["capture"]["captured"] == list(range(16, 26))
    assert sorted(p.name for p in (tmp_path / "qkv3").rglob("block_*.safetensors")) == [
        f"block_{b:04d}.safetensors" for b in range(16, 26)
    ]
    assert proc.stdout.count("calibrated oal on 3 layers") == 1  # process 0 reports, the other stays quiet


@pytest.mark.slow
def test_two_process_finetune_matches_one_process_with_accumulation(world, tmp_path):
    env = subprocess_env(world, ACCELERATE_USE_CPU="1", HF_HOME=str(tmp_path / "hf"))
    args = ["finetune", "--model", str(world["model"]), "--preset", "smoke", "--kernel", "oal", "--random-groups",
            "3", "--layers", "1-2", "--updates", "6", "--block-len", "32", "--val-every", "3", "--threads", "1",
            "--data-dir", str(world["data"])]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    _run([*OAL, *args, "--grad-accum", "2", "--out", str(one)], env)
    _run([*accelerate_launch(tmp_path), *args, "--out", str(two)], env)
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert (s1["num_processes"], s2["num_processes"]) == (1, 2)
    assert s1["data"]["global_batch"] == s2["data"]["global_batch"] == 2
    l1, l2 = ([json.loads(line) for line in (d / "train_log.jsonl").open()] for d in (one, two))
    assert [r["blocks"] for r in l1] == [r["blocks"] for r in l2]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in l1]), torch.tensor([r[key] for r in l2]), rtol=1e-5, atol=0
        )
    v1, v2 = ([json.loads(line)["nll"] for line in (d / "val.jsonl").open()] for d in (one, two))
    torch.testing.assert_close(torch.tensor(v1), torch.tensor(v2), rtol=1e-5, atol=0)
    p1, p2 = (load_file(max((d / "checkpoints").iterdir()) / "trainable.safetensors") for d in (one, two))
    assert p1.keys() == p2.keys()
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], rtol=0, atol=1e-6)
    diff = max(float((p1[k] - p2[k]).abs().max()) for k in p1)
    print(f"max |Δparameter| between 2 processes and 1 process with accumulation: {diff:.3g}")


@pytest.mark.slow
def test_two_process_fsdp_finetune_matches_one_process_and_resumes(world, tmp_path):
    """`--fsdp` (torch FSDP2 on gloo: every decoder block sharded over 2 processes) follows the one-process
    trajectory with the same global batch, writes whole tensors, and resumes from its gathered checkpoint."""
    env = subprocess_env(world, ACCELERATE_USE_CPU="1", HF_HOME=str(tmp_path / "hf"))
    args = ["finetune", "--model", str(world["model"]), "--preset", "smoke", "--kernel", "oal", "--random-groups",
            "3", "--layers", "1-2", "--updates", "6", "--block-len", "32", "--val-every", "3", "--val-blocks", "3",
            "--threads", "1", "--data-dir", str(world["data"])]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    _run([*OAL, *args, "--grad-accum", "2", "--out", str(one)], env)
    _run([*accelerate_launch(tmp_path), *args, "--fsdp", "--out", str(two)], env)
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert (s1["num_processes"], s2["num_processes"]) == (1, 2) and s2["data"]["global_batch"] == 2
    assert s1["model"]["trainable_parameters"] == s2["model"]["trainable_parameters"]
    l1, l2 = ([json.loads(line) for line in (d / "train_log.jsonl").open()] for d in (one, two))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in l1]), torch.tensor([r[key] for r in l2]), rtol=1e-5, atol=0
        )
    v1, v2 = ([json.loads(line)["nll"] for line in (d / "val.jsonl").open()] for d in (one, two))
    torch.testing.assert_close(torch.tensor(v1), torch.tensor(v2), rtol=1e-5, atol=0)

    def final(d):
        ckpt = max((d / "checkpoints").iterdir())
        return load_file(ckpt / "trainable.safetensors"), torch.load(ckpt / "optimizer.pt", weights_only=True)

    (p1, _), (p2, opt2) = final(one), final(two)
    assert p1.keys() == p2.keys()
    for k in p1:  # whole tensors, not one process's shard
        torch.testing.assert_close(p1[k], p2[k], rtol=0, atol=1e-6)
    assert len(opt2["state"]) == len(p2)  # every parameter's AdamW moments, gathered
    b1, b2 = (load_file(d / "best" / "kernels.safetensors") for d in (one, two))
    assert b1.keys() == b2.keys() and all(torch.allclose(b1[k], b2[k], atol=1e-6) for k in b1)

    # resume: SIGKILL the whole launch after its first update, rerun, and land on the uninterrupted run's result
    three = tmp_path / "three"
    log = three / "train_log.jsonl"
    tail = [*args, "--fsdp", "--checkpoint-every", "1", "--out", str(three)]
    proc = subprocess.Popen([*accelerate_launch(tmp_path), *tail], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not (log.is_file() and log.read_text().splitlines()):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no update in 600 s"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    killed_at = len(log.read_text().splitlines())
    _run([*accelerate_launch(tmp_path), *tail], env)
    resumed = json.loads((three / "summary.json").read_text())["resumed_at"]
    assert killed_at < 6 and resumed and resumed[0] >= 1, (killed_at, resumed)
    p3 = final(three)[0]
    for k in p2:
        torch.testing.assert_close(p3[k], p2[k], rtol=0, atol=1e-6)


def test_finetune_refuses_processes_that_formed_no_group(tmp_path, monkeypatch):
    """torchrun on CPUs without ACCELERATE_USE_CPU: accelerate sees one process per process; training alone in
    each would write one run directory from several processes. It is refused before anything is written."""
    from oal.training import FinetuneConfig, FinetuneData, finetune

    monkeypatch.setenv("WORLD_SIZE", "2")
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    config = FinetuneConfig(updates=1, block_len=16, val_every=1, val_blocks=1)
    with pytest.raises(ValueError, match="started 2 processes but accelerate joined 1.*ACCELERATE_USE_CPU"):
        finetune(small_llama(), config, tmp_path / "run", data=FinetuneData.from_blocks(ids, 1, source="random"))
    assert not (tmp_path / "run").exists()
