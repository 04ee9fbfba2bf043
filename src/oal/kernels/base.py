"""The interface every attention kernel of this package implements (OAL, the global quadratic, the F.1
baselines and exact softmax), so that calibration (Eq. 20), fidelity, conversion and generation treat them alike.

Shapes throughout: q ``(B, Hq, N, d)`` post-RoPE, k ``(B, Hkv, N, d)``, v ``(B, Hkv, N, dv)``; query head h
reads KV head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from typing import NamedTuple

import torch
from torch import nn

# where the prompt being prefilled in chunks ends (oal.models.prefill): a chunk of a prompt that will outgrow the
# kept form builds the state at once instead of keeping keys only to fold them a chunk later, and the exact heads'
# key buffers are allocated for the whole prompt at its first chunk
_PROMPT_END: ContextVar[int | None] = ContextVar("oal_prompt_end", default=None)


GROWTH = 64  # spare key/value slots added to an exact head's buffer when it is full (at 8k: ≤ 0.7 MB in all)

# the model layer a kernel call belongs to (oal.models.hooks): a prompt leaves each layer's growing buffers a
# different number of spare slots, so that the decode steps after it grow one layer's buffers at a time
_LAYER: ContextVar[int | None] = ContextVar("oal_layer", default=None)


@contextlib.contextmanager
def model_layer(index: int | None) -> Iterator[None]:
    """Within it, kernel calls belong to the model's layer ``index`` (None: to none; see :func:`spare_slots`)."""
    token = _LAYER.set(index)
    try:
        yield
    finally:
        _LAYER.reset(token)


# the buffers reserved for the cache of the layer being run (reserved_buffers): what cache_empty hands out first
_RESERVED: ContextVar[list[torch.Tensor] | None] = ContextVar("oal_reserved", default=None)


@contextlib.contextmanager
def reserved_buffers(buffers: list[torch.Tensor] | None) -> Iterator[None]:
    """Within it, :func:`cache_empty` takes a buffer of ``buffers`` (removing it) where one has the shape, dtype and
    device asked for. A prompt's cache buffers, reserved for every layer before its first layer runs
    (:func:`oal.models.state_cache.reserved_for_prompt`), then sit below all of the prompt's transients in malloc's
    heap instead of amid each layer's, where a long-lived block keeps the freed ones around it from being reused
    and the heap grows layer after layer."""
    token = _RESERVED.set(buffers)
    try:
        yield
    finally:
        _RESERVED.reset(token)


def cache_empty(like: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised ``shape`` tensor in ``dtype`` (default ``like``'s) on ``like``'s device for a buffer the cache
    keeps: a reserved one where :func:`reserved_buffers` has it, else a new one."""
    dtype = like.dtype if dtype is None else dtype
    pool = _RESERVED.get()
    if pool:
        for i, buf in enumerate(pool):
            if buf.dtype == dtype and buf.device == like.device and tuple(buf.shape) == shape:
                return pool.pop(i)
    return like.new_empty(shape, dtype=dtype)


def spare_slots(growth: int) -> int:
    """Spare slots a prompt leaves in a buffer that a decode step grows by ``growth`` slots when full: 0 outside a
    model's layer, else the layer's own share ``41 · layer mod growth`` (distinct for ``growth`` consecutive layers
    when ``growth`` is a power of 2). Without it every layer's buffer is full after a prompt and the first step
    grows them all at once: each new buffer is allocated before its old one is freed, and the freed ones are too
    small for the next layer's, so that step's transient was the whole grown cache (14 MB at 1k, stop 36)."""
    layer = _LAYER.get()
    return 0 if layer is None else (41 * layer) % growth


@contextlib.contextmanager
def prompt_end(position: int) -> Iterator[None]:
    """Within it, kernel calls belong to a prompt that runs to context length ``position`` (a prompt in chunks,
    whose caller owns the states: :func:`oal.kernels.kept.start` and :func:`oal.kernels.kept.extend` keep keys and
    values only if the whole prompt stays below the limit, and an :class:`oal.kernels.ExactHeadsKernel` writes a
    chunk's keys into the room its state's buffers have)."""
    token = _PROMPT_END.set(position)
    try:
        yield
    finally:
        _PROMPT_END.reset(token)


def context_end(end: int) -> int:
    """The context length a call that reaches position ``end`` is part of: the prompt's end within
    :func:`prompt_end`, else ``end``."""
    hint = _PROMPT_END.get()
    return end if hint is None else max(end, hint)


def prompt_room(end: int, growth: int = GROWTH) -> int:
    """Slots of a cache buffer that a call reaching position ``end`` allocates: room to the prompt's end
    (:func:`context_end`) and the layer's :func:`spare_slots` for a buffer grown by ``growth`` slots. The one
    formula the buffers' allocations and the prompt's reserve (:func:`oal.kernels.kept.prompt_buffers`) share."""
    return context_end(end) + spare_slots(growth)


def in_prompt() -> bool:
    """Whether the caller is a prompt in chunks (:func:`prompt_end`)."""
    return _PROMPT_END.get() is not None


class KeptKV(NamedTuple):
    """The kernel heads' keys ``k (B, K, capacity, d)`` and values ``v (B, K, capacity, dv)`` (fp32, or bf16 for a
    bf16 model) of the first ``length`` tokens (slots ``length …`` are spare room the decode step writes into), in
    place of their state: the kept form of :mod:`oal.kernels.kept`."""

    k: torch.Tensor
    v: torch.Tensor
    length: int


KEPT_GROWTH = 16  # spare slots added to kept keys/values when full (one copy per 16 tokens, ≤ 8 KB per head spare)


def with_kept(kept: KeptKV, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, KeptKV]:
    """The keys and values of every position, ``kept``'s (widened to k's dtype, exactly) followed by the new ``k``,
    ``v`` ``(B, K, n, ·)``, and the kept form with the new ones appended (in its own dtype). Within a prompt in
    chunks (:func:`prompt_end`, whose caller owns the state) whose first chunk made room for them, the new ones go
    into that room in place; otherwise into new buffers with the layer's :func:`spare_slots` of room after them (as
    a prompt's first chunk leaves them: the decode steps after a prompt in chunks then grow one or two layers'
    buffers at a time, not all at the first)."""
    past, n = kept.length, k.shape[2]
    room = kept.k.shape[2] >= past + n and kept.k.is_contiguous() and kept.v.is_contiguous()
    if in_prompt() and room:
        # no second buffer per chunk: the first chunk's buffers are not freed between the chunks' transients,
        # where they would stay as holes in malloc's heap
        kept.k[:, :, past : past + n], kept.v[:, :, past : past + n] = k, v
        # views of the buffers where the dtypes agree: the fused kernels read a head's first rows in place
        keys, values = (x[:, :, : past + n].to(k.dtype) for x in (kept.k, kept.v))
        return keys, values, KeptKV(kept.k, kept.v, past + n)
    keys = torch.cat([kept.k[:, :, :past].to(k.dtype), k], dim=2)
    values = torch.cat([kept.v[:, :, :past].to(v.dtype), v], dim=2)
    capacity = past + n + spare_slots(KEPT_GROWTH)
    grown = []
    for old, new in ((kept.k, k), (kept.v, v)):
        buf = old.new_empty(*old.shape[:2], capacity, old.shape[3])
        buf[:, :, :past] = old[:, :, :past]
        buf[:, :, past : past + n] = new
        grown.append(buf)
    return keys, values, KeptKV(grown[0], grown[1], past + n)


def check_positions(positions: torch.Tensor, n: int) -> torch.Tensor:
    """positions: ``(P,)`` integer query positions in ``[0, n)``."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.is_floating_point():
        got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"positions: expected a 1-D integer tensor, got {got}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= n):
        raise ValueError(
            f"positions: expected values in [0, {n}), got [{int(positions.min())}, {int(positions.max())}]"
        )
    return positions.long()


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, Hkv, N, ·)`` -> ``(B, Hq, N, ·)`` following the GQA mapping (no copy when Hq == Hkv)."""
    B, Hkv, N, D = x.shape
    if num_heads == Hkv:
        return x
    return x[:, :, None].expand(B, Hkv, num_heads // Hkv, N, D).reshape(B, num_heads, N, D)


class AttentionKernel(nn.Module):
    """Causal normalised kernel attention for the query heads of one layer.

    Subclasses set ``name`` and implement :meth:`weights` (the unnormalised causal kernel for a set of query
    positions, used by calibration and by the naive path) and :meth:`forward` (the linear-time evaluation).
    """

    name: str = "kernel"
    #: the fused CPU extensions (:mod:`oal.ops.quadratic.cpu`) this kernel's own code calls: loaded when it is
    #: attached to a model on CPU (the chunked operator and the decode step, which also decodes softmax layers)
    cpu_extensions: tuple[str, ...] = ("chunk", "decode")

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def weights(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Unnormalised kernel values ``(B, Hq, P, N)`` between the queries at ``positions`` and all keys;
        entries with key index > query position are zero."""
        raise NotImplementedError

    def at_positions(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Outputs ``(B, Hq, P, dv)`` at the given query positions, each over its causal prefix, in
        O(P·N): what the Eq. 20 objective needs for its 32 sampled positions. Differentiable."""
        positions = check_positions(positions, q.shape[2])
        w = self.weights(q, k, positions)
        vv = repeat_kv(v.to(w.dtype), self.num_heads)
        return ((w @ vv) / w.sum(-1, keepdim=True)).to(q.dtype)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mode: str = "chunk",
        initial_state: object | None = None,
        output_final_state: bool = False,
    ) -> tuple[torch.Tensor, object | None]:
        """Outputs ``(B, Hq, N, dv)`` for every position, and the recurrent state if asked."""
        raise NotImplementedError

    def causal_mask(self, positions: torch.Tensor, n: int) -> torch.Tensor:
        """``(P, N)`` boolean mask, True where key j ≤ query position."""
        return torch.arange(n, device=positions.device)[None, :] <= positions[:, None]


class SoftmaxKernel(AttentionKernel):
    """Exact softmax attention, the reference every approximation is measured against."""

    name = "softmax"

    def weights(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        positions = check_positions(positions, q.shape[2])
        qs = q[:, :, positions].float()
        kk = repeat_kv(k.float(), self.num_heads)
        logits = (qs @ kk.mT) * self.scale
        logits = logits.masked_fill(~self.causal_mask(positions, k.shape[2]), float("-inf"))
        return torch.exp(logits - logits.amax(-1, keepdim=True))

    def forward(self, q, k, v, *, mode="chunk", initial_state=None, output_final_state=False):
        if initial_state is not None or output_final_state:
            raise ValueError("initial_state: exact softmax keeps a KV cache, not a recurrent state")
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return o, None
