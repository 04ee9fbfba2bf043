"""The ``"oal"`` attention implementation: Q/K/V capture and per-layer kernel replacement.

It is registered with transformers' ``AttentionInterface`` (and, for mask construction, ``AttentionMaskInterface``
with SDPA's mask function), so a model switched to it through ``model.set_attn_implementation("oal")`` builds the
same masks as with ``"sdpa"``. For every attention call it looks at the calling module:

* if a kernel is attached (:func:`attach_kernel`, stored as the submodule ``self_attn.oal_kernel``), the kernel
  computes the attention output from the post-RoPE q and un-repeated k, v in place of softmax;
* otherwise it calls transformers' ``sdpa_attention_forward`` unchanged, so logits are identical to ``"sdpa"`` —
  except for the one-token steps of a softmax layer whose cache entry is an
  :class:`oal.models.state_cache.ExactKVLayer` (the softmax layers of a model with kernels, on CPU fp32): those run
  the fused exact step of :func:`oal.kernels.decode.softmax_decode_step` (the same softmax, another summation order);
* if a :func:`capture_qkv` recorder is active on the module, q, k, v (and optionally the output) are recorded.

The model is switched to ``"oal"`` only while a kernel is attached or a capture is running, and switched back to
its previous implementation afterwards.

Caching and generation. A layer with a kernel keeps the kernel's recurrent state in the cache instead of keys and
values (:class:`oal.models.state_cache.KernelStateLayer`). The attention function cannot see the cache (transformers
passes it to the attention module, not to the attention function), so a forward pre-hook on every module with a
kernel looks up the module's cache entry — turning the empty entry of a fresh ``DynamicCache`` into a
``KernelStateLayer`` — and leaves it on the module for the duration of that forward. The cache entry's ``update``
returns the new tokens' k, v unchanged; the attention function runs the kernel on them from the stored state
(``mode="chunk"`` for several tokens, ``"recurrent"`` for one) and stores the new state. Without a cache, a kernel
sees one full causal sequence. Exact-softmax kernels (:class:`oal.kernels.SoftmaxKernel`) keep keys and values like
any softmax layer. Kernels run in fp32 at least (half-precision q, k, v are cast up, the output back), and an
attached kernel's floating tensors are never cast below fp32 (``model.to(torch.bfloat16)`` leaves them in fp32).
Padding (left or right, one contiguous block of real tokens per row) runs row by row, each row's kernel seeing
only its real tokens from its own state (:class:`oal.models.state_cache.RowStates`), so a padded batch gives each
row what that sequence alone gives; packed sequences, sliding windows, softcapping and attention sinks are refused.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..kernels import kept as kept_form
from ..kernels.base import AttentionKernel, SoftmaxKernel, model_layer, reserved_buffers
from ..kernels.decode import decode_step, prepare_decode, softmax_decode_step
from ..ops.quadratic import cpu as cpu_kernels
from ..ops.softmax import softmax_at_end
from .architecture import attention_spec, check_layer, get_attention_modules
from .state_cache import KernelStateLayer, RowStates, exact_kv_layer, kernel_state_layer

ATTN_IMPLEMENTATION = "oal"
KERNEL_ATTR = "oal_kernel"
_RECORDER_ATTR = "_oal_recorder"
_PREVIOUS_ATTR = "_oal_previous_attn_implementation"
_HOOKS_ATTR = "_oal_cache_hooks"
_STATE_ATTR = "_oal_state_layer"  # the module's KernelStateLayer during one forward (None: no cache)
_EXACT_KV_ATTR = "_oal_exact_kv_layer"  # a softmax layer's ExactKVLayer during one forward (None: other entry)
_HALF = (torch.float16, torch.bfloat16)
# Attention-function arguments that change the softmax itself; a kernel cannot honour them.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")
# ... and those the fused softmax decode step of a layer without a kernel leaves to SDPA
_SOFTMAX_KWARGS = (*_UNSUPPORTED_KWARGS, "sliding_window")


class QKV(NamedTuple):
    """One attention call of one layer.

    q ``(B, Hq, N, d)`` and k ``(B, Hkv, N, d)`` after RoPE, v ``(B, Hkv, N, dv)`` (k, v not repeated to Hq
    heads); ``o`` ``(B, Hq, N, dv)`` the attention output before ``W_o`` (of the kernel, if one was attached),
    or None when not requested; ``scale`` the softmax scaling the layer uses.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor | None
    scale: float


class QKVRecorder(Mapping):
    """What :func:`capture_qkv` recorded: ``rec[layer]`` is that layer's latest call; :meth:`history` all calls
    when ``keep_all`` was set."""

    def __init__(self, layers: Sequence[int], *, outputs: bool, keep_all: bool, device: str | torch.device | None):
        self.layers = tuple(layers)
        self.outputs = outputs
        self.keep_all = keep_all
        self.device = device
        self._calls: dict[int, list[QKV]] = {layer: [] for layer in self.layers}

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        # Always a copy: a static KV cache updates the tensors it hands out in place.
        return x.detach().to(self.device if self.device is not None else x.device, copy=True)

    def record(self, layer: int, q, k, v, o, scale: float) -> None:
        qkv = QKV(self._store(q), self._store(k), self._store(v), self._store(o) if self.outputs else None, scale)
        if self.keep_all:
            self._calls[layer].append(qkv)
        else:
            self._calls[layer] = [qkv]

    def __getitem__(self, layer: int) -> QKV:
        if layer not in self._calls:
            raise KeyError(f"layer {layer} was not captured; captured layers: {list(self.layers)}")
        if not self._calls[layer]:
            raise KeyError(f"layer {layer} has not run yet inside capture_qkv")
        return self._calls[layer][-1]

    def __iter__(self) -> Iterator[int]:
        return (layer for layer in self.layers if self._calls[layer])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def history(self, layer: int) -> list[QKV]:
        """Every recorded call of ``layer`` in order (only the latest unless ``keep_all=True``)."""
        if layer not in self._calls:
            raise KeyError(f"layer {layer} was not captured; captured layers: {list(self.layers)}")
        return list(self._calls[layer])


def _check_kernel_call(
    module: nn.Module, kernel: AttentionKernel, n: int, past: int, attention_mask, scaling, dropout, kwargs
) -> None:
    """The call must be plain causal attention of ``n`` new queries over ``past + n`` keys."""
    where = f"layer {module.layer_idx} ({type(kernel).__name__})"
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{where}: kernels are causal, but this attention module is not")
    if dropout:
        raise ValueError(f"{where}: attention dropout {dropout} is not supported by kernels; call model.eval()")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{where}: the attention argument {name!r} is not supported by kernels")
    if scaling is not None and not math.isclose(kernel.scale, scaling, rel_tol=1e-6):
        raise ValueError(f"{where}: kernel scale {kernel.scale} differs from the layer's scaling {scaling}")


# the last mask _key_validity accepted and its result: every layer of a forward gets the same mask tensor, and a
# prompt in chunks of 512 at 8k would otherwise compare 512 × 8k masks in every layer of every chunk (~0.7 s)
_LAST_VALIDITY: list[tuple | None] = [None]


def _key_validity(where: str, attention_mask: torch.Tensor | None, n: int, past: int) -> torch.Tensor | None:
    """:func:`_check_key_validity`, remembered for the last mask it accepted (the same tensor object, unmodified:
    its version counter, with the same ``n`` and ``past``)."""
    if attention_mask is None:
        return None
    if attention_mask.is_inference():  # no version counter to tell an in-place change: checked every time
        return _check_key_validity(where, attention_mask, n, past)
    key = (attention_mask._version, n, past)
    last = _LAST_VALIDITY[0]
    if last is not None and last[0]() is attention_mask and last[1] == key:
        return last[2]
    valid = _check_key_validity(where, attention_mask, n, past)
    _LAST_VALIDITY[0] = (weakref.ref(attention_mask), key, valid)
    return valid


def _check_key_validity(where: str, attention_mask: torch.Tensor, n: int, past: int) -> torch.Tensor | None:
    """The keys each row may use under ``attention_mask`` ``(B|1, 1|H, n, past + n)`` (bool, or additive 0/-inf):
    None for plain causal attention (or no mask), else ``valid (B, past + n)`` bool for a padding mask — causal ∧
    ``valid`` for every query whose own token is valid, the same or all masked or all unmasked (SDPA's mask builder
    unmasks empty rows) for a padding query, with each row's valid tokens one contiguous block (left or right
    padding).

    Anything else (packed sequences, sliding windows, bidirectional blocks) raises."""
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    device = allowed.device
    causal = torch.arange(past + n, device=device)[None, :] <= torch.arange(past, past + n, device=device)[:, None]
    refuse = (
        f"{where}: got an attention mask that is neither causal nor causal with padding (packed sequences or a "
        "sliding window); kernels support causal attention with left or right padding only"
    )
    if allowed.dim() != 4 or allowed.shape[-2:] != (n, past + n):
        raise ValueError(refuse)
    if bool((allowed == causal).all()):
        return None
    if allowed.shape[1] != 1 and not bool((allowed == allowed[:, :1]).all()):
        raise ValueError(refuse)
    rows = allowed[:, 0]
    # the last query attends to every valid key: a left-padded row's last token is real, and a right-padded row's
    # last (padding) query attends to the real keys before it
    valid = rows[:, -1, :]
    qvalid = valid[:, past:]
    expected = (rows == (causal & valid[:, None, :])).all(-1)
    # a padding query's row may also be all masked, or all unmasked (SDPA's guard against empty rows)
    padding_row = ~qvalid & (~rows.any(-1) | rows.all(-1))
    if not bool((expected | padding_row).all()):
        raise ValueError(refuse)
    count = valid.sum(-1)
    first = valid.int().argmax(-1)
    last = past + n - 1 - valid.flip(-1).int().argmax(-1)
    if bool(((last - first + 1 != count) & (count > 0)).any()):
        raise ValueError(refuse)
    return valid


def _kernel_attention(
    module: nn.Module,
    kernel: AttentionKernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    kwargs: dict,
) -> torch.Tensor:
    """The kernel's attention output ``(B, N, Hq, dv)`` in value's dtype, continuing from the cached state."""
    where = f"layer {module.layer_idx} ({type(kernel).__name__})"
    n = query.shape[2]
    layer: KernelStateLayer | None = getattr(module, _STATE_ATTR, None)
    past = key.shape[2] - n if layer is None else layer.seen - n
    _check_kernel_call(module, kernel, n, past, attention_mask, scaling, dropout, kwargs)
    valid = _key_validity(where, attention_mask, n, past)
    if isinstance(kernel, SoftmaxKernel) and past:
        # exact softmax keeps keys and values: the fused step, else transformers' own SDPA call with the kernel's scale
        out = _softmax_decode(module, query, key, value, valid is None, kernel.scale)
        if out is None:
            out = _softmax_chunk(query, key, value, attention_mask, dropout, kernel.scale, kwargs)
        if out is None:
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=kernel.scale, **kwargs)
        return out
    if key.shape[2] != n:
        raise ValueError(
            f"{where}: got {n} queries against {key.shape[2]} cached keys; a layer with a kernel keeps a recurrent "
            "state, not keys and values: run the model with use_cache=False or a fresh cache"
        )
    # kernels accumulate in fp32 (q/k may already be fp32 after RoPE under autocast while v is half), and autocast
    # must not push their GEMMs back to half precision; the copy is made contiguous (the heads transposed out of
    # the projection are not), so that the fused kernels do not copy it once more
    q, k, v = (
        x.to(torch.float32, memory_format=torch.contiguous_format) if x.dtype in _HALF else x
        for x in (query, key, value)
    )
    # the buffers reserved for this layer's cache before the prompt (state_cache.reserved_for_prompt): taken by
    # this call or freed now
    reserve = None
    if layer is not None:
        reserve, layer.reserve = layer.reserve, None
    # autocast is turned off only where it is on: the context costs ~30 µs a layer in a decode step, whose GEMMs have
    # just streamed the weights through the CPU's caches
    device = q.device.type
    with torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else nullcontext():
        if valid is not None or (layer is not None and isinstance(layer.state, RowStates)):
            o = _padded_attention(where, kernel, q, k, v, valid, layer, past, module.layer_idx, key.dtype)
        elif layer is None:
            o, _ = kernel(q, k, v)
        else:
            past, state = layer.take(n)
            if past and state is None:
                raise ValueError(
                    f"{where}: the kernel returned no recurrent state for the first {past} tokens, so this cache "
                    "cannot continue; run the model with use_cache=False"
                )
            with reserved_buffers(reserve) if reserve is not None else nullcontext():
                o, state = _step(kernel, q, k, v, state, past, layer.keep_keys, module.layer_idx, key.dtype)
            layer.put(state)
    return o.to(value.dtype).transpose(1, 2).contiguous()


def _step(kernel: AttentionKernel, q, k, v, state, past: int, keep: bool, layer_idx: int, model_dtype: torch.dtype):
    """The kernel on new tokens after ``past`` tokens summarised by ``state``: ``(o, new state)``. A prompt from
    no state keeps the kernel heads' keys and values while they are smaller than the state (``keep``; the kept form
    of :mod:`oal.kernels.kept`, in bf16 for a bf16 ``model_dtype``, folded at model layer ``layer_idx``'s fold
    point). One-token steps take the fused in-place step (the cache owns the state), else the kernel's own recurrent
    mode (autograd, non-fp32, other kernels, no compiler); several tokens the chunked mode; both from the kernel's
    own state (a kept form folded into it first), unless they keep a kept form below its fold point. Buffers a
    prompt leaves get the layer's :func:`~oal.kernels.base.spare_slots`, and a prompt builds the fused step's
    constants (:func:`~oal.kernels.decode.prepare_decode`)."""
    with model_layer(layer_idx):
        return _step_in_layer(kernel, q, k, v, state, past, keep, layer_idx, model_dtype)


def _step_in_layer(kernel, q, k, v, state, past: int, keep: bool, layer_idx: int, model_dtype: torch.dtype):
    if q.shape[2] == 1:
        return _new_tokens(kernel, q, k, v, state, past, keep, layer_idx, model_dtype)
    prepare_decode(kernel, q, k, v)
    o, state = _new_tokens(kernel, q, k, v, state, past, keep, layer_idx, model_dtype)
    if state is not None and kept_form.kept_of(state) is None:
        prepare_decode(kernel, q, k, v, state)  # the state's own constants too (a kept form's steps need none)
    return o, state


def _new_tokens(kernel, q, k, v, state, past: int, keep: bool, layer_idx: int, model_dtype: torch.dtype):
    n = q.shape[2]
    if keep and state is None:
        started = kept_form.start(kernel, q, k, v, model_dtype)
        if started is not None:
            return started
    if n > 1:  # a prompt in chunks (oal.models.prefill) stays in the kept form up to the fold point
        extended = kept_form.extend(kernel, q, k, v, state, model_dtype, layer_idx)
        if extended is not None:
            return extended
    fused = decode_step(kernel, q, k, v, state, past, layer_idx) if n == 1 else None
    if fused is None:
        mode = "recurrent" if n == 1 else "chunk"
        fused = kernel(q, k, v, mode=mode, initial_state=kept_form.fold(kernel, state), output_final_state=True)
    return fused


def _padded_attention(
    where: str,
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor | None,
    layer: KernelStateLayer | None,
    past: int,
    layer_idx: int,
    model_dtype: torch.dtype,
) -> torch.Tensor:
    """A padded batch, row by row: each row's kernel sees only its valid tokens (the contiguous block
    :func:`_key_validity` checked), from its own state, exactly as that sequence alone would; padding queries
    get output 0. With a cache the state becomes a :class:`RowStates`. ``valid``: ``(B, past + n)`` or None (all
    new tokens valid)."""
    B, n = q.shape[0], q.shape[2]
    new_valid = torch.ones(B, n, dtype=torch.bool, device=q.device) if valid is None else valid[:, past:]
    rows = None
    if layer is not None:
        past_, state = layer.take(n)
        if past_ and state is None:
            raise ValueError(f"{where}: the kernel returned no recurrent state for the first {past_} tokens")
        rows = RowStates.split(state, B, past_)
        if valid is not None:
            for b, seen in enumerate(rows.seen):
                held = valid[b, :past]
                if int(held.sum()) != seen or (seen and not bool(held[past - seen :].all())):
                    raise ValueError(
                        f"{where}: row {b}: the attention mask over the {past} cached tokens does not match what the "
                        f"cached state holds (its last {seen} tokens); a mask cannot change tokens already cached"
                    )
    o = q.new_zeros(B, q.shape[1], n, v.shape[-1])
    for b in range(B):
        idx = new_valid[b].nonzero().flatten()
        if idx.numel() == 0:
            continue
        s, e = int(idx[0]), int(idx[-1]) + 1
        sl = (slice(b, b + 1), slice(None), slice(s, e))
        if rows is None:
            o[sl], _ = kernel(q[sl], k[sl], v[sl])
            continue
        seen = rows.seen[b]
        if seen and s:
            raise ValueError(
                f"{where}: row {b} continues after padding (a right-padded sequence cannot be extended from the "
                "cache); pad on the left for generation"
            )
        o[sl], state_b = _step(kernel, q[sl], k[sl], v[sl], rows.rows[b], seen, layer.keep_keys, layer_idx, model_dtype)
        rows = rows.replace_row(b, state_b, seen + (e - s))
    if layer is not None:
        layer.put(rows)
    return o


def _softmax_decode(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor | None:
    """A softmax layer's one-token step through the fused kernel (``(B, 1, Hq, dv)``, as SDPA's output), when its
    cache entry is an :class:`ExactKVLayer` that just returned ``key`` / ``value`` and the mask is plain causal;
    None otherwise (the caller runs SDPA)."""
    entry = getattr(module, _EXACT_KV_ATTR, None)
    if entry is None or query.shape[2] != 1 or not causal or value is not entry.values:
        return None
    buffers = entry.buffers(key)
    if buffers is None:
        return None
    out = softmax_decode_step(query, *buffers, key.shape[2], scale)
    return None if out is None else out.to(value.dtype).transpose(1, 2)


def _softmax_chunk(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scale: float | None,
    kwargs: dict,
) -> torch.Tensor | None:
    """A softmax layer's several queries after cached keys under plain causal attention (a prompt's later chunk):
    ``(B, N, Hq, dv)`` as SDPA's output, from :func:`oal.ops.softmax.softmax_at_end` without the mask transformers
    built; None otherwise (the caller runs SDPA with the mask)."""
    n, past = query.shape[2], key.shape[2] - query.shape[2]
    if n < 2 or past <= 0 or dropout or any(kwargs.get(name) is not None for name in _SOFTMAX_KWARGS):
        return None
    if not _plain_causal(attention_mask, n, past):
        return None
    out = softmax_at_end(query, key, value, scale)
    return None if out is None else out.to(value.dtype).transpose(1, 2).contiguous()


def _plain_causal(attention_mask: torch.Tensor | None, n: int, past: int) -> bool:
    """Whether ``attention_mask`` is plain causal attention of ``n`` queries over ``past + n`` keys (or None)."""
    try:
        return _key_validity("", attention_mask, n, past) is None
    except ValueError:
        return False


def oal_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``"oal"`` attention function: query ``(B, Hq, N, d)``, key/value ``(B, Hkv, N_kv, ·)`` ->
    ``(attn_output (B, N, Hq, dv), attn_weights)``, as transformers' ``sdpa_attention_forward``. For a layer
    with a recurrent kernel, N_kv = N (the new tokens; the past is in the cached state)."""
    kernel = getattr(module, KERNEL_ATTR, None)
    out = weights = None
    if (
        kernel is None
        and query.shape[2] == 1  # a one-token step (a prompt stays on SDPA)
        and not dropout
        and not any(kwargs.get(name) is not None for name in _SOFTMAX_KWARGS)
        and _plain_causal(attention_mask, 1, key.shape[2] - 1)
    ):
        out = _softmax_decode(
            module, query, key, value, True, float(scaling if scaling is not None else module.scaling)
        )
    if kernel is None and out is None:
        out = _softmax_chunk(query, key, value, attention_mask, dropout, scaling, kwargs)
    if kernel is None and out is None:
        out, weights = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    elif kernel is not None:
        out = _kernel_attention(module, kernel, query, key, value, attention_mask, dropout, scaling, kwargs)
    recorder = getattr(module, _RECORDER_ATTR, None)
    if recorder is not None:
        recorder.record(
            module.layer_idx,
            query,
            key,
            value,
            out.transpose(1, 2) if recorder.outputs else None,
            float(scaling if scaling is not None else module.scaling),
        )
    return out, weights


AttentionInterface.register(ATTN_IMPLEMENTATION, oal_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _sync_attn_implementation(model: PreTrainedModel) -> None:
    """Use ``"oal"`` while any layer has a kernel or a recorder; otherwise go back to the previous one."""
    modules = get_attention_modules(model)
    needed = any(
        getattr(m, KERNEL_ATTR, None) is not None or getattr(m, _RECORDER_ATTR, None) is not None for m in modules
    )
    current = model.config._attn_implementation
    if needed and current != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"model: {type(model).__name__} does not let its attention implementation be switched at runtime"
            )
        setattr(model, _PREVIOUS_ATTR, current)
    elif not needed and current == ATTN_IMPLEMENTATION and hasattr(model, _PREVIOUS_ATTR):
        model.set_attn_implementation(getattr(model, _PREVIOUS_ATTR))
        delattr(model, _PREVIOUS_ATTR)


def _find_state_layer(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of every attention module of a model with a kernel: leave the module's cache entry on it
    for the attention function — a :class:`KernelStateLayer` for a kernel's state, an :class:`ExactKVLayer` for
    a softmax layer's keys and values (a fresh ``DynamicLayer`` becomes one)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    kernel = getattr(module, KERNEL_ATTR, None)
    layer = exact = None
    if cache is not None and kernel is not None and not isinstance(kernel, SoftmaxKernel):
        layer = kernel_state_layer(cache, module.layer_idx)
        layer.expect_update()
    elif cache is not None:
        exact = exact_kv_layer(cache, module.layer_idx)
    setattr(module, _STATE_ATTR, layer)
    setattr(module, _EXACT_KV_ATTR, exact)


def _forget_state_layer(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
    """Forward hook (also run on exceptions): the cache must not outlive the forward through the module."""
    module.__dict__.pop(_STATE_ATTR, None)
    module.__dict__.pop(_EXACT_KV_ATTR, None)


def _sync_cache_hooks(model: PreTrainedModel) -> None:
    """The cache hooks on every attention module while any layer has a kernel (softmax layers too: their entries
    become :class:`ExactKVLayer`), on none otherwise."""
    modules = get_attention_modules(model)
    needed = any(getattr(m, KERNEL_ATTR, None) is not None for m in modules)
    for module in modules:
        handles = getattr(module, _HOOKS_ATTR, None)
        if needed and handles is None:
            setattr(
                module,
                _HOOKS_ATTR,
                (
                    module.register_forward_pre_hook(_find_state_layer, with_kwargs=True),
                    module.register_forward_hook(_forget_state_layer, with_kwargs=True, always_call=True),
                ),
            )
        elif not needed and handles is not None:
            for handle in handles:
                handle.remove()
            module.__dict__.pop(_HOOKS_ATTR, None)


class _KeepPrecisionApply:
    """Replacement of an attached kernel's ``nn.Module._apply``: device moves and up-casts apply, casts of
    fp32/fp64 tensors to fp16/bf16 do not (the tensor is only moved), so ``model.to(torch.bfloat16)`` keeps the
    kernel in fp32. Installed on the kernel instance by :func:`attach_kernel`; an object rather than a bound
    method so that it survives deep copies and pickling of the model."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, fn, recurse: bool = True) -> nn.Module:
        def keep_precision(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if isinstance(out, torch.Tensor) and out.dtype in _HALF and t.is_floating_point() and t.dtype not in _HALF:
                return t.to(device=out.device)
            return out

        return type(self.module)._apply(self.module, keep_precision, recurse)


def attach_kernel(model: PreTrainedModel, layer: int, kernel: AttentionKernel) -> None:
    """Replace softmax attention in ``layer`` by ``kernel`` (stored as ``self_attn.oal_kernel``, so it moves with
    the model and appears in its state dict). The kernel is moved to the layer's device, its dtype is kept, and
    later casts of the model leave it at fp32 or above. Replaces any kernel already attached there."""
    check_layer(model, layer)
    if not isinstance(kernel, AttentionKernel):
        raise ValueError(f"kernel: expected an oal.kernels.AttentionKernel, got {type(kernel).__name__}")
    spec = attention_spec(model)
    got = (kernel.num_heads, kernel.num_kv_heads, kernel.head_dim)
    want = (spec.num_heads, spec.num_kv_heads, spec.head_dim)
    if got != want:
        raise ValueError(f"kernel: expected (num_heads, num_kv_heads, head_dim) = {want}, got {got}")
    if not math.isclose(kernel.scale, spec.scaling, rel_tol=1e-6):
        raise ValueError(f"kernel: expected scale {spec.scaling} like the model, got {kernel.scale}")
    module = get_attention_modules(model)[layer]
    kernel._apply = _KeepPrecisionApply(kernel)
    setattr(module, KERNEL_ATTR, kernel.to(module.q_proj.weight.device))
    if module.q_proj.weight.device.type == "cpu":
        # at attach time, not inside the first forward (a prefill's timing included); only what the kernel calls
        # (each library's code pages are resident memory of every process running the model)
        cpu_kernels.preload({e for m in kernel.modules() if isinstance(m, AttentionKernel) for e in m.cpu_extensions})
    _sync_cache_hooks(model)
    _sync_attn_implementation(model)


def detach_kernel(model: PreTrainedModel, layer: int) -> AttentionKernel:
    """Remove and return the kernel attached to ``layer`` (softmax attention again). A cache filled while the
    kernel was attached cannot be used afterwards (its entry for this layer holds the kernel's state)."""
    check_layer(model, layer)
    module = get_attention_modules(model)[layer]
    kernel = getattr(module, KERNEL_ATTR, None)
    if kernel is None:
        raise ValueError(f"layer: no kernel is attached to layer {layer}")
    delattr(module, KERNEL_ATTR)
    kernel.__dict__.pop("_apply", None)
    _sync_cache_hooks(model)
    _sync_attn_implementation(model)
    return kernel


def attached_kernels(model: PreTrainedModel) -> dict[int, AttentionKernel]:
    """``{layer: kernel}`` for every layer with a kernel attached."""
    modules = get_attention_modules(model)
    return {i: getattr(m, KERNEL_ATTR) for i, m in enumerate(modules) if getattr(m, KERNEL_ATTR, None) is not None}


@contextmanager
def capture_qkv(
    model: PreTrainedModel,
    layers: Sequence[int] | None = None,
    *,
    outputs: bool = False,
    keep_all: bool = False,
    device: str | torch.device | None = "cpu",
) -> Iterator[QKVRecorder]:
    """Record q, k, v of ``layers`` (default: all) for forwards run inside the block::

        with capture_qkv(model, layers=[4, 12]) as rec:
            model(input_ids)
        q, k, v, o, scale = rec[4]

    Without attached kernels the forward is numerically identical to ``"sdpa"``. ``outputs`` also records the
    attention output before ``W_o``; ``keep_all`` keeps every call (e.g. several batches) instead of the latest;
    ``device`` is where copies are stored (None: where they were computed). Captured tensors are detached.
    Under KV-cache decoding, k and v are the cache's full keys and values for softmax layers and the new tokens'
    keys and values for layers with a recurrent kernel.
    """
    modules = get_attention_modules(model)
    if layers is None:
        layers = list(range(len(modules)))
    layers = [check_layer(model, layer, name="layers") for layer in layers]
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers: expected distinct layer indices, got {layers}")
    busy = [layer for layer in layers if getattr(modules[layer], _RECORDER_ATTR, None) is not None]
    if busy:
        raise ValueError(f"layers: {busy} are already being captured by an enclosing capture_qkv")
    recorder = QKVRecorder(layers, outputs=outputs, keep_all=keep_all, device=device)
    try:
        for layer in layers:
            setattr(modules[layer], _RECORDER_ATTR, recorder)
        _sync_attn_implementation(model)
        yield recorder
    finally:
        for layer in layers:
            if getattr(modules[layer], _RECORDER_ATTR, None) is recorder:
                delattr(modules[layer], _RECORDER_ATTR)
        _sync_attn_implementation(model)
