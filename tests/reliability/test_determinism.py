"""The same command with the same seed, run twice on the CPU, gives identical results: byte-identical parameter
files for `oal calibrate` and `oal finetune`, and exactly equal captured Q/K/V (fresh capture caches, so the
capture is repeated too; those files carry several metadata entries, whose order safetensors does not fix)."""

from __future__ import annotations

import json

import torch
from reliability_world import CALIBRATE_FAST, N, without_times
from typer.testing import CliRunner

from oal.cli import app
from oal.io import load_tensors


def _invoke(args: list) -> None:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output


def test_calibrate_twice_gives_identical_files(world, tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    for i, out in enumerate(runs):
        _invoke(["calibrate", "--kernel", "oal", "--groups", world["groups"], "--model", world["model"],
                 "--seq-len", N, "--layers", "1-2", "--data", world["data"], "--cache", tmp_path / f"qkv{i}",
                 "--out", out, "--seed", "3", "--threads", "1", *CALIBRATE_FAST])  # fmt: skip
    a, b = runs
    for rel in ("params.safetensors", "global/params.safetensors", "layers/layer_001.safetensors"):
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    blocks = sorted(p.relative_to(tmp_path / "qkv0") for p in (tmp_path / "qkv0").rglob("block_*.safetensors"))
    assert len(blocks) == 10
    for rel in blocks:  # the captured Q/K/V and outputs too (tensors: the header's metadata order may vary)
        (ta, ma), (tb, mb) = (load_tensors(tmp_path / q / rel) for q in ("qkv0", "qkv1"))
        assert ma == mb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), rel
    sa, sb = (without_times(json.loads((d / "summary.json").read_text())) for d in runs)
    assert sa == sb


def test_finetune_twice_gives_identical_files(world, tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        _invoke(["finetune", "--model", world["model"], "--preset", "smoke", "--kernel", "oal", "--random-groups", "3",
                 "--layers", "1-2", "--updates", "4", "--block-len", "32", "--threads", "1", "--seed", "5",
                 "--data-dir", world["data"], "--out", out])  # fmt: skip
    a, b = runs
    ca, cb = (max((d / "checkpoints").iterdir()) for d in runs)
    for x, y in ((ca / "trainable.safetensors", cb / "trainable.safetensors"),
                 (a / "best" / "kernels.safetensors", b / "best" / "kernels.safetensors"),
                 (a / "best" / "adapter" / "adapter_model.safetensors",
                  b / "best" / "adapter" / "adapter_model.safetensors")):  # fmt: skip
        assert x.read_bytes() == y.read_bytes(), x
    la, lb = ([without_times(json.loads(line)) for line in (d / "train_log.jsonl").open()] for d in runs)
    assert la == lb and len(la) == 4
