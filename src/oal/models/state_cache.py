"""A transformers cache for models with attached kernels: converted layers keep the kernel's recurrent state,
softmax layers keep their keys and values.

A converted layer's cache entry is a :class:`KernelStateLayer`. Its ``update(k, v)`` returns the new tokens' keys
and values unchanged (nothing is concatenated or stored) and only counts them; the ``"oal"`` attention function
(:mod:`oal.models.hooks`) then runs the kernel on the new tokens from the stored state (chunk mode for a prompt,
recurrent mode for one token) and stores the state it returns. The state's size does not depend on the context
length: the packed state ``(B, Hkv, 1 + d + d(d+1)/2, dv + 1)`` of Eq. 5 (updated token by token as in Algorithm
1) for OAL, the global quadratic and TaylorShift, a
:class:`oal.ops.linear.LinearState` per KV head (DiJiang) or per query head (Performer, SpectraFormer), or
whatever object another kernel's ``forward(..., output_final_state=True)`` returns. Below the memory crossover
(:func:`oal.kernels.kept.keep_limit`: 1,089 tokens for d = dv = 64) OAL, the global quadratic and their sink/window
and exact-heads forms keep the kernel heads' fp32 keys and values instead (:mod:`oal.kernels.kept`; a converted
layer then never holds more than the softmax layer it replaces), folded into the state when it becomes the
smaller; ``keep_keys=False`` keeps the state from the first token. Batch operations (beam
search, batch selection, offloading) map over the tensors of the state (a pytree: a tensor, a tuple / named tuple
/ list / dict of tensors and plain values), whose first dimension must be the batch.

The layer reports ``get_seq_length()`` and ``get_mask_sizes()`` exactly as a ``DynamicLayer`` holding the same
tokens would, so transformers builds the same position ids and masks for the softmax layers as without
conversion. Any fresh ``DynamicCache`` works too: when a converted layer first sees it, its empty entry is
replaced by a :class:`KernelStateLayer` (that is what makes ``model.generate()`` and ``model(..., use_cache=True)``
work unchanged). :class:`KernelCache` builds the same structure up front.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch.utils import _pytree as pytree
from transformers import Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from ..kernels import kept as kept_form
from ..kernels.base import cache_empty, context_end, model_layer, prompt_room, reserved_buffers
from ..kernels.decode import GROWTH

__all__ = [
    "ExactKVLayer",
    "KernelCache",
    "KernelStateLayer",
    "RowStates",
    "cache_nbytes",
    "exact_kv_layer",
    "kernel_state_layer",
    "layer_nbytes",
    "state_nbytes",
]


def _map_state(state: object, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
    return pytree.tree_map_only(torch.Tensor, fn, state)


def state_nbytes(state: object) -> int:
    """Bytes held by the tensors of a kernel state (any pytree of tensors)."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor))


class RowStates(NamedTuple):
    """The state of a converted layer after a padded batch: one state per row (batch size 1 each, or None before
    the row's first real token) and the number of real tokens each row's state summarises. Rows of a padded batch
    are evaluated separately (:mod:`oal.models.hooks`), since each has its own sinks, window and state length."""

    rows: tuple
    seen: tuple[int, ...]

    @classmethod
    def split(cls, state: object, batch: int, past: int) -> RowStates:
        """``state`` as per-row states: itself if it already is, else the batched state after ``past`` unpadded
        tokens cut into ``batch`` rows (copies)."""
        if isinstance(state, RowStates):
            if len(state.rows) != batch:
                raise ValueError(f"cache: the batch has {batch} rows, the cached per-row state {len(state.rows)}")
            return state
        if state is None:
            return cls((None,) * batch, (0,) * batch)
        return cls(tuple(_map_state(state, lambda t, b=b: t[b : b + 1].clone()) for b in range(batch)), (past,) * batch)

    def replace_row(self, b: int, state: object, seen: int) -> RowStates:
        return RowStates(self.rows[:b] + (state,) + self.rows[b + 1 :], self.seen[:b] + (seen,) + self.seen[b + 1 :])

    def select(self, indices: list[int]) -> RowStates:
        """Rows ``indices`` in that order (beam reordering, batch selection; a row may repeat)."""
        return RowStates(
            tuple(_map_state(self.rows[i], lambda t: t.clone()) for i in indices), tuple(self.seen[i] for i in indices)
        )


class KernelStateLayer(CacheLayerMixin):
    """Cache entry of one converted layer: the kernel's recurrent state after :attr:`seen` tokens.

    Protocol per forward (the attention hooks of :mod:`oal.models.hooks` drive it): :meth:`expect_update` before
    the attention module runs, ``update`` from the module (counts the new tokens, returns k, v unchanged),
    :meth:`take` and :meth:`put` from the attention function around the kernel call. Each step checks the one
    before, so a layer whose kernel was detached, or an attention call that failed half-way, raises instead of
    silently continuing from a wrong state.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, keep_keys: bool = True) -> None:
        super().__init__()
        self.state: object | None = None
        self.seen = 0
        self.keep_keys = keep_keys
        self.reserve: list[torch.Tensor] | None = None  # a prompt's buffers, allocated before it (reserved_for_prompt)
        self.device: torch.device | None = None
        self._expecting = False
        self._pending = 0

    def __repr__(self) -> str:
        return f"KernelStateLayer(seen={self.seen}, state_bytes={self.nbytes})"

    @property
    def nbytes(self) -> int:
        return state_nbytes(self.state)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def expect_update(self) -> None:
        """Called before the converted attention module runs: the next ``update`` belongs to its kernel."""
        self._expecting = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Count the new tokens and return their keys ``(B, Hkv, n, d)`` and values unchanged."""
        if not self._expecting:
            raise ValueError(
                "cache: this layer keeps a kernel's recurrent state, but no kernel is attached to it any more "
                "(it was detached after the cache was filled); start a new cache"
            )
        if self._pending:
            raise ValueError(
                f"cache: the previous {self._pending} tokens of this layer never reached its kernel (a forward failed "
                "half-way); the state is stale, start a new cache"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._expecting = False
        self._pending = key_states.shape[-2]
        self.seen += self._pending
        return key_states, value_states

    def take(self, num_tokens: int) -> tuple[int, object | None]:
        """For the attention function: ``(past, state)`` for a call on ``num_tokens`` new tokens, where ``past``
        is the number of tokens the state summarises."""
        if self._pending != num_tokens:
            raise ValueError(
                f"cache: expected the {self._pending} tokens passed to update(), got an attention call on {num_tokens}"
            )
        return self.seen - num_tokens, self.state

    def put(self, state: object | None) -> None:
        """Store the state after the pending tokens (None: the kernel returned no state; continuing then fails)."""
        self.state = state
        self._pending = 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """As a ``DynamicLayer`` with the same tokens: ``(seen + query_length, 0)``."""
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = None
        self.seen = 0
        self._expecting = False
        self._pending = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("cache: a recurrent kernel state cannot be cropped (no assisted or speculative decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if isinstance(self.state, RowStates):
            self.state = self.state.select(beam_idx.tolist())
            return
        self.state = _map_state(self.state, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if isinstance(self.state, RowStates):
            self.state = self.state.select([i for i in range(len(self.state.rows)) for _ in range(repeats)])
            return
        self.state = _map_state(self.state, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if isinstance(self.state, RowStates):
            picked = torch.arange(len(self.state.rows))[indices.cpu() if isinstance(indices, torch.Tensor) else indices]
            self.state = self.state.select(picked.tolist())
            return
        self.state = _map_state(self.state, lambda t: t[indices, ...])

    def offload(self) -> None:
        self.state = _map_state(self.state, lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.device is not None:
            self.state = _map_state(self.state, lambda t: t.to(self.device, non_blocking=True))


class ExactKVLayer(DynamicLayer):
    """The cache entry of a softmax layer of a model with kernels: a ``DynamicLayer`` whose keys and values live
    in a buffer with spare slots, so that a decode step writes its key in place instead of concatenating.

    ``DynamicLayer.update`` copies the whole cache every step (``torch.cat``: at 8k, 12.6 MB read and written per
    SmolLM2 layer and token); here the new tokens go into the buffer ``(B, Hkv, capacity, d)`` and :attr:`keys` /
    :attr:`values` are the views of its first :meth:`get_seq_length` slots, so every ``DynamicLayer`` method
    (crop, reorder, batch selection, masks) keeps its meaning; a method that replaces the views by other tensors
    (beam reordering) simply makes the next update start a new buffer. A prompt into an empty entry fills a buffer
    of its size (of the whole prompt's for the first of a prompt in chunks: :func:`~oal.kernels.base.prompt_end`)
    plus the layer's :func:`~oal.kernels.base.spare_slots` (``layer_idx``: at most 63, so that the layers' buffers
    fill up at different steps); later the buffer is grown by ``GROWTH`` (64) spare slots when
    full (one copy per GROWTH tokens). :meth:`buffers` hands the buffers to the fused one-token softmax
    step (:func:`oal.kernels.decode.softmax_decode_step`), which reads every key once for all query heads of its
    KV head.
    """

    def __init__(self, layer_idx: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self.reserve: list[torch.Tensor] | None = None  # a prompt's buffers, allocated before it (reserved_for_prompt)

    def __repr__(self) -> str:
        return (
            f"ExactKVLayer(seen={self.get_seq_length()}, capacity={0 if self._kbuf is None else self._kbuf.shape[2]})"
        )

    def _owns_views(self) -> bool:
        """Whether :attr:`keys` / :attr:`values` are still the views of the first slots of the buffers."""
        if self._kbuf is None or self.keys is None or self.values is None:
            return False
        return all(
            view.data_ptr() == buf.data_ptr()
            and view.stride() == buf.stride()
            and view.shape[:2] == buf.shape[:2]
            and view.shape[3] == buf.shape[3]
            and view.dtype == buf.dtype
            for view, buf in ((self.keys, self._kbuf), (self.values, self._vbuf))
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states (B, Hkv, n, d)`` / ``value_states (B, Hkv, n, dv)``; returns all keys and values
        (views of the buffers) like ``DynamicLayer.update``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = self.get_seq_length()
        n = key_states.shape[-2]
        if not self._owns_views() or used + n > self._kbuf.shape[2]:
            # a prompt into an empty cache gets only the layer's share of spare slots: all GROWTH would raise the
            # prefill's peak memory, none would make every softmax layer grow at the first step at once
            # a prompt in chunks (oal.models.prefill) gets room for all of it at its first chunk: regrown at every
            # chunk, each softmax layer copied its keys and values once a chunk and left the smaller buffer behind
            # amid the chunk's freed activations
            with model_layer(self.layer_idx):
                capacity = context_end(used + n) + GROWTH if used else prompt_room(n)
            if used:  # the buffers replaced: its own, or the tensors a DynamicLayer left (taken over)
                old = (self._kbuf, self._vbuf) if self._kbuf is not None else (self.keys, self.values)
                kept_form.note_regrown(sum(t.nbytes for t in old if isinstance(t, torch.Tensor)))
            with reserved_buffers(self.reserve):
                kbuf = cache_empty(key_states, *key_states.shape[:2], capacity, key_states.shape[3])
                vbuf = cache_empty(value_states, *value_states.shape[:2], capacity, value_states.shape[3])
            self.reserve = None
            if used:
                kbuf[:, :, :used] = self.keys
                vbuf[:, :, :used] = self.values
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf[:, :, used : used + n] = key_states
        self._vbuf[:, :, used : used + n] = value_states
        self.keys, self.values = self._kbuf[:, :, : used + n], self._vbuf[:, :, : used + n]
        return self.keys, self.values

    def buffers(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(key buffer, value buffer)`` when ``keys`` is the view :meth:`update` just returned, else None."""
        return (self._kbuf, self._vbuf) if keys is self.keys and self._owns_views() else None

    @property
    def nbytes(self) -> int:
        """Bytes held, the spare slots included."""
        if self._owns_views():
            return sum(t.numel() * t.element_size() for t in (self._kbuf, self._vbuf))
        tensors = (self.keys, self.values) if self.is_initialized else ()
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()


def exact_kv_layer(cache: Cache, layer_idx: int) -> DynamicLayer | None:
    """The :class:`ExactKVLayer` of softmax layer ``layer_idx`` in ``cache``, replacing an empty ``DynamicLayer``
    by one; None when the entry is of another kind or already holds keys and values (it then keeps working as
    it is, through SDPA)."""
    entry = _entry(cache, layer_idx) if isinstance(cache, Cache) else None
    if isinstance(entry, ExactKVLayer):
        return entry
    if type(entry) is DynamicLayer and not entry.is_initialized:
        cache.layers[layer_idx] = ExactKVLayer(layer_idx)
        return cache.layers[layer_idx]
    return None


def _entry(cache: Cache, layer_idx: int) -> CacheLayerMixin | None:
    """Entry ``layer_idx`` of ``cache`` (a lazily grown cache first gets its entries up to it); None past its end."""
    layers = cache.layers
    if cache.layer_class_to_replicate is not None:
        while len(layers) <= layer_idx:
            layers.append(cache.layer_class_to_replicate())
    return layers[layer_idx] if layer_idx < len(layers) else None


# Entries a converted layer may take over: empty dynamic ones (a window is meaningless for a kernel's state).
_REPLACEABLE = (DynamicLayer, DynamicSlidingWindowLayer, ExactKVLayer)


def kernel_state_layer(cache: Cache, layer_idx: int) -> KernelStateLayer:
    """The :class:`KernelStateLayer` of ``layer_idx`` in ``cache``, replacing an empty dynamic entry by one.

    Raises ValueError when the entry already holds keys and values (the cache was filled while the layer still
    ran softmax) or is of another kind (e.g. a static cache)."""
    if not isinstance(cache, Cache):
        raise ValueError(f"cache: expected a transformers Cache, got {type(cache).__name__}")
    entry = _entry(cache, layer_idx)
    if entry is None:
        raise ValueError(f"cache: expected an entry for layer {layer_idx}, got a cache of {len(cache.layers)} layers")
    if isinstance(entry, KernelStateLayer):
        return entry
    if type(entry) in _REPLACEABLE and not entry.is_initialized:
        cache.layers[layer_idx] = KernelStateLayer()
        return cache.layers[layer_idx]
    what = "holds keys and values" if getattr(entry, "is_initialized", False) else "is not a dynamic cache layer"
    raise ValueError(
        f"cache: layer {layer_idx} has a kernel, so its cache entry must keep the kernel's recurrent state, but the "
        f"given cache's entry ({type(entry).__name__}) {what}; start from a fresh DynamicCache or "
        "oal.models.KernelCache(model)"
    )


class KernelCache(DynamicCache):
    """A ``DynamicCache`` whose converted layers are :class:`KernelStateLayer` from the start.

    ``KernelCache(model)`` for a model with attached kernels; layers with an exact-softmax kernel (and all others)
    keep their keys and values, in an :class:`ExactKVLayer` (grown in place, decoded by the fused softmax step).
    ``keep_keys``: whether converted layers keep their kernel heads' keys and values below the memory crossover
    (:mod:`oal.kernels.kept`; the default) or the kernel's state from the first token.
    Passing it to ``generate(..., cache=cache)`` or ``model(..., cache=cache)`` is
    optional (a fresh ``DynamicCache`` is taken over on first use), but it keeps a handle for inspection and
    memory accounting (:func:`cache_nbytes`)."""

    def __init__(self, model: torch.nn.Module, *, keep_keys: bool = True) -> None:
        from ..kernels.base import SoftmaxKernel
        from .hooks import attached_kernels

        super().__init__(config=model.config.get_text_config(decoder=True))
        kernels = attached_kernels(model)
        for layer in range(len(self.layers)):
            kernel = kernels.get(layer)
            if kernel is not None and not isinstance(kernel, SoftmaxKernel):
                kernel_state_layer(self, layer).keep_keys = keep_keys
            elif kernels:
                exact_kv_layer(self, layer)


def layer_nbytes(entry: object) -> int:
    """Bytes held by one cache entry: the state of a :class:`KernelStateLayer`, the keys and values otherwise."""
    if isinstance(entry, (KernelStateLayer, ExactKVLayer)):
        return entry.nbytes
    tensors = [getattr(entry, "keys", None), getattr(entry, "values", None)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by all entries of a cache (keys and values of softmax layers, states of converted ones)."""
    return sum(layer_nbytes(entry) for entry in cache.layers)


@contextlib.contextmanager
def reserved_for_prompt(model: torch.nn.Module, cache: object, batch: int, n: int) -> Iterator[None]:
    """Within it, a CPU inference prompt of ``n`` tokens (``batch`` rows; in one call, or in chunks within
    :func:`oal.kernels.base.prompt_end`, whose first chunk takes them) into ``cache``'s empty converted and softmax
    entries (:class:`KernelStateLayer`, :class:`ExactKVLayer`, as :class:`KernelCache` makes them) finds the buffers
    each layer's cache will keep already allocated, every layer's before the first layer runs
    (:func:`oal.kernels.kept.prompt_buffers`; :func:`oal.kernels.base.reserved_buffers`). Allocated amid each layer's
    transients, a kept buffer pinned the freed blocks around it and malloc's heap grew layer after layer: a 1k prompt's
    peak RSS held 20–33 MB of freed heap beside 34 MB of cache (stop 51). Buffers a layer does not take are freed at
    its end; none are reserved elsewhere (autograd, other devices, a cache with tokens, other entries)."""
    from .hooks import attached_kernels

    entries = []
    ok = isinstance(cache, Cache) and n > 1 and not torch.is_grad_enabled() and model.device.type == "cpu"
    kernels = attached_kernels(model) if ok and cache.get_seq_length() == 0 else {}
    text = model.config.get_text_config(decoder=True)
    for idx, entry in enumerate(cache.layers if kernels else ()):
        kernel = kernels.get(idx)
        with model_layer(idx):
            if isinstance(entry, KernelStateLayer) and kernel is not None and entry.state is None:
                d = kernel.head_dim
                shapes = kept_form.prompt_buffers(kernel, batch, n, d, d, model.dtype, entry.keep_keys)
            elif isinstance(entry, ExactKVLayer) and not entry.is_initialized:
                d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
                shape = (batch, text.num_key_value_heads, prompt_room(n), d)
                shapes = [(shape, model.dtype)] * 2
            else:
                continue
        if shapes:
            entry.reserve = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
            entries.append(entry)
    try:
        yield
    finally:
        for entry in entries:
            entry.reserve = None
