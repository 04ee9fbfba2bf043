"""The fused decode step of a converted layer: one C++ call per layer and token on CPU, state updated in place.

``kernel(q, k, v, mode="recurrent", initial_state=state, output_final_state=True)`` is the reference: it leaves
its input state untouched and allocates the new one, and for an OAL + sinks + window layer with exact heads it
runs many small torch operations (input checks, slicing heads, Eq. 3 coefficients, query weights, the kernel
readout, the window slide, the exact part, the combination; a whole SmolLM2 step at 512 tokens took 138 ms with
them and 68 ms with this path, one thread). A decode step's real work is tiny — read and update a
``(D, dv+1)`` state per KV head, a few hundred exact keys — so that dispatch overhead was most of a converted
model's decode latency. :func:`decode_step` computes the same outputs with ``decode.cpp``:

* OAL / global kernels (:class:`OALKernel`): the packed state is read once per KV head for all its query heads
  and updated in place (Algorithm 1, lines 6–11);
* :class:`SinkWindowKernel`: the same, plus the exact sinks and window in one normalisation, the window
  sliding in place;
* :class:`ExactHeadsKernel`: the exact heads' keys/values are written into spare slots of their buffer (grown by
  :data:`GROWTH` slots when full, so the copy is amortised), the other heads as above; with a decode budget the
  new key's page bounds are updated in place and a step past the budget attends to the selected pages only
  (:mod:`oal.ops.page_select`: the bounds ranked, the selected pages' keys read, one task per exact head);
* the kept form of any of them (:mod:`oal.kernels.kept`: below the memory crossover the cache keeps the kernel
  heads' keys and values instead of the state): the new key is written into a spare slot and the kernel part is
  evaluated over the kept keys through the kernel's factor, in blocks whose sums add up; the sinks and window are
  exact parts of the same keys. The step that would make the kept keys larger than the state folds them into it
  first (:func:`oal.kernels.kept.fold`) and runs on the state.

It is what the model's cache uses for one-token steps (:mod:`oal.models.hooks`); because it writes into the
state it is given, it is only for a state that nothing else holds. It applies to CPU float32 inputs and states
with autograd off; :func:`decode_step` returns None otherwise (and when the extension cannot be built), and the
caller runs the reference. The query-side constants (Eq. 6 query weights of the kernel heads, β) are computed once
and reused until a parameter changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops.quadratic import cpu as cpu_kernel
from ..ops.quadratic.utils import feature_dim, query_weights
from ..ops.sink_window import SinkWindowState
from . import kept as kept_form
from .base import GROWTH
from .hybrid import ExactHeadsKernel, ExactHeadsState, bounds_buffer, refresh_bounds
from .oal import OALKernel, oal_coefficients, oal_factor
from .sink_window import SinkWindowKernel

__all__ = ["GROWTH", "decode_step", "prepare_decode", "softmax_decode_step"]

_CONSTANTS_ATTR = "_oal_decode_constants"
_STATE_WEIGHTS_ATTR = "_oal_decode_state_weights"
_EMPTY = torch.empty(0)


def _parts(kernel) -> tuple[OALKernel, SinkWindowKernel | None, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(OAL kernel, sink/window wrapper or None, exact KV heads, kernel KV heads, kernel query heads)."""
    if isinstance(kernel, ExactHeadsKernel):
        inner = kernel.inner
        sw = inner if isinstance(inner, SinkWindowKernel) else None
        oal = sw.inner if sw is not None else inner
        return oal, sw, kernel.exact_kv_heads, kernel.kernel_kv_heads, kernel._kernel_q
    sw = kernel if isinstance(kernel, SinkWindowKernel) else None
    oal = sw.inner if sw is not None else kernel
    return oal, sw, (), tuple(range(kernel.num_kv_heads)), tuple(range(kernel.num_heads))


def _parameters_key(module: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """``(storage, version counter)`` of every parameter of ``module`` and its submodules, by a plain walk of their
    dicts: ``module.parameters()`` (named generators, prefixes, a memo set) cost ~30 µs a kernel in a decode step,
    whose GEMMs have just streamed the weights through the CPU's caches."""
    key = []
    stack = [module]
    while stack:
        m = stack.pop()
        key.extend((p.data_ptr(), p._version) for p in m._parameters.values() if p is not None)
        stack.extend(c for c in m._modules.values() if c is not None)
    return tuple(key)


def _cached(kernel, attr: str, build: Callable[[torch.nn.Module], object]) -> object:
    """``build(kernel)``, cached on the kernel under ``attr`` and rebuilt when any of its parameters changes
    (version counter or storage, :func:`_parameters_key`)."""
    key = _parameters_key(kernel)
    cached = getattr(kernel, attr, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        value = build(kernel)
    object.__setattr__(kernel, attr, (key, value))
    return value


def _constants(kernel) -> tuple[tuple, tuple[torch.Tensor, ...]]:
    """``(parts, constants)``: the kernel's :func:`_parts` and ``(exact KV heads, kernel KV heads, β (K·G,), factor
    W (K·G, R, d), c (K·G, R), c0 (K·G,))`` as fp32 / int64 CPU tensors (Eq. 7's factor for kept keys), cached on
    the kernel together (:func:`_cached`; the parts' module lookups cost ~10 µs a layer in a decode step)."""
    return _cached(kernel, _CONSTANTS_ATTR, _build_constants)


def _kernel_query_heads(oal: OALKernel, kq: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(query head indices, their groups, their L as fp32)`` for the kernel query heads ``kq``."""
    hq = torch.tensor(kq, dtype=torch.long)
    return hq, oal.groups.index_select(0, hq), oal.L.float().index_select(0, hq)


def _build_constants(kernel) -> tuple[tuple, tuple[torch.Tensor, ...]]:
    parts = _parts(kernel)
    oal, sw, exact, rest, kq = parts
    if not kq:  # every head exact
        exact_idx, none = torch.tensor(exact, dtype=torch.long), torch.empty(0, dtype=torch.long)
        return parts, (exact_idx, none, _EMPTY, _EMPTY.view(0, 0, 0), _EMPTY.view(0, 0), _EMPTY)
    hq, groups, L = _kernel_query_heads(oal, kq)
    beta = (sw.beta.float().index_select(0, hq) if sw is not None else torch.zeros(len(kq))).contiguous()
    factor = oal_factor(groups, L, oal.eps)
    consts = (torch.tensor(exact, dtype=torch.long), torch.tensor(rest, dtype=torch.long), beta)
    return parts, consts + tuple(x.float().contiguous() for x in (factor.W, factor.c, factor.c0))


def _state_weights(kernel) -> torch.Tensor:
    """The query side of Eq. 6 for the state, ``wq (K·G, D)`` fp32: read only by steps from a state, not from
    kept keys, so built apart from :func:`_constants` and only where a state is there (SmolLM2's 24 kernel layers:
    1.8 MB that a 1k context in the kept form never reads)."""
    return _cached(kernel, _STATE_WEIGHTS_ATTR, _build_state_weights)


def _build_state_weights(kernel) -> torch.Tensor:
    oal, _, _, _, kq = _parts(kernel)
    if not kq:
        return torch.empty(0, feature_dim(kernel.head_dim))
    _, groups, L = _kernel_query_heads(oal, kq)
    a, b, C = oal_coefficients(groups, L, oal.eps)
    return query_weights(a, b, C, kernel.scale).contiguous()


def _on_cpu(*tensors: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether every tensor is a CPU tensor of ``dtype`` (fp32 unless told)."""
    return all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


def _usable(kernel, q, k, v, *, any_length: bool = False) -> bool:
    """Whether :func:`decode_step` applies to a one-token call (or, with ``any_length``, would apply to the
    one-token steps after this call: the same kernel, devices, dtypes and autograd)."""
    if not isinstance(kernel, (OALKernel, SinkWindowKernel, ExactHeadsKernel)):
        return False
    if q.dim() != 4 or (q.shape[2] != 1 and not any_length) or not _on_cpu(q, k, v):
        return False
    if kept_form.needs_autograd(kernel, q, k, v):
        return False
    return cpu_kernel.load("decode") is not None


def prepare_decode(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: object = None) -> None:
    """Build the kernel's decode constants (:func:`_constants`) during a prompt (q ``(B, Hq, N, d)``) whose
    one-token steps will take :func:`decode_step`, so that the first step allocates no more than the later ones:
    built at the first step, their transients (index / gather / where over every query head, ~6 MB over
    SmolLM2's 30 layers) were that step's peak above the prompt's. Given the state the prompt left (``state``),
    also the state's query weights (:func:`_state_weights`) unless it is a kept form: a kept form's steps build
    them where they fold it, beside the state they allocate there."""
    if _usable(kernel, q, k, v, any_length=True):
        _constants(kernel)
        if state is not None and kept_form.kept_of(state) is None:
            _state_weights(kernel)


def _grown(x: torch.Tensor, used: int) -> torch.Tensor:
    """``x (B, E, cap, ·)`` (or an int8 cache's scales ``(B, E, cap)``) with room for slot ``used``: itself if it
    has it, else a copy of its first ``used`` slots in a buffer of ``used + GROWTH`` slots."""
    if x.shape[2] > used and x.is_contiguous():
        return x
    kept_form.note_regrown(x.nbytes)
    out = x.new_empty(x.shape[0], x.shape[1], used + GROWTH, *x.shape[3:])
    out[:, :, :used] = x[:, :, :used]
    return out


def _bounds(
    kernel: ExactHeadsKernel, state: ExactHeadsState, ex_k: torch.Tensor, ex_ks: torch.Tensor | None, past: int
) -> torch.Tensor:
    """The page bounds buffer of the exact keys ``ex_k`` (grown to their capacity) for slots below ``past``:
    the state's, or (a state from a path that keeps none) computed once from the keys."""
    page = kernel.decode_page
    if state.k_bounds is not None:
        return bounds_buffer(state.k_bounds, ex_k, page)
    bounds = bounds_buffer(None, ex_k, page)
    refresh_bounds(bounds, ex_k, ex_ks, 0, past, page)
    return bounds


def decode_step(
    kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: object, past: int, layer: int | None = None
):
    """One token: q ``(B, Hq, 1, d)``, k ``(B, Hkv, 1, d)``, v ``(B, Hkv, 1, dv)`` after ``past`` tokens whose
    state is ``state`` (as ``kernel.forward(..., output_final_state=True)`` returned it, or its kept form from
    :func:`oal.kernels.kept.start`; written in place).

    Returns ``(o (B, Hq, 1, dv), new state)`` equal to the kernel's recurrent step (the new state kept while
    the kept keys stay within :func:`oal.kernels.kept.fold_point` of the model's layer ``layer``, folded otherwise),
    or None when the fused path does not apply (see the module docstring)."""
    if state is None or not _usable(kernel, q, k, v):
        return None
    (oal, sw, _, rest, _), (exact_idx, kern_idx, beta, fw, fc, fc0) = _constants(kernel)
    inner = state.inner if isinstance(state, ExactHeadsState) else state
    if isinstance(inner, kept_form.KeptKV):
        if inner.length != past:
            return None
        limit = kept_form.fold_point(kernel, q.shape[-1], v.shape[-1], layer, inner.k.element_size())
        if past + 1 > limit:
            state = kept_form.fold(kernel, state)
            inner = state.inner if isinstance(state, ExactHeadsState) else state
        else:
            inner = kept_form.grown(inner, limit)
    ex_k = ex_v = ex_ks = ex_vs = ex_b = _EMPTY
    if isinstance(kernel, ExactHeadsKernel):
        if not isinstance(state, ExactHeadsState) or state.offset != past:
            return None
        ex_k, ex_v = _grown(state.k, past), _grown(state.v, past)
        # the exact heads' keys and values: fp32, bf16 or int8 with fp32 scales (kv_dtype)
        if not _on_cpu(ex_k, ex_v, dtype=kernel.kv_dtype or torch.float32):
            return None
        if kernel.kv_dtype == torch.int8:
            if state.k_scale is None or state.v_scale is None:
                return None
            ex_ks, ex_vs = _grown(state.k_scale, past), _grown(state.v_scale, past)
            if not _on_cpu(ex_ks, ex_vs):
                return None
        if kernel.decode_budget is not None:
            ex_b = _bounds(kernel, state, ex_k, ex_ks if kernel.kv_dtype == torch.int8 else None, past)
            if not _on_cpu(ex_b, dtype=torch.bfloat16):
                return None
    kept = isinstance(inner, kept_form.KeptKV)
    S = sink_k = sink_v = win_k = win_v = kept_k = kept_v = _EMPTY
    if rest and kept:
        kept_k, kept_v = inner.k, inner.v
        if not _on_cpu(kept_k, kept_v, dtype=kept_k.dtype) or kept_k.dtype not in (torch.float32, torch.bfloat16):
            return None
    elif rest:
        if sw is not None:
            if not isinstance(inner, SinkWindowState) or inner.offset != past:
                return None
            S, sink_k, sink_v, win_k, win_v = (t.contiguous() for t in inner[:5])
            if not _on_cpu(S, sink_k, sink_v, win_k, win_v):
                return None
        elif isinstance(inner, torch.Tensor) and _on_cpu(inner):
            S = inner.contiguous()
        else:
            return None
        if S.shape[2] != feature_dim(kernel.head_dim):
            return None
    wq = _state_weights(kernel) if rest and not kept else _EMPTY.view(0, 0)
    B, Hq, _, d = q.shape
    dv = v.shape[-1]
    out = q.new_empty(B, Hq, dv)
    cpu_kernel.load("decode").decode_step(
        q.reshape(B, Hq, d).contiguous(),
        k.reshape(B, -1, d).contiguous(),
        v.reshape(B, -1, dv).contiguous(),
        out,
        exact_idx,
        ex_k,
        ex_v,
        ex_ks,
        ex_vs,
        kern_idx,
        S,
        wq,
        beta,
        sink_k,
        sink_v,
        win_k,
        win_v,
        kept_k,
        kept_v,
        fw,
        fc,
        fc0,
        kept,
        past,
        sw.n_sink if sw is not None else 0,
        sw.window if sw is not None else 0,
        kernel.scale,
        oal.eps,
        sw is not None and (sw.n_sink > 0 or sw.window > 0),
        isinstance(kernel, ExactHeadsKernel) and kernel.product_dtype is not None,
        ex_b,
        kernel.decode_page if isinstance(kernel, ExactHeadsKernel) else 1,
        (kernel.decode_budget or 0) if isinstance(kernel, ExactHeadsKernel) else 0,
    )
    new_inner = None
    if rest and kept:
        new_inner = inner._replace(length=past + 1)
    elif rest:
        new_inner = SinkWindowState(S, sink_k, sink_v, win_k, win_v, past + 1) if sw is not None else S
    if isinstance(kernel, ExactHeadsKernel):
        scales = (ex_ks, ex_vs) if kernel.kv_dtype == torch.int8 else (None, None)
        bounds = ex_b if kernel.decode_budget is not None else None
        return out.view(B, Hq, 1, dv), ExactHeadsState(ex_k, ex_v, new_inner, past + 1, *scales, bounds)
    return out.view(B, Hq, 1, dv), new_inner


def softmax_decode_step(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int, scale: float
) -> torch.Tensor | None:
    """Exact causal softmax of one new query per row over the first ``length`` cached keys, the new one included:
    q ``(B, Hq, 1, d)``, ``k_buf (B, Hkv, capacity, d)`` / ``v_buf (B, Hkv, capacity, dv)`` contiguous buffers
    whose slot ``length - 1`` holds the new token (:class:`oal.models.state_cache.ExactKVLayer`). Returns
    ``o (B, Hq, 1, dv)``, what ``F.scaled_dot_product_attention`` gives over those keys (GQA: query head h uses
    KV head h // (Hq / Hkv)), or None where the fused path does not apply (not CPU fp32, autograd on, no
    extension, other shapes); the caller then runs SDPA.

    ``decode.cpp``'s exact-head step with every KV head exact: each key is read once for all query heads of its
    KV head, long contexts split into parts combined by their maxima. It rewrites slot ``length - 1`` from
    itself."""
    if q.dim() != 4 or q.shape[2] != 1 or k_buf.dim() != 4 or v_buf.dim() != 4 or length < 1:
        return None
    B, Hq, _, d = q.shape
    Hkv, cap, dv = k_buf.shape[1], k_buf.shape[2], v_buf.shape[3]
    if (
        not _on_cpu(q, k_buf, v_buf)
        or k_buf.shape[0] != B
        or k_buf.shape[3] != d
        or tuple(v_buf.shape[:3]) != (B, Hkv, cap)
        or Hkv == 0
        or Hq % Hkv
        or cap < length
        or not (k_buf.is_contiguous() and v_buf.is_contiguous())
        or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_buf, v_buf)))
    ):
        return None
    ext = cpu_kernel.load("decode")
    if ext is None:
        return None
    t = length - 1
    out = q.new_empty(B, Hq, dv)
    ext.decode_step(
        q.reshape(B, Hq, d).contiguous(),
        k_buf[:, :, t].contiguous(),
        v_buf[:, :, t].contiguous(),
        out,
        torch.arange(Hkv),
        k_buf,
        v_buf,
        _EMPTY,
        _EMPTY,
        torch.empty(0, dtype=torch.long),
        _EMPTY,
        _EMPTY.view(0, 0),
        _EMPTY,
        _EMPTY,
        _EMPTY,
        _EMPTY,
        _EMPTY,
        _EMPTY,
        _EMPTY,
        _EMPTY.view(0, 0, 0),
        _EMPTY.view(0, 0),
        _EMPTY,
        False,
        t,
        0,
        0,
        scale,
        0.0,
        False,
        False,
        _EMPTY,
        1,
        0,
    )
    return out.view(B, Hq, 1, dv)
