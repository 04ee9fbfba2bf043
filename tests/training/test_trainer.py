import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from oal.models import attached_kernels
from oal.training import CheckpointError, finetune, latest_checkpoint, load_finetuned
from oal.training.lora import trainable_parameters

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


class Killed(Exception):
    """Raised from on_step: the run stops as if the process had died right there."""


def kill_at(step):
    def on_step(record):
        if record["step"] == step:
            raise Killed(step)

    return on_step


def jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def strip_time(records):
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


def final_params(run):
    return load_file(latest_checkpoint(run / "checkpoints") / "trainable.safetensors")


def assert_same_run(a, b):
    assert strip_time(jsonl(a / "train_log.jsonl")) == strip_time(jsonl(b / "train_log.jsonl"))
    assert strip_time(jsonl(a / "val.jsonl")) == strip_time(jsonl(b / "val.jsonl"))
    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    ba, bb = load_file(a / "best" / "kernels.safetensors"), load_file(b / "best" / "kernels.safetensors")
    assert all(torch.equal(ba[k], bb[k]) for k in ba)
    sa, sb = (json.loads((r / "summary.json").read_text()) for r in (a, b))
    assert sa["best"] == sb["best"]


def test_outputs_and_best_checkpoint(tmp_path, converted, data, config):
    model = converted()
    groups = attached_kernels(model)[1].groups.clone()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = config(updates=8, val_every=2, lr=0.05)  # a large lr: validation NLL gets worse after its best point
    result = finetune(model, cfg, tmp_path, data=data())
    train, val = jsonl(tmp_path / "train_log.jsonl"), jsonl(tmp_path / "val.jsonl")
    assert [r["step"] for r in train] == list(range(1, 9))
    assert all({"loss", "lr", "grad_norm", "time", "blocks"} <= set(r) for r in train)
    assert [r["step"] for r in val] == [2, 4, 6, 8] and all(r["tokens"] == 2 * 15 for r in val)
    best = min(val, key=lambda r: r["nll"])
    assert result.summary["best"] == {"step": best["step"], "val_nll": best["nll"], "val_ppl": best["ppl"]}
    assert best["step"] < 8  # the selection matters in this run
    # the returned model holds the best weights, not the last ones
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    best_saved, last_saved = load_file(ckpt / "best.safetensors"), load_file(ckpt / "trainable.safetensors")
    params = trainable_parameters(result.model)
    assert all(torch.equal(p.detach(), best_saved[n]) for n, p in params.items())
    assert not all(torch.equal(best_saved[n], last_saved[n]) for n in params)
    # kernel parameters trained, frozen backbone and groups untouched
    base = result.model.base_model.model
    after = {k.replace(".base_layer", ""): v for k, v in base.state_dict().items() if "lora_" not in k}
    assert after.keys() == init.keys()
    for name, t in init.items():
        trained = name.endswith(("oal_kernel.L", "oal_kernel.theta"))
        assert torch.equal(after[name], t) != trained, name
    assert torch.equal(base.model.layers[1].self_attn.oal_kernel.groups, groups)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (
        summary["model"]["converted_layers"] == [1, 2]
        and summary["model"]["trainable_parameters"]["kernel"] == 6 * 4 * 4 + 6 * 8  # L (Hq, G+1, G+1), θ (Hq, d)
    )
    assert "valid split" in summary["data"]["note"] and summary["provenance"]["command"]
    assert json.loads((tmp_path / "best" / "info.json").read_text())["step"] == best["step"]


def test_load_finetuned(tmp_path, converted, data, config):
    result = finetune(converted(), config(updates=4), tmp_path, data=data())
    ids = torch.randint(0, 97, (1, 19))
    result.model.eval()
    with torch.no_grad():
        want = result.model(input_ids=ids).logits
    # onto the plain backbone: kernels are rebuilt from kernels.json
    plain = converted({})
    loaded = load_finetuned(plain, tmp_path)
    layers = loaded.base_model.model.model.layers
    assert [hasattr(layer.self_attn, "oal_kernel") for layer in layers] == [False, True, True]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=0)
    merged = load_finetuned(converted(), tmp_path / "best", merge=True)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layer 1 differs"):
        load_finetuned(converted({1: "global"}), tmp_path)
    with pytest.raises(ValueError, match="layers \\[0\\]"):
        load_finetuned(converted({0: "global", 1: "oal", 2: "dijiang"}), tmp_path)
    (tmp_path / "best" / "kernels.json").write_text("{}")
    with pytest.raises(CheckpointError, match="kernels.json"):
        load_finetuned(converted(), tmp_path)


@pytest.mark.parametrize("kill,every", [(3, None), (5, 1), (1, None)])
def test_resume_equals_uninterrupted(tmp_path, converted, data, config, kill, every):
    cfg = config(updates=6, checkpoint_every=every)
    finetune(converted(), cfg, tmp_path / "ref", data=data())
    with pytest.raises(Killed):
        finetune(converted(), cfg, tmp_path / "run", data=data(), on_step=kill_at(kill))
    result = finetune(converted(), cfg, tmp_path / "run", data=data())
    assert_same_run(tmp_path / "ref", tmp_path / "run")
    last_ckpt = (kill // (every or 2)) * (every or 2)
    assert result.summary["resumed_at"] == ([last_ckpt] if last_ckpt else [])
    # calling it again on a finished run trains nothing and reports the same result
    again = finetune(converted(), cfg, tmp_path / "run", data=data())
    assert again.summary["best"] == result.summary["best"] and again.summary["resumed_at"][-1] == 6


def test_refuses_damaged_or_foreign_checkpoints(tmp_path, converted, data, config):
    cfg = config(updates=6)
    with pytest.raises(Killed):
        finetune(converted(), cfg, tmp_path, data=data(), on_step=kill_at(3))
    with pytest.raises(CheckpointError, match="lr"):
        finetune(converted(), config(updates=6, lr=1e-3), tmp_path, data=data())
    with pytest.raises(CheckpointError, match="model_fingerprint"):
        finetune(converted({1: "oal"}), cfg, tmp_path, data=data())
    with pytest.raises(CheckpointError, match="data"):
        finetune(converted(), cfg, tmp_path, data=data(seed=4))
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    with open(ckpt / "trainable.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 8)
    with pytest.raises(CheckpointError, match="trainable.safetensors has"):
        finetune(converted(), cfg, tmp_path, data=data())


def test_same_block_order_for_every_method(tmp_path, converted, data, config):
    cfg = config(updates=5, val_every=5)
    blocks = []
    for i, kernels in enumerate([{}, {1: "oal"}, {0: "dijiang", 2: "global"}]):
        finetune(converted(kernels), cfg, tmp_path / str(i), data=data())
        blocks.append([r["blocks"] for r in jsonl(tmp_path / str(i) / "train_log.jsonl")])
    assert blocks[0] == blocks[1] == blocks[2]
    assert sorted(b[0] for b in blocks[0]) == sorted({b[0] for b in blocks[0]})  # 5 distinct of 8 blocks


SCRIPT = """
import sys, torch
torch.set_num_threads(1)
sys.path[:0] = [{here!r}, {tests!r}]  # conftest, and the tiny module it imports
from conftest import tiny_converted, tiny_data, tiny_config
from oal.training import finetune
finetune(tiny_converted(), tiny_config(updates=24, checkpoint_every=1), sys.argv[1], data=tiny_data(),
         on_step=lambda r: print("step", r["step"], flush=True))
"""


def test_sigkill_at_a_random_point(tmp_path, converted, data, config):
    """A real SIGKILL of a training process, then a resume: the result equals an uninterrupted run."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(here=str(HERE), tests=str(HERE.parent)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(run)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()  # wait for the first update: imports and setup take seconds
        assert first.startswith("step"), first
        # a random point, counted in updates rather than seconds: on an idle machine the 24 tiny updates take
        # under a second, so a random delay could outlast the run
        skip = random.Random().randrange(0, 12)
        for _ in range(skip):
            assert proc.stdout.readline().startswith("step")
        time.sleep(random.Random().uniform(0.0, 0.05))
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL, "the run finished before the kill"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    killed_after = len((run / "train_log.jsonl").read_text().splitlines())
    cfg = config(updates=24, checkpoint_every=1)
    finetune(converted(), cfg, run, data=data())
    finetune(converted(), cfg, tmp_path / "ref", data=data())
    assert 1 <= killed_after < 24, f"killed after {skip + 1} printed updates, {killed_after} logged"
    assert_same_run(tmp_path / "ref", run)


DP_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
sys.path[:0] = [{here!r}, {tests!r}]  # conftest, and the tiny module it imports
from conftest import tiny_converted, tiny_data, tiny_config
from oal.training import finetune

def on_step(record):
    if len(sys.argv) > 2 and record["step"] == int(sys.argv[2]):
        raise SystemExit(3)

finetune(tiny_converted(), tiny_config(updates=6, checkpoint_every=1), sys.argv[1], data=tiny_data(blocks=14),
         on_step=on_step)
"""


@pytest.mark.slow
def test_two_process_data_parallel_resume(tmp_path):
    """torchrun with 2 CPU processes (what `accelerate launch` runs): distinct blocks per process, global batch 2,
    and an interrupted run resumes to the uninterrupted result."""
    script = tmp_path / "dp.py"
    script.write_text(DP_SCRIPT.format(here=str(HERE), tests=str(HERE.parent)))
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)])}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]

    def launch(*args):
        return subprocess.run([*torchrun, str(script), *args], env=env, capture_output=True, text=True, timeout=600)

    ref = launch(str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert launch(str(tmp_path / "run"), "4").returncode != 0
    resumed = launch(str(tmp_path / "run"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "ref", tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["data"]["global_batch"] == 2 and summary["resumed_at"] == [4]
    blocks = [r["blocks"] for r in jsonl(tmp_path / "ref" / "train_log.jsonl")]
    assert all(len(set(b)) == 2 for b in blocks) and len({x for b in blocks for x in b}) == 12


def test_fsdp_needs_several_processes(tmp_path, converted, data, config):
    with pytest.raises(ValueError, match="fsdp: sharding needs at least 2 processes, got 1"):
        finetune(converted(), config(), tmp_path / "run", data=data(), fsdp=True)
