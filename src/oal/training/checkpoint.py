"""Checksummed, atomically written checkpoint directories and the resumable training state.

A checkpoint directory is filled under a temporary name, its files are hashed into ``manifest.json`` (sha256 and
size of every file), and only then is it renamed into place; :func:`verify_checked_dir` recomputes the hashes and
refuses a directory with a missing, truncated, altered or extra file, so a damaged checkpoint is reported and never
loaded silently.

The training state of update s lives in ``<run>/checkpoints/step-{s:06d}/``:

* ``trainable.safetensors``: LoRA and kernel parameters (names as in the PEFT model);
* ``best.safetensors``: the same parameters at the best validation point so far (absent before the first one);
* ``optimizer.pt``: the AdamW state dict (read back with ``torch.load(weights_only=True)``);
* ``state.json``: update count, scheduler state, best-so-far metrics, the train/validation logs, training seconds,
  and the identity of the run (protocol, data hashes, model fingerprint) that a resume must match.

The data order needs no position of its own (update s reads ``order[s]``), and dropout is reseeded from
(seed, update, process) before every update, so no RNG state has to be carried across a restart.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file

from ..io import read_json

MANIFEST = "manifest.json"
FORMAT = "oal.checkpoint"
VERSION = 1
STATE_KIND = "training-state"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, truncated or altered, or belongs to a different run."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def write_checked_dir(target: str | os.PathLike, write: Callable[[Path], None], *, kind: str) -> Path:
    """Call ``write(tmp)`` to fill a temporary directory beside ``target``, add the manifest, and rename it to
    ``target`` (replacing an existing one). A reader never sees a directory without its complete manifest."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    old = None
    try:
        write(tmp)
        files = {}
        for rel in _files(tmp):
            _fsync(tmp / rel)
            files[rel] = {"bytes": (tmp / rel).stat().st_size, "sha256": sha256_file(tmp / rel)}
        manifest = {"format": FORMAT, "version": VERSION, "kind": kind, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        _fsync(tmp / MANIFEST)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / target.name)
        os.replace(tmp, target)
        _fsync(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return target


def verify_checked_dir(path: str | os.PathLike, *, kind: str | None = None) -> dict[str, Any]:
    """Check every file of a directory written by :func:`write_checked_dir` against its manifest; return the
    manifest. Raises :class:`CheckpointError` naming the first problem found."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    try:
        manifest = read_json(path / MANIFEST, what="checkpoint manifest")
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e}); it is incomplete or was not written by oal") from e
    if not isinstance(manifest, dict) or (manifest.get("format"), manifest.get("version")) != (FORMAT, VERSION):
        raise CheckpointError(f"{path}: expected a {FORMAT} v{VERSION} manifest")
    if kind is not None and manifest.get("kind") != kind:
        raise CheckpointError(f"{path}: expected a {kind!r} checkpoint, got {manifest.get('kind')!r}")
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise CheckpointError(f"{path}: malformed manifest (no file list)")
    present = set(_files(path)) - {MANIFEST}
    extra = sorted(present - set(listed))
    if extra:
        raise CheckpointError(f"{path}: files not in the manifest: {extra} (the checkpoint was altered)")
    for rel, info in listed.items():
        file = path / rel
        if rel not in present:
            raise CheckpointError(f"{path}: {rel} is missing (the checkpoint is incomplete or was altered)")
        size = file.stat().st_size
        if size != info.get("bytes"):
            raise CheckpointError(f"{path}: {rel} has {size} bytes, the manifest says {info.get('bytes')} (truncated?)")
        if sha256_file(file) != info.get("sha256"):
            raise CheckpointError(f"{path}: {rel} does not match its sha256 in the manifest (the file was altered)")
    return manifest


class TrainingState(NamedTuple):
    """A loaded training checkpoint: parameter tensors, optimizer state dict and the ``state.json`` content."""

    trainable: dict[str, torch.Tensor]
    best: dict[str, torch.Tensor] | None
    optimizer: dict[str, Any]
    state: dict[str, Any]
    path: Path


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The ``step-*`` directory with the highest update count under ``root``, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return max(steps)[1] if steps else None


def save_training_state(
    root: str | os.PathLike,
    step: int,
    *,
    trainable: dict[str, torch.Tensor],
    best: dict[str, torch.Tensor] | None,
    optimizer: dict[str, Any],
    state: dict[str, Any],
) -> Path:
    """Write the checkpoint of update ``step`` and then delete older checkpoints and leftovers of killed writes."""
    root = Path(root)

    def write(tmp: Path) -> None:
        save_file(trainable, tmp / "trainable.safetensors")
        if best is not None:
            save_file(best, tmp / "best.safetensors")
        torch.save(optimizer, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")

    path = write_checked_dir(step_dir(root, step), write, kind=STATE_KIND)
    for p in root.iterdir():
        stale = p.name.startswith(".step-") or (_STEP_DIR.match(p.name) and p != path)
        if stale and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    return path


def load_training_state(path: str | os.PathLike) -> TrainingState:
    """Verify a training checkpoint against its manifest and load it (CPU tensors)."""
    path = Path(path)
    verify_checked_dir(path, kind=STATE_KIND)
    try:
        best = load_file(path / "best.safetensors") if (path / "best.safetensors").is_file() else None
        return TrainingState(
            trainable=load_file(path / "trainable.safetensors"),
            best=best,
            optimizer=torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True),
            state=read_json(path / "state.json", what="training state"),
            path=path,
        )
    except Exception as e:  # verified bytes that still do not parse: written by an incompatible version
        raise CheckpointError(f"{path}: checkpoint files could not be read ({type(e).__name__}: {e})") from e


BEST_KIND = "finetuned"


def resolve_finetuned_dir(path: str | os.PathLike) -> Path:
    """A run directory means its ``best/``; otherwise ``path`` itself."""
    path = Path(path)
    return path / "best" if (path / "best" / MANIFEST).is_file() else path


def is_finetuned_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a fine-tuning run directory or its ``best/`` export (judged by the manifest's kind)."""
    manifest = resolve_finetuned_dir(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return read_json(manifest, what="checkpoint manifest").get("kind") == BEST_KIND
    except (ValueError, AttributeError):
        return False
