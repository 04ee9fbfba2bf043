"""The high-contribution-dimension intervention of §3.2 / App. A.2 (Table 1).

For query head h with high-contribution subset S_h (the union of its non-bulk groups, Eq. 19) and a baseline m,
the exact kernel factorises over dimensions (Eq. 8–9). The hybrid kernel approximates only the S_h part:

    κ̃_ij = κ̂^(m)_S(q_i ⊙ 1_S, k_j ⊙ 1_S) · exp(Σ_{r∉S} q_ir k_jr / √d)                       (10)
    ỹ_i  = Σ_{j≤i} κ̃_ij v_j / Σ_{j≤i} κ̃_ij                                                  (11)

where κ̂_S is the baseline applied to the masked vectors *with its own input preprocessing* (the kernel's
:meth:`~oal.kernels.AttentionKernel.weights` on the masked q, k). Errors are attention-output MSEs against exact
softmax at sampled query positions, averaged over heads, positions and output dimensions (Eq. 12–13), and
``R_S = E_S / E_full`` (Eq. 14).

GQA: S_h belongs to a query head, but keys are shared by the query heads of a KV head, so keys are repeated to
the query heads before masking and the kernel is rebuilt with one KV head per query head
(:func:`expand_kv_heads`; its parameters and fixed projections are per query head or per layer, so it is the
same kernel). Kernel weights carry per-row stabilisers (Performer's shifts); a positive factor per query row
cancels in Eq. 11. Everything after the kernel call is float64.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..grouping import GroupAssignment, group_heads
from ..kernels import AttentionKernel, repeat_kv


def subset_mask(groups: GroupAssignment, layer: int) -> torch.Tensor:
    """``(Hq, d)`` bool: True on S_h = the union of head h's non-bulk groups (group id ≥ 1; the bulk is group 0)."""
    return groups.group_ids(layer) > 0


def expand_kv_heads(kernel: AttentionKernel) -> AttentionKernel:
    """A copy of ``kernel`` with one KV head per query head (keys/values repeated by the caller), same state.

    Registry kernels keep no state tied to the KV-head count, so the copy computes the same kernel on repeated
    keys; the count is changed on a deep copy to keep the caller's kernel intact."""
    if kernel.num_kv_heads == kernel.num_heads:
        return kernel
    out = copy.deepcopy(kernel)
    for m in out.modules():
        if isinstance(m, AttentionKernel):
            m.num_kv_heads = m.num_heads
    return out


def sample_positions(n: int, count: int, seed: int, layer: int, block: int) -> torch.Tensor:
    """``count`` distinct causal query positions in ``[0, n)`` (sorted), determined by (seed, layer, block) only,
    so every method, kernel seed and subset is evaluated at the same positions."""
    if not 1 <= count <= n:
        raise ValueError(f"positions: expected 1 ≤ count ≤ N={n}, got {count}")
    words = np.random.SeedSequence([seed, layer, block, 0x51]).generate_state(2, dtype=np.uint32)
    gen = torch.Generator().manual_seed((int(words[0]) << 31) ^ int(words[1]))
    return torch.randperm(n, generator=gen)[:count].sort().values


def exact_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float):
    """Exact causal softmax outputs ``(Hq, P, dv)`` (float64) of one sequence: q ``(Hq, N, d)``, k ``(Hkv, N, d)``,
    v ``(Hkv, N, dv)``."""
    Hq = q.shape[0]
    kk = repeat_kv(k[None].double(), Hq)[0]
    vv = repeat_kv(v[None].double(), Hq)[0]
    logits = (q[:, positions].double() @ kk.mT) * scale
    causal = torch.arange(k.shape[1])[None, :] <= positions[:, None]
    logits = logits.masked_fill(~causal, float("-inf"))
    return torch.softmax(logits, -1) @ vv


def hybrid_outputs(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    masks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Eq. 10–11 for M subsets at once: q ``(Hq, N, d)``, k ``(Hkv, N, d)``, v ``(Hkv, N, dv)`` of one sequence,
    ``masks (M, Hq, d)`` bool (True: dimension approximated by ``kernel``) -> ``(M, Hq, P, dv)`` float64.

    ``kernel`` must have one KV head per query head (:func:`expand_kv_heads`). Keys after the last position are
    dropped first (causality makes them irrelevant). An all-True mask gives the full method, an all-False one exact
    softmax (whenever the kernel is constant in j on zero vectors, as all registry baselines are)."""
    Hq, N, d = q.shape
    if masks.dim() != 3 or masks.shape[1:] != (Hq, d) or masks.dtype != torch.bool:
        raise ValueError(f"masks: expected a bool tensor of shape (M, {Hq}, {d}), got {tuple(masks.shape)}")
    if kernel.num_kv_heads != kernel.num_heads or kernel.num_heads != Hq:
        raise ValueError(
            f"kernel: expected {Hq} query and KV heads (expand_kv_heads), got {kernel.num_heads}, {kernel.num_kv_heads}"
        )
    n = int(positions.max()) + 1
    q, kk, vv = q[:, :n], repeat_kv(k[None, :, :n], Hq)[0], repeat_kv(v[None, :, :n], Hq)[0]
    m = masks[:, :, None, :].to(q.dtype)
    with torch.no_grad():
        w = kernel.weights(q[None] * m, kk[None] * m, positions).double()  # (M, Hq, P, n)
        qc = q[:, positions].double()[None] * (~masks)[:, :, None, :]  # (M, Hq, P, d): the exact complement
        logits = (qc @ kk.double().mT) * scale
        causal = torch.arange(n)[None, :] <= positions[:, None]
        logits = logits.masked_fill(~causal, float("-inf"))
        factor = torch.exp(logits - logits.amax(-1, keepdim=True))
        wt = w * factor
        return (wt @ vv.double()) / wt.sum(-1, keepdim=True)


def output_mse(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Eq. 12–13: mean over heads, positions and output dimensions; ``y (..., Hq, P, dv)`` -> ``(...)``."""
    return (y - ref).square().mean(dim=(-3, -2, -1))


def matched_controls(mask: torch.Tensor, bulk: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` cardinality-matched random subsets: for each head, |S_h| dimensions drawn without replacement from
    its bulk group. ``mask``, ``bulk`` ``(Hq, d)`` bool -> ``(count, Hq, d)`` bool."""
    Hq, d = mask.shape
    out = torch.zeros(count, Hq, d, dtype=torch.bool)
    for h in range(Hq):
        size = int(mask[h].sum())
        pool = bulk[h].nonzero().flatten()
        if size > pool.numel():
            raise ValueError(f"mask: head {h} has |S|={size} but only {pool.numel()} bulk dimensions")
        if size == 0:
            continue
        keys = torch.rand(count, pool.numel(), generator=gen)
        pick = pool[keys.argsort(-1)[:, :size]]
        out[torch.arange(count)[:, None], h, pick] = True
    return out


def p_value(observed: float, controls: Sequence[float] | torch.Tensor) -> float:
    """Eq. 15: one-sided Monte-Carlo p-value ``(1 + #{R_b ≥ R_S}) / (B + 1)``."""
    c = torch.as_tensor(controls, dtype=torch.float64).flatten()
    if c.numel() == 0:
        raise ValueError("controls: expected at least one control replicate")
    return (1 + int((c >= observed).sum())) / (c.numel() + 1)


def gaussian_groups(
    template: GroupAssignment, layers: Sequence[int], num_kv_heads: int, lengths: Sequence[int], seed: int
) -> GroupAssignment:
    """The Gaussian control's grouping (App. A.1): the grouping procedure of ``template`` (its α, γ, τ, G_min, B,
    bootstrap seed) applied to χ (Eq. 2) of i.i.d. N(0, 1) queries/keys with the calibration prompts' shapes
    (``lengths``, ``(Hq, Hkv, d)``), drawn independently per layer from ``seed``."""
    from ..analysis import gaussian_control_scores

    p = template.params
    chi = {
        layer: gaussian_control_scores(
            lengths, template.num_heads, num_kv_heads, template.head_dim, seed=seed * 100_003 + layer
        )
        for layer in layers
    }
    return group_heads(
        chi,
        model_id=f"gaussian-control({template.model_id})",
        alpha=p["alpha"],
        gamma=p["gamma"],
        tau=p.get("tau", 1.5),
        g_min=p.get("g_min", 2),
        n_boot=p.get("n_boot", 1000),
        seed=p.get("seed", 0),
        eps=p.get("eps", 1e-12),
    )


def gaussian_qk(q: torch.Tensor, k: torch.Tensor, seed: int, layer: int, block: int):
    """i.i.d. N(0, 1) tensors with the shapes of q and k (fp32), determined by (seed, layer, block)."""
    words = np.random.SeedSequence([seed, layer, block, 0x6A]).generate_state(2, dtype=np.uint32)
    gen = torch.Generator().manual_seed((int(words[0]) << 31) ^ int(words[1]))
    return torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)


def retained_ratio(e_s: torch.Tensor, e_full: torch.Tensor) -> torch.Tensor:
    """Eq. 14 with the A.2 aggregation: ``e_s``, ``e_full`` ``(L, B, seeds, ...)`` -> MSEs averaged over seeds,
    then the ratio per (layer, sequence), then the macro-average over layers and sequences: ``(...)``."""
    es, ef = e_s.mean(2), e_full.mean(2)
    while ef.dim() < es.dim():
        ef = ef[..., None]
    return (es / ef).mean(dim=(0, 1))


@dataclass
class InterventionErrors:
    """Attention-output MSEs ``(L, B, S)`` (layers × blocks × kernel seeds) of one method: full head (``full``),
    high-contribution subset (``subset``), and their Gaussian-control counterparts; ``controls (L, Bc, S, C)`` on
    the first Bc blocks for the C matched random subsets."""

    full: torch.Tensor
    subset: torch.Tensor
    gauss_full: torch.Tensor | None = None
    gauss_subset: torch.Tensor | None = None
    controls: torch.Tensor | None = None

    def summary(self, layers: Sequence[int]) -> dict:
        out: dict = {
            "R_S": float(retained_ratio(self.subset, self.full)),
            "E_S": float(self.subset.mean()),
            "E_full": float(self.full.mean()),
            "per_layer": {
                str(layer): {
                    "R_S": float(retained_ratio(self.subset[i : i + 1], self.full[i : i + 1])),
                    "E_S": float(self.subset[i].mean()),
                    "E_full": float(self.full[i].mean()),
                }
                for i, layer in enumerate(layers)
            },
        }
        if self.gauss_full is not None:
            out["R_S_gaussian"] = float(retained_ratio(self.gauss_subset, self.gauss_full))
            out["E_S_gaussian"] = float(self.gauss_subset.mean())
            out["E_full_gaussian"] = float(self.gauss_full.mean())
            for i, layer in enumerate(layers):
                out["per_layer"][str(layer)]["R_S_gaussian"] = float(
                    retained_ratio(self.gauss_subset[i : i + 1], self.gauss_full[i : i + 1])
                )
        if self.controls is not None and self.controls.shape[-1] > 0:
            nb = self.controls.shape[1]
            observed = float(retained_ratio(self.subset[:, :nb], self.full[:, :nb]))
            r_b = retained_ratio(self.controls, self.full[:, :nb])
            out["controls"] = {
                "B": int(r_b.numel()),
                "blocks": nb,
                "R_S_on_control_blocks": observed,
                "R_controls_mean": float(r_b.mean()),
                "R_controls_max": float(r_b.max()),
                "exceeding": int((r_b >= observed).sum()),
                "p_value": p_value(observed, r_b),
            }
        return out


def evaluate_intervention(
    get_states,
    make_kernel,
    seeds: Sequence[int],
    masks: dict[int, torch.Tensor],
    layers: Sequence[int],
    blocks: Sequence[int],
    *,
    positions: int = 32,
    seed: int = 0,
    gaussian_masks: dict[int, torch.Tensor] | None = None,
    controls: int = 0,
    control_blocks: int = 0,
    batch: int = 4,
    on_step=None,
) -> InterventionErrors:
    """All MSEs of one method.

    ``get_states(layer, block)`` -> :class:`oal.fidelity.capture.LayerStates` with batch 1; ``make_kernel(s,
    layer)`` -> the method's kernel for kernel seed s; ``masks[layer]`` ``(Hq, d)`` the subsets S_h (their
    complement within each head is the bulk group from which matched controls are drawn); ``gaussian_masks``
    the Gaussian control's subsets (None: no Gaussian control). Controls: ``controls`` matched subsets per layer
    (drawn once from ``(seed, layer)``, shared by blocks and kernel seeds), evaluated on the first
    ``control_blocks`` blocks; subsets are evaluated ``batch`` at a time."""
    L, B, S = len(layers), len(blocks), len(seeds)
    full, subset = torch.zeros(L, B, S, dtype=torch.float64), torch.zeros(L, B, S, dtype=torch.float64)
    g_full = torch.zeros(L, B, S, dtype=torch.float64) if gaussian_masks is not None else None
    g_subset = torch.zeros(L, B, S, dtype=torch.float64) if gaussian_masks is not None else None
    nc = min(control_blocks, B) if controls else 0
    ctrl = torch.zeros(L, nc, S, controls, dtype=torch.float64) if nc else None
    for li, layer in enumerate(layers):
        mask = masks[layer]
        ctrl_masks = None
        if nc:
            words = np.random.SeedSequence([seed, layer, 0xC7]).generate_state(2, dtype=np.uint32)
            gen = torch.Generator().manual_seed((int(words[0]) << 31) ^ int(words[1]))
            ctrl_masks = matched_controls(mask, ~mask, controls, gen)
        kernels = [expand_kv_heads(make_kernel(s, layer)) for s in seeds]
        for bi, b in enumerate(blocks):
            st = get_states(layer, b)
            q, k, v = st.q[0], st.k[0], st.v[0]
            pos = sample_positions(q.shape[1], positions, seed, layer, b)
            ref = exact_outputs(q, k, v, pos, st.scale)
            both = torch.stack([torch.ones_like(mask), mask])
            if gaussian_masks is not None:
                gq, gk = gaussian_qk(q, k, seed, layer, b)
                g_ref = exact_outputs(gq, gk, v, pos, st.scale)
                g_both = torch.stack([torch.ones_like(mask), gaussian_masks[layer]])
            for si, kern in enumerate(kernels):
                e = output_mse(hybrid_outputs(kern, q, k, v, pos, both, st.scale), ref)
                full[li, bi, si], subset[li, bi, si] = e[0], e[1]
                if gaussian_masks is not None:
                    e = output_mse(hybrid_outputs(kern, gq, gk, v, pos, g_both, st.scale), g_ref)
                    g_full[li, bi, si], g_subset[li, bi, si] = e[0], e[1]
                if ctrl is not None and bi < nc:
                    for c0 in range(0, controls, batch):
                        cm = ctrl_masks[c0 : c0 + batch]
                        ctrl[li, bi, si, c0 : c0 + cm.shape[0]] = output_mse(
                            hybrid_outputs(kern, q, k, v, pos, cm, st.scale), ref
                        )
            if on_step is not None:
                on_step()
    return InterventionErrors(full, subset, g_full, g_subset, ctrl)
