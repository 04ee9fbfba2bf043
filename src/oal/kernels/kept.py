"""Kernel heads below the memory crossover keep their keys and values instead of the state ("kept form").

A kernel head's packed state (Eq. 5) holds ``D (dv + 1)`` numbers whatever the context, ``D = 1 + d + d(d+1)/2``:
for d = dv = 64, 139,425 fp32 (558 KB), as much as the keys and values of 1,089 tokens. Below that a converted
layer would hold more than the softmax layer it replaces (SmolLM2 at batch 8 and 256 tokens: a 329 MB cache
against the original's 92 MB), and every decode step would read and write all of it. So the model's cache keeps
the keys and values of a converted layer's kernel heads while they are the smaller of the two
(:func:`keep_limit` tokens), and a decode step evaluates the kernel part from them: κ(q, k_j) of every kept key
through the kernel's factor (Eq. 7 as a sum of squares, :class:`oal.ops.quadratic.KernelFactor`) — the parallel
form of Eq. 2 for one query, the same kernel as the state's readout (Eq. 6) up to fp32 rounding — in
``decode.cpp``. When one more token would make them larger than the state, :func:`fold` sums them into the state
the kernel would have built (Eq. 5; with sinks and a window: the state of the keys that left the window, plus the
sinks and the window), and decoding continues from it.

The kept form belongs to the cache (:class:`oal.models.state_cache.KernelStateLayer`): the kernels' own API and
state types are unchanged (but for one: an :class:`ExactHeadsKernel` takes a kept form as its inner state), and any
call that needs the kernel's state (autograd, CUDA, another dtype, a kernel without this path) gets it from
:func:`fold` first. Several new tokens after a kept form (a prompt in chunks) are evaluated over the kept and the new
keys without a state (:func:`extend`). It applies to OAL and the global quadratic, with or without sinks and a
window, and to the kernel heads of :class:`ExactHeadsKernel` (its exact heads keep their keys and values anyway).
"""

from __future__ import annotations

import torch

from ..ops.quadratic import cpu as cpu_kernel
from ..ops.quadratic.utils import cyclic_features, cyclic_maps, cyclic_width, feature_dim
from ..ops.sink_window import SinkWindowState
from .base import KEPT_GROWTH, KeptKV, cache_empty, context_end, prompt_end, prompt_room, with_kept
from .hybrid import ExactHeadsKernel, ExactHeadsState
from .oal import OALKernel
from .sink_window import SinkWindowKernel, kernel_at_end

__all__ = [
    "FOLD_SPREAD",
    "KEPT_GROWTH",
    "KeptKV",
    "STEP_RELEASE_BYTES",
    "extend",
    "fold",
    "fold_point",
    "grown",
    "keep_limit",
    "kept_of",
    "needs_autograd",
    "note_regrown",
    "prompt_buffers",
    "prompt_end",
    "start",
    "take_regrown",
]

# layer i of a model folds FOLD_SPREAD-cyclically i tokens after the limit, so that one decode step folds one
# or two layers instead of all (a whole SmolLM2 at once: ~235 ms extra in one step at batch 1)
FOLD_SPREAD = 32
# keys per feature block while folding: a (128, D) block, 1.1 MB for d = 64 (512 keys' 4.4 MB was the largest
# transient of a 1k decode at its fold step)
_FOLD_BLOCK = 128


def _inner(kernel) -> OALKernel | SinkWindowKernel | None:
    """The kernel whose state the kept form replaces: the kernel itself, an exact-heads kernel's inner one (None
    when every head is exact), None for kernels without this path."""
    if isinstance(kernel, ExactHeadsKernel):
        return kernel.inner if kernel.kernel_kv_heads else None
    return kernel if isinstance(kernel, (OALKernel, SinkWindowKernel)) else None


def keep_limit(kernel, d: int, dv: int, itemsize: int = 4) -> int:
    """Tokens up to which a kernel head's keys and values (``itemsize`` bytes a number: 4, or 2 for a bf16 model)
    take no more memory than its fp32 state, ``D (dv + 1)`` numbers, and the sinks and window (fp32) the state keeps
    beside it: 1,089 fp32 tokens for d = dv = 64 (1,349 with 4 sinks and a 256-token window), twice as many in
    bf16; 0 for kernels without the kept form."""
    inner = _inner(kernel)
    if inner is None:
        return 0
    extra = inner.n_sink + inner.window if isinstance(inner, SinkWindowKernel) else 0
    return (feature_dim(d) * (dv + 1) + extra * (d + dv)) * 4 // ((d + dv) * itemsize)


def fold_point(kernel, d: int, dv: int, layer: int | None = None, itemsize: int = 4) -> int:
    """The context length a kept form may reach before it is folded: :func:`keep_limit`, plus ``layer mod
    FOLD_SPREAD`` tokens for layer ``layer`` of a model. Past the limit the kept keys and values take a little more
    memory than the state would (at most FOLD_SPREAD - 1 tokens' worth), but never more than the softmax layer's
    keys and values of the same context."""
    limit = keep_limit(kernel, d, dv, itemsize)
    return limit + (layer % FOLD_SPREAD if limit and layer is not None else 0)


def needs_autograd(kernel, *tensors: torch.Tensor) -> bool:
    """Whether a call of ``kernel`` on ``tensors`` must record gradients (then only the kernel's own modes apply)."""
    return torch.is_grad_enabled() and (
        any(p.requires_grad for p in kernel.parameters()) or any(t.requires_grad for t in tensors)
    )


def _cpu_inference(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kept form's fused path can take this call: CPU fp32 inputs, no autograd."""
    cpu_fp32 = all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v))
    return cpu_fp32 and not needs_autograd(kernel, q, k, v)


def _kept_heads(kernel, x: torch.Tensor) -> torch.Tensor:
    """x ``(B, Hkv, n, ·)`` restricted to the heads whose state the kept form replaces."""
    if isinstance(kernel, ExactHeadsKernel):
        return x[:, list(kernel.kernel_kv_heads)]
    return x


#: a decode step returns the freed heap (:mod:`oal.models.prefill`) once the cache buffers replaced since the last
#: release held at least this many bytes: a release walks every free chunk of malloc's heap (0.3–0.4 ms a step in a
#: fresh process, 1.6–4.6 ms where earlier work fragmented the heap, stop 56), and after a 1k prompt SmolLM2's kept
#: keys and exact heads regrow in some layer at nearly every step (185 of 200), 1.6 MB a step on average
STEP_RELEASE_BYTES = 4 * 2**20

# the bytes of the cache buffers replaced by larger ones (or kept keys folded into a state) since take_regrown() last
# said so: the freed smaller buffers stay in malloc's heap until oal.models.prefill returns them after a decode step
_REGROWN = [0]


def note_regrown(nbytes: int) -> None:
    """Record that cache buffers of ``nbytes`` bytes were just replaced by larger ones (see :func:`take_regrown`)."""
    _REGROWN[0] += nbytes


def take_regrown(at_least: int = 1) -> bool:
    """Whether the buffers replaced since this last said so (or since the start) held at least ``at_least`` bytes;
    if so the count starts again."""
    if _REGROWN[0] < at_least:
        return False
    _REGROWN[0] = 0
    return True


def _keeps(n: int, limit: int) -> bool:
    """Whether a prompt of ``n`` tokens from no state (to the prompt's end, :func:`prompt_end`) keeps keys and
    values under ``limit`` (:func:`keep_limit`) and has the fused decode kernel to continue with."""
    return n > 0 and context_end(n) <= limit and cpu_kernel.load("decode") is not None


def _kept_capacity(n: int, limit: int) -> int:
    """Slots of the kept keys' buffers after a prompt of ``n`` tokens: room for the rest of a prompt in chunks (its
    later chunks write into it: with_kept), then the layer's share of spare slots (< KEPT_GROWTH, a few KB per head),
    so that the decode steps after the prompt grow one or two layers' buffers at a time instead of all at the first;
    never past ``limit``."""
    return min(prompt_room(n, KEPT_GROWTH), limit)


def _buffer(x: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """``x (B, K, n, ·)`` copied into the first n slots of a contiguous ``dtype`` buffer of ``capacity`` slots."""
    out = cache_empty(x, x.shape[0], x.shape[1], capacity, x.shape[3], dtype=dtype)
    out[:, :, : x.shape[2]] = x
    return out


def start(
    kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, object] | None:
    """A prompt from no state, keeping the kernel heads' keys and values: ``(o (B, Hq, n, dv), state)`` where the
    state is a :class:`KeptKV` (an :class:`ExactHeadsState` holding one for an exact-heads kernel); the kernel runs
    without building its final state. q, k, v are fp32; ``model_dtype`` is the dtype they came in: for a bf16 model
    the keys and values are kept in bf16, exactly (they are bf16 numbers), else in fp32. None where the kept form
    does not apply: a kernel without it, a prompt longer than :func:`keep_limit`, not CPU fp32, autograd on, or no
    fused decode kernel to continue with, or a prompt in chunks that will outgrow the limit (:func:`prompt_end`)."""
    dtype = torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float32
    n, d, dv = k.shape[2], k.shape[3], v.shape[3]
    limit = keep_limit(kernel, d, dv, dtype.itemsize)
    if not _cpu_inference(kernel, q, k, v) or not _keeps(n, limit):
        return None
    o, _ = kernel(q, k, v)
    capacity = _kept_capacity(n, limit)
    kept = KeptKV(_buffer(_kept_heads(kernel, k), capacity, dtype), _buffer(_kept_heads(kernel, v), capacity, dtype), n)
    if isinstance(kernel, ExactHeadsKernel):
        return o, kernel.exact_state(k, v, kept, n)
    return o, kept


def prompt_buffers(
    kernel, batch: int, n: int, d: int, dv: int, model_dtype: torch.dtype = torch.float32, keep: bool = True
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The shapes and dtypes of the buffers a layer's cache keeps after a CPU inference prompt of ``n`` tokens from no
    state (in one call, or the first chunk of a prompt to :func:`prompt_end`), as the current model layer
    (:func:`~oal.kernels.base.model_layer`) allocates them: the kept keys and values (:func:`start`) and an
    exact-heads kernel's keys, values and page bounds; [] for kernels whose state is built elsewhere (the chunked
    kernels' states, the baselines). What :func:`oal.models.state_cache.reserved_for_prompt` allocates before the
    prompt's first layer runs. ``keep``: whether the layer keeps keys and values below the limit (its cache's
    ``keep_keys``)."""
    dtype = torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float32
    shapes = []
    limit = keep_limit(kernel, d, dv, dtype.itemsize)
    if keep and _keeps(n, limit):
        capacity = _kept_capacity(n, limit)
        K = len(kernel.kernel_kv_heads) if isinstance(kernel, ExactHeadsKernel) else kernel.num_kv_heads
        shapes += [((batch, K, capacity, d), dtype), ((batch, K, capacity, dv), dtype)]
    if isinstance(kernel, ExactHeadsKernel):
        # start's exact_state or the kernel's own prompt; the exact heads compute on fp32 inputs (oal.models.hooks
        # widens a bf16 model's)
        shapes += kernel.buffer_shapes(batch, prompt_room(n), d, dv, kernel.kv_dtype or torch.float32, bounds=True)
    return shapes


def _state_of(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The packed state ``Σ_j φ(k_j) [v_j; 1]ᵀ`` (Eq. 5) of keys ``k (B, K, n, d)`` and values ``v (B, K, n, dv)``:
    ``(B, K, D, dv + 1)`` fp32. One head and one block of keys at a time (features never exceed one block), with
    the cyclic pair features (a broadcast product, no gather; :func:`oal.ops.quadratic.utils.cyclic_maps`) and
    their rows put in the canonical order once per head: ~2.8× faster than the canonical features."""
    B, K, n, d = k.shape
    dv = v.shape[-1]
    _, cyclic_of_canon = cyclic_maps(d, k.device)
    S = k.new_empty(B, K, feature_dim(d), dv + 1, dtype=torch.float32)
    for b in range(B):
        for h in range(K):
            acc = k.new_zeros((d + 1) * cyclic_width(d + 1), dv + 1, dtype=torch.float32)
            for j in range(0, n, _FOLD_BLOCK):
                kb, vb = k[b, h, j : j + _FOLD_BLOCK].float(), v[b, h, j : j + _FOLD_BLOCK].float()
                u = torch.cat([vb, torch.ones_like(vb[:, :1])], dim=-1)
                acc.addmm_(cyclic_features(kb).mT, u)
            S[b, h] = acc[cyclic_of_canon]
    return S


def _fold_inner(inner, kept: KeptKV) -> object:
    """The state ``inner`` (an :class:`OALKernel` or :class:`SinkWindowKernel`) returns after the kept tokens."""
    n = kept.length
    note_regrown(kept.k.nbytes + kept.v.nbytes)
    k, v = kept.k[:, :, :n], kept.v[:, :, :n]
    if not isinstance(inner, SinkWindowKernel):
        return _state_of(k, v)
    s, w = inner.n_sink, inner.window
    B, K, _, d = k.shape
    dv = v.shape[-1]
    f32 = torch.float32  # the kernel's inputs' dtype (bf16 kept keys are widened, exactly)
    sink_k, sink_v = k.new_zeros(B, K, s, d, dtype=f32), v.new_zeros(B, K, s, dv, dtype=f32)
    win_k, win_v = k.new_zeros(B, K, w, d, dtype=f32), v.new_zeros(B, K, w, dv, dtype=f32)
    m = min(s, n)
    sink_k[:, :, :m], sink_v[:, :, :m] = k[:, :, :m], v[:, :, :m]
    m = min(w, n)
    if m:
        win_k[:, :, w - m :], win_v[:, :, w - m :] = k[:, :, n - m :], v[:, :, n - m :]
    S = _state_of(k[:, :, s : max(s, n - w)], v[:, :, s : max(s, n - w)])
    return SinkWindowState(S, sink_k, sink_v, win_k, win_v, n)


def fold(kernel, state: object) -> object:
    """``state`` as the kernel's own state: a kept form is folded into the state the kernel would have returned
    after the same tokens (Eq. 5); any other state is returned as it is."""
    if isinstance(state, KeptKV):
        return _fold_inner(_inner(kernel), state)
    if isinstance(state, ExactHeadsState) and isinstance(state.inner, KeptKV):
        return state._replace(inner=_fold_inner(_inner(kernel), state.inner))
    return state


def kept_of(state: object) -> KeptKV | None:
    """The kept form in ``state`` (itself, or an exact-heads state's inner part), or None."""
    if isinstance(state, ExactHeadsState):
        state = state.inner
    return state if isinstance(state, KeptKV) else None


def extend(
    kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: object,
    model_dtype: torch.dtype = torch.float32,
    layer: int | None = None,
) -> tuple[torch.Tensor, object] | None:
    """Several new tokens after a kept form (a prompt in chunks, a multi-token continuation) that keep it below
    layer ``layer``'s :func:`fold_point`: ``(o, state)`` with the new keys and values appended to the kept ones.
    With the fused CPU kernels the new queries are evaluated over the kept and the new keys without a state
    (:func:`_at_end`: the rows one call over the whole prompt gives them); otherwise from the kernel's chunked mode
    on the kept form folded into a transient state (the same arithmetic as a cache that had kept the state). None
    where it does not apply (as :func:`start`, or a state that is not a kept form, or a context past the fold point:
    then the caller folds for good)."""
    kept = kept_of(state)
    if kept is None:
        return None
    n, d, dv = k.shape[2], k.shape[3], v.shape[3]
    total = kept.length + n
    if context_end(total) > fold_point(kernel, d, dv, layer, kept.k.element_size()):
        return None
    if not _cpu_inference(kernel, q, k, v):
        return None
    if _at_end_usable(kernel):
        if isinstance(state, ExactHeadsState):  # its inner kernel continues from the kept form itself
            return kernel(q, k, v, mode="chunk", initial_state=state, output_final_state=True)
        keys, values, grown = with_kept(kept, k, v)
        return _at_end(kernel, q, keys, values), grown
    o, after = kernel(q, k, v, mode="chunk", initial_state=fold(kernel, state), output_final_state=True)
    dtype = kept.k.dtype
    new = KeptKV(
        torch.cat([kept.k[:, :, : kept.length], _kept_heads(kernel, k).to(dtype)], dim=2),
        torch.cat([kept.v[:, :, : kept.length], _kept_heads(kernel, v).to(dtype)], dim=2),
        total,
    )
    return o, after._replace(inner=new) if isinstance(after, ExactHeadsState) else new


def _at_end_usable(kernel) -> bool:
    """Whether :func:`_at_end` (or an exact-heads kernel's inner kernel on a kept form) can evaluate a chunk of
    ``kernel`` after its kept keys: the fused CPU kernels it needs are available (the caller checked CPU fp32
    inference)."""
    if cpu_kernel.load() is None:
        return False
    return not isinstance(_inner(kernel), SinkWindowKernel) or cpu_kernel.load("window") is not None


def _at_end(kernel, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``o (B, Hq, n, dv)`` of ``kernel`` (OAL or the global quadratic, with or without sinks and a window) for the
    queries ``q`` that are the last n of the positions of ``keys``, ``values`` ``(B, Hkv, N, ·)``: in parallel form
    with the queries aligned at the end of the keys, no state folded (:func:`oal.kernels.sink_window.kernel_at_end`)."""
    o = kernel_at_end(kernel, q, keys, values)
    if o is None:
        raise RuntimeError("the fused CPU kernels refused a call _at_end_usable accepted")
    return o


def grown(kept: KeptKV, limit: int) -> KeptKV:
    """``kept`` with room for slot ``length``: itself if it has it, else its keys and values copied into buffers
    of ``min(length + 1 + KEPT_GROWTH, limit)`` slots (the caller folds before ``length`` reaches ``limit``)."""
    if kept.k.shape[2] > kept.length and kept.k.is_contiguous() and kept.v.is_contiguous():
        return kept
    capacity = min(kept.length + 1 + KEPT_GROWTH, limit)
    note_regrown(kept.k.nbytes + kept.v.nbytes)
    n = kept.length
    k, v = (_buffer(x[:, :, :n], capacity, x.dtype) for x in (kept.k, kept.v))
    return KeptKV(k, v, n)
