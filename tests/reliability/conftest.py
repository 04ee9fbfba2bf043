"""Fixtures of the reliability tests; the helpers are in reliability_world.py."""

from __future__ import annotations

import pytest
import torch
from reliability_world import make_env


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OAL_CACHE_DIR", str(root / "oal-cache"))
        mp.delenv("OAL_DATA_DIR", raising=False)
        yield make_env(root)


@pytest.fixture
def world(tiny_world, monkeypatch):
    """The session's tiny world, with its private token cache and no $OAL_DATA_DIR for this test."""
    monkeypatch.setenv("OAL_CACHE_DIR", str(tiny_world["root"] / "oal-cache"))
    monkeypatch.delenv("OAL_DATA_DIR", raising=False)
    return tiny_world


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
