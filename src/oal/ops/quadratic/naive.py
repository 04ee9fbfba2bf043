"""Ground truth: the explicit N×N kernel matrix of Eq. 3, masked causally and normalised.

Nothing here uses the packed layout of the fast paths: the quadratic term is ``Σ_{r,t} C_rt x_r x_t`` written
as an inner product over all d² ordered pairs, so this file checks the packing, the multiplicities and the
coefficient placement of ``chunk.py`` and ``recurrent.py`` rather than sharing them.
"""

from __future__ import annotations

import torch

from .utils import (
    QuadraticAttentionOutput,
    check_coefficients,
    check_key_weight,
    check_qkv,
    check_state,
    compute_dtype,
    default_scale,
    split_state,
)


def naive_kernel_matrix(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor, C: torch.Tensor, scale: float
) -> torch.Tensor:
    """Explicit κ(q_i, k_j) of Eq. 3 for one head: q ``(Nq, d)``, k ``(Nk, d)``, a ``()``, b ``(d,)``,
    C ``(d, d)`` -> ``(Nq, Nk)``.

    ``Σ_r b_r x_r = scale · (q ⊙ b) · k`` and ``Σ_{r,t} C_rt x_r x_t = scale² · vec(C ⊙ q qᵀ) · vec(k kᵀ)``.
    """
    lin = (q * b) @ k.T * scale
    qq = (q[:, :, None] * q[:, None, :] * C).flatten(1)
    kk = (k[:, :, None] * k[:, None, :]).flatten(1)
    return a + lin + (qq @ kk.T) * scale**2


def naive_quadratic_attention(
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
    key_weight: torch.Tensor | None = None,
    return_denominator: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | QuadraticAttentionOutput:
    """O(N²) causal normalised kernel attention, ``o_i = Σ_{j≤i} ω_j κ_ij v_j / Σ_{j≤i} ω_j κ_ij`` (ω_j = 1
    without ``key_weight``).

    Shapes as in :func:`oal.ops.quadratic_attention`. An ``initial_state`` (packed, from a previous segment)
    adds its readout ``Σ_{prefix} κ(q_i, k_j) u_j``, evaluated here from the unpacked H0, H1, H2 of Eq. 5–6.
    The final state is the explicit sum of Eq. 5 over the prefix and this segment.
    """
    dims = check_qkv(q, k, v)
    check_coefficients(a, b, C, dims)
    if initial_state is not None:
        check_state(initial_state, dims)
    if key_weight is not None:
        check_key_weight(key_weight, dims, q.device)
    s = default_scale(dims.d, scale)
    cdt = compute_dtype(q.dtype)
    qf, kf, vf = q.to(cdt), k.to(cdt), v.to(cdt)
    af, bf, Cf = a.to(cdt), b.to(cdt), C.to(cdt)
    u = torch.cat([vf, torch.ones_like(vf[..., :1])], dim=-1)
    count = None  # weighted number of keys each query sees, (B, Hkv, N)
    if key_weight is not None:
        u = u * key_weight.to(cdt)[..., None]
        count = key_weight.detach().to(cdt).cumsum(-1)
        if initial_state is not None:
            count = count + initial_state[:, :, :1, -1].detach().to(cdt)
    mask = torch.ones(dims.N, dims.N, dtype=torch.bool, device=q.device).tril()
    prefix = None
    if initial_state is not None:
        h0, h1, h2 = split_state(initial_state.to(cdt), dims.d)
        prefix = (h0, h1, h2)
    out, dens = [], []
    for bi in range(dims.B):
        heads, head_dens = [], []
        for h in range(dims.Hq):
            kv = h // dims.group
            kappa = naive_kernel_matrix(qf[bi, h], kf[bi, kv], af[h], bf[h], Cf[h], s)
            num = torch.where(mask, kappa, torch.zeros_like(kappa)) @ u[bi, kv]
            if prefix is not None:
                h0, h1, h2 = (p[bi, kv] for p in prefix)
                qi = qf[bi, h]
                num = (
                    num
                    + af[h] * h0
                    + s * (qi * bf[h]) @ h1
                    + s**2 * torch.einsum("ir,it,rt,rtc->ic", qi, qi, Cf[h], h2)
                )
            den = num[:, -1:]
            if count is not None:  # no key with weight > 0 yet: output 0, not 0/0
                den = torch.where(count[bi, kv, :, None] > 0, den, torch.ones_like(den))
            heads.append(num[:, :-1] / den)
            head_dens.append(num[:, -1])
        out.append(torch.stack(heads))
        dens.append(torch.stack(head_dens))
    o = torch.stack(out).to(q.dtype)
    final = None
    if output_final_state:
        final = _explicit_state(kf, u, dims.d)
        if initial_state is not None:
            final = final + initial_state.to(cdt)
    if return_denominator:
        return QuadraticAttentionOutput(o, torch.stack(dens), final)
    return o, final


def _explicit_state(k: torch.Tensor, u: torch.Tensor, d: int) -> torch.Tensor:
    """Eq. 5 summed over all tokens, packed: ``(B, Hkv, N, d)``, ``(B, Hkv, N, dv+1)`` -> ``(B, Hkv, D, dv+1)``."""
    h0 = u.sum(-2, keepdim=True)
    h1 = torch.einsum("bhnr,bhnc->bhrc", k, u)
    h2 = torch.einsum("bhnr,bhnt,bhnc->bhrtc", k, k, u)
    r, t = torch.triu_indices(d, d, device=k.device)
    return torch.cat([h0, h1, h2[:, :, r, t, :]], dim=-2)
