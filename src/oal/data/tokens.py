"""Token streams cut into evaluation/calibration blocks (paper App. F.3, C) and the short grouping prompts.

Tokenisation never adds special tokens (F.3: no BOS/EOS). Token ids of whole splits are cached under
``<cache>/tokens/`` keyed by the tokenizer's full definition and the text, since a split takes seconds to
tokenise (WikiText-2 test: ~6 s with the SmolLM2 fast tokenizer on a 2-core CPU).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ..cache import user_cache_dir
from .text import load_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class TokenBlocks(NamedTuple):
    """``ids`` ``(n, length)`` int64 token ids and the text source label (see :class:`oal.data.Text`)."""

    ids: torch.Tensor
    source: str


def _check_positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """A hash of everything that determines a fast tokenizer's output, or None for a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return hashlib.sha256(backend.to_str().encode()).hexdigest()


def _encode(tokenizer: PreTrainedTokenizerBase, text: str | list[str]):
    # verbose=False: whole splits are far longer than model_max_length, which is expected here.
    return tokenizer(text, add_special_tokens=False, verbose=False, return_attention_mask=False)["input_ids"]


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str, *, cache: bool = True) -> torch.Tensor:
    """Token ids ``(T,)`` int64 of ``text`` without special tokens, from the on-disk cache when possible."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"text: expected a non-empty string, got {text!r:.40}")
    fingerprint = tokenizer_fingerprint(tokenizer) if cache else None
    path = None
    if fingerprint is not None:
        key = hashlib.sha256(f"{fingerprint}\0{hashlib.sha256(text.encode()).hexdigest()}".encode()).hexdigest()
        path = user_cache_dir() / "tokens" / f"{key[:32]}.npy"
        try:
            arr = np.load(path, allow_pickle=False)
            if arr.ndim == 1 and arr.dtype in (np.int32, np.int64):
                logger.debug("token ids from cache %s", path)
                return torch.from_numpy(arr.astype(np.int64))
        except (OSError, ValueError):
            pass
    ids = torch.tensor(_encode(tokenizer, text), dtype=torch.long)
    if path is not None:
        _write_atomic(path, ids.numpy().astype(np.int32 if ids.numel() == 0 or ids.max() < 2**31 else np.int64))
    return ids


def _write_atomic(path, arr: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", suffix=".npy", delete=False) as f:
            np.save(f, arr)
        os.replace(f.name, path)
    except OSError as e:  # a read-only or full cache only costs speed
        logger.warning("could not write the token cache %s: %s", path, e)


def split_blocks(ids: torch.Tensor, block_len: int, *, max_blocks: int | None = None) -> torch.Tensor:
    """Cut a 1-D token stream into non-overlapping ``(n, block_len)`` blocks, dropping the incomplete last one
    (F.3); ``max_blocks`` keeps only the first blocks."""
    _check_positive(block_len, "block_len")
    if max_blocks is not None:
        _check_positive(max_blocks, "max_blocks")
    if ids.dim() != 1:
        raise ValueError(f"ids: expected a 1-D token stream, got shape {tuple(ids.shape)}")
    n = ids.numel() // block_len
    if n == 0:
        raise ValueError(f"block_len: the text has {ids.numel()} tokens, fewer than one block of {block_len}")
    if max_blocks is not None:
        n = min(n, max_blocks)
    return ids[: n * block_len].view(n, block_len)


def blocks(
    tokenizer: PreTrainedTokenizerBase,
    split: str = "test",
    block_len: int = 4096,
    *,
    data_dir: str | os.PathLike | None = None,
    max_blocks: int | None = None,
    source: str = "auto",
    cache: bool = True,
) -> TokenBlocks:
    """A split's text (:func:`oal.data.load_text`), tokenised as one stream and cut into non-overlapping
    ``(n_blocks, block_len)`` blocks, the incomplete last block dropped. ``max_blocks`` is an upper bound:
    fewer blocks come back if the split is shorter."""
    _check_positive(block_len, "block_len")
    if max_blocks is not None:
        _check_positive(max_blocks, "max_blocks")
    text = load_text(split, data_dir=data_dir, source=source)
    ids = tokenize(tokenizer, text.text, cache=cache)
    out = split_blocks(ids, block_len, max_blocks=max_blocks)
    logger.info("%d blocks of %d tokens (of %d tokens) from %s", out.shape[0], block_len, ids.numel(), text.source)
    return TokenBlocks(out, text.source)


def _is_heading(paragraph: str) -> bool:
    return paragraph.startswith("=") and paragraph.endswith("=")


def short_prompts(
    tokenizer: PreTrainedTokenizerBase,
    n: int = 40,
    length: int = 64,
    *,
    split: str = "valid",
    data_dir: str | os.PathLike | None = None,
    source: str = "auto",
) -> TokenBlocks:
    """``n`` short prompts ``(n, length)`` for activation analysis and grouping (§4, App. C: "40 short
    calibration prompts"), deterministic for a given text and tokenizer.

    The split's paragraphs (entries split at blank lines, stripped; WikiText headings ``= … =`` left out) are
    tokenised one by one; of those with at least ``length`` tokens, ``n`` evenly spaced ones (in source order)
    are kept, each cut to its first ``length`` tokens. Each prompt starts at a paragraph start.
    """
    _check_positive(n, "n")
    _check_positive(length, "length")
    text = load_text(split, data_dir=data_dir, source=source)
    paragraphs = [p.strip() for entry in text.entries for p in entry.split("\n\n")]
    paragraphs = [p for p in paragraphs if p and not _is_heading(p)]
    encoded = _encode(tokenizer, paragraphs) if paragraphs else []
    long_enough = [ids for ids in encoded if len(ids) >= length]
    if len(long_enough) < n:
        raise ValueError(
            f"n: {text.source} has {len(long_enough)} paragraphs of at least length={length} tokens, fewer than n={n}"
        )
    picked = [long_enough[i * len(long_enough) // n][:length] for i in range(n)]
    logger.info("%d prompts of %d tokens from %s", n, length, text.source)
    return TokenBlocks(torch.tensor(picked, dtype=torch.long), text.source)
