import json

import pytest
import torch

from oal.training import CheckpointError, latest_checkpoint, load_training_state, verify_checked_dir
from oal.training.checkpoint import MANIFEST, save_training_state, sha256_file, write_checked_dir


def _write(tmp):
    (tmp / "a.txt").write_text("alpha")
    (tmp / "sub").mkdir()
    (tmp / "sub" / "b.bin").write_bytes(bytes(range(256)))


def test_manifest_lists_every_file(tmp_path):
    path = write_checked_dir(tmp_path / "ck", _write, kind="demo")
    manifest = verify_checked_dir(path, kind="demo")
    assert set(manifest["files"]) == {"a.txt", "sub/b.bin"}
    assert manifest["files"]["a.txt"] == {"bytes": 5, "sha256": sha256_file(path / "a.txt")}
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary directory left behind
    with pytest.raises(CheckpointError, match="expected a 'other' checkpoint"):
        verify_checked_dir(path, kind="other")


def test_replacing_an_existing_directory(tmp_path):
    write_checked_dir(tmp_path / "ck", _write, kind="demo")
    write_checked_dir(tmp_path / "ck", lambda t: (t / "c.txt").write_text("gamma"), kind="demo")
    assert set(verify_checked_dir(tmp_path / "ck")["files"]) == {"c.txt"}
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_failed_write_leaves_nothing(tmp_path):
    def boom(tmp):
        (tmp / "a.txt").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checked_dir(tmp_path / "ck", boom, kind="demo")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: (p / "a.txt").write_text("alphA"), "does not match its sha256"),
        (lambda p: (p / "sub" / "b.bin").write_bytes(bytes(range(100))), "truncated"),
        (lambda p: (p / "a.txt").unlink(), "missing"),
        (lambda p: (p / "extra.txt").write_text("hi"), "not in the manifest"),
        (lambda p: (p / MANIFEST).unlink(), "incomplete or was not written by oal"),
        (lambda p: (p / MANIFEST).write_text("{"), "not valid JSON"),
        (lambda p: (p / MANIFEST).write_text(json.dumps({"format": "x"})), "manifest"),
    ],
)
def test_damage_is_detected(tmp_path, damage, message):
    path = write_checked_dir(tmp_path / "ck", _write, kind="demo")
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        verify_checked_dir(path)


def test_training_state_round_trip_and_cleanup(tmp_path):
    root = tmp_path / "checkpoints"
    p = torch.nn.Parameter(torch.randn(3, 4))
    opt = torch.optim.AdamW([p])
    p.grad = torch.randn(3, 4)
    opt.step()
    trainable = {"w": p.detach().clone()}
    save_training_state(root, 2, trainable=trainable, best=None, optimizer=opt.state_dict(), state={"step": 2})
    (root / ".step-000004.tmp-dead").mkdir()  # a write killed half-way
    path = save_training_state(
        root, 4, trainable=trainable, best=trainable, optimizer=opt.state_dict(), state={"step": 4}
    )
    assert latest_checkpoint(root) == path and sorted(q.name for q in root.iterdir()) == ["step-000004"]
    loaded = load_training_state(path)
    assert loaded.state == {"step": 4} and torch.equal(loaded.trainable["w"], trainable["w"])
    assert torch.equal(loaded.best["w"], trainable["w"])
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, 4))])
    opt2.load_state_dict(loaded.optimizer)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with open(path / "optimizer.pt", "r+b") as f:  # flip one byte
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CheckpointError, match="optimizer.pt does not match"):
        load_training_state(path)
    assert latest_checkpoint(tmp_path / "nothing") is None
