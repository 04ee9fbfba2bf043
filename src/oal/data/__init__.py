"""Evaluation and calibration data: WikiText-2 raw text (local copy, Hub, or an offline stand-in), token blocks
and the short grouping prompts."""

from .text import SOURCES, SPLITS, Text, load_text, read_wikitext_rows, wikitext_file
from .tokens import TokenBlocks, blocks, short_prompts, split_blocks, tokenize, tokenizer_fingerprint

__all__ = [
    "SOURCES",
    "SPLITS",
    "Text",
    "TokenBlocks",
    "blocks",
    "load_text",
    "read_wikitext_rows",
    "short_prompts",
    "split_blocks",
    "tokenize",
    "tokenizer_fingerprint",
    "wikitext_file",
]
