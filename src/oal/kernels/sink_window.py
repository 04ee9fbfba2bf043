"""A quadratic kernel (OAL or the learned global one) with exact attention sinks and an exact local window.

Beyond the paper: measured on SmolLM2, 36–49 % of the softmax mass of layers 12 and 20 sits on position 0 (an
attention sink) whose value is small, a peak no quadratic kernel can reproduce, and LoLCATs closes much of its
gap with a 64-token softmax window. This wrapper keeps the first ``n_sink`` keys and the last ``window`` keys of
every query exact and leaves the rest to the inner kernel, in one normalisation with a learned per-head
log-scale β (see :func:`oal.ops.sink_window_attention` and ``docs/sink_window.md``). Names: ``oal+sink``,
``oal+window``, ``oal+sink+window``, ``global+sink+window``, …; with ``n_sink = window = 0`` it is the inner
kernel itself.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops.quadratic import factored_kernel
from ..ops.quadratic.chunk import parallel_at_end
from ..ops.quadratic.utils import check_qkv, compute_dtype
from ..ops.sink_window import SinkWindowState, sink_window_attention, sink_window_weights
from ..ops.sink_window.utils import all_exact, check_config, evaluate_at_end, exact_segment
from .base import AttentionKernel, check_positions, repeat_kv
from .oal import OALKernel, oal_coefficients, oal_factor

SUFFIXES = ("+sink", "+window")


def sink_window_name(inner_name: str, n_sink: int, window: int) -> str:
    """``inner_name`` plus ``+sink`` if n_sink > 0 and ``+window`` if window > 0."""
    return inner_name + ("+sink" if n_sink else "") + ("+window" if window else "")


def split_sink_window_name(name: str) -> tuple[str, bool, bool]:
    """``"oal+sink+window"`` -> ``("oal", True, True)``; ``"global+window"`` -> ``("global", False, True)``;
    a name without suffixes -> ``(name, False, False)``. Suffixes must come in the order ``+sink+window``."""
    base, *parts = name.split("+")
    tail = ["+" + p for p in parts]
    if not base or tail not in ([], ["+sink"], ["+window"], ["+sink", "+window"]):
        raise ValueError(
            f"name: expected '<kernel>' optionally followed by '+sink' and/or '+window' in that order, got {name!r}"
        )
    return base, "+sink" in tail, "+window" in tail


def kernel_at_end(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: torch.Tensor | None = None):
    """``kernel`` (an :class:`OALKernel` or :class:`GlobalQuadraticKernel`, or a :class:`SinkWindowKernel` over one)
    for queries ``q (B, Hq, n, d)`` that are the last n of the N positions of ``k``, ``v`` ``(B, Hkv, N, ·)``, without
    a state: ``o (B, Hq, n, dv)``, the rows one call over all N positions gives them (a prompt's later chunk over its
    kept keys: :func:`oal.ops.quadratic.chunk.parallel_at_end`, :func:`oal.ops.sink_window.utils.evaluate_at_end`).
    ``heads``: the kernel's query heads that q holds (an index tensor; None: all of them). None where the fused
    kernels do not apply."""
    sink = isinstance(kernel, SinkWindowKernel)
    oal = kernel.inner if sink else kernel
    groups, L, beta = oal.groups, oal.L, kernel.beta if sink else None
    if heads is not None:
        groups, L = groups.index_select(0, heads.to(groups.device)), L.index_select(0, heads.to(L.device))
        beta = None if beta is None else beta.index_select(0, heads.to(beta.device))
    a, b, C = oal_coefficients(groups, L, oal.eps)
    factor = oal_factor(groups, L, oal.eps)
    if sink:
        return evaluate_at_end(
            q, k, v, a, b, C, beta, n_sink=kernel.n_sink, window=kernel.window, scale=kernel.scale, factor=factor,
            kernel_floor=oal.eps,
        )  # fmt: skip
    out = parallel_at_end(q, k, v, a, b, C, kernel.scale, factor, oal.eps)
    return None if out is None else out[0]


class SinkWindowKernel(AttentionKernel):
    """Exact sinks + exact window + an inner :class:`OALKernel` (or :class:`GlobalQuadraticKernel`) elsewhere.

    Trainable parameters: the inner kernel's ``L`` (as ``inner.L``) and ``beta (Hq,)``, the per-head log-scale
    of the kernel part: exact weights are ``e^{s_ij}``, kernel weights ``e^{β_h} κ_ij``. β = 0 (the default) is
    the right scale for a kernel that approximates ``e^{s}`` itself, as the second-order Taylor initialisation
    does (κ ≈ 1 + s + s²/2). A calibrated kernel is only determined up to a per-head factor (Eq. 20 compares
    normalised outputs), so β must be fitted with it; :meth:`match_beta_` gives a data-driven start that
    matches the kernel part's mass to the softmax mass of the same keys.

    ``forward`` returns a :class:`oal.ops.sink_window.SinkWindowState` as its recurrent state.
    """

    cpu_extensions = ("chunk", "decode", "window")  # the exact part's prompt kernel

    def __init__(self, inner: OALKernel, n_sink: int = 4, window: int = 64, beta: torch.Tensor | None = None) -> None:
        if not isinstance(inner, OALKernel):
            raise ValueError(f"inner: expected an OALKernel or GlobalQuadraticKernel, got {type(inner).__name__}")
        check_config(n_sink, window)
        super().__init__(inner.num_heads, inner.num_kv_heads, inner.head_dim)
        self.inner = inner
        self.n_sink = n_sink
        self.window = window
        self.name = sink_window_name(inner.name, n_sink, window)
        if beta is None:
            beta = torch.zeros(inner.num_heads)
        if not isinstance(beta, torch.Tensor) or beta.shape != (inner.num_heads,):
            got = tuple(beta.shape) if isinstance(beta, torch.Tensor) else type(beta).__name__
            raise ValueError(f"beta: expected shape ({inner.num_heads},), got {got}")
        self.beta = nn.Parameter(beta.detach().to(inner.L.dtype).clone())

    def extra_repr(self) -> str:
        return f"name={self.name!r}, n_sink={self.n_sink}, window={self.window}"

    def weights(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Combined weights ``(B, Hq, P, N)`` with one common scale per query row (which cancels in
        :meth:`at_positions`): ``e^{s_ij - M_i}`` on the exact set, ``e^{β_h - M_i} κ_ij`` on the kernel set,
        0 past the query; see :func:`oal.ops.sink_window.sink_window_weights`."""
        positions = check_positions(positions, q.shape[2])
        cdt = compute_dtype(q.dtype)
        qs, kk = q[:, :, positions].to(cdt), k.to(cdt)
        logits = (qs @ repeat_kv(kk, self.num_heads).mT) * self.scale
        factor = oal_factor(self.inner.groups, self.inner.L.to(cdt), self.inner.eps)
        kappa = factored_kernel(qs, kk, factor, self.scale)
        return sink_window_weights(logits, kappa, positions, self.beta.to(cdt), n_sink=self.n_sink, window=self.window)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mode: str = "chunk",
        initial_state: SinkWindowState | None = None,
        output_final_state: bool = False,
        chunk_size: int = 64,
    ) -> tuple[torch.Tensor, SinkWindowState | None]:
        if mode == "chunk" and all_exact(q.shape[2], self.n_sink, self.window, initial_state, self.beta):
            return exact_segment(q, k, v, check_qkv(q, k, v), self.n_sink, self.window, self.scale, output_final_state)
        inner = self.inner
        a, b, C = oal_coefficients(inner.groups, inner.L, inner.eps)
        factor = oal_factor(inner.groups, inner.L, inner.eps) if mode == "chunk" else None
        return sink_window_attention(
            q,
            k,
            v,
            a,
            b,
            C,
            self.beta,
            n_sink=self.n_sink,
            window=self.window,
            scale=self.scale,
            mode=mode,
            chunk_size=chunk_size,
            initial_state=initial_state,
            output_final_state=output_final_state,
            factor=factor,
            kernel_floor=inner.eps,
        )

    @torch.no_grad()
    def match_beta_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Set β so that, per head, the kernel part carries the softmax mass of its keys on average:

            β_h = mean_{b, i} [ log Σ_{j∈K_i} e^{s_ij} - log Σ_{j∈K_i} κ_ij ]

        over the batch and the query ``positions`` whose kernel set K_i is non-empty (a mean of log-ratios, so
        no single row dominates). If no position has a non-empty K_i, β is left as it is. Returns β."""
        positions = check_positions(positions, q.shape[2])
        cdt = compute_dtype(q.dtype)
        qs, kk = q[:, :, positions].to(cdt), k.to(cdt)
        logits = (qs @ repeat_kv(kk, self.num_heads).mT) * self.scale
        kappa = factored_kernel(qs, kk, oal_factor(self.inner.groups, self.inner.L.to(cdt), self.inner.eps), self.scale)
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        kern = (j >= self.n_sink) & (j <= positions.to(q.device)[:, None] - self.window)  # (P, N)
        rows = kern.any(-1)
        if not bool(rows.any()):
            return self.beta.detach().clone()
        ratio = torch.logsumexp(logits.masked_fill(~kern, -math.inf), -1) - torch.log((kappa * kern).sum(-1))
        new = ratio[:, :, rows].mean(dim=(0, 2))
        self.beta.copy_(new.to(self.beta.dtype))
        return self.beta.detach().clone()
