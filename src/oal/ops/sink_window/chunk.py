"""Prefill: the sink/window operator for a whole segment at once.

* Kernel part (keys n_sink ≤ j ≤ i - w): the chunked quadratic operator on the keys delayed by w, with key
  weights removing the sinks (see ``utils``): the plain operator's cost and state.
* Exact part: per block of ``chunk_size`` queries, one GEMM against the n_sink sinks and the
  ``chunk_size + w - 1`` keys that cover the block's windows, masked to each query's (i - w, i]:
  O(N · (n_sink + w + chunk_size)) work, O(chunk_size · (n_sink + w + chunk_size)) extra memory per head.
* Both parts meet in one normalisation (:func:`utils.combine`).
"""

from __future__ import annotations

import torch

from ..quadratic.utils import KernelFactor, check_coefficients, check_factor, check_floor, check_qkv, default_scale
from .utils import SinkWindowState, check_beta, check_config, check_state, evaluate

DEFAULT_CHUNK = 64


def chunk_sink_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    C: torch.Tensor,
    beta: torch.Tensor,
    *,
    n_sink: int = 4,
    window: int = 64,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    initial_state: SinkWindowState | None = None,
    output_final_state: bool = False,
    factor: KernelFactor | None = None,
    kernel_floor: float | None = None,
) -> tuple[torch.Tensor, SinkWindowState | None]:
    """Chunked sink/window attention; see :func:`oal.ops.sink_window_attention` for the arguments.

    Differentiable in q, k, v, a, b, C, beta and the factor.
    """
    dims = check_qkv(q, k, v)
    check_coefficients(a, b, C, dims)
    check_beta(beta, dims)
    check_config(n_sink, window)
    # what the kernel part's operator would check again (evaluate calls it unchecked): the factor, the floor and
    # the state's buffers, which it reads as keys
    if factor is not None:
        check_factor(factor, dims)
    check_floor(kernel_floor)
    if initial_state is not None:
        check_state(initial_state, dims, n_sink, window, k.dtype, buffers_finite=True)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    return evaluate(
        q,
        k,
        v,
        a,
        b,
        C,
        beta,
        dims=dims,
        n_sink=n_sink,
        window=window,
        scale=default_scale(dims.d, scale),
        kernel_mode="chunk",
        block=chunk_size,
        chunk_size=chunk_size,
        initial_state=initial_state,
        output_final_state=output_final_state,
        factor=factor,
        kernel_floor=kernel_floor,
    )
