"""Shared fixtures. Data comes from ``$OAL_DATA_DIR`` or ``<repo>/../shared/data`` and is never copied into the repo."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# Without a GPU the Triton kernels are tested in Triton's CPU interpreter. Triton reads this when it is first
# imported (transformers and peft may import it long before tests/ops/test_triton.py runs), so set it here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def shared_data_dir() -> Path | None:
    env = os.environ.get("OAL_DATA_DIR")
    for cand in ([Path(env)] if env else []) + [REPO.parent / "shared" / "data"]:
        if (cand / "wikitext-2-raw" / "wiki.test.raw").is_file():
            return cand
    return None


@pytest.fixture(scope="session")
def data_dir() -> Path:
    d = shared_data_dir()
    if d is None:
        pytest.skip("shared data not found: set OAL_DATA_DIR or place it at ../shared/data")
    return d


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def spy_fast_path(monkeypatch):
    """``spy_fast_path(owner, name) -> calls``: replaces ``owner.name``, a fast path that returns None where it does
    not apply, by a wrapper appending to ``calls`` whether each call took it."""

    def install(owner: object, name: str) -> list[bool]:
        calls: list[bool] = []
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(owner, name, wrapper)
        return calls

    return install
