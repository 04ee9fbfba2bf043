"""Raw evaluation/calibration text: WikiText-2 raw v1, from a local copy, the Hugging Face Hub, or an offline
stand-in, always reporting which one was used.

Sources, tried in this order when ``source="auto"``:

1. ``local``: ``<data_dir>/wikitext-2-raw/wiki.{split}.raw`` with ``data_dir`` the argument, else
   ``$OAL_DATA_DIR``. A ``data_dir`` passed explicitly must hold the split (no fallback); a missing split
   under ``$OAL_DATA_DIR`` only logs a warning and moves on.
2. ``hf``: ``datasets.load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1")``, when the ``datasets`` package is
   installed and the Hub answers (or ``HF_HUB_OFFLINE`` is set and its cache holds the data).
3. ``pydoc``: the English reference text CPython ships in ``pydoc_data.topics``, so that everything runs
   offline. It is *not* WikiText: numbers measured on it are not comparable to the paper's.

Text assembly (paper App. F.3, "text entries are joined in source order with two newlines"): the entries are the
dataset's rows, joined with ``"\\n\\n"``. The Hub's WikiText rows are the raw file's lines, each keeping its
trailing ``"\\n"``, with whitespace-only lines replaced by ``""`` (the dataset's original builder). The local
path reads the file the same way (text mode, so CRLF copies give the same rows), hence both produce the same
string. For ``pydoc`` the entries are the topics in sorted key order, split by index: ``i % 10 == 0`` test,
``i % 10 == 1`` valid, the rest train.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
SOURCES = ("auto", "local", "hf", "pydoc")
HF_DATASET = ("Salesforce/wikitext", "wikitext-2-raw-v1")
_SPLIT_ALIASES = {"validation": "valid"}
_HF_SPLITS = {"train": "train", "valid": "validation", "test": "test"}


class Text(NamedTuple):
    """A split's entries in source order, their ``"\\n\\n"``-joined text, and the source label:
    ``local:<file>``, ``hf:Salesforce/wikitext/wikitext-2-raw-v1/<split>`` or ``pydoc:pydoc_data.topics/<split>``.
    """

    text: str
    entries: list[str]
    source: str


def check_split(split: str) -> str:
    split = _SPLIT_ALIASES.get(split, split)
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    return split


def wikitext_file(data_dir: str | os.PathLike, split: str) -> Path:
    return Path(data_dir).expanduser() / "wikitext-2-raw" / f"wiki.{check_split(split)}.raw"


def read_wikitext_rows(path: str | os.PathLike, *, name: str = "path") -> list[str]:
    """The rows of a raw WikiText file exactly as the Hub dataset has them (see the module docstring); errors
    name the argument ``name`` the file came from."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: {path} is not valid UTF-8 ({e.reason} at byte {e.start})") from e
    if not any(line.strip() for line in lines):
        raise ValueError(f"{name}: {path} is empty (no non-blank line)")
    return [line if line.strip() else "" for line in lines]


def _from_local(data_dir: Path, split: str) -> Text:
    path = wikitext_file(data_dir, split)
    if not path.is_file():
        raise FileNotFoundError(f"data_dir: no WikiText-2 raw {split!r} split at {path}")
    rows = read_wikitext_rows(path, name="data_dir")
    return Text("\n\n".join(rows), rows, f"local:{path}")


def _hub_reachable(timeout: float = 3.0) -> bool:
    # load_dataset retries for ~30 s when offline; a quick connection test avoids that wait.
    try:
        from huggingface_hub import constants

        host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except (OSError, ImportError):
        return False


def _from_hf(split: str) -> Text:
    """Raises ImportError without ``datasets``, ConnectionError (or what ``datasets`` raises) when unavailable."""
    import datasets  # optional dependency (the ``train`` extra)

    if not os.environ.get("HF_HUB_OFFLINE") and not _hub_reachable():
        raise ConnectionError("the Hugging Face Hub is not reachable")
    rows = datasets.load_dataset(*HF_DATASET, split=_HF_SPLITS[split])["text"]
    return Text("\n\n".join(rows), list(rows), f"hf:{'/'.join(HF_DATASET)}/{split}")


def _from_pydoc(split: str) -> Text:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    wanted = {"test": 0, "valid": 1}
    entries = [
        topics[key] for i, key in enumerate(keys) if (i % 10 == wanted[split] if split in wanted else i % 10 >= 2)
    ]
    return Text("\n\n".join(entries), entries, f"pydoc:pydoc_data.topics/{split}")


def load_text(split: str = "test", *, data_dir: str | os.PathLike | None = None, source: str = "auto") -> Text:
    """The joined text of a WikiText-2 raw split (``"train"``, ``"valid"`` or ``"test"``; ``"validation"`` is
    accepted) from the first available source (module docstring). ``source`` forces one of ``"local"``,
    ``"hf"``, ``"pydoc"``. The source used is in the result and logged."""
    split = check_split(split)
    if source not in SOURCES:
        raise ValueError(f"source: expected one of {SOURCES}, got {source!r}")
    if data_dir is not None and source not in ("auto", "local"):
        raise ValueError(f"data_dir: only read with source 'auto' or 'local', got source={source!r}")
    result = None
    if source in ("auto", "local"):
        if data_dir is not None:
            result = _from_local(Path(data_dir), split)
        elif os.environ.get("OAL_DATA_DIR"):
            env_dir = Path(os.environ["OAL_DATA_DIR"])
            try:
                result = _from_local(env_dir, split)
            except FileNotFoundError as e:
                if source == "local":
                    raise
                logger.warning("$OAL_DATA_DIR has no %r split (%s); trying other sources", split, e)
        elif source == "local":
            raise ValueError("data_dir: source='local' needs data_dir or $OAL_DATA_DIR")
    if result is None and source in ("auto", "hf"):
        try:
            result = _from_hf(split)
        except Exception as e:  # no datasets package, no network, hub errors: all mean "not available"
            if source == "hf":
                raise
            logger.info("WikiText-2 from the Hub is not available (%s: %s)", type(e).__name__, e)
    if result is None:
        result = _from_pydoc(split)
        logger.warning("using the offline stand-in text %s: it is not WikiText-2", result.source)
    logger.info(
        "text %r: %d entries, %d characters from %s", split, len(result.entries), len(result.text), result.source
    )
    return result
