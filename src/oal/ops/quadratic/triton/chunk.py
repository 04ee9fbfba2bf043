"""Chunked quadratic-kernel attention on Triton: the same contract as :func:`oal.ops.chunk_quadratic_attention`.

Forward, per window of chunks (fla's ``chunk_fwd_h`` / ``chunk_fwd_o`` split):

1. ``chunk_fwd_h`` passes the fp32 state across the window's chunks, one program per (feature block, dv block,
   KV head) holding its state tile in registers (plus one per block for the count column), and writes a
   snapshot of the state before every chunk (in the dot dtype: bf16 for half inputs). This is the only
   sequential loop; it runs (2 + ⌊d/2⌋ + 1)·(dv blocks + 1)·B·Hkv programs side by side (105 per KV head at
   d = dv = 64), and its GEMMs are ``[block, chunk] @ [chunk, dv block]``. On CUDA it runs on a side stream,
   one window ahead of the readout, into two alternating snapshot buffers.
2. ``chunk_fwd_o`` computes every chunk of every query head in parallel: ``[chunk, block] @ [block, dv]``
   readouts of the snapshot over all feature blocks (the query features never touch memory), the exact
   within-chunk kernel, and the normalisation. The G query heads of a KV head run as neighbouring programs, so
   each snapshot is read from HBM once and from L2 by the rest of the group.

Why snapshots and not one sequential program per KV head: the state is ``D·(dv+1)`` fp32 (558 KB at d = 64),
too large for one SM, and B·Hkv is tiny (2 in the benchmark), so a per-head loop would use 2 of 132 SMs.
Snapshots trade memory for parallelism; to bound it, the sequence is cut into windows whose snapshots fit
``snapshot_budget`` bytes, the fp32 state carrying over between windows.

Backward recomputes the snapshots window by window from saved window-start states (a few states, not one per
chunk), runs the reverse state pass ``chunk_bwd_dh`` (dS_c summed over the G query heads), then ``chunk_bwd_dq``
and ``chunk_bwd_dkv``. Only ``o``, the fp32 denominators ``(B, Hq, N)`` and the window-start states are kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..utils import (
    KernelFactor,
    check_coefficients,
    check_factor,
    check_floor,
    check_qkv,
    check_state,
    default_scale,
    query_weights,
)
from .utils import (
    Consts,
    accum_dtype,
    block_table,
    block_weights,
    consts,
    last_dim_contiguous,
    snapshot_dtype,
    snapshot_rows,
    strides3,
    unsupported_reason,
)

#: Default bound on the per-chunk state snapshots of one window (forward; twice this in backward).
DEFAULT_SNAPSHOT_BUDGET = 64 * 2**20


class _Cfg(NamedTuple):
    chunk: int
    floor: float | None
    budget: int


def _kernels():
    from . import kernels

    return kernels


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _state_block_v(cst: Consts, programs_per_v: int, device: torch.device) -> int:
    """dv tile of the state-passing kernels: split dv until the grid covers the GPU twice (min 32 wide)."""
    bv = cst.BV
    while bv > 32 and programs_per_v * math.ceil(cst.DV / bv) < 2 * _num_sms(device):
        bv //= 2
    return bv


def window_chunks(
    B: int, Hkv: int, d: int, dv: int, n_chunks: int, dtype: torch.dtype, budget: int, backward: bool
) -> int:
    """Chunks per window so that one window's snapshots (two sets in backward) stay within ``budget`` bytes;
    windows are balanced so the last one is not a sliver."""
    rows = snapshot_rows(d)
    per_chunk = B * Hkv * rows * (dv * snapshot_dtype(dtype).itemsize + accum_dtype(dtype).itemsize)
    per_chunk *= 2 if backward else 1
    # kernels index a window's snapshots with int32 offsets
    most = max(1, min(budget // per_chunk, (2**31 - 1) // (rows * max(dv, 1))))
    windows = math.ceil(n_chunks / most)
    return math.ceil(n_chunks / windows)


@dataclass
class LaunchConfig:
    """Warps and pipeline stages of the chunked kernels (None: by chunk size), and whether the forward overlaps
    a window's state passing with the previous window's readout on a second CUDA stream. Results never depend
    on these; ``benchmarks/gpu_check.py`` sets them while it tunes."""

    fwd_o_warps: int | None = None
    fwd_o_stages: int = 2
    fwd_h_warps: int = 4
    fwd_h_stages: int = 3
    bwd_warps: int | None = None
    overlap: bool = True


LAUNCH = LaunchConfig()


def _warps(BT: int, dtype: torch.dtype) -> int:
    if LAUNCH.fwd_o_warps is not None:
        return LAUNCH.fwd_o_warps
    # fp32 tiles take twice the registers of bf16 ones
    return 4 if BT <= 64 and dtype != torch.float32 else 8


def _bwd_warps(BT: int) -> int:
    if LAUNCH.bwd_warps is not None:
        return LAUNCH.bwd_warps
    # the backward programs hold ~8 [BT, BK] fp32 tiles at once
    return 4 if BT <= 32 else 8


def _launch_fwd_h(k, v, tab, state, h, hden, t0: int, N: int, nc: int, BT: int, cst: Consts) -> None:
    B, Hkv = k.shape[:2]
    bv = _state_block_v(cst, cst.NBLK * B * Hkv, k.device)
    nv = math.ceil(cst.DV / bv)
    grid = (cst.NBLK, nv + 1, B * Hkv)  # the extra dv block carries the denominator column
    _kernels().chunk_fwd_h[grid](
        k,
        v,
        tab,
        state,
        h,
        hden,
        *strides3(k),
        *strides3(v),
        t0,
        N,
        nc,
        Hkv,
        D_HEAD=cst.D_HEAD,
        DV=cst.DV,
        D_FEAT=cst.D_FEAT,
        NBLK=cst.NBLK,
        BT=BT,
        BK=cst.BK,
        BV=bv,
        NV=nv,
        DT=cst.DT,
        ADT=cst.ADT,
        INTERP=cst.INTERP,
        num_warps=LAUNCH.fwd_h_warps,
        num_stages=LAUNCH.fwd_h_stages,
    )


def _launch_fwd_o(q, k, v, qwb, fac, h, hden, o, den, t0, N, nc, BT, floor, cst: Consts, *, intra: bool = True) -> None:
    B, Hq = q.shape[:2]
    G = Hq // k.shape[1]
    c0, fc, fw = fac if fac is not None else (qwb, qwb, qwb)
    R = fc.shape[-1] if fac is not None else 0
    _kernels().chunk_fwd_o[(B * Hq, nc)](
        q,
        k,
        v,
        qwb,
        c0,
        fc,
        fw,
        h,
        hden,
        o,
        den if den is not None else o,
        *strides3(q),
        *strides3(k),
        *strides3(v),
        *strides3(o),
        t0,
        N,
        nc,
        Hq,
        G,
        R,
        float(floor or 0.0),
        D_HEAD=cst.D_HEAD,
        DV=cst.DV,
        NBLK=cst.NBLK,
        BT=BT,
        BK=cst.BK,
        BV=cst.BV,
        FACTOR=fac is not None,
        INTRA=intra,
        HAS_FLOOR=floor is not None,
        STORE_DEN=den is not None,
        DT=cst.DT,
        ADT=cst.ADT,
        INTERP=cst.INTERP,
        num_warps=_warps(BT, q.dtype),
        num_stages=LAUNCH.fwd_o_stages,
    )


def _windows(N: int, BT: int, wc: int) -> list[tuple[int, int]]:
    """(first token, chunks) of each window."""
    n_chunks = math.ceil(N / BT)
    return [(c * BT, min(wc, n_chunks - c)) for c in range(0, n_chunks, wc)]


def _snapshots(B: int, Hkv: int, wc: int, cst: Consts, dtype: torch.dtype, device: torch.device):
    """Block-ordered snapshot buffers of one window: ``h`` (dot dtype) and ``hden`` (fp32)."""
    rows = B * Hkv * wc * cst.NBLK * cst.BK
    h = torch.empty(rows * cst.DV, dtype=snapshot_dtype(dtype), device=device)
    return h, torch.empty(rows, dtype=accum_dtype(dtype), device=device)


def _forward(q, k, v, qwb, fac, init, cfg: _Cfg, keep: bool):
    """Windows of state passing then readout. On CUDA with several windows (and ``LAUNCH.overlap``), state
    passing runs on a side stream into two alternating snapshot buffers, so that window w+1's sequential chunk
    loop (a few hundred programs) overlaps window w's readout instead of leaving the GPU mostly idle."""
    B, Hq, N, d = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    cst = consts(d, dv, q.dtype)
    adt = accum_dtype(q.dtype)
    BT = cfg.chunk
    state = torch.zeros(B, Hkv, cst.D_FEAT, dv + 1, dtype=adt, device=q.device)
    if init is not None:
        state.copy_(init)
    o = torch.empty(B, Hq, N, dv, dtype=q.dtype, device=q.device)
    den = torch.empty(B, Hq, N, dtype=adt, device=q.device) if keep else None
    tab = block_table(d, q.device)
    n_chunks = math.ceil(N / BT)
    # with a backward to come, windows are sized for it (two snapshot sets) so its windows are these
    wc = window_chunks(B, Hkv, d, dv, n_chunks, q.dtype, cfg.budget, backward=keep)
    overlap = q.is_cuda and LAUNCH.overlap and wc < n_chunks
    if overlap:  # two buffers in the same budget
        wc = window_chunks(B, Hkv, d, dv, n_chunks, q.dtype, max(1, cfg.budget // 2), backward=keep)
    windows = _windows(N, BT, wc)
    bufs = [_snapshots(B, Hkv, wc, cst, q.dtype, q.device) for _ in range(2 if overlap else 1)]
    starts = []
    if not overlap:
        h, hden = bufs[0]
        for t0, nc in windows:
            if keep:
                starts.append(state.clone())
            _launch_fwd_h(k, v, tab, state, h, hden, t0, N, nc, BT, cst)
            _launch_fwd_o(q, k, v, qwb, fac, h, hden, o, den, t0, N, nc, BT, cfg.floor, cst)
        return o, state, den, starts, wc
    main = torch.cuda.current_stream(q.device)
    side = _side_stream(q.device)
    side.wait_stream(main)  # inputs and the initial state are ready
    freed = [None, None]  # per buffer: event after the readout that last read it
    for w, (t0, nc) in enumerate(windows):
        h, hden = bufs[w % 2]
        with torch.cuda.stream(side):
            if freed[w % 2] is not None:
                side.wait_event(freed[w % 2])
            if keep:
                start = state.clone()
                start.record_stream(main)
                starts.append(start)
            _launch_fwd_h(k, v, tab, state, h, hden, t0, N, nc, BT, cst)
            ready = torch.cuda.Event()
            ready.record(side)
        main.wait_event(ready)
        _launch_fwd_o(q, k, v, qwb, fac, h, hden, o, den, t0, N, nc, BT, cfg.floor, cst)
        freed[w % 2] = torch.cuda.Event()
        freed[w % 2].record(main)
    main.wait_stream(side)
    return o, state, den, starts, wc


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _backward(q, k, v, qwb, fac, o, den, starts, wc: int, do, dfinal, cfg: _Cfg):
    """Gradients, window by window in reverse, with the forward's windows (``wc`` chunks each)."""
    B, Hq, N, d = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    G = Hq // Hkv
    cst = consts(d, dv, q.dtype)
    adt = accum_dtype(q.dtype)
    BT = cfg.chunk
    kern = _kernels()
    dev = q.device

    # dU_i = [do_i / den_i, δ_i]: δ is the denominator's gradient, zero where the floor clamp is active
    do = last_dim_contiguous(do)
    if cfg.floor is not None:
        seen = starts[0][:, :, 0, dv].repeat_interleave(G, dim=1)  # keys before this segment, per query head
        bound = cfg.floor * (seen[..., None] + torch.arange(1, N + 1, device=dev, dtype=adt))
        den_c = torch.maximum(den, bound)
        live = den >= bound
    else:
        den_c, live = den, None
    delta = -(do.to(adt) * o.to(adt)).sum(-1) / den_c
    if live is not None:
        delta = torch.where(live, delta, torch.zeros_like(delta))
    den_c = den_c.contiguous()

    dstate = torch.zeros(B, Hkv, cst.D_FEAT, dv + 1, dtype=adt, device=dev)
    if dfinal is not None:
        dstate.copy_(dfinal)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv_ = torch.empty_like(v)
    dqwb = torch.zeros(qwb.shape, dtype=adt, device=dev)
    if fac is not None:
        c0, fc, fw = fac
        dfac = tuple(torch.zeros(x.shape, dtype=adt, device=dev) for x in fac)
        R = fc.shape[-1]
    else:
        c0 = fc = fw = qwb
        dfac = (dqwb, dqwb, dqwb)  # never written: FACTOR=False
        R = 0

    h, hden = _snapshots(B, Hkv, wc, cst, q.dtype, dev)
    dh, dhden = _snapshots(B, Hkv, wc, cst, q.dtype, dev)
    bv = _state_block_v(cst, cst.NBLK * B * Hkv, dev)
    tab = block_table(d, dev)
    shape = dict(D_HEAD=cst.D_HEAD, DV=cst.DV, NBLK=cst.NBLK, BT=BT, BK=cst.BK, DT=cst.DT, ADT=cst.ADT)
    warps = _bwd_warps(BT)
    windows = _windows(N, BT, wc)
    if len(windows) != len(starts):
        raise RuntimeError(f"backward windows ({len(windows)}) do not match the forward's ({len(starts)})")
    for (t0, nc), start in zip(reversed(windows), reversed(starts), strict=True):
        state = start.clone()
        _launch_fwd_h(k, v, tab, state, h, hden, t0, N, nc, BT, cst)
        kern.chunk_bwd_dh[(cst.NBLK, math.ceil(dv / bv), B * Hkv)](
            q,
            tab,
            qwb,
            do,
            den_c,
            delta,
            dstate,
            dh,
            dhden,
            *strides3(q),
            *strides3(do),
            t0,
            N,
            nc,
            Hkv,
            G,
            D_FEAT=cst.D_FEAT,
            BV=bv,
            INTERP=cst.INTERP,
            num_warps=8,
            **shape,
        )
        kern.chunk_bwd_dq[(B * Hq, nc)](
            q,
            k,
            v,
            qwb,
            c0,
            fc,
            fw,
            h,
            hden,
            do,
            den_c,
            delta,
            dq,
            dqwb,
            *dfac,
            *strides3(q),
            *strides3(k),
            *strides3(v),
            *strides3(do),
            *strides3(dq),
            t0,
            N,
            nc,
            Hq,
            G,
            R,
            BV=cst.BV,
            FACTOR=fac is not None,
            INTERP=cst.INTERP,
            num_warps=warps,
            **shape,
        )
        kern.chunk_bwd_dkv[(B * Hkv, nc)](
            q,
            k,
            v,
            qwb,
            c0,
            fc,
            fw,
            dh,
            dhden,
            do,
            den_c,
            delta,
            dk,
            dv_,
            *strides3(q),
            *strides3(k),
            *strides3(v),
            *strides3(do),
            *strides3(dk),
            *strides3(dv_),
            t0,
            N,
            nc,
            Hkv,
            G,
            R,
            BV=cst.BV,
            FACTOR=fac is not None,
            INTERP=cst.INTERP,
            num_warps=warps,
            **shape,
        )
    return dq, dk, dv_, dqwb, (dfac if fac is not None else None), dstate


class ChunkQuadraticFunction(torch.autograd.Function):
    """Autograd wrapper: inputs ``q, k, v``, the block-ordered query weights ``qwb (Hq, NBLK·BK)`` (Eq. 6, see
    :func:`.utils.block_weights`), the factor ``(c0, c, scale·W)`` or Nones, and the initial state; outputs ``o``
    and the final state."""

    @staticmethod
    def forward(ctx, q, k, v, qwb, c0, fc, fw, init, cfg: _Cfg):
        fac = None if c0 is None else (c0, fc, fw)
        keep = any(ctx.needs_input_grad)
        o, final, den, starts, wc = _forward(q, k, v, qwb, fac, init, cfg, keep)
        if keep:
            ctx.save_for_backward(q, k, v, qwb, c0, fc, fw, o, den, *starts)
            ctx.cfg = cfg
            ctx.window_chunks = wc
            ctx.init_dtype = None if init is None else init.dtype
        ctx.set_materialize_grads(False)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, qwb, c0, fc, fw, o, den, *starts = ctx.saved_tensors
        fac = None if c0 is None else (c0, fc, fw)
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv, dqwb, dfac, dstate = _backward(
            q, k, v, qwb, fac, o, den, starts, ctx.window_chunks, do, dfinal, ctx.cfg
        )
        dc0, dfc, dfw = (None, None, None) if dfac is None else (x.to(y.dtype) for x, y in zip(dfac, fac, strict=True))
        dinit = None if ctx.init_dtype is None else dstate.to(ctx.init_dtype)
        return dq, dk, dv, dqwb.to(qwb.dtype), dc0, dfc, dfw, dinit, None


def chunk_quadratic_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    C: torch.Tensor,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    factor: KernelFactor | None = None,
    kernel_floor: float | None = None,
    snapshot_budget: int = DEFAULT_SNAPSHOT_BUDGET,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked causal quadratic-kernel attention on Triton; arguments and results as in
    :func:`oal.ops.quadratic_attention` (``mode="chunk"``).

    ``chunk_size`` must be one of :data:`CHUNK_SIZES`; it need not divide N. ``snapshot_budget`` bounds the bytes
    of per-chunk state snapshots held at once (the sequence is processed in windows that fit it; results do
    not depend on it). Differentiable in q, k, v, a, b, C, the factor and the initial state; the final state is
    fp32 (fp64 for fp64 inputs) in the canonical packed layout. ``validate=False`` skips the input checks (their
    NaN and symmetry tests synchronise with the GPU) for callers that checked once.
    """
    if validate:
        dims = check_qkv(q, k, v)
        check_coefficients(a, b, C, dims)
        if factor is not None:
            check_factor(factor, dims)
        if initial_state is not None:
            check_state(initial_state, dims)
        check_floor(kernel_floor)
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
        if not isinstance(snapshot_budget, int) or snapshot_budget < 1:
            raise ValueError(f"snapshot_budget: expected a positive number of bytes, got {snapshot_budget!r}")
        reason = unsupported_reason(q, v, chunk_size)
        if reason is not None:
            raise ValueError(f"backend='triton': {reason}")
    s = default_scale(q.shape[-1], scale)
    adt = accum_dtype(q.dtype)
    qwb = block_weights(query_weights(a.to(adt), b.to(adt), C.to(adt), s), q.shape[-1]).contiguous()
    if factor is not None:
        c0 = factor.c0.to(adt).contiguous()
        fc = factor.c.to(adt).contiguous()
        fw = (factor.W.to(adt) * s).contiguous()
    else:
        c0 = fc = fw = None
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    cfg = _Cfg(chunk=chunk_size, floor=kernel_floor, budget=snapshot_budget)
    o, final = ChunkQuadraticFunction.apply(q, k, v, qwb, c0, fc, fw, initial_state, cfg)
    return o, (final if output_final_state else None)
