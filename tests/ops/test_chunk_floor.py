"""The torch chunked path's kernel_floor counts the keys of an initial state (H0's count channel)."""

from __future__ import annotations

import torch

from oal.ops.quadratic import chunk_quadratic_attention, naive_quadratic_attention, recurrent_quadratic_attention


def test_chunk_floor_counts_prefix_keys():
    """A floor above the kernel's minimum: the clamp bound is floor · (prefix keys + position + 1) in both the
    chunked and the recurrent path (the recurrent one reads the count from canonical row 0 directly)."""
    gen = torch.Generator().manual_seed(0)
    B, H, P, N, d, dv = 1, 2, 7, 12, 6, 4
    q, k = (torch.randn(B, H, P + N, d, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, P + N, dv, generator=gen, dtype=torch.float64)
    a = torch.full((H,), 1e-3, dtype=torch.float64)
    b = torch.zeros(H, d, dtype=torch.float64)
    C = torch.eye(d, dtype=torch.float64).expand(H, d, d) * 0.5
    _, state = naive_quadratic_attention(q[:, :, :P], k[:, :, :P], v[:, :, :P], a, b, C, output_final_state=True)
    tail = (q[:, :, P:], k[:, :, P:], v[:, :, P:])
    o_chunk, _ = chunk_quadratic_attention(*tail, a, b, C, chunk_size=5, initial_state=state, kernel_floor=0.4)
    o_rec, _ = recurrent_quadratic_attention(*tail, a, b, C, initial_state=state, kernel_floor=0.4)
    o_free, _ = chunk_quadratic_attention(*tail, a, b, C, chunk_size=5, initial_state=state)
    assert not torch.allclose(o_chunk, o_free)  # the floor is active somewhere
    torch.testing.assert_close(o_chunk, o_rec, rtol=1e-12, atol=1e-12)
