"""Small shared helpers: devices, dtypes, the data folder, lm-eval's standard error, atomic JSON output."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

DATA_DIR_ENV = "OAL_DATA_DIR"

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def model_device(model: torch.nn.Module) -> torch.device:
    """Device of the model's first parameter (CPU for a parameterless module)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"fp32"``, ``"bfloat16"``/``"bf16"``, ``"float16"``/``"fp16"`` or a floating torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype: expected one of {sorted(DTYPES)} or a floating torch.dtype, got {dtype!r}")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """``data_dir``, else ``$OAL_DATA_DIR``, else None (then only the Hugging Face loaders can be used).

    A folder that is given but does not exist raises FileNotFoundError naming it.
    """
    if data_dir is None:
        env = os.environ.get(DATA_DIR_ENV)
        if not env:
            return None
        data_dir, origin = env, f"${DATA_DIR_ENV}"
    else:
        origin = "data_dir"
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{origin}: no such data folder: {path}")
    return path


def check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit: expected None or an int >= 1 (the first `limit` examples), got {limit!r}")


def mean_stderr(values: Sequence[float]) -> float:
    """Standard error of the mean as lm-eval computes it: sample std (n - 1) / sqrt(n).

    For 0/1 values with mean p this is sqrt(p (1 - p) / (n - 1)). NaN for fewer than two values.
    """
    n = len(values)
    if n < 2:
        return float("nan")
    mu = sum(values) / n
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def write_json_atomic(path: str | os.PathLike, obj: object) -> Path:
    """Write ``obj`` as indented JSON through a temporary sibling file and a rename, so readers never see a
    partial file. Creates the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
