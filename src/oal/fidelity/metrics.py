"""Frozen-attention error metrics of App. C (Eq. 21–22).

For held-out sequence b, ``Y_b`` collects the exact outputs of all evaluated layers and heads into one tensor
(before W_o: the per-head attention outputs; after W_o: each layer's heads concatenated in their original order and
passed through that layer's frozen output projection, bias included), ``Ŷ_b`` the approximation's, and ``n_b``
the number of scalar elements of ``Y_b``:

    MSE    = 1/B Σ_b ‖Ŷ_b − Y_b‖²_F / n_b                                  (21)
    RelMSE = 1/B Σ_b ‖Ŷ_b − Y_b‖²_F / ‖Y_b‖²_F                             (22)

Each sequence is normalised by its own energy before the mean over sequences. Because the layers of a sequence
are pooled before the division, a sequence's RelMSE is ``Σ_l err_l / Σ_l energy_l`` (not a mean of per-layer
ratios). :class:`FidelityAccumulator` keeps the three sums per (method, stage, sequence, layer[, head]) in float64
and reduces them in :meth:`FidelityAccumulator.metrics`.
"""

from __future__ import annotations

from collections import defaultdict

import torch

STAGES = ("before_wo", "after_wo")


def error_sums(approx: torch.Tensor, exact: torch.Tensor, dims: tuple[int, ...] | None = None):
    """``(‖approx − exact‖², ‖exact‖², numel)`` in float64, summed over ``dims`` (all by default)."""
    if approx.shape != exact.shape:
        raise ValueError(
            f"approx: expected shape {tuple(exact.shape)} like the exact output, got {tuple(approx.shape)}"
        )
    a, e = approx.detach().double(), exact.detach().double()
    if dims is None:
        return float((a - e).square().sum()), float(e.square().sum()), e.numel()
    n = 1
    for d in dims:
        n *= e.shape[d]
    return (a - e).square().sum(dims), e.square().sum(dims), n


def reduce_sequences(per_seq: list[tuple[float, float, int]]) -> dict[str, float]:
    """Eq. 21–22 from per-sequence ``(sq_err, energy, n)``: ``{"mse", "relmse", "sequences"}``."""
    if not per_seq:
        raise ValueError("per_seq: expected at least one sequence")
    for _, en, n in per_seq:
        if n <= 0 or en <= 0:
            raise ValueError(f"per_seq: expected positive element counts and energies, got n={n}, energy={en}")
    B = len(per_seq)
    return {
        "mse": sum(sq / n for sq, _, n in per_seq) / B,
        "relmse": sum(sq / en for sq, en, _ in per_seq) / B,
        "sequences": B,
    }


class FidelityAccumulator:
    """Collects per-(method, stage, sequence, layer) error sums, and per-head sums before W_o."""

    def __init__(self) -> None:
        # (method, stage, seq, layer) -> [sq, energy, n]
        self._sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        # (method, seq, layer) -> (sq (Hq,), energy (Hq,), n per head)
        self._heads: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def add(self, method: str, stage: str, seq: int, layer: int, approx: torch.Tensor, exact: torch.Tensor) -> None:
        """Add one layer of one sequence: ``approx``/``exact`` ``(1, Hq, N, dv)`` before W_o or ``(1, N, hidden)``
        after."""
        if stage not in STAGES:
            raise ValueError(f"stage: expected one of {STAGES}, got {stage!r}")
        sq, en, n = error_sums(approx, exact)
        s = self._sums[(method, stage, seq, layer)]
        s[0] += sq
        s[1] += en
        s[2] += n
        if stage == "before_wo":
            if approx.dim() != 4 or approx.shape[0] != 1:
                raise ValueError(f"approx: expected (1, Hq, N, dv) before W_o, got {tuple(approx.shape)}")
            hs, he, hn = error_sums(approx[0], exact[0], dims=(1, 2))
            self._heads[(method, seq, layer)] = (hs, he, hn)

    def methods(self) -> list[str]:
        return list(dict.fromkeys(k[0] for k in self._sums))

    def _per_seq(self, method: str, stage: str, layers: set[int] | None = None) -> list[tuple[float, float, int]]:
        seqs: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        for (m, st, b, layer), (sq, en, n) in self._sums.items():
            if m == method and st == stage and (layers is None or layer in layers):
                acc = seqs[b]
                acc[0] += sq
                acc[1] += en
                acc[2] += n
        return [tuple(v) for _, v in sorted(seqs.items())]

    def metrics(self, method: str) -> dict:
        """``{mse_before_wo, relmse_before_wo, mse_after_wo, relmse_after_wo, sequences, per_layer, per_head}``
        with per-layer values computed the same way on that layer alone, and per-head RelMSE/MSE before W_o."""
        out: dict = {}
        for stage in STAGES:
            r = reduce_sequences(self._per_seq(method, stage))
            out[f"mse_{stage}"], out[f"relmse_{stage}"] = r["mse"], r["relmse"]
            out["sequences"] = r["sequences"]
        layers = sorted({k[3] for k in self._sums if k[0] == method})
        per_layer = {}
        for layer in layers:
            entry = {}
            for stage in STAGES:
                r = reduce_sequences(self._per_seq(method, stage, {layer}))
                entry[f"mse_{stage}"], entry[f"relmse_{stage}"] = r["mse"], r["relmse"]
            per_layer[str(layer)] = entry
        out["per_layer"] = per_layer
        per_head = {}
        for layer in layers:
            items = [v for (m, _, li), v in sorted(self._heads.items()) if m == method and li == layer]
            if not items:
                continue
            rel = torch.stack([hs / he for hs, he, _ in items]).mean(0)
            mse = torch.stack([hs / hn for hs, _, hn in items]).mean(0)
            per_head[str(layer)] = {"relmse_before_wo": rel.tolist(), "mse_before_wo": mse.tolist()}
        out["per_head"] = per_head
        return out
