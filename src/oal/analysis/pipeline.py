"""From captured per-layer queries/keys to everything §3 and App. A/B need, so the CLI stays a thin layer.

:func:`analyze_contributions` consumes an iterable of captures, one per batch of prompts, each a mapping
``layer → (q, k)`` or ``layer → (q, k, lengths)`` with q ``(B, Hq, N, d)`` post-RoPE, k ``(B, Hkv, N, d)``
and optional right-padding ``lengths`` ``(B,)``. It keeps only O(d) numbers per prompt, layer and head.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..io import CHECKSUM_KEY, load_tensors, save_tensors
from .contributions import check_lengths, contribution_scores, mean_abs
from .report import LayerSummary, layer_summaries
from .stability import gaussian_control_scores

SCHEMA = "oal.contributions"
SCHEMA_VERSION = 1


@dataclass
class ContributionAnalysis:
    """Per-prompt statistics for the analysed layers (``layers[i]`` is row i of every tensor).

    chi ``(L, P, Hq, d)``: χ_{p,r} (Eq. 2); q_abs ``(L, P, Hq, d)`` and k_abs ``(L, P, Hkv, d)``: mean |q|, |k|
    over each prompt's positions (Fig. 1 a/b); lengths ``(P,)``: prompt lengths. All float64 on the CPU.
    """

    layers: list[int]
    chi: torch.Tensor
    q_abs: torch.Tensor
    k_abs: torch.Tensor
    lengths: list[int]
    model_id: str = ""

    @property
    def num_heads(self) -> int:
        return self.chi.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k_abs.shape[2]

    @property
    def head_dim(self) -> int:
        return self.chi.shape[3]

    def index(self, layer: int) -> int:
        if layer not in self.layers:
            raise ValueError(f"layer: expected one of the analysed layers {self.layers}, got {layer}")
        return self.layers.index(layer)

    @property
    def chi_mean(self) -> torch.Tensor:
        """χ_r ``(L, Hq, d)``: equal-weight mean over prompts (Eq. 2)."""
        return self.chi.mean(1)

    def chi_by_layer(self) -> dict[int, torch.Tensor]:
        """layer → per-prompt χ ``(P, Hq, d)``, the input of :func:`oal.grouping.group_heads`."""
        return {layer: self.chi[i] for i, layer in enumerate(self.layers)}

    def head_profile(self, layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fig. 1 panels for one query head: mean |q| ``(d,)``, mean |k| of its KV head ``(d,)``, χ_r ``(d,)``;
        each an equal-weight mean over prompts."""
        i = self.index(layer)
        if not 0 <= head < self.num_heads:
            raise ValueError(f"head: expected a query head in [0, {self.num_heads}), got {head}")
        kv = head // (self.num_heads // self.num_kv_heads)
        return self.q_abs[i, :, head].mean(0), self.k_abs[i, :, kv].mean(0), self.chi[i, :, head].mean(0)

    def summaries(self, ks: tuple[int, ...] = (1, 2, 5)) -> list[LayerSummary]:
        return layer_summaries(self.chi_mean, self.layers, ks)

    def gaussian_control(self, seed: int = 0) -> torch.Tensor:
        """χ_{p,r} ``(P, Hq, d)`` of i.i.d. N(0, 1) q/k with these prompts' lengths and this layer shape (Fig. 5)."""
        return gaussian_control_scores(self.lengths, self.num_heads, self.num_kv_heads, self.head_dim, seed=seed)

    def save(self, path: str | Path) -> Path:
        """safetensors file with the tensors, the layer ids, the lengths and the model id."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "chi": self.chi.contiguous(),
            "q_abs": self.q_abs.contiguous(),
            "k_abs": self.k_abs.contiguous(),
            "layers": torch.tensor(self.layers, dtype=torch.long),
            "lengths": torch.tensor(self.lengths, dtype=torch.long),
        }
        meta = {"schema": SCHEMA, "version": str(SCHEMA_VERSION), "model_id": self.model_id}
        return save_tensors(path, tensors, metadata=meta)

    @classmethod
    def load(cls, path: str | Path, *, model_id: str | None = None) -> ContributionAnalysis:
        """Read a file written by :meth:`save` (checksums verified; errors start with ``chi:``)."""
        path = Path(path)
        t, meta = load_tensors(path, what="chi")
        if meta.get("schema") != SCHEMA or meta.get("version") != str(SCHEMA_VERSION):
            got = {k: v for k, v in meta.items() if k != CHECKSUM_KEY}
            raise ValueError(f"chi: {path}: expected schema {SCHEMA!r} version {SCHEMA_VERSION}, got {json.dumps(got)}")
        if model_id is not None and meta.get("model_id") != model_id:
            raise ValueError(
                f"chi: {path}: contributions are for model_id={meta.get('model_id')!r}, expected {model_id!r}"
            )
        missing = sorted({"chi", "q_abs", "k_abs", "layers", "lengths"} - set(t))
        if missing:
            raise ValueError(f"chi: {path} lacks the tensors {missing}")
        return cls(t["layers"].tolist(), t["chi"], t["q_abs"], t["k_abs"], t["lengths"].tolist(), meta["model_id"])


def analyze_contributions(
    captures: Iterable[Mapping[int, tuple]], *, scale: float | None = None, model_id: str = ""
) -> ContributionAnalysis:
    """Accumulate χ_{p,r} (Eq. 2) and mean |q|, |k| per prompt for every captured layer.

    Every capture must hold the same layers, all with the same ``(Hq, Hkv, d)``; prompts are numbered in the
    order they arrive. ``scale`` defaults to 1/sqrt(d).
    """
    layers: list[int] | None = None
    ref: tuple[int, int, int] | None = None
    chi: dict[int, list[torch.Tensor]] = {}
    qa: dict[int, list[torch.Tensor]] = {}
    ka: dict[int, list[torch.Tensor]] = {}
    lengths: list[int] = []
    for n_cap, cap in enumerate(captures):
        if not isinstance(cap, Mapping) or not cap:
            raise ValueError(f"captures[{n_cap}]: expected a non-empty mapping layer → (q, k[, lengths])")
        if layers is None:
            layers = sorted(int(x) for x in cap)
            chi, qa, ka = ({layer: [] for layer in layers} for _ in range(3))
        elif sorted(int(x) for x in cap) != layers:
            raise ValueError(f"captures[{n_cap}]: expected layers {layers}, got {sorted(cap)}")
        cap_lengths = None
        for layer in layers:
            entry = cap[layer]
            if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
                raise ValueError(f"captures[{n_cap}][{layer}]: expected (q, k) or (q, k, lengths)")
            q, k = entry[0], entry[1]
            c = contribution_scores(q, k, scale, lengths=entry[2] if len(entry) == 3 else None)
            n = check_lengths(entry[2] if len(entry) == 3 else None, q.shape[0], q.shape[2]).tolist()
            if cap_lengths is None:
                cap_lengths = n
            elif n != cap_lengths:
                raise ValueError(f"captures[{n_cap}][{layer}]: expected the same lengths in every layer, got {n}")
            heads = (q.shape[1], k.shape[1], q.shape[3])
            if ref is None:
                ref = heads
            elif heads != ref:
                raise ValueError(f"captures[{n_cap}][{layer}]: expected (Hq, Hkv, d) = {ref}, got {heads}")
            chi[layer].append(c)
            qa[layer].append(mean_abs(q, n))
            ka[layer].append(mean_abs(k, n))
        lengths.extend(cap_lengths)
    if layers is None:
        raise ValueError("captures: expected at least one capture, got none")
    return ContributionAnalysis(
        layers=layers,
        chi=torch.stack([torch.cat(chi[layer]) for layer in layers]),
        q_abs=torch.stack([torch.cat(qa[layer]) for layer in layers]),
        k_abs=torch.stack([torch.cat(ka[layer]) for layer in layers]),
        lengths=lengths,
        model_id=model_id,
    )
