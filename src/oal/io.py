"""Small file helpers shared by every command: atomic writes, checksummed safetensors files and the provenance
block of each result file."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CHECKSUM_KEY = "oal.sha256"
"""safetensors metadata key holding ``{tensor name: sha256}`` (JSON) of every tensor in the file."""


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place, so a reader (or a
    resumed run) never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_json(path: str | os.PathLike, data: Any) -> Path:
    return write_text(path, json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")


def read_json(path: str | os.PathLike, *, what: str = "file") -> Any:
    """Read JSON with an error that names the file instead of a bare decoder traceback."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e})") from e


def _json_default(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def provenance(**extra: Any) -> dict[str, Any]:
    """Who made a result and how: the exact command, UTC time, versions and machine, plus ``extra``."""
    return {
        "command": " ".join(
            shlex.quote(a) for a in ["oal" if sys.argv[0].endswith("oal") else sys.argv[0]] + sys.argv[1:]
        ),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads",
        **extra,
    }


# ------------------------------------------------------------------------------------------ checksummed tensors


class IntegrityError(ValueError):
    """A stored file is truncated, altered or unreadable; the message names the file and what failed."""


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 over a tensor's dtype, shape and bytes (contiguous, on the CPU)."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_tensors(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> Path:
    """Write ``tensors`` as safetensors atomically, with the sha256 of every tensor in the metadata
    (:data:`CHECKSUM_KEY`), so :func:`load_tensors` detects a truncated or altered file."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    meta = {**(metadata or {}), CHECKSUM_KEY: json.dumps({k: tensor_sha256(v) for k, v in sorted(tensors.items())})}
    return atomic_write(path, lambda p: save_file(tensors, str(p), metadata=meta))


_unverified: set[str] = set()


def load_tensors(
    path: str | os.PathLike, keys: Iterable[str] | None = None, *, prefix: str = "", what: str = "file"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read tensors (all, those in ``keys``, or those whose name starts with ``prefix``, returned without it) and
    the metadata of a safetensors file, verifying each tensor read against its stored sha256.

    Raises :class:`IntegrityError` naming ``what`` and the file when the file cannot be parsed (truncated,
    not safetensors), a requested tensor is absent, or a checksum differs. Files written before checksums were
    recorded load with a warning (once per directory): safetensors itself still detects their truncation, not an
    altered byte.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what}: no such file: {path}")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
            names = list(fh.keys())
            wanted = [k for k in names if k.startswith(prefix)] if keys is None else list(keys)
            missing = sorted(set(wanted) - set(names))
            if missing:
                raise IntegrityError(f"{what}: {path} has no tensors {missing}")
            tensors = {k: fh.get_tensor(k) for k in wanted}
    except SafetensorError as e:
        raise IntegrityError(f"{what}: {path} is not a readable safetensors file, truncated or altered ({e})") from None
    if CHECKSUM_KEY in meta:
        try:
            sums = json.loads(meta[CHECKSUM_KEY])
        except json.JSONDecodeError:
            raise IntegrityError(f"{what}: {path} has a malformed checksum record (the file was altered)") from None
        for k, t in tensors.items():
            if sums.get(k) != tensor_sha256(t):
                raise IntegrityError(
                    f"{what}: tensor {k!r} of {path} does not match its sha256 (the file was altered or damaged); "
                    "delete the file and re-create it"
                )
    elif str(path.parent) not in _unverified:  # once per directory: a cache holds many such files
        _unverified.add(str(path.parent))
        logger.warning(
            "%s: %s (and maybe other files in its directory) has no checksums (written by an older version); "
            "loaded unverified",
            what,
            path,
        )
    return ({k[len(prefix) :]: v for k, v in tensors.items()} if keys is None else tensors), meta
