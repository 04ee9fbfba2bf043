"""Triton backend of the quadratic-kernel operator (chunked forward/backward and decode), fla-style.

Importing this package does not import Triton; the kernels load on first use, so ``TRITON_INTERPRET=1`` set
before that first call runs them on CPU tensors in Triton's interpreter.
"""

from .chunk import DEFAULT_SNAPSHOT_BUDGET, ChunkQuadraticFunction, chunk_quadratic_attention_triton, window_chunks
from .recurrent import recurrent_quadratic_attention_triton
from .utils import CHUNK_SIZES, MAX_HEAD_DIM, MAX_VALUE_DIM, interpreting, triton_importable, unsupported_reason

__all__ = [
    "CHUNK_SIZES",
    "DEFAULT_SNAPSHOT_BUDGET",
    "MAX_HEAD_DIM",
    "MAX_VALUE_DIM",
    "ChunkQuadraticFunction",
    "chunk_quadratic_attention_triton",
    "interpreting",
    "recurrent_quadratic_attention_triton",
    "triton_importable",
    "unsupported_reason",
    "window_chunks",
]
