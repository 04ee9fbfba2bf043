"""Small file helpers shared by every command: atomic writes and the provenance block of each result file."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


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
