"""Outlier-aware dimension grouping (§4.2, Appendix B, Eqs. 16–19).

Per layer and query head, the d dimensions are sorted by their calibration contribution χ_r (Eq. 2) and cut
only in the high-contribution tail, at large gaps that are stable under prompt-level bootstrap resampling.
Groups are listed bulk (lowest contribution) first and are what :class:`oal.kernels.OALKernel` takes as its
``(Hq, d)`` group-id map (:meth:`GroupAssignment.group_ids`).

Indexing: a cut ``k`` is the paper's 1-based position, i.e. it puts the ``k`` lowest dimensions ``π_1..π_k`` on
the lower side. With 0-based sorted values ``s[0] ≤ … ≤ s[d-1]``, ``ρ_k = s[k] / max(s[k-1], ε)``.

The bootstrap draws one ``(B, P)`` prompt-index matrix from ``seed``; every head grouped with the same seed
and number of prompts sees the same resamples (the prompts are shared by all heads), so
:func:`group_heads` gives exactly what :func:`group_dimensions` gives head by head.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

SCHEMA = "oal.groups"
SCHEMA_VERSION = 1

# Appendix B grouping settings: (α, γ) per backbone; τ = 1.5, G_min = 2, B = 1000 for both.
PAPER_SETTINGS: dict[str, dict[str, float]] = {
    "qwen2.5-0.5b": {"alpha": 0.25, "gamma": 0.9},
    "llama-3.2-1b": {"alpha": 0.5, "gamma": 0.5},
}


@dataclass(frozen=True)
class GroupingResult:
    """The partition of one head's dimensions and the evidence behind it.

    ``groups``: sorted original dimension indices per group, bulk first; ``group_ids``: ``(d,)`` long.
    ``order``: the stable ascending order π (0-based dims); ``chi_mean``: χ_r in original dimension order.
    ``candidates``: the candidate cuts k (1-based, Eq. 16 indexing); ``rho`` and ``support`` align with them
    (``support`` is None for :func:`fixed_budget_groups`). ``cuts`` = sorted(natural_cuts + fallback_cuts).
    """

    groups: list[list[int]]
    group_ids: torch.Tensor
    order: list[int]
    chi_mean: list[float]
    candidates: list[int]
    rho: list[float]
    support: list[float] | None
    natural_cuts: list[int]
    fallback_cuts: list[int]
    params: dict = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def cuts(self) -> list[int]:
        return sorted(self.natural_cuts + self.fallback_cuts)

    def to_dict(self) -> dict:
        """JSON-friendly form (no tensors)."""
        return {
            "groups": self.groups,
            "cuts": self.cuts,
            "natural_cuts": self.natural_cuts,
            "fallback_cuts": self.fallback_cuts,
            "order": self.order,
            "chi_mean": self.chi_mean,
            "candidates": self.candidates,
            "rho": self.rho,
            "support": self.support,
            "params": self.params,
        }

    @classmethod
    def from_dict(cls, data: Mapping, head_dim: int) -> GroupingResult:
        groups = [[int(r) for r in g] for g in data["groups"]]
        ids = group_ids_from_groups(groups, head_dim)
        support = None if data.get("support") is None else [float(s) for s in data["support"]]
        return cls(
            groups=groups,
            group_ids=ids,
            order=[int(r) for r in data["order"]],
            chi_mean=[float(x) for x in data["chi_mean"]],
            candidates=[int(c) for c in data["candidates"]],
            rho=[float(x) for x in data["rho"]],
            support=support,
            natural_cuts=[int(c) for c in data["natural_cuts"]],
            fallback_cuts=[int(c) for c in data["fallback_cuts"]],
            params=dict(data.get("params", {})),
        )


def group_ids_from_groups(groups: Sequence[Sequence[int]], head_dim: int) -> torch.Tensor:
    """``(d,)`` long group ids from a list of groups; the groups must partition ``range(head_dim)``."""
    ids = [-1] * head_dim
    for g, dims in enumerate(groups):
        for r in dims:
            if not (isinstance(r, int) and 0 <= r < head_dim) or ids[r] >= 0:
                raise ValueError(f"groups: expected a partition of range({head_dim}), got {[list(x) for x in groups]}")
            ids[r] = g
    if -1 in ids or any(len(g) == 0 for g in groups):
        raise ValueError(f"groups: expected a partition of range({head_dim}) into non-empty groups, got {groups}")
    return torch.tensor(ids, dtype=torch.long)


def _groups_from_cuts(order: torch.Tensor, cuts: Sequence[int]) -> list[list[int]]:
    """Eq. 19: ``G_g = {π_{k_{g-1}+1}, …, π_{k_g}}`` with ``k_0 = 0``, ``k_G = d``, mapped to original indices."""
    pi = order.tolist()
    bounds = [0, *sorted(cuts), len(pi)]
    return [sorted(pi[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _check_params(alpha: float, gamma: float, tau: float, g_min: int, n_boot: int, eps: float) -> None:
    if not (isinstance(alpha, (int, float)) and 0 < alpha <= 1):
        raise ValueError(f"alpha: expected a tail fraction in (0, 1], got {alpha!r}")
    if not (isinstance(gamma, (int, float)) and 0 <= gamma <= 1):
        raise ValueError(f"gamma: expected a minimum support in [0, 1], got {gamma!r}")
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau: expected a positive ratio threshold, got {tau!r}")
    if not (isinstance(g_min, int) and g_min >= 1):
        raise ValueError(f"g_min: expected an integer ≥ 1, got {g_min!r}")
    if not (isinstance(n_boot, int) and n_boot >= 1):
        raise ValueError(f"n_boot: expected an integer ≥ 1, got {n_boot!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps: expected a positive finite number, got {eps!r}")


def _check_chi(chi: torch.Tensor, name: str, dims: int) -> torch.Tensor:
    shape = "(P, d)" if dims == 2 else "(P, H, d)"
    if not isinstance(chi, torch.Tensor) or chi.dim() != dims or not chi.is_floating_point():
        got = (tuple(chi.shape), chi.dtype) if isinstance(chi, torch.Tensor) else type(chi).__name__
        raise ValueError(f"{name}: expected a floating tensor of shape {shape}, got {got}")
    if chi.shape[0] < 1 or chi.shape[-1] < 1:
        raise ValueError(f"{name}: expected at least one prompt and one dimension, got {tuple(chi.shape)}")
    c = chi.detach().to(torch.float64).cpu()
    if not bool(torch.isfinite(c).all()) or bool((c < 0).any()):
        raise ValueError(f"{name}: expected finite non-negative contributions")
    return c


def tail_candidates(d: int, alpha: float) -> list[int]:
    """Candidate cuts ``{max(1, d − m), …, d − 1}`` with ``m = ⌈α d⌉`` (App. B). ``α d`` is rounded to 9
    decimals before the ceiling so that e.g. α = 0.07, d = 100 gives m = 7, not 8."""
    m = math.ceil(round(alpha * d, 9))
    return list(range(max(1, d - m), d))


def bootstrap_counts(num_prompts: int, n_boot: int, seed: int) -> torch.Tensor:
    """Multiplicities ``(B, P)`` float64 of B prompt-level resamples of size P drawn with replacement."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(num_prompts, (n_boot, num_prompts), generator=g)
    counts = torch.zeros(n_boot, num_prompts, dtype=torch.float64)
    return counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))


def _evidence(
    chi: torch.Tensor, counts: torch.Tensor, cands: torch.Tensor, tau: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For chi ``(P, H, d)``: the order π ``(H, d)``, χ_r ``(H, d)``, ρ_k (Eq. 16) and S_k (Eqs. 17–18),
    both ``(H, K)``, for the candidate cuts ``cands`` ``(K,)``."""
    P, H, d = chi.shape
    mean = chi.mean(0)
    order = torch.sort(mean, dim=-1, stable=True).indices
    s = mean.gather(-1, order)
    rho = s[:, cands] / s[:, cands - 1].clamp_min(eps)
    if cands.numel() == 0:  # d = 1: nothing to cut
        return order, mean, rho, rho.clone()
    boot = (counts @ chi.reshape(P, H * d) / P).reshape(-1, H, d).gather(-1, order.expand(counts.shape[0], H, d))
    # Candidates are the contiguous range k0..d-1, so only the tail needs running extrema:
    # lower[..., j] = max over sorted positions 0..k0+j-1, upper[..., j] = min over positions k0+j..d-1.
    k0 = int(cands[0])
    lower = torch.cat([boot[..., :k0].amax(-1, keepdim=True), boot[..., k0 : d - 1]], -1).cummax(-1).values
    upper = boot[..., k0:].flip(-1).cummin(-1).values.flip(-1)
    ratio = upper / lower.clamp_min(eps)  # Eq. 17, (B, H, K)
    support = (ratio >= tau).to(torch.float64).mean(0)  # Eq. 18
    return order, mean, rho, support


def _select_cuts(
    cands: list[int], rho: list[float], support: list[float], tau: float, gamma: float, g_min: int
) -> tuple[list[int], list[int]]:
    natural = [k for k, r, s in zip(cands, rho, support, strict=True) if r >= tau and s >= gamma]
    need = g_min - 1 - len(natural)
    if need > 0:
        unused = [i for i, k in enumerate(cands) if k not in natural]
        # Python's sort is stable, so exact (S_k, ρ_k) ties keep the candidate order.
        ranked = sorted(unused, key=lambda i: (-support[i], -rho[i]))
        fallback = sorted(cands[i] for i in ranked[:need])
    else:
        fallback = []
    return natural, fallback


def _grouping_results(
    chi: torch.Tensor,
    counts: torch.Tensor,
    alpha: float,
    gamma: float,
    tau: float,
    g_min: int,
    eps: float,
    params: dict,
) -> list[GroupingResult]:
    P, H, d = chi.shape
    cand_list = tail_candidates(d, alpha)
    if len(cand_list) < g_min - 1:
        raise ValueError(
            f"g_min: {g_min} groups need {g_min - 1} cuts but alpha={alpha} with d={d} allows only {len(cand_list)}"
        )
    cands = torch.tensor(cand_list, dtype=torch.long)
    order, mean, rho, support = _evidence(chi, counts, cands, tau, eps)
    out = []
    for h in range(H):
        rho_h, sup_h = rho[h].tolist(), support[h].tolist()
        natural, fallback = _select_cuts(cand_list, rho_h, sup_h, tau, gamma, g_min)
        groups = _groups_from_cuts(order[h], natural + fallback)
        out.append(
            GroupingResult(
                groups=groups,
                group_ids=group_ids_from_groups(groups, d),
                order=order[h].tolist(),
                chi_mean=mean[h].tolist(),
                candidates=cand_list,
                rho=rho_h,
                support=sup_h,
                natural_cuts=natural,
                fallback_cuts=fallback,
                params=dict(params),
            )
        )
    return out


def group_dimensions(
    chi: torch.Tensor,
    *,
    alpha: float,
    gamma: float,
    tau: float = 1.5,
    g_min: int = 2,
    n_boot: int = 1000,
    seed: int = 0,
    eps: float = 1e-12,
) -> GroupingResult:
    """Group one head's dimensions from its per-prompt contributions ``chi`` ``(P, d)`` (App. B).

    χ_r is the mean over prompts; π its stable ascending order. Candidate cuts are the top-⌈αd⌉ tail
    (:func:`tail_candidates`). A cut is natural when ρ_k ≥ τ (Eq. 16) and its bootstrap support S_k ≥ γ
    (Eqs. 17–18, ``n_boot`` prompt resamples from ``seed``, π fixed). All natural cuts are kept; if they give
    fewer than ``g_min`` groups, unused candidates are added by descending (S_k, ρ_k), ties in candidate order.
    """
    _check_params(alpha, gamma, tau, g_min, n_boot, eps)
    c = _check_chi(chi, "chi", 2)
    params = {"alpha": alpha, "gamma": gamma, "tau": tau, "g_min": g_min, "n_boot": n_boot, "seed": seed, "eps": eps}
    counts = bootstrap_counts(c.shape[0], n_boot, seed)
    return _grouping_results(c[:, None, :], counts, alpha, gamma, tau, g_min, eps, params)[0]


def fixed_budget_groups(chi_mean: torch.Tensor, G: int, *, eps: float = 1e-12) -> GroupingResult:
    """Fig. 2b diagnostic: cut the sorted profile at its ``G − 1`` largest adjacent gaps (App. B).

    "Gap" is the ratio ρ_k = χ_{π_{k+1}} / max(χ_{π_k}, ε) of Eq. 16, over every adjacent pair k = 1…d−1 (not
    only the tail), so the budgets are comparable with the natural cuts. Exact ties keep the lower k. The
    G−1 largest of a fixed ranking are nested, so a larger G only subdivides a smaller G's groups.
    """
    if not isinstance(chi_mean, torch.Tensor) or chi_mean.dim() != 1 or not chi_mean.is_floating_point():
        raise ValueError(
            f"chi_mean: expected a floating tensor of shape (d,), got {getattr(chi_mean, 'shape', chi_mean)}"
        )
    c = _check_chi(chi_mean[None], "chi_mean", 2)[0]
    d = c.numel()
    if not (isinstance(G, int) and 1 <= G <= d):
        raise ValueError(f"G: expected an integer group budget in [1, {d}], got {G!r}")
    order = torch.sort(c, stable=True).indices
    s = c[order]
    cands = list(range(1, d))
    rho = (s[1:] / s[:-1].clamp_min(eps)).tolist()
    ranked = sorted(range(d - 1), key=lambda i: -rho[i])
    cuts = sorted(cands[i] for i in ranked[: G - 1])
    groups = _groups_from_cuts(order, cuts)
    return GroupingResult(
        groups=groups,
        group_ids=group_ids_from_groups(groups, d),
        order=order.tolist(),
        chi_mean=c.tolist(),
        candidates=cands,
        rho=rho,
        support=None,
        natural_cuts=cuts,
        fallback_cuts=[],
        params={"method": "fixed_budget", "G": G, "eps": eps},
    )


@dataclass
class GroupAssignment:
    """Groups for every grouped (layer, query head) of one model, with evidence; JSON round-trip.

    ``layers[l][h]`` is the :class:`GroupingResult` of layer l, query head h.
    """

    model_id: str
    head_dim: int
    num_heads: int
    layers: dict[int, list[GroupingResult]]
    params: dict = field(default_factory=dict)

    def group_ids(self, layer: int) -> torch.Tensor:
        """``(Hq, d)`` long group ids of one layer, the ``groups`` argument of ``OALKernel``."""
        if layer not in self.layers:
            raise ValueError(f"layer: expected one of the grouped layers {sorted(self.layers)}, got {layer}")
        return torch.stack([r.group_ids for r in self.layers[layer]])

    def group_id_tensors(self) -> dict[int, torch.Tensor]:
        """layer → ``(Hq, d)`` group ids for every grouped layer."""
        return {layer: self.group_ids(layer) for layer in sorted(self.layers)}

    def num_groups(self, layer: int | None = None) -> int:
        """Largest group count over the heads of ``layer`` (or of all layers): ``OALKernel``'s ``num_groups``."""
        layers = self.layers.values() if layer is None else [self.layers[layer]]
        return max(r.num_groups for heads in layers for r in heads)

    def group_counts(self) -> list[int]:
        """Group count of every (layer, head), layer-major."""
        return [r.num_groups for layer in sorted(self.layers) for r in self.layers[layer]]

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "model_id": self.model_id,
            "head_dim": self.head_dim,
            "num_heads": self.num_heads,
            "params": self.params,
            "layers": {str(layer): [r.to_dict() for r in heads] for layer, heads in sorted(self.layers.items())},
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), allow_nan=False, indent=1))
        return path

    @classmethod
    def from_dict(
        cls,
        data: Mapping,
        *,
        model_id: str | None = None,
        head_dim: int | None = None,
        num_heads: int | None = None,
        source: str = "groups",
    ) -> GroupAssignment:
        """Validate and load; ``model_id``/``head_dim``/``num_heads``, when given, must match the file."""
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA or data.get("version") != SCHEMA_VERSION:
            got = (data.get("schema"), data.get("version")) if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"{source}: expected schema {SCHEMA!r} version {SCHEMA_VERSION}, got {got}")
        try:
            return cls._from_checked_dict(data, model_id, head_dim, num_heads, source)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{source}: malformed group file ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_checked_dict(
        cls, data: Mapping, model_id: str | None, head_dim: int | None, num_heads: int | None, source: str
    ) -> GroupAssignment:
        for key, want in (("model_id", model_id), ("head_dim", head_dim), ("num_heads", num_heads)):
            if want is not None and data[key] != want:
                raise ValueError(f"{source}: groups were made for {key}={data[key]!r}, but {want!r} was expected")
        d, H = int(data["head_dim"]), int(data["num_heads"])
        layers: dict[int, list[GroupingResult]] = {}
        for key, heads in data["layers"].items():
            if len(heads) != H:
                raise ValueError(f"{source}: layer {key}: expected {H} heads, got {len(heads)}")
            for h, r in enumerate(heads):
                try:
                    group_ids_from_groups(r["groups"], d)
                except ValueError as e:
                    raise ValueError(f"{source}: layer {key} head {h}: {e}") from None
                if len(r["chi_mean"]) != d or sorted(r["order"]) != list(range(d)):
                    raise ValueError(f"{source}: layer {key} head {h}: expected chi_mean/order of length d={d}")
            layers[int(key)] = [GroupingResult.from_dict(r, d) for r in heads]
        if not layers:
            raise ValueError(f"{source}: expected at least one layer")
        return cls(str(data["model_id"]), d, H, layers, dict(data.get("params", {})))

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        model_id: str | None = None,
        head_dim: int | None = None,
        num_heads: int | None = None,
    ) -> GroupAssignment:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such group file")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not a JSON group file (not UTF-8 text: {e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON group file ({e})") from None
        return cls.from_dict(data, model_id=model_id, head_dim=head_dim, num_heads=num_heads, source=str(path))


def group_heads(
    chi: torch.Tensor | Mapping[int, torch.Tensor],
    *,
    model_id: str,
    alpha: float,
    gamma: float,
    tau: float = 1.5,
    g_min: int = 2,
    n_boot: int = 1000,
    seed: int = 0,
    eps: float = 1e-12,
    layers: Sequence[int] | None = None,
) -> GroupAssignment:
    """Group every (layer, head): ``chi`` is ``(L, P, Hq, d)`` per-prompt contributions (layer ids ``layers``,
    default 0..L−1) or a mapping layer → ``(P, Hq, d)``. Equal to :func:`group_dimensions` per head."""
    _check_params(alpha, gamma, tau, g_min, n_boot, eps)
    if isinstance(chi, Mapping):
        if layers is not None:
            raise ValueError("layers: expected None when chi is a mapping (its keys are the layers)")
        items = [(int(layer), _check_chi(c, f"chi[{layer}]", 3)) for layer, c in sorted(chi.items())]
    else:
        if not isinstance(chi, torch.Tensor) or chi.dim() != 4:
            raise ValueError(f"chi: expected a (L, P, Hq, d) tensor or a mapping, got {getattr(chi, 'shape', chi)}")
        ids = list(range(chi.shape[0])) if layers is None else [int(x) for x in layers]
        if len(ids) != chi.shape[0] or len(set(ids)) != len(ids):
            raise ValueError(f"layers: expected {chi.shape[0]} distinct layer ids, got {layers}")
        items = [(layer, _check_chi(chi[i], f"chi[{i}]", 3)) for i, layer in enumerate(ids)]
    if not items:
        raise ValueError("chi: expected at least one layer")
    shapes = {tuple(c.shape) for _, c in items}
    if len(shapes) != 1:
        raise ValueError(f"chi: expected every layer to have the same (P, Hq, d), got {sorted(shapes)}")
    P, H, d = shapes.pop()
    params = {"alpha": alpha, "gamma": gamma, "tau": tau, "g_min": g_min, "n_boot": n_boot, "seed": seed, "eps": eps}
    counts = bootstrap_counts(P, n_boot, seed)
    out = {layer: _grouping_results(c, counts, alpha, gamma, tau, g_min, eps, params) for layer, c in items}
    return GroupAssignment(model_id, d, H, out, {**params, "num_prompts": P})
