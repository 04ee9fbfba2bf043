"""Head-granular hybrid: a few KV heads of a layer keep exact softmax attention over the whole context (with a
growing key/value cache), every other head runs an inner linear-time kernel (OAL, the learned global quadratic,
or either with exact sinks and a window).

Beyond the paper. On SmolLM2 a plain or sink/window conversion loses in-context retrieval (a passkey is never
found again): the heads that copy a token from far back need the exact, un-averaged attention peak that no
degree-2 kernel and no window provides. DuoAttention keeps such "retrieval heads" with a full KV cache and gives
the others sinks + a window only; here the others keep the whole context through the kernel's state too.

Exactness is per KV head (GQA: the query heads of a group share the group's keys and values, so keeping one
query head exact costs the whole group's cache). The inner kernel keeps its parameters for every query head (so
calibrated parameters load unchanged); the exact heads' parameters are simply not used.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..ops import page_select
from ..ops.quadratic import cpu as cpu_kernels
from ..ops.quadratic.utils import check_qkv
from ..ops.sink_window import sink_window_attention
from ..ops.sink_window.utils import all_exact, exact_segment
from ..ops.softmax.chunk import rows_contiguous, softmax_at_end
from .base import (
    AttentionKernel,
    KeptKV,
    cache_empty,
    check_positions,
    in_prompt,
    prompt_room,
    repeat_kv,
    with_kept,
)
from .oal import OALKernel, oal_attention, oal_coefficients, oal_factor
from .sink_window import SinkWindowKernel, kernel_at_end

__all__ = [
    "ExactHeadsKernel",
    "ExactHeadsState",
    "EXACT_HEADS",
    "bf16_product_attention",
    "bounds_buffer",
    "dequantize_int8",
    "quantize_int8",
    "refresh_bounds",
]

EXACT_HEADS = "exact-heads"


class ExactHeadsState(NamedTuple):
    """Decoding state of :class:`ExactHeadsKernel` after ``offset`` tokens.

    ``k (B, E, capacity, d)`` and ``v (B, E, capacity, dv)``: the keys and values of the E exact KV heads in
    slots ``0 … offset-1`` (they grow with the context, like a KV cache; capacity ≥ offset, the slots past
    offset are spare room the in-place decode step of :mod:`oal.kernels.decode` writes into); ``inner``: the
    inner kernel's state over the other KV heads (constant size), None when every KV head is exact.
    ``k_scale``, ``v_scale (B, E, capacity)`` fp32: with int8 keys and values (``kv_dtype=torch.int8``) each
    slot's scale (:func:`quantize_int8`), else None.
    ``k_bounds (B, E, pages, 2, d)`` bf16: with a decode budget (``ExactHeadsKernel.decode_budget``), each page's
    element-wise key minimum and maximum (:func:`oal.ops.page_select.page_bounds`) for the slots below ``offset``,
    with room for the pages of every slot of the buffers; else None (built when a step needs them).
    """

    k: torch.Tensor
    v: torch.Tensor
    inner: object | None
    offset: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_bounds: torch.Tensor | None = None


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (..., n)`` -> ``(int8 (..., n), scale (...) fp32)``: each vector over its last dimension quantised
    symmetrically with its own scale ``max(absmax, 1e-30) / 127``, ``x / scale`` rounded half to even and clamped
    to ±127 (the 8-bit exact cache: one scale per token and head, as KIVI's and HF's quantised caches keep per group).
    ``decode.cpp`` quantises a decode step's new key with the same operations, bit for bit."""
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_min(1e-30) / 127
    return (xf / scale.unsqueeze(-1)).round().clamp_(-127, 127).to(torch.int8), scale


def dequantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 numbers ``x · scale`` an int8 vector stands for (``x (..., n)`` int8, ``scale (...)``)."""
    return x.float() * scale.unsqueeze(-1)


def _stored(x: torch.Tensor, kv_dtype: torch.dtype | None) -> torch.Tensor:
    """``x`` as the exact heads' cache gives it back, in x's dtype: rounded to bf16, quantised to int8 and back, or
    itself (``kv_dtype`` None)."""
    if kv_dtype == torch.int8:
        return dequantize_int8(*quantize_int8(x)).to(x.dtype)
    return x if kv_dtype is None else x.to(kv_dtype).to(x.dtype)


def bounds_buffer(old: torch.Tensor | None, k: torch.Tensor, page: int) -> torch.Tensor:
    """A ``(B, E, pages, 2, d)`` bf16 page-bounds buffer with a page for every slot of the key buffer ``k (B, E,
    capacity, d)``: ``old`` where it has them, else a new one with ``old``'s pages copied in."""
    pages = page_select.num_pages(k.shape[2], page)
    if old is not None and old.shape[2] >= pages and old.is_contiguous():
        return old
    new = cache_empty(k, k.shape[0], k.shape[1], pages, 2, k.shape[3], dtype=torch.bfloat16)
    if old is not None:
        new[:, :, : old.shape[2]] = old[:, :, :pages]
    return new


def refresh_bounds(
    bounds: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None, start: int, end: int, page: int
) -> None:
    """Recompute, in place, the bounds of the pages that hold slots ``[start, end)`` of the key buffer ``k``
    (from each page's first slot to ``end``; int8 keys dequantised with their scales ``k_scale``)."""
    if end <= start:
        return
    p0 = start // page
    keys = k[:, :, p0 * page : end]
    if k_scale is not None:
        keys = dequantize_int8(keys, k_scale[:, :, p0 * page : end])
    bounds[:, :, p0 : page_select.num_pages(end, page)] = page_select.page_bounds(keys, page)


def _check_heads(exact_kv_heads: Iterable[int], num_kv_heads: int) -> tuple[int, ...]:
    heads = list(exact_kv_heads)
    if not all(isinstance(h, int) and not isinstance(h, bool) for h in heads):
        raise ValueError(f"exact_kv_heads: expected integer KV head indices, got {heads!r}")
    bad = [h for h in heads if not 0 <= h < num_kv_heads]
    if bad or len(set(heads)) != len(heads) or not heads:
        raise ValueError(
            f"exact_kv_heads: expected distinct KV head indices in [0, {num_kv_heads}), at least one, got {heads!r}"
        )
    return tuple(sorted(heads))


def _heads(x: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
    """``x[:, heads]`` of ``x (B, H, ·, ·)``: ``x`` itself for all heads, a view for one contiguous run of them, else
    a copy (index_select; advanced indexing copied at ~3.6 GB/s, 0.3 s of an 8k prefill)."""
    if heads == tuple(range(x.shape[1])):
        return x
    if heads == tuple(range(heads[0], heads[0] + len(heads))):
        return x.narrow(1, heads[0], len(heads))
    return x.index_select(1, torch.tensor(heads, device=x.device))


def _put_heads(o: torch.Tensor, heads: tuple[int, ...], x: torch.Tensor) -> None:
    """``o[:, heads] = x``, through a view where the heads are one contiguous run."""
    if heads == tuple(range(heads[0], heads[0] + len(heads))):
        o.narrow(1, heads[0], len(heads)).copy_(x)
    else:
        o.index_copy_(1, torch.tensor(heads, device=o.device), x.to(o.dtype))


def bf16_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int,
    scale: float,
    block: int = 256,
    round_kv: bool = True,
) -> torch.Tensor:
    """The exact heads' causal softmax with bf16 products, in torch (the reference of the fused kernels, and the
    path where they do not apply): the N new queries ``q (B, Eg, N, d)`` over ``past`` cached + N new keys ``k (B,
    E, past + N, d)`` and values ``v`` (bf16 numbers), with ``a = bf16(scale · q)``, ``s_ij = a_i · k_j`` (exact
    products, fp32 sums), ``p_ij = bf16(e^{s_ij - max_j s_ij})`` and ``o_i = Σ_j p_ij v_j / Σ_j p_ij``. The fused
    kernels subtract a running maximum over blocks of keys instead of the row's, so their weights round at other
    points: each weight within 2^-8 of this one's relative to the row's sum, the outputs within 2^-8 · max |v|.
    Without autograd only: ``block`` queries at a time bound the score matrix. ``round_kv=False`` (an 8-bit exact
    cache: ``k``, ``v`` its dequantised fp32 numbers): the keys and values are used as given, the scales folded into
    the products as the fused kernels fold them (``s_ij = sk_j · a_i · k̂_j`` over the integers k̂, exact products;
    the prompt kernel rounds the dequantised values to bf16, within 2^-9 · max |v| of this)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("q, k, v: bf16_product_attention is inference-only (autograd is on for an input)")
    B, Eg, N, _ = q.shape
    a = (q.float() * scale).to(torch.bfloat16).float()
    kf, vf = (k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()) if round_kv else (k.float(), v.float())
    kf, vf = repeat_kv(kf, Eg), repeat_kv(vf, Eg)
    out = q.new_empty(B, Eg, N, v.shape[-1], dtype=torch.float32)
    for i0 in range(0, N, block):
        i1 = min(N, i0 + block)
        keys = past + i1
        s = a[:, :, i0:i1] @ kf[:, :, :keys].mT
        visible = (
            torch.arange(keys, device=q.device)[None, :] <= (past + torch.arange(i0, i1, device=q.device))[:, None]
        )
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True)).to(torch.bfloat16).float()
        out[:, :, i0:i1] = (p @ vf[:, :, :keys]) / p.sum(-1, keepdim=True)
    return out


def _straight_through(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantised to int8 and back in the forward pass, its gradient passed through unchanged."""
    return x + (_stored(x, torch.int8) - x).detach()


def _fused_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int,
    scale: float,
    bf16_products: bool = False,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """``ExactHeadsKernel._exact_forward`` through the fused CPU kernel, or None where it does not apply (autograd,
    not CPU, q not fp32, keys/values not fp32, bf16 or int8 with ``scales``, no extension)."""
    if q.device.type != "cpu" or q.dtype != torch.float32:
        return None
    if k.dtype not in (torch.float32, torch.bfloat16, torch.int8) or (k.dtype == torch.int8) != (scales is not None):
        return None
    if v.dtype != k.dtype or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return None
    ext = cpu_kernels.load("window")
    if ext is None:
        return None
    B, Eg, N, d = q.shape
    E = k.shape[1]
    extra = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
    out = ext.exact_prefill(
        q.reshape(B, E, Eg // E, N, d).contiguous(),
        rows_contiguous(k),
        rows_contiguous(v),
        past,
        scale,
        bf16_products,
        **extra,
    )
    return out.view(B, Eg, N, v.shape[-1])


def _tiles_faster(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the exact heads' prompt with bf16 products over bf16 keys runs as torch's bf16 SDPA: on a CPU with
    AMX tiles, without autograd, for fp32 queries (bf16 queries take SDPA anyway)."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or q.shape[2] < 2:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return False
    return cpu_kernels.amx_bf16()


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float) -> torch.Tensor:
    """SDPA of the N new queries ``q (B, Eg, N, d)`` over ``past`` cached + N new keys, causal (GQA as needed). A
    prompt's later chunk on CPU without autograd takes :func:`oal.ops.softmax.softmax_at_end` (the same flash
    kernel, without the ``(N, past + N)`` mask and SDPA's copy of it in q's dtype: 3 N (past + N) bytes in bf16, 24 MiB
    per exact layer for the last 1k chunk of an 8k prompt)."""
    n = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if past == 0 or n == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=past == 0, scale=scale, enable_gqa=gqa)
    out = softmax_at_end(q, k, v, scale)
    if out is not None:
        return out
    keys = torch.arange(past + n, device=q.device)
    mask = keys[None, :] <= (past + torch.arange(n, device=q.device))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _bf16_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float) -> torch.Tensor:
    """:func:`bf16_product_attention`'s arithmetic through torch's bf16 SDPA: the rounded scaled queries
    ``bf16(scale · q)`` against the bf16 keys (exact products, fp32 sums), weights rounded to bf16 at a running
    maximum for the product with the bf16 values, fp32 sums; the bf16 output adds its own rounding (≤ 2^-9 of
    |o|). Returns bf16 ``(B, Eg, N, dv)``."""
    a = (q * scale).to(torch.bfloat16)
    return _causal_sdpa(a, k.to(torch.bfloat16), v.to(torch.bfloat16), past, 1.0)


class ExactHeadsKernel(AttentionKernel):
    """Exact softmax on the KV heads ``exact_kv_heads`` (and their query heads), ``inner`` on the others.

    ``inner`` is an :class:`OALKernel` / :class:`GlobalQuadraticKernel` or a :class:`SinkWindowKernel` around one,
    built for all ``Hq`` heads. ``forward`` returns an :class:`ExactHeadsState` as its recurrent state.
    ``kv_dtype`` (``torch.bfloat16``, ``torch.int8`` or None): the dtype the exact heads' keys and values are stored
    in, and rounded to before they are used, also within a prompt (None: the inputs' dtype). bf16 halves the growing
    part of the cache and what a decode step reads of it; int8 (an 8-bit exact cache, :func:`quantize_int8`: one fp32
    scale per token and head beside the 8-bit numbers) takes 68 of bf16's 128 bytes per 64-number vector; the
    attention itself computes in the inputs' dtype, on the dequantised numbers.
    ``product_dtype`` (``torch.bfloat16`` or None, only with ``kv_dtype`` bf16 or int8): the exact heads' two
    products take bf16 operands with fp32 sums: the scaled queries and the softmax weights are rounded to bf16
    before they meet the keys and values (:func:`bf16_product_attention`), which AVX512_BF16 computes at twice the
    fp32 rate (int8 keys and values: their scales folded into the products, :func:`bf16_product_attention` with
    ``round_kv=False``). Under autograd (training) only the queries are rounded (straight through) and the weights
    stay fp32 (SDPA and its fused backward): outputs within 2^-8 · max |v| of the rounded weights'; int8 keys and
    values are quantised straight through as well.
    ``decode_budget`` (None, or a multiple of ``decode_page`` keys): a one-token step (decoding) over more keys than
    the budget attends, per exact KV head, only to the ``decode_budget // decode_page`` pages of ``decode_page``
    keys that :func:`oal.ops.page_select.select_pages` picks (page 0, the recent pages and those whose key bounds
    promise the highest scores; Quest-style), so that a step reads ~``decode_budget`` keys whatever the context.
    Prompts stay exact. The state then carries each page's key bounds (4 bytes per key and head at page 64).
    """

    cpu_extensions = ("chunk", "decode", "window")  # the exact part's prompt kernel

    def __init__(
        self,
        inner: OALKernel | SinkWindowKernel,
        exact_kv_heads: Iterable[int],
        kv_dtype: torch.dtype | None = None,
        product_dtype: torch.dtype | None = None,
        decode_budget: int | None = None,
        decode_page: int = 64,
    ) -> None:
        if not isinstance(inner, (OALKernel, SinkWindowKernel)):
            raise ValueError(
                f"inner: expected an OALKernel, GlobalQuadraticKernel or SinkWindowKernel, got {type(inner).__name__}"
            )
        if kv_dtype not in (None, torch.bfloat16, torch.int8):
            raise ValueError(f"kv_dtype: expected None, torch.bfloat16 or torch.int8, got {kv_dtype!r}")
        if product_dtype not in (None, torch.bfloat16):
            raise ValueError(f"product_dtype: expected None or torch.bfloat16, got {product_dtype!r}")
        if product_dtype is not None and kv_dtype not in (torch.bfloat16, torch.int8):
            raise ValueError(
                f"product_dtype: bf16 products need the keys and values stored in bf16 or int8 (kv_dtype="
                f"torch.bfloat16 or torch.int8), got kv_dtype={kv_dtype!r}"
            )
        page_select.check_budget(decode_budget, decode_page)
        super().__init__(inner.num_heads, inner.num_kv_heads, inner.head_dim)
        self.inner = inner
        self.decode_budget = decode_budget
        self.decode_page = decode_page
        self.exact_kv_heads = _check_heads(exact_kv_heads, inner.num_kv_heads)
        self.kv_dtype = kv_dtype
        self.product_dtype = product_dtype
        self.name = f"{inner.name}+exact"
        g = self.num_heads // self.num_kv_heads
        rest = [h for h in range(self.num_kv_heads) if h not in self.exact_kv_heads]
        self.kernel_kv_heads = tuple(rest)
        self._exact_q = tuple(h * g + i for h in self.exact_kv_heads for i in range(g))
        self._kernel_q = tuple(h * g + i for h in rest for i in range(g))

    def extra_repr(self) -> str:
        kv = "" if self.kv_dtype is None else f", kv_dtype={self.kv_dtype}"
        if self.product_dtype is not None:
            kv += f", product_dtype={self.product_dtype}"
        if self.decode_budget is not None:
            kv += f", decode_budget={self.decode_budget}, decode_page={self.decode_page}"
        return f"name={self.name!r}, exact_kv_heads={list(self.exact_kv_heads)}{kv}"

    @property
    def _oal(self) -> OALKernel:
        return self.inner.inner if isinstance(self.inner, SinkWindowKernel) else self.inner

    # -------------------------------------------------------------------------------------------- calibration

    def weights(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``(B, Hq, P, N)``: the inner kernel's weights, with the exact heads' rows replaced by
        ``e^{s_ij - max_j s_ij}`` on the causal prefix (each row is normalised on its own)."""
        positions = check_positions(positions, q.shape[2])
        w = self.inner.weights(q, k, positions)
        qs = _heads(q, self._exact_q)[:, :, positions].to(w.dtype)
        ke = _stored(_heads(k, self.exact_kv_heads), self.kv_dtype)
        ke = repeat_kv(ke.to(w.dtype), len(self._exact_q))
        if self.product_dtype is None:
            logits = (qs @ ke.mT) * self.scale
        else:  # the scaled queries rounded as the products take them
            logits = (qs * self.scale).to(self.product_dtype).to(w.dtype) @ ke.mT
        logits = logits.masked_fill(~self.causal_mask(positions, k.shape[2]), float("-inf"))
        exact = torch.exp(logits - logits.amax(-1, keepdim=True))
        idx = torch.tensor(self._exact_q, device=w.device)
        return w.index_copy(1, idx, exact)

    # -------------------------------------------------------------------------------------------- evaluation

    def _inner_forward(self, q, k, v, *, mode, initial_state, output_final_state, chunk_size):
        """The inner kernel on the query heads ``self._kernel_q`` and KV heads ``self.kernel_kv_heads`` only. An
        ``initial_state`` that is a kept form (:class:`~oal.kernels.base.KeptKV`, those heads' keys and values: a
        prompt's later chunk, :func:`oal.kernels.kept.extend`) continues without a state: the new queries over the
        kept and the new keys on the fused CPU kernels, the rows one call over the whole prompt gives them; the
        final state is the kept form grown."""
        hq = torch.tensor(self._kernel_q, device=q.device)
        oal = self._oal
        groups, L = oal.groups.index_select(0, hq.to(oal.groups.device)), oal.L.index_select(0, hq.to(oal.L.device))
        if isinstance(initial_state, KeptKV):
            keys, values, grown = with_kept(initial_state, k, v)
            o = kernel_at_end(self.inner, q, keys, values, hq)
            if o is None:
                raise ValueError(
                    "initial_state: a kept form (keys and values in place of the inner state) continues only on the "
                    "fused CPU kernels without autograd; fold it into the kernel's state first (oal.kernels.kept.fold)"
                )
            return o, grown if output_final_state else None
        if not isinstance(self.inner, SinkWindowKernel):
            return oal_attention(
                q,
                k,
                v,
                groups,
                L,
                oal.eps,
                mode=mode,
                chunk_size=chunk_size,
                initial_state=initial_state,
                output_final_state=output_final_state,
            )
        sw = self.inner
        beta = sw.beta.index_select(0, hq.to(sw.beta.device))
        if mode == "chunk" and all_exact(q.shape[2], sw.n_sink, sw.window, initial_state, beta):
            return exact_segment(q, k, v, check_qkv(q, k, v), sw.n_sink, sw.window, self.scale, output_final_state)
        a, b, C = oal_coefficients(groups, L, oal.eps)
        return sink_window_attention(
            q,
            k,
            v,
            a,
            b,
            C,
            beta,
            n_sink=sw.n_sink,
            window=sw.window,
            scale=self.scale,
            mode=mode,
            chunk_size=chunk_size,
            initial_state=initial_state,
            output_final_state=output_final_state,
            factor=oal_factor(groups, L, oal.eps) if mode == "chunk" else None,
            kernel_floor=oal.eps,
        )

    def _exact_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        past: int,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Causal softmax of the N new queries ``q (B, Eg, N, d)`` over ``past`` cached + N new keys ``k (B, E,
        past + N, d)``, ``v`` (stored dtype: fp32, bf16, or int8 with ``scales`` ``(B, E, past + N)`` each). Without
        autograd on CPU fp32 it is one fused call (``window.cpp``'s ``exact_prefill``: flash-style, each key read
        once for a KV head's query heads, int8 key scales folded into the scores); otherwise SDPA on the keys and values
        (dequantised) cast to q's dtype. With bf16 products: on a CPU with AMX tiles (bf16 storage, no autograd)
        torch's bf16 SDPA on the same rounded numbers (:func:`_bf16_sdpa`, 2.8–4× the fused call there), else the
        fused call, else :func:`bf16_product_attention` without autograd, SDPA on the rounded scaled queries with
        it, and for bf16 queries (a bf16 model) SDPA as it is (its bf16 products are these, within the same
        bound)."""
        bf16_products = self.product_dtype is not None
        if bf16_products and scales is None and _tiles_faster(q, k, v):
            return _bf16_sdpa(q, k, v, past, self.scale).to(q.dtype)
        fused = _fused_exact(q, k, v, past, self.scale, bf16_products, scales)
        if fused is not None:
            return fused
        if scales is not None:
            k, v = dequantize_int8(k, scales[0]), dequantize_int8(v, scales[1])
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if bf16_products and not grad and q.dtype != torch.bfloat16:
            return bf16_product_attention(q, k, v, past, self.scale, round_kv=scales is None).to(q.dtype)
        # below: SDPA. For bf16 queries (a bf16 model) its bf16 products are these (weights rounded for the second
        # product); under autograd the scaled queries are rounded, straight through, the weights stay fp32
        scale = self.scale
        if bf16_products and q.dtype != torch.bfloat16:
            a = q * scale
            q, scale = a + (a.to(torch.bfloat16).to(a.dtype) - a).detach(), 1.0
        return _causal_sdpa(q, k.to(q.dtype), v.to(q.dtype), past, scale)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mode: str = "chunk",
        initial_state: ExactHeadsState | None = None,
        output_final_state: bool = False,
        chunk_size: int = 64,
    ) -> tuple[torch.Tensor, ExactHeadsState | None]:
        """q ``(B, Hq, N, d)``, k ``(B, Hkv, N, d)``, v ``(B, Hkv, N, dv)`` -> ``(o (B, Hq, N, dv), state)``.

        ``mode`` (``naive`` / ``chunk`` / ``recurrent``) selects the inner kernel's evaluation; the exact heads
        are one SDPA call over their cached and new keys in every mode. The state's exact keys and values may have
        room past its ``offset``: within :func:`oal.kernels.base.prompt_end` (a prompt in chunks whose caller owns
        the state) the first chunk allocates them for the whole prompt and later chunks write into that room;
        elsewhere ``initial_state`` is left as it was."""
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(
                f"q, k, v: expected 4-D (B, H, N, ·) tensors, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if q.shape[1] != self.num_heads or k.shape[1] != self.num_kv_heads or v.shape[1] != self.num_kv_heads:
            raise ValueError(
                f"q, k, v: expected {self.num_heads} query and {self.num_kv_heads} KV heads, got {q.shape[1]}, "
                f"{k.shape[1]} and {v.shape[1]}"
            )
        ex = self.exact_kv_heads
        kv_dtype = self.kv_dtype or k.dtype
        int8 = kv_dtype == torch.int8
        B, n = k.shape[0], k.shape[2]
        past = 0
        inner_state = None
        if initial_state is not None:
            if not isinstance(initial_state, ExactHeadsState):
                raise ValueError(f"initial_state: expected an ExactHeadsState, got {type(initial_state).__name__}")
            past = initial_state.offset
            want = (B, len(ex))
            sk, sv = initial_state.k, initial_state.v
            if (
                tuple(sk.shape[:2]) != want
                or sk.shape[2] < past
                or sk.shape[-1] != k.shape[-1]
                or sk.dtype != kv_dtype
                or sv.dtype != kv_dtype
                or tuple(sv.shape[:3]) != tuple(sk.shape[:3])
            ):
                raise ValueError(
                    f"initial_state: expected exact keys of shape {want + ('≥' + str(past), k.shape[-1])} in "
                    f"{kv_dtype} and values of the same length, got {tuple(sk.shape)} in {sk.dtype} and "
                    f"{tuple(sv.shape)} in {sv.dtype}"
                )
            scales = (initial_state.k_scale, initial_state.v_scale)
            if int8 != (scales[0] is not None) or int8 != (scales[1] is not None):
                raise ValueError(
                    f"initial_state: expected k_scale and v_scale {'(int8 keys)' if int8 else 'None'}, got "
                    f"{[None if x is None else tuple(x.shape) for x in scales]}"
                )
            if int8 and any(tuple(x.shape) != tuple(sk.shape[:3]) or x.dtype != torch.float32 for x in scales):
                raise ValueError(
                    f"initial_state: expected fp32 scales of shape {tuple(sk.shape[:3])}, got "
                    f"{[(tuple(x.shape), x.dtype) for x in scales]}"
                )
            inner_state = initial_state.inner
            old = (sk, sv) + (scales if int8 else ())
            reuse = output_final_state and in_prompt() and sk.shape[2] >= past + n
            if reuse:
                # a prompt in chunks (its caller owns the state): this chunk's keys and values go into the room
                # its first chunk made, instead of a copy of all the past ones per chunk
                bufs = old
            else:
                bufs = self._exact_buffers(
                    k,
                    v,
                    kv_dtype,
                    prompt_room(past + n) if output_final_state else past + n,
                    lasting=output_final_state,
                )
                for buf, x in zip(bufs, old, strict=True):
                    buf[:, :, :past] = x[:, :, :past]
        else:
            reuse = False
            bufs = self._exact_buffers(k, v, kv_dtype, prompt_room(n) if output_final_state else n, output_final_state)
        kn, vn = _heads(k, ex), _heads(v, ex)
        if int8:
            (qk, sk), (qv, sv) = quantize_int8(kn), quantize_int8(vn)
            for buf, x in zip(bufs, (qk, qv, sk, sv), strict=True):
                buf[:, :, past : past + n] = x
        else:
            bufs[0][:, :, past : past + n], bufs[1][:, :, past : past + n] = kn, vn
        qe = _heads(q, self._exact_q)
        if int8 and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            # training: the cached keys are constants, the new ones quantised straight through
            ke, ve = (
                torch.cat([dequantize_int8(b[:, :, :past], sc[:, :, :past]).to(x.dtype), _straight_through(x)], 2)
                for b, sc, x in ((bufs[0], bufs[2], kn), (bufs[1], bufs[3], vn))
            )
            ks = None
        else:
            live = tuple(b[:, :, : past + n] for b in bufs)
            ke, ve, ks = live[0], live[1], live[2:] if int8 else None
        budget = self.decode_budget
        selects = budget is not None and n == 1 and past + 1 > budget
        bounds = None
        if budget is not None and (output_final_state or selects):
            bounds = self._bounds(initial_state, bufs, reuse, past, n)
        if selects:  # a decode step over more keys than the budget: the selected pages' keys only
            E, page = len(ex), self.decode_page
            pages = page_select.select_pages(
                qe.reshape(B, E, -1, qe.shape[-1]), bounds, past + 1, budget, page, self.scale
            )
            idx = page_select.page_keys(pages, past + 1, page)
            ke, ve = page_select.gather_keys(ke, idx), page_select.gather_keys(ve, idx)
            ks = None if ks is None else tuple(page_select.gather_keys(x, idx) for x in ks)
            oe = self._exact_forward(qe, ke, ve, idx.shape[-1] - 1, ks).to(q.dtype)
        else:
            oe = self._exact_forward(qe, ke, ve, past, ks).to(q.dtype)
        new_inner = None
        if not self._kernel_q:
            o = oe
        else:
            # the exact heads' output goes into place (and is freed) before the kernel heads run: one buffer fewer
            # alive beside the inner kernel's transients
            o = q.new_empty(B, self.num_heads, q.shape[2], v.shape[-1])
            _put_heads(o, self._exact_q, oe)
            del oe
            rest = self.kernel_kv_heads
            oi, new_inner = self._inner_forward(
                _heads(q, self._kernel_q),
                _heads(k, rest),
                _heads(v, rest),
                mode=mode,
                initial_state=inner_state,
                output_final_state=output_final_state,
                chunk_size=chunk_size,
            )
            _put_heads(o, self._kernel_q, oi)
        if not output_final_state:
            return o, None
        scales = bufs[2:] if int8 else (None, None)
        return o, ExactHeadsState(bufs[0], bufs[1], new_inner, past + n, *scales, bounds)

    def _bounds(self, initial_state: ExactHeadsState | None, bufs: tuple, reuse: bool, past: int, n: int):
        """The page bounds of the keys in ``bufs`` after this call's ``n`` keys: ``initial_state``'s (valid below
        ``past``; in place when its buffers are reused, else copied) with the new keys' pages recomputed, or all
        pages computed where it has none."""
        page = self.decode_page
        old = None if initial_state is None else initial_state.k_bounds
        bounds = bounds_buffer(old if reuse else None, bufs[0], page)
        if old is not None and bounds is not old:
            m = min(old.shape[2], bounds.shape[2])
            bounds[:, :, :m] = old[:, :, :m]
        scale = bufs[2] if len(bufs) > 2 else None
        refresh_bounds(bounds, bufs[0], scale, past if old is not None else 0, past + n, page)
        return bounds

    def _exact_buffers(
        self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, capacity: int, lasting: bool = True
    ) -> tuple:
        """Empty ``(B, E, capacity, ·)`` key and value buffers of the exact heads in ``dtype``, and for int8 their
        ``(B, E, capacity)`` fp32 scale buffers after them (:meth:`buffer_shapes`); ``lasting``: buffers the state keeps
        (:func:`~oal.kernels.base.cache_empty`: reserved ones first), else a call's own."""
        empty = cache_empty if lasting else (lambda like, *shape, dtype: like.new_empty(shape, dtype=dtype))
        shapes = self.buffer_shapes(k.shape[0], capacity, k.shape[-1], v.shape[-1], dtype)
        return tuple(empty(k, *shape, dtype=dt) for shape, dt in shapes)

    def buffer_shapes(
        self, batch: int, capacity: int, d: int, dv: int, dtype: torch.dtype, bounds: bool = False
    ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The shapes and dtypes of the exact heads' buffers of ``capacity`` slots in ``dtype`` (keys, values, and
        for int8 their scales), and with ``bounds`` the page bounds buffer a decode budget keeps beside them."""
        E = len(self.exact_kv_heads)
        shapes = [((batch, E, capacity, d), dtype), ((batch, E, capacity, dv), dtype)]
        if dtype == torch.int8:
            shapes += [((batch, E, capacity), torch.float32)] * 2
        if bounds and self.decode_budget is not None:
            pages = page_select.num_pages(capacity, self.decode_page)
            shapes.append(((batch, E, pages, 2, d), torch.bfloat16))
        return shapes

    def exact_state(self, k: torch.Tensor, v: torch.Tensor, inner: object, offset: int) -> ExactHeadsState:
        """The state after a prompt whose keys ``k (B, Hkv, offset, d)`` and values ``v`` were all seen, with
        ``inner`` as the kernel heads' state: the exact heads' keys and values stored in ``kv_dtype`` (quantised for
        int8) in buffers with room for the rest of a prompt in chunks (:func:`~oal.kernels.base.prompt_end`: its later
        chunks write into it, as :meth:`forward` leaves room) and the layer's :func:`~oal.kernels.base.spare_slots`
        after them."""
        kv_dtype = self.kv_dtype or k.dtype
        kn, vn = _heads(k, self.exact_kv_heads), _heads(v, self.exact_kv_heads)
        parts = (kn, vn)
        if kv_dtype == torch.int8:
            (qk, sk), (qv, sv) = quantize_int8(kn), quantize_int8(vn)
            parts = (qk, qv, sk, sv)  # the order of _exact_buffers
        bufs = self._exact_buffers(k, v, kv_dtype, prompt_room(offset))
        for buf, x in zip(bufs, parts, strict=True):
            buf[:, :, :offset] = x
        scales = bufs[2:] if kv_dtype == torch.int8 else (None, None)
        bounds = None if self.decode_budget is None else self._bounds(None, bufs, False, 0, offset)
        return ExactHeadsState(bufs[0], bufs[1], inner, offset, *scales, bounds)
