"""Table 2 (App. C): every method's outputs over ALL positions of held-out blocks, on frozen captured Q/K/V,
compared with exact softmax before and after the frozen W_o."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels import AttentionKernel
from ..models import exact_attention
from .capture import LayerStates
from .metrics import FidelityAccumulator

SINK_COLUMNS = ("position_0", "positions_0_3")


def sink_mass(q: torch.Tensor, k: torch.Tensor, scale: float, n_first: int = 4) -> torch.Tensor:
    """Exact softmax attention mass on key 0 and on keys 0..n_first-1, per query: ``(B, Hq, N, 2)``.

    Computed as attention applied to indicator values (one SDPA call), so it costs one attention pass."""
    B, Hkv, N, _ = k.shape
    ind = torch.zeros(B, Hkv, N, 2, dtype=q.dtype)
    ind[:, :, 0, 0] = 1
    ind[:, :, :n_first, 1] = 1
    return exact_attention(q, k, ind, scale=scale)


@dataclass
class FidelityRun:
    """Accumulated errors, per-method kernel seconds, and diagnostics per layer: ``sink`` (mean softmax mass on
    key 0 / keys 0–3 per head, averaged over queries and blocks) and ``capture_check`` (largest |SDPA − captured
    model output| before W_o, which must be ~0)."""

    acc: FidelityAccumulator
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    sink: dict[int, torch.Tensor] = field(default_factory=dict)
    capture_check: dict[int, float] = field(default_factory=dict)


def evaluate_fidelity(
    get_states: Callable[[int, int], LayerStates],
    kernels: Mapping[str, Mapping[int, AttentionKernel]],
    projections: Mapping[int, tuple[torch.Tensor, torch.Tensor | None]],
    layers: Sequence[int],
    blocks: Sequence[int],
    *,
    on_step: Callable[[], None] | None = None,
) -> FidelityRun:
    """Run every kernel of ``kernels[method][layer]`` with its chunked forward on ``get_states(layer, block)``
    (q ``(1, Hq, N, d)``, k/v ``(1, Hkv, N, ·)``, o the model's attention output) and accumulate Eq. 21–22 sums
    before and after ``projections[layer] = (W_o (hidden, Hq·dv), bias or None)``.

    The reference is exact causal softmax (SDPA on the same tensors, as the model computes it)."""
    run = FidelityRun(FidelityAccumulator())
    sink_sum: dict[int, torch.Tensor] = {}
    for b in blocks:
        for layer in layers:
            st = get_states(layer, b)
            q, k, v = st.q, st.k, st.v
            with torch.no_grad():
                exact = exact_attention(q, k, v, scale=st.scale)
                if st.o is not None:
                    diff = float((exact - st.o).abs().max())
                    run.capture_check[layer] = max(run.capture_check.get(layer, 0.0), diff)
                W, bias = projections[layer]
                exact_after = _project(exact, W, bias)
                mass = sink_mass(q, k, st.scale).double().mean(dim=(0, 2))  # (Hq, 2)
                sink_sum[layer] = sink_sum.get(layer, 0) + mass
                for method, per_layer in kernels.items():
                    kern = per_layer[layer]
                    t0 = time.perf_counter()
                    o, _ = kern(q, k, v)
                    run.seconds[method] += time.perf_counter() - t0
                    o = o.float()
                    if not bool(torch.isfinite(o).all()):
                        raise ValueError(f"{method}: non-finite outputs in layer {layer}, block {b}")
                    run.acc.add(method, "before_wo", b, layer, o, exact)
                    run.acc.add(method, "after_wo", b, layer, _project(o, W, bias), exact_after)
            if on_step is not None:
                on_step()
    run.sink = {layer: s / len(blocks) for layer, s in sink_sum.items()}
    return run


def _project(o: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(1, Hq, N, dv)`` -> ``(1, N, hidden)``: heads concatenated in their original order, then W_o (+ bias)."""
    B, H, N, dv = o.shape
    if W.shape[1] != H * dv:
        raise ValueError(f"W: expected shape (hidden, {H * dv}) for {H} heads of {dv}, got {tuple(W.shape)}")
    return F.linear(o.transpose(1, 2).reshape(B, N, H * dv), W.to(o.dtype), None if bias is None else bias.to(o.dtype))


def markdown_table(methods: Mapping[str, Mapping[str, float]], *, digits: int = 3) -> str:
    """Table 2 layout: one row per method, MSE and RelMSE before and after W_o."""
    lines = [
        "| Method | Before W_o MSE ↓ | Before W_o RelMSE ↓ | After W_o MSE ↓ | After W_o RelMSE ↓ |",
        "|---|---:|---:|---:|---:|",
    ]

    def f(x: float) -> str:
        return f"{x:.{digits}e}" if (x != 0 and abs(x) < 10 ** (-digits)) else f"{x:.{digits}f}"

    for name, m in methods.items():
        lines.append(
            f"| {name} | {f(m['mse_before_wo'])} | {f(m['relmse_before_wo'])} | {f(m['mse_after_wo'])} | "
            f"{f(m['relmse_after_wo'])} |"
        )
    return "\n".join(lines)
