"""The reference: softmax attention of the last ``n`` positions over all ``N`` keys under the causal mask aligned at
the end (row r is position ``N - n + r`` and reads keys ``0 … N - n + r``), grouped-query heads by repetition."""

from __future__ import annotations

import torch


def naive_softmax_at_end(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q ``(B, Hq, n, d)``, k ``(B, Hkv, N, d)``, v ``(B, Hkv, N, dv)`` with ``n ≤ N`` and ``Hkv | Hq`` (query head
    h reads KV head ``h // (Hq / Hkv)``): ``o (B, Hq, n, dv)`` in q's dtype, computed in fp32 (fp64 for fp64
    inputs). ``scale`` None: ``1 / sqrt(d)``."""
    n, N, d = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = k.to(dtype).repeat_interleave(group, 1)
    values = v.to(dtype).repeat_interleave(group, 1)
    scores = q.to(dtype) @ keys.transpose(-1, -2) * (d**-0.5 if scale is None else scale)
    causal = torch.arange(N, device=q.device)[None, :] <= torch.arange(N - n, N, device=q.device)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) @ values).to(q.dtype)
