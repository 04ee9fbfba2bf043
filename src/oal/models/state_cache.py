"""A transformers cache for models with attached kernels: converted layers keep the kernel's recurrent state,
softmax layers keep their keys and values.

A converted layer's cache entry is a :class:`KernelStateLayer`. Its ``update(k, v)`` returns the new tokens' keys
and values unchanged (nothing is concatenated or stored) and only counts them; the ``"oal"`` attention function
(:mod:`oal.models.hooks`) then runs the kernel on the new tokens from the stored state (chunk mode for a prompt,
recurrent mode for one token) and stores the state it returns. The state's size does not depend on the context
length: the packed state ``(B, Hkv, 1 + d + d(d+1)/2, dv + 1)`` of Eq. 5 (updated token by token as in Algorithm
1) for OAL, the global quadratic and TaylorShift, a
:class:`oal.ops.linear.LinearState` per KV head (DiJiang) or per query head (Performer, SpectraFormer), or
whatever object another kernel's ``forward(..., output_final_state=True)`` returns. Batch operations (beam
search, batch selection, offloading) map over the tensors of the state (a pytree: a tensor, a tuple / named tuple
/ list / dict of tensors and plain values), whose first dimension must be the batch.

The layer reports ``get_seq_length()`` and ``get_mask_sizes()`` exactly as a ``DynamicLayer`` holding the same
tokens would, so transformers builds the same position ids and masks for the softmax layers as without
conversion. Any fresh ``DynamicCache`` works too: when a converted layer first sees it, its empty entry is
replaced by a :class:`KernelStateLayer` (that is what makes ``model.generate()`` and ``model(..., use_cache=True)``
work unchanged). :class:`KernelCache` builds the same structure up front.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils import _pytree as pytree
from transformers import Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

__all__ = [
    "KernelCache",
    "KernelStateLayer",
    "RowStates",
    "cache_nbytes",
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

    def __init__(self) -> None:
        super().__init__()
        self.state: object | None = None
        self.seen = 0
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


# Entries a converted layer may take over: empty dynamic ones (a window is meaningless for a kernel's state).
_REPLACEABLE = (DynamicLayer, DynamicSlidingWindowLayer)


def kernel_state_layer(cache: Cache, layer_idx: int) -> KernelStateLayer:
    """The :class:`KernelStateLayer` of ``layer_idx`` in ``cache``, replacing an empty dynamic entry by one.

    Raises ValueError when the entry already holds keys and values (the cache was filled while the layer still
    ran softmax) or is of another kind (e.g. a static cache)."""
    if not isinstance(cache, Cache):
        raise ValueError(f"cache: expected a transformers Cache, got {type(cache).__name__}")
    layers = cache.layers
    if cache.layer_class_to_replicate is not None:
        while len(layers) <= layer_idx:
            layers.append(cache.layer_class_to_replicate())
    if layer_idx >= len(layers):
        raise ValueError(f"cache: expected an entry for layer {layer_idx}, got a cache of {len(layers)} layers")
    entry = layers[layer_idx]
    if isinstance(entry, KernelStateLayer):
        return entry
    if type(entry) in _REPLACEABLE and not entry.is_initialized:
        layers[layer_idx] = KernelStateLayer()
        return layers[layer_idx]
    what = "holds keys and values" if getattr(entry, "is_initialized", False) else "is not a dynamic cache layer"
    raise ValueError(
        f"cache: layer {layer_idx} has a kernel, so its cache entry must keep the kernel's recurrent state, but the "
        f"given cache's entry ({type(entry).__name__}) {what}; start from a fresh DynamicCache or "
        "oal.models.KernelCache(model)"
    )


class KernelCache(DynamicCache):
    """A ``DynamicCache`` whose converted layers are :class:`KernelStateLayer` from the start.

    ``KernelCache(model)`` for a model with attached kernels; layers with an exact-softmax kernel (and all others)
    keep their keys and values. Passing it to ``generate(..., cache=cache)`` or ``model(..., cache=cache)`` is
    optional (a fresh ``DynamicCache`` is taken over on first use), but it keeps a handle for inspection and
    memory accounting (:func:`cache_nbytes`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from ..kernels.base import SoftmaxKernel
        from .hooks import attached_kernels

        super().__init__(config=model.config.get_text_config(decoder=True))
        for layer, kernel in attached_kernels(model).items():
            if not isinstance(kernel, SoftmaxKernel):
                kernel_state_layer(self, layer)


def layer_nbytes(entry: object) -> int:
    """Bytes held by one cache entry: the state of a :class:`KernelStateLayer`, the keys and values otherwise."""
    if isinstance(entry, KernelStateLayer):
        return entry.nbytes
    tensors = [getattr(entry, "keys", None), getattr(entry, "values", None)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by all entries of a cache (keys and values of softmax layers, states of converted ones)."""
    return sum(layer_nbytes(entry) for entry in cache.layers)
