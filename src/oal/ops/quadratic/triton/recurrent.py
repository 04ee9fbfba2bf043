"""Decode on Triton: T new tokens (typically 1) against the packed state, Algorithm 1 lines 7–10.

Same contract as :func:`oal.ops.recurrent_quadratic_attention`. The state stays in the canonical packed layout
``(B, Hkv, D, dv+1)`` (fp32), read and written once per step by ``2 + ⌊d/2⌋ + 1`` block programs per KV head;
each adds its part of the G query heads' readouts into a small fp32 buffer, and a second kernel divides. The
work per step is independent of how many tokens the state has absorbed.
"""

from __future__ import annotations

import torch

from ..utils import check_coefficients, check_floor, check_qkv, check_state, default_scale, query_weights
from .utils import accum_dtype, block_table, block_weights, consts, last_dim_contiguous, strides3, unsupported_reason


def recurrent_quadratic_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    C: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    kernel_floor: float | None = None,
    inplace: bool = False,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent (decode) step on Triton; arguments and results as in :func:`oal.ops.quadratic_attention`
    (``mode="recurrent"``).

    ``inplace=True`` updates ``initial_state`` itself (it must then be a contiguous fp32 tensor, fp64 for fp64
    inputs) and returns it as the final state: no state-sized allocation or copy per token. ``validate=False``
    skips the input checks, whose NaN/symmetry tests synchronise with the GPU — for decode loops whose inputs
    were checked once. Not differentiable: training uses the chunked mode.
    """
    if validate:
        dims = check_qkv(q, k, v)
        check_coefficients(a, b, C, dims)
        if initial_state is not None:
            check_state(initial_state, dims)
        check_floor(kernel_floor)
        reason = unsupported_reason(q, v, None)
        if reason is not None:
            raise ValueError(f"backend='triton': {reason}")
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, a, b, C, initial_state) if x is not None):
            raise ValueError("mode='recurrent' with backend='triton' is not differentiable; use mode='chunk'")
    B, Hq, T, d = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    G = Hq // Hkv
    adt = accum_dtype(q.dtype)
    cst = consts(d, dv, q.dtype)
    s = default_scale(d, scale)
    if inplace:
        if initial_state is None or initial_state.dtype != adt or not initial_state.is_contiguous():
            raise ValueError(
                f"initial_state: inplace=True needs a contiguous {adt} state, got {_describe(initial_state)}"
            )
        state_in = state_out = initial_state
    else:
        if initial_state is None:
            state_in = torch.zeros(B, Hkv, cst.D_FEAT, dv + 1, dtype=adt, device=q.device)
        else:
            state_in = initial_state.to(adt).contiguous()
        state_out = torch.empty_like(state_in)
    with torch.no_grad():
        qwb = block_weights(query_weights(a.to(adt), b.to(adt), C.to(adt), s), d).contiguous()
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    from . import kernels

    num = torch.zeros(B, Hq, T, dv + 1, dtype=adt, device=q.device)
    kernels.recurrent_step[(cst.NBLK, B * Hkv)](
        q,
        k,
        v,
        block_table(d, q.device),
        qwb,
        state_in,
        state_out,
        num,
        *strides3(q),
        *strides3(k),
        *strides3(v),
        T,
        Hkv,
        G,
        D_HEAD=cst.D_HEAD,
        DV=cst.DV,
        D_FEAT=cst.D_FEAT,
        NBLK=cst.NBLK,
        BK=cst.BK,
        BV=cst.BV,
        ADT=cst.ADT,
        num_warps=2,  # 4 warps make ptxas spill this kernel (sm_90, benchmarks/compile_check.py)
    )
    o = torch.empty(B, Hq, T, dv, dtype=q.dtype, device=q.device)
    kernels.recurrent_finalize[(B * Hq, T)](
        num,
        state_out,
        o,
        *strides3(o),
        T,
        Hq,
        G,
        float(kernel_floor or 0.0),
        DV=cst.DV,
        D_FEAT=cst.D_FEAT,
        BV=cst.BV,
        HAS_FLOOR=kernel_floor is not None,
        num_warps=1,
    )
    return o, (state_out if output_final_state or inplace else None)


def _describe(x: torch.Tensor | None) -> str:
    if x is None:
        return "None"
    return f"{x.dtype} tensor (contiguous={x.is_contiguous()})"
