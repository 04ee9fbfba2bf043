"""Analytical FLOP counts of the benchmarked attention operators (a multiply-add is 2 FLOPs).

Only the matrix products are counted; elementwise work (feature maps, squares, masks, the division) is left out.
For the chunked quadratic operator that work is ``(2·Hq + Hkv)·D`` per token for the feature products plus
``Hq·R·c`` for the squares, about 1.5 % of the products at d = 64, so the count is a slight undercount.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.quadratic import feature_dim


@dataclass(frozen=True)
class AttnShape:
    """Problem size of one attention call: q ``(batch, heads_q, n, head_dim)``, k ``(batch, heads_kv, n,
    head_dim)``, v ``(batch, heads_kv, n, value_dim)``."""

    batch: int
    heads_q: int
    heads_kv: int
    n: int
    head_dim: int
    value_dim: int

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "n", "head_dim", "value_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads_q: expected a multiple of heads_kv={self.heads_kv}, got {self.heads_q}")

    def with_n(self, n: int) -> AttnShape:
        return AttnShape(self.batch, self.heads_q, self.heads_kv, n, self.head_dim, self.value_dim)


def sdpa_causal_flops(shape: AttnShape) -> float:
    """Useful FLOPs of causal softmax attention: ``B·Hq·N²·(d + dv)``.

    QKᵀ and PV over the causal half: ``N²/2`` (query, key) pairs, each ``2·d`` FLOPs for the score and ``2·dv``
    for the value product. This is the FlashAttention convention; a backend that computes the full masked
    ``N×N`` product (the math backend) does twice this work, which the count deliberately does not credit.
    """
    s = shape
    return float(s.batch * s.heads_q * s.n * s.n * (s.head_dim + s.value_dim))


def chunk_sizes(n: int, chunk: int) -> list[int]:
    """Lengths of the chunks ``[0, c), [c, 2c), …`` covering n tokens (the last one may be shorter)."""
    if chunk < 1:
        raise ValueError(f"chunk: expected a positive integer, got {chunk!r}")
    cs = min(chunk, n)
    return [min(cs, n - start) for start in range(0, n, cs)]


def quadratic_chunk_flops(shape: AttnShape, rank: int, chunk: int = 64) -> float:
    """FLOPs of :func:`oal.ops.quadratic.chunk.chunk_quadratic_attention` with a rank-``R`` kernel factor.

    Per KV head, for a chunk of ``n`` tokens and the ``g = Hq/Hkv`` query heads sharing it, with
    ``D = 1 + d + d(d+1)/2`` state rows (the cyclic layout has the same count for even d):

    * inter-chunk readout (Eq. 6), ``(g·n, D) @ (D, dv+1)``: ``2·g·n·D·(dv+1)``
    * intra-chunk scores of the factored kernel (Eq. 7), ``(g·R·n, d+1) @ (d+1, n)``: ``2·g·R·n²·(d+1)``
    * intra-chunk values, ``(g·n, n) @ (n, dv+1)``: ``2·g·n²·(dv+1)`` (the full square: the torch loop applies
      the causal mask by multiplication; the fused CPU kernel skips the fully masked 16-key panels of the
      scores and values, so it does somewhat less than this count)
    * state update (Eq. 5), ``(D, n) @ (n, dv+1)``: ``2·D·n·(dv+1)``

    Summed over the chunks this is, per token and for a full chunk c,
    ``2·(dv+1)·(Hq + Hkv)·D + 2·Hq·c·(R·(d+1) + dv+1)``. For OAL with G groups ``R = G + 1``.
    """
    s = shape
    if rank < 1:
        raise ValueError(f"rank: expected a positive integer, got {rank!r}")
    D = feature_dim(s.head_dim)
    e = s.value_dim + 1
    sizes = chunk_sizes(s.n, chunk)
    tokens = sum(sizes)
    squares = sum(n * n for n in sizes)
    per_batch = (
        2 * s.heads_q * tokens * D * e  # readout
        + 2 * s.heads_q * rank * squares * (s.head_dim + 1)  # factored intra-chunk scores
        + 2 * s.heads_q * squares * e  # intra-chunk values
        + 2 * s.heads_kv * tokens * D * e  # state update
    )
    return float(s.batch * per_batch)
