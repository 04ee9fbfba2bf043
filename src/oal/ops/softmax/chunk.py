"""Softmax attention of a prompt's later chunk without a mask: the queries ``q (B, Hq, n, d)`` are the last n of the
N positions of the keys, so every query reads all ``N - n`` keys before the chunk and the chunk's own keys causally.
The two parts are two calls of torch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which
returns each row's log-sum-exp) — the first with the grouped query heads of a KV head stacked as rows (no mask, no
repeated keys), the second causal over the n new keys (a square: the causal mask of equal lengths, no tensor) —
merged by their log-sum-exps: ``o = (e^{l₁} o₁ + e^{l₂} o₂) / (e^{l₁} + e^{l₂})``.

Through SDPA with transformers' mask, each softmax layer of a chunk took a ``(n, N)`` bool mask and SDPA's float
copy of it (4 n N bytes: 32 MB for a 1024-token chunk over 8k keys in fp32), one size larger every chunk, so that no
chunk's copy fit where the last one had been and the heap grew by ~30 MB a chunk (SmolLM2's 8k fp32 prompt, stop
47)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quadratic import cpu as cpu_kernels

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None):
    """torch's CPU flash kernel: ``(o (B, H, L, dv), log-sum-exp (B, H, L) fp32)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def softmax_at_end(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor | None:
    """q ``(B, Hq, n, d)`` the last n positions of k ``(B, Hkv, N, d)``, v ``(B, Hkv, N, dv)`` (``Hkv | Hq``; k and v
    may be views of longer buffers): ``o (B, Hq, n, dv)`` in q's dtype, equal to
    :func:`~oal.ops.softmax.naive.naive_softmax_at_end` up to rounding. None where it does not apply: not CPU,
    autograd, no keys before the queries (``n == N``: one causal SDPA call), dtypes that differ or that the kernel
    lacks, values of another head size than the keys (the flash kernel's condition)."""
    B, Hq, n, d = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    past = N - n
    if past <= 0 or Hq % Hkv or v.shape[3] != d or any(t.device.type != "cpu" for t in (q, k, v)):
        return None
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return None
    group = Hq // Hkv
    dv = v.shape[3]
    # the keys before the chunk: every query reads all of them, so a KV head's query heads are one block of rows
    rows = q.reshape(B, Hkv, group * n, d)
    o_past, l_past = _flash(rows, k[:, :, :past], v[:, :, :past], False, scale)
    o_past, l_past = o_past.reshape(B, Hq, n, dv), l_past.reshape(B, Hq, n)
    # the chunk's own keys, causal: n queries over n keys (the mask of equal lengths); few keys, so repeated
    k_new = k[:, :, past:].repeat_interleave(group, 1) if group > 1 else k[:, :, past:]
    v_new = v[:, :, past:].repeat_interleave(group, 1) if group > 1 else v[:, :, past:]
    o_new, l_new = _flash(q, k_new, v_new, True, scale)
    top = torch.maximum(l_past, l_new)
    w_past, w_new = (l_past - top).exp_().unsqueeze(-1), (l_new - top).exp_().unsqueeze(-1)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = (o_past.to(acc) * w_past + o_new.to(acc) * w_new) / (w_past + w_new)
    return out.to(q.dtype)


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x (B, H, n, ·)`` with each head's rows contiguous (as ``window.cpp``'s ``exact_prefill`` reads them): ``x``
    where they are (the first n slots of a buffer with room), else a contiguous copy."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def causal_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of a whole segment: q ``(B, Hq, N, d)``, k ``(B, Hkv, N, d)``, v ``(B, Hkv, N, dv)``
    (``Hkv | Hq``), row i reading keys ``0 … i``: ``o (B, Hq, N, dv)`` in q's dtype, equal to
    :func:`~oal.ops.softmax.naive.naive_softmax_at_end` with ``n = N`` up to rounding. CPU fp32 without autograd:
    one call of ``window.cpp``'s ``exact_prefill`` (flash-style, each key read once for its KV head's query heads;
    0.65–0.92× the time of SDPA with grouped heads at 16–256 tokens, SmolLM2's shapes); otherwise SDPA with grouped
    heads, differentiable."""
    fused = (
        q.device.type == "cpu"
        and all(t.dtype == torch.float32 for t in (q, k, v))
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
    )
    ext = cpu_kernels.load("window") if fused else None
    if ext is not None:
        B, Hq, N, d = q.shape
        Hkv = k.shape[1]
        q = q.reshape(B, Hkv, Hq // Hkv, N, d).contiguous()
        out = ext.exact_prefill(q, rows_contiguous(k), rows_contiguous(v), 0, scale, False)
        return out.view(B, Hq, N, v.shape[-1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
