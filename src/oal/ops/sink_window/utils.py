"""Pieces shared by the evaluation modes of the sink/window operator: the decode state, input checks, and the
segment evaluation that ``chunk.py`` (blocks of queries, chunked kernel part) and ``recurrent.py`` (one query
at a time, recurrent kernel part) run.

Positions are global: a segment of N tokens that continues a state of ``offset = t0`` tokens holds the
positions ``t0 … t0+N-1``. For query i the exact set is ``E_i = {j ≤ i : j < n_sink or j > i - w}`` and the
kernel set ``K_i = {j : n_sink ≤ j ≤ i - w}``.

The kernel part is the plain quadratic operator run on keys delayed by w: with the "extended" key sequence
``ext = [window buffer (keys t0-w … t0-1); segment keys]`` (w + N entries, ext position p holding key
``t0 - w + p``), query r of the segment reads the delayed keys ``ext[0 … r]`` = keys ``… t0 + r - w``, and the
key weights ``ω_r = [t0 - w + r ≥ n_sink]`` drop the sinks and the padding before position 0. That keeps the
kernel part's state and cost exactly those of the plain operator.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..quadratic import KernelFactor, feature_dim, quadratic_attention
from ..quadratic import cpu as cpu_kernel
from ..quadratic.chunk import chunk_checked, head_rows, parallel_at_end
from ..quadratic.utils import Dims, _need_finite, _need_shape, _need_tensor, compute_dtype
from ..softmax import causal_softmax

MODES = ("naive", "chunk", "recurrent")


class SinkWindowState(NamedTuple):
    """Decoding state of the sink/window operator after ``offset`` tokens, per KV head (GQA: the query heads of a
    group share it). Its size does not depend on ``offset``:

    * ``kernel (B, Hkv, D, dv+1)``, D = 1 + d + d(d+1)/2: the packed quadratic state (Eq. 5) over the keys that
      have left the window, ``n_sink ≤ j ≤ offset - 1 - w``; accumulation dtype (fp32, fp64 for fp64 inputs).
    * ``sink_k (B, Hkv, n_sink, d)``, ``sink_v (B, Hkv, n_sink, dv)``: keys/values 0 … n_sink-1 (slots at or past
      ``offset`` are zero and unused); the inputs' dtype.
    * ``window_k (B, Hkv, w, d)``, ``window_v (B, Hkv, w, dv)``: keys/values ``offset-w … offset-1``, oldest
      first, zero-padded on the left while ``offset < w``; the inputs' dtype. (A slide by one token costs the
      same O(w) copy as a functional ring-buffer write, and the ordered layout is what a chunked continuation
      reads directly.)
    * ``offset``: tokens seen so far.

    Bytes per sequence: ``Hkv · [D·(dv+1)·4 + (n_sink + w)·(d + dv)·itemsize]`` (fp32 state), whatever the
    context length.
    """

    kernel: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    window_k: torch.Tensor
    window_v: torch.Tensor
    offset: int

    @property
    def nbytes(self) -> int:
        """Memory held by the tensors of this state."""
        return sum(t.numel() * t.element_size() for t in self[:5])


def check_config(n_sink: int, window: int) -> None:
    for name, x in (("n_sink", n_sink), ("window", window)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise ValueError(f"{name}: expected a non-negative integer, got {x!r}")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


def check_beta(beta: torch.Tensor, dims: Dims) -> None:
    """beta: ``(Hq,)`` finite per-head log-scale of the kernel part."""
    beta = _need_tensor("beta", beta)
    _need_shape("beta", beta, (dims.Hq,))
    _need_finite("beta", beta)


def check_state(
    state: SinkWindowState, dims: Dims, n_sink: int, window: int, dtype: torch.dtype, buffers_finite: bool = False
) -> None:
    """A state must come from the same configuration, batch, heads, head dims and input dtype (and, with
    ``buffers_finite``, hold finite sink and window keys and values)."""
    if not isinstance(state, SinkWindowState):
        raise ValueError(f"initial_state: expected a SinkWindowState, got {type(state).__name__}")
    B, _, Hkv, _, d, dv = dims
    _need_shape(
        "initial_state.kernel", _need_tensor("initial_state.kernel", state.kernel), (B, Hkv, feature_dim(d), dv + 1)
    )
    _need_finite("initial_state.kernel", state.kernel)
    for name, x, n, width in (
        ("sink_k", state.sink_k, n_sink, d),
        ("sink_v", state.sink_v, n_sink, dv),
        ("window_k", state.window_k, window, d),
        ("window_v", state.window_v, window, dv),
    ):
        _need_shape(f"initial_state.{name}", _need_tensor(f"initial_state.{name}", x), (B, Hkv, n, width))
        if x.dtype != dtype:
            raise ValueError(f"initial_state.{name}: expected dtype {dtype} like the keys, got {x.dtype}")
        if buffers_finite:
            _need_finite(f"initial_state.{name}", x)
    if not isinstance(state.offset, int) or isinstance(state.offset, bool) or state.offset < 0:
        raise ValueError(f"initial_state.offset: expected a non-negative integer, got {state.offset!r}")


class Segment(NamedTuple):
    """One segment's keys as the evaluation reads them (see the module docstring); inputs' dtype."""

    ext_k: torch.Tensor  # (B, Hkv, w + N, d)
    ext_v: torch.Tensor  # (B, Hkv, w + N, dv)
    sink_k: torch.Tensor  # (B, Hkv, n_sink, d), slots this segment reaches filled in
    sink_v: torch.Tensor  # (B, Hkv, n_sink, dv)
    offset: int


def prepare_segment(
    k: torch.Tensor, v: torch.Tensor, n_sink: int, window: int, state: SinkWindowState | None
) -> Segment:
    """The window buffer followed by the segment (``ext``), and the sink buffers with the sink positions this
    segment reaches filled in; a missing state is position 0 with empty (zero) buffers."""
    B, Hkv, N, _ = k.shape
    t0 = 0 if state is None else state.offset

    def buffers(x: torch.Tensor, sink: torch.Tensor | None, win: torch.Tensor | None):
        width = x.shape[-1]
        if sink is None:
            sink = x.new_zeros(B, Hkv, n_sink, width)
            win = x.new_zeros(B, Hkv, window, width)
        kept = min(t0, n_sink)
        new = min(n_sink, t0 + N) - kept  # sink slots this segment fills
        sink = torch.cat([sink[:, :, :kept], x[:, :, :new], sink[:, :, kept + new :]], dim=2)
        return torch.cat([win, x], dim=2), sink

    ext_k, sink_k = buffers(k, *((None, None) if state is None else (state.sink_k, state.window_k)))
    ext_v, sink_v = buffers(v, *((None, None) if state is None else (state.sink_v, state.window_v)))
    return Segment(ext_k, ext_v, sink_k, sink_v, t0)


def evaluate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    C: torch.Tensor,
    beta: torch.Tensor,
    *,
    dims: Dims,
    n_sink: int,
    window: int,
    scale: float,
    kernel_mode: str,
    block: int,
    chunk_size: int,
    initial_state: SinkWindowState | None,
    output_final_state: bool,
    factor: KernelFactor | None,
    kernel_floor: float | None,
) -> tuple[torch.Tensor, SinkWindowState | None]:
    """One segment: the kernel part through the quadratic operator (``kernel_mode``), then the exact part and
    the combination for blocks of ``block`` queries. Inputs are validated by the caller. A fresh segment in chunk mode
    that no kernel key reaches (:func:`all_exact`) is causal softmax (:func:`exact_segment`)."""
    if kernel_mode == "chunk" and all_exact(dims.N, n_sink, window, initial_state, beta):
        return exact_segment(q, k, v, dims, n_sink, window, scale, output_final_state)
    B, Hq, Hkv, N, d, dv = dims
    G = dims.group
    w = window
    cdt = compute_dtype(q.dtype)
    seg = prepare_segment(k, v, n_sink, w, initial_state)
    t0 = seg.offset
    ext_k, ext_v = seg.ext_k.to(cdt), seg.ext_v.to(cdt)
    qc = q.to(cdt)

    # kernel part over K_i: the plain operator on the delayed keys ext[0 … N-1] with the sinks/padding removed.
    # Key p of ext is position t0 - w + p, in the kernel set iff p ≥ i0; query i reads keys p ≤ i, so queries
    # before i0 (a fresh prompt's first n_sink + w) have none and the operator runs on queries/keys i0 … N-1 only
    # (before i0 no key has entered the state, so the initial state is still the one to continue).
    key_weight = (torch.arange(N, device=q.device) + (t0 - w) >= n_sink).to(cdt).expand(B, Hkv, N)
    i0 = min(N, max(0, n_sink + w - t0))
    if i0 < N and kernel_mode == "chunk":  # inputs checked by chunk_sink_window_attention
        o_kern, den, kernel_state = chunk_checked(
            qc[:, :, i0:],
            ext_k[:, :, i0:N],
            ext_v[:, :, i0:N],
            a,
            b,
            C,
            Dims(B, Hq, Hkv, N - i0, d, dv),
            scale,
            chunk_size,
            None if initial_state is None else initial_state.kernel,
            output_final_state,
            factor,
            kernel_floor,
            key_weight[:, :, i0:],
            True,
        )
    elif i0 < N:
        o_kern, den, kernel_state = quadratic_attention(
            qc[:, :, i0:],
            ext_k[:, :, i0:N],
            ext_v[:, :, i0:N],
            a,
            b,
            C,
            scale=scale,
            mode=kernel_mode,
            chunk_size=chunk_size,
            initial_state=None if initial_state is None else initial_state.kernel,
            output_final_state=output_final_state,
            factor=factor,
            kernel_floor=kernel_floor,
            key_weight=key_weight[:, :, i0:],
            return_denominator=True,
        )
    else:
        o_kern, den = qc.new_zeros(B, Hq, 0, dv), qc.new_zeros(B, Hq, 0)
        kernel_state = None
        if output_final_state:
            kernel_state = (
                initial_state.kernel.clone()
                if initial_state is not None
                else qc.new_zeros(B, Hkv, feature_dim(d), dv + 1)
            )
    if i0:  # no kernel keys: output and denominator 0 (log_mass below is then -inf)
        o_kern = torch.cat([o_kern.new_zeros(B, Hq, i0, dv), o_kern], dim=2)
        den = torch.cat([den.new_zeros(B, Hq, i0), den], dim=2)
    count = key_weight.cumsum(-1)  # kernel keys each query sees, (B, Hkv, N)
    if initial_state is not None:
        count = count + initial_state.kernel[:, :, :1, dv].to(cdt)
    log_mass = _log_mass(beta.to(cdt).view(Hkv, G, 1), den.view(B, Hkv, G, N), count[:, :, None])
    o_kern = o_kern.view(B, Hkv, G, N, dv)

    if n_sink == 0 and w == 0:
        o = o_kern  # no exact set: the plain kernel, whatever β
    elif _fused_window_usable(qc, ext_k, ext_v, log_mass, o_kern):
        inputs = (
            qc.reshape(B, Hkv, G, N, d).contiguous(),
            ext_k.contiguous(),
            ext_v.contiguous(),
            seg.sink_k.to(cdt).contiguous(),
            seg.sink_v.to(cdt).contiguous(),
            log_mass.contiguous(),
            o_kern.contiguous(),
        )
        ext = cpu_kernel.load("window")
        if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
            o = _FusedWindow.apply(*inputs, t0, n_sink, w, scale, ext)
        else:
            # without autograd the combination overwrites the kernel part's output (fresh here, its own buffer):
            # window.cpp reads each row of o_kern just before it writes that row, so one (B, Hq, N, dv) buffer
            # fewer is live at a prompt's peak
            o = inputs[-1]
            ext.window_combine(*inputs, o, t0, n_sink, w, scale)
    else:
        q_groups = qc.view(B, Hkv, G, N, d)
        sink_k, sink_v = seg.sink_k.to(cdt), seg.sink_v.to(cdt)
        outs = []
        for start in range(0, N, block):
            end = min(start + block, N)
            keys, vals, mask = _exact_keys(ext_k, ext_v, sink_k, sink_v, start, end, t0, n_sink, w)
            outs.append(
                combine(
                    q_groups[:, :, :, start:end],
                    keys,
                    vals,
                    mask,
                    scale,
                    log_mass[..., start:end],
                    o_kern[:, :, :, start:end],
                )
            )
        o = torch.cat(outs, dim=3)
    o = o.reshape(B, Hq, N, dv).to(q.dtype)
    return o, _final_state(seg, kernel_state, N) if output_final_state else None


def _final_state(seg: Segment, kernel_state: torch.Tensor, N: int) -> SinkWindowState:
    """The state after a segment of N tokens read as ``seg``, with the kernel part's state ``kernel_state``."""
    return SinkWindowState(
        kernel=kernel_state,
        sink_k=seg.sink_k,
        sink_v=seg.sink_v,
        window_k=seg.ext_k[:, :, N:].clone(),
        window_v=seg.ext_v[:, :, N:].clone(),
        offset=seg.offset + N,
    )


def all_exact(
    n: int, n_sink: int, window: int, initial_state: SinkWindowState | None, beta: torch.Tensor | None = None
) -> bool:
    """Whether a segment of ``n ≥ 1`` tokens has no kernel key for any query because it starts the sequence (no
    ``initial_state``) and ends before position ``n_sink + window``: ``K_i = {n_sink ≤ j ≤ i - w}`` is empty for
    every ``i < n_sink + w``, and ``E_i`` is then every key up to i. The operator is causal softmax there (β, the
    kernel and its coefficients drop out), which :func:`exact_segment` evaluates — the chunk mode, and the
    sink/window and exact-heads kernels without computing their coefficients. False where ``beta`` (the β in use)
    records a gradient: the blockwise evaluation gives it a zero gradient, which a training loop may count on."""
    beta_grad = beta is not None and torch.is_grad_enabled() and beta.requires_grad
    return initial_state is None and 0 < n <= n_sink + window and not beta_grad


def exact_segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dims: Dims,
    n_sink: int,
    window: int,
    scale: float,
    output_final_state: bool,
) -> tuple[torch.Tensor, SinkWindowState | None]:
    """The operator on a segment where :func:`all_exact` holds: ``(o (B, Hq, N, dv)`` in q's dtype, the state after
    it)``, o being causal softmax in the accumulation dtype (:func:`oal.ops.softmax.causal_softmax`: one fused call
    on CPU fp32, SDPA otherwise) — the outputs of the blockwise evaluation up to rounding, without its kernel part
    (empty), log-masses (-∞) and windows of zeros. The state: sinks and window as the blockwise evaluation leaves
    them, an empty kernel state. Inputs validated by the caller."""
    cdt = compute_dtype(q.dtype)
    o = causal_softmax(q.to(cdt), k.to(cdt), v.to(cdt), scale).to(q.dtype)
    if not output_final_state:
        return o, None
    B, _, Hkv, N, d, dv = dims
    seg = prepare_segment(k, v, n_sink, window, None)
    return o, _final_state(seg, q.new_zeros(B, Hkv, feature_dim(d), dv + 1, dtype=cdt), N)


def _log_mass(beta: torch.Tensor, den: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The log of the kernel part's mass ``e^β Σ_K κ`` ``(B, Hkv, G, N)`` from its denominators ``den`` and the
    number of kernel keys each query sees ``count`` (broadcast to den); -inf where K_i is empty (that part then
    contributes nothing)."""
    return torch.where(
        count > 0,
        beta + torch.log(torch.where(count > 0, den, torch.ones_like(den))),
        torch.full_like(den, -math.inf),
    )


def evaluate_at_end(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    C: torch.Tensor,
    beta: torch.Tensor,
    *,
    n_sink: int,
    window: int,
    scale: float,
    factor: KernelFactor | None,
    kernel_floor: float | None,
) -> torch.Tensor | None:
    """Queries ``q (B, Hq, n, d)`` that are the last n of the N positions of ``k (B, Hkv, N, d)``, ``v``, without a
    state: ``o (B, Hq, n, dv)`` in q's dtype, the rows one call over all N positions gives them (a prompt's later
    chunk over the keys kept before it, :mod:`oal.kernels.kept`). The kernel part is the quadratic operator's
    parallel form on the delayed keys (:func:`oal.ops.quadratic.chunk.parallel_at_end`), the exact part the fused
    window kernel continuing at position N - n, its sinks and window taken from the keys before. None where the
    fused kernels do not apply (autograd, not CPU, no fused kernel): the caller evaluates otherwise."""
    B, Hq, n, d = q.shape
    Hkv, N, dv = k.shape[1], k.shape[2], v.shape[-1]
    G, w, past = Hq // Hkv, window, N - n
    f32 = torch.float32
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, a, b, C, beta)):
        return None
    qc, kc, vc = q.to(f32), head_rows(k.to(f32)), head_rows(v.to(f32))  # the kernels read k and v in place
    if not _fused_window_usable(qc, kc, vc):
        return None
    # kernel part: query at position past + r reads the keys at positions n_sink … past + r - w, i.e. the delayed
    # keys 0 … N - w - 1 (those below n_sink weigh 0) aligned at the end, for the rows r ≥ first that have any
    first = min(n, max(0, w - past))
    if first < n:
        weight = (torch.arange(N - w, device=q.device) >= n_sink).to(f32)
        part = parallel_at_end(
            qc[:, :, first:], kc[:, :, : N - w], vc[:, :, : N - w], a, b, C, scale, factor, kernel_floor,
            weight.expand(B, Hkv, N - w),
        )  # fmt: skip
        if part is None:
            return None
    if first == 0 and n:  # every row has kernel keys: the parallel form's outputs are the kernel part as they are
        o_kern, den = part[0].view(B, Hkv, G, n, dv), part[1]
        count = weight.cumsum(0)[past - w :].view(1, 1, 1, n)
    else:
        o_kern = qc.new_zeros(B, Hkv, G, n, dv)
        den = qc.new_zeros(B, Hkv, G, n)
        count = qc.new_zeros(B, Hkv, 1, n)
        if first < n:
            o_kern[:, :, :, first:] = part[0].view(B, Hkv, G, n - first, dv)
            den[:, :, :, first:] = part[1]
            count[..., first:] = weight.cumsum(0)[past + first - w :]
    if n_sink == 0 and w == 0:  # no exact set: the plain kernel, whatever β
        return o_kern.reshape(B, Hq, n, dv).to(q.dtype)
    log_mass = _log_mass(beta.to(f32).view(Hkv, G, 1), den, count)
    # exact part: the segment continues from the sinks (zeros past the keys) and the window buffer (the w keys
    # before it, zeros before position 0) followed by its own keys, as prepare_segment lays them out
    sinks = [x.new_zeros(B, Hkv, n_sink, x.shape[-1]) for x in (kc, vc)]
    m = min(n_sink, N)
    for sink, x in zip(sinks, (kc, vc), strict=True):
        sink[:, :, :m] = x[:, :, :m]
    if past >= w:  # the window buffer and the segment are the last w + n keys: read in place
        ext = [x[:, :, past - w :] for x in (kc, vc)]
    else:
        ext = [x.new_zeros(B, Hkv, w + n, x.shape[-1]) for x in (kc, vc)]
        for buf, x in zip(ext, (kc, vc), strict=True):
            buf[:, :, w - past :] = x
    qg = qc.reshape(B, Hkv, G, n, d).contiguous()
    cpu_kernel.load("window").window_combine(
        qg, ext[0], ext[1], sinks[0], sinks[1], log_mass.contiguous(), o_kern, o_kern, past, n_sink, w, scale
    )
    return o_kern.reshape(B, Hq, n, dv).to(q.dtype)


def _fused_window_usable(*tensors: torch.Tensor) -> bool:
    """Whether the exact part can run on the fused CPU kernel (``window.cpp``): CPU fp32, the extension available."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return False
    return cpu_kernel.load("window") is not None


class _FusedWindow(torch.autograd.Function):
    """The exact part and the combination (:func:`combine` over every block) on ``window.cpp``: forward
    ``window_combine``, backward ``window_backward`` (each block's weights recomputed, nothing stored but the
    inputs and the output). Shapes as :func:`combine`'s for the whole segment: q ``(B, Hkv, G, N, d)``, ext_k / ext_v
    ``(B, Hkv, w + N, ·)``, sink_k / sink_v ``(B, Hkv, n_sink, ·)``, log_mass ``(B, Hkv, G, N)``, o_kern
    ``(B, Hkv, G, N, dv)``; all contiguous CPU fp32. Not twice differentiable."""

    @staticmethod
    def forward(ctx, q, ext_k, ext_v, sink_k, sink_v, log_mass, o_kern, t0, n_sink, w, scale, ext):
        out = torch.empty_like(o_kern)
        ext.window_combine(q, ext_k, ext_v, sink_k, sink_v, log_mass, o_kern, out, t0, n_sink, w, scale)
        ctx.save_for_backward(q, ext_k, ext_v, sink_k, sink_v, log_mass, o_kern, out)
        ctx.config = (t0, n_sink, w, scale, ext)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        t0, n_sink, w, scale, ext = ctx.config
        grads = ext.window_backward(*ctx.saved_tensors, d_out.contiguous(), t0, n_sink, w, scale)
        return (*grads, None, None, None, None, None)


def _exact_keys(
    ext_k: torch.Tensor,
    ext_v: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    start: int,
    end: int,
    t0: int,
    n_sink: int,
    w: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidate exact keys ``(B, Hkv, L, ·)`` of the queries ``start … end-1`` (segment-relative) and the mask
    ``(n, L)`` of the ones in each query's E_i: the sinks j ≤ i, then the ext positions ``start+1 … end-1+w``,
    of which query r takes ``r < p ≤ r + w`` with key index ``t0 - w + p ≥ n_sink`` (a sink in the window is
    counted once, as a sink; padding before position 0 is never taken)."""
    dev = ext_k.device
    r = torch.arange(start, end, device=dev)[:, None]
    keys, vals, masks = [], [], []
    if n_sink:
        keys.append(sink_k)
        vals.append(sink_v)
        masks.append(torch.arange(n_sink, device=dev)[None, :] <= r + t0)
    if w:
        p = torch.arange(start + 1, end + w, device=dev)[None, :]
        keys.append(ext_k[:, :, start + 1 : end + w])
        vals.append(ext_v[:, :, start + 1 : end + w])
        masks.append((p > r) & (p <= r + w) & (p >= n_sink + w - t0))
    if len(keys) == 1:
        return keys[0], vals[0], masks[0]
    return torch.cat(keys, dim=2), torch.cat(vals, dim=2), torch.cat(masks, dim=1)


def combine(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    log_mass: torch.Tensor,
    o_kern: torch.Tensor,
) -> torch.Tensor:
    """Exact part plus kernel part in one normalisation, for a block of queries.

    q ``(B, Hkv, G, n, d)``, keys ``(B, Hkv, L, d)``, vals ``(B, Hkv, L, dv)``, mask ``(n, L)``,
    log_mass ``(B, Hkv, G, n)`` = ``β_h + log Σ_{K_i} κ_ij`` (-inf for an empty K_i),
    o_kern ``(B, Hkv, G, n, dv)`` the normalised kernel output. With ``M_i = max(max_{E_i} s_ij, log_mass_i)``
    every exponential below is ≤ 1 and the denominator is ≥ 1 (the term attaining M_i is 1), so nothing
    overflows and nothing divides by zero; M_i cancels, so it is detached.
    """
    B, Hkv, G, n, d = q.shape
    L = keys.shape[2]
    logits = (q.reshape(B, Hkv, G * n, d) @ keys.mT).view(B, Hkv, G, n, L) * scale
    logits = logits.masked_fill(~mask, -math.inf)
    M = torch.maximum(logits.amax(-1), log_mass).detach()
    p = torch.exp(logits - M[..., None])
    kern_scale = torch.exp(log_mass - M)
    den = p.sum(-1) + kern_scale
    num = (p.view(B, Hkv, G * n, L) @ vals).view(B, Hkv, G, n, -1) + kern_scale[..., None] * o_kern
    return num / den[..., None]
