"""Decode: the sink/window operator token by token from a :class:`SinkWindowState`.

Per token i: the key leaving the window (i - w) enters the packed kernel state unless it is a sink (the
quadratic operator's recurrent step with key weight 0 or 1), the new key joins the window (and, for i < n_sink,
the sinks), and query i reads the kernel state, the sinks and the window in one normalisation. The memory is
that of the state, independent of the context length.
"""

from __future__ import annotations

import torch

from ..quadratic.utils import KernelFactor, check_coefficients, check_qkv, default_scale
from .utils import SinkWindowState, check_beta, check_config, check_state, evaluate


def recurrent_sink_window_attention(
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
    initial_state: SinkWindowState | None = None,
    output_final_state: bool = False,
    factor: KernelFactor | None = None,
    kernel_floor: float | None = None,
) -> tuple[torch.Tensor, SinkWindowState | None]:
    """Recurrent sink/window attention for T ≥ 1 new tokens; see :func:`oal.ops.sink_window_attention`.

    ``factor`` is unused (the recurrent kernel readout works from a, b, C).
    """
    dims = check_qkv(q, k, v)
    check_coefficients(a, b, C, dims)
    check_beta(beta, dims)
    check_config(n_sink, window)
    if initial_state is not None:
        check_state(initial_state, dims, n_sink, window, k.dtype)
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
        kernel_mode="recurrent",
        block=1,
        chunk_size=1,
        initial_state=initial_state,
        output_final_state=output_final_state,
        factor=None,
        kernel_floor=kernel_floor,
    )
