"""Chunked (block-GEMM) evaluation of the quadratic kernel: the HD form of Eq. 5–6, one chunk at a time.

For a chunk of positions ``[s, e)`` and the prefix state ``S = Σ_{j<s} φ_k(k_j) u_jᵀ`` of Eq. 5:

    num_i = φ_q(q_i) S  +  Σ_{s≤j≤i} κ(q_i, k_j) u_j         (inter-chunk readout, Eq. 6, + exact intra-chunk part)
    S ← S + φ_k(K_chunk)ᵀ U_chunk
    o_i = num_i[:dv] / num_i[dv]

Layout choices, all for speed on CPUs and a small working set:

* The coefficients sit on the query side, so the G = Hq/Hkv query heads of a KV head read one shared state;
  their chunks are stacked into one GEMM ``φ_q (G·n, D) @ S (D, dv+1)``.
* Work proceeds one KV head at a time, so the live memory beyond inputs and output is one state plus the
  features of one chunk (about 3.5 MB at d = 64 and the default chunk of 64), whatever N is.
* Features use the cyclic layout of :func:`utils.cyclic_maps`: one broadcast product against a strided view
  gives ``[1, x, x_r x_t]`` with no gather. The state is converted to and from the canonical packed layout
  only at the ends of a segment.
* The intra-chunk kernel comes either from the feature product (any symmetric C) or, given a
  :class:`KernelFactor`, from R score matrices squared and summed (Eq. 7): R·(d+1) instead of D per pair.
* Without autograd, per-chunk tensors live in buffers reused across chunks (cache-hot writes are several times
  faster than fresh allocations); with autograd the same steps run out-of-place, so the function is
  differentiable in q, k, v, a, b, C, the factor and the initial state.
"""

from __future__ import annotations

import math

import torch

from .utils import (
    KernelFactor,
    QuadraticAttentionOutput,
    check_coefficients,
    check_factor,
    check_floor,
    check_key_weight,
    check_qkv,
    check_state,
    compute_dtype,
    cyclic_features,
    cyclic_maps,
    cyclic_query_weights,
    cyclic_width,
    default_scale,
)

DEFAULT_CHUNK = 64


def factored_kernel(q: torch.Tensor, k: torch.Tensor, factor: KernelFactor, scale: float) -> torch.Tensor:
    """Explicit kernel from its sum-of-squares form: q ``(B, Hq, Nq, d)``, k ``(B, Hkv, Nk, d)`` ->
    ``(B, Hq, Nq, Nk)`` with ``κ = c0 + Σ_m (c_m + scale · (q ⊙ W_m) · k)²``."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    R = factor.c.shape[-1]
    qw = q[:, :, None] * (factor.W * scale)[None, :, :, None, :]
    z = (qw.reshape(B, Hkv, -1, d) @ k.mT).view(B, Hq, R, Nq, Nk)
    z = z + factor.c[None, :, :, None, None]
    return factor.c0[None, :, None, None] + z.square().sum(2)


class _Workspace:
    """Flat buffers of the no-grad path; ``take`` carves a contiguous tensor from the front of one."""

    def __init__(self, sizes: dict[str, int], dtype: torch.dtype, device: torch.device) -> None:
        self.flat = {name: torch.empty(size, dtype=dtype, device=device) for name, size in sizes.items()}

    def take(self, name: str, *shape: int) -> torch.Tensor:
        return self.flat[name][: math.prod(shape)].view(*shape)


def chunk_quadratic_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    C: torch.Tensor,
    *,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    factor: KernelFactor | None = None,
    kernel_floor: float | None = None,
    key_weight: torch.Tensor | None = None,
    return_denominator: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | QuadraticAttentionOutput:
    """Chunked causal quadratic-kernel attention; see :func:`oal.ops.quadratic_attention` for the arguments.

    Returns ``o (B, Hq, N, dv)`` in q's dtype and, if asked, the packed final state ``(B, Hkv, D, dv+1)`` in
    the accumulation dtype (fp32, or fp64 for fp64 inputs); with ``return_denominator`` a
    :class:`QuadraticAttentionOutput`.
    """
    dims = check_qkv(q, k, v)
    check_coefficients(a, b, C, dims)
    if factor is not None:
        check_factor(factor, dims)
    if initial_state is not None:
        check_state(initial_state, dims)
    check_floor(kernel_floor)
    if key_weight is not None:
        check_key_weight(key_weight, dims, q.device)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    s = default_scale(dims.d, scale)
    B, Hq, Hkv, N, d, dv = dims
    G = dims.group
    cdt = compute_dtype(q.dtype)
    dev = q.device
    canon_of_cyc, cyc_of_canon = cyclic_maps(d, dev)
    Dc = canon_of_cyc.numel()
    one_row = d * cyclic_width(d + 1)  # cyclic index of x'_d · x'_d = 1 · 1 (r = d, δ = 0)
    cs = max(1, min(chunk_size, N))
    R = 0 if factor is None else factor.c.shape[-1]
    extra = tuple(x for x in (initial_state, key_weight) if x is not None)
    inputs = (q, k, v, a, b, C, *(factor or ()), *extra)
    fast = not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs))
    if fast:
        ws = _Workspace(
            {
                "pq": B * G * cs * Dc,
                "pk": B * cs * Dc,
                "num": B * G * cs * (dv + 1),
                "qw": B * G * R * cs * (d + 1),
                "z": B * G * R * cs * cs,
                "kern": B * G * cs * cs,
            },
            cdt,
            dev,
        )

    w = cyclic_query_weights(a.to(cdt), b.to(cdt), C.to(cdt), s).view(Hkv, G, 1, Dc)
    if factor is not None:
        fw = (factor.W.to(cdt) * s).view(Hkv, G, R, 1, d)
        fc = factor.c.to(cdt).view(Hkv, G, R, 1, 1)
        c0 = factor.c0.to(cdt).view(Hkv, G, 1, 1)

    o = torch.empty(B, Hq, N, dv, dtype=q.dtype, device=dev)
    o_groups = o.view(B, Hkv, G, N, dv)
    dens = torch.empty(B, Hkv, G, N, dtype=cdt, device=dev) if return_denominator else None
    q_groups = q.view(B, Hkv, G, N, d)
    causal = torch.ones(cs, cs, dtype=cdt, device=dev).tril()  # [query i, key j]
    steps = torch.arange(1, cs + 1, dtype=cdt, device=dev)[:, None]
    finals = []

    for h in range(Hkv):
        if initial_state is None:
            state = torch.zeros(B, Dc, dv + 1, dtype=cdt, device=dev)
        else:
            state = initial_state[:, h].to(cdt)[:, canon_of_cyc]
        # keys before this segment: H0's count column, which the cyclic layout stores at the 1·1 feature
        seen = state[:, None, one_row : one_row + 1, dv:].detach().clone()  # (B, 1, 1, 1)

        for start in range(0, N, cs):
            end = min(start + cs, N)
            n = end - start
            qc = q_groups[:, h, :, start:end].to(cdt)  # (B, G, n, d)
            kc = k[:, h, start:end].to(cdt)  # (B, n, d)
            vc = v[:, h, start:end].to(cdt)
            u = torch.cat([vc, torch.ones_like(vc[..., :1])], dim=-1)  # (B, n, dv+1)
            if key_weight is None:
                count = seen + steps[:n]  # keys seen by each query, (B, 1, n, 1)
            else:
                wc = key_weight[:, h, start:end].to(cdt)
                u = u * wc[..., None]
                count = seen + wc.detach().cumsum(-1)[:, None, :, None]
            k1 = torch.cat([kc, torch.ones_like(kc[..., :1])], dim=-1)  # (B, n, d+1)

            # inter-chunk readout (Eq. 6) of the G heads at once: (G·n, D) @ (D, dv+1)
            if fast:
                pq = cyclic_features(qc, out=ws.take("pq", B, G, n, Dc)).mul_(w[h])
                num = torch.matmul(pq.view(B, G * n, Dc), state, out=ws.take("num", B, G * n, dv + 1))
            else:
                pq = cyclic_features(qc) * w[h]
                num = pq.view(B, G * n, Dc) @ state

            # intra-chunk part: the explicit kernel on the causal triangle, rows (head, query), columns keys
            if factor is not None and fast:
                qw = ws.take("qw", B, G, R, n, d + 1)
                torch.mul(qc[:, :, None], fw[h], out=qw[..., :d])
                qw[..., d:] = fc[h]
                z = torch.matmul(qw.view(B, G * R * n, d + 1), k1.mT, out=ws.take("z", B, G * R * n, n))
                kern = torch.sum(z.square_().view(B, G, R, n, n), 2, out=ws.take("kern", B, G, n, n))
                kern.add_(c0[h]).mul_(causal[:n, :n])
            elif factor is not None:
                qw = torch.cat([qc[:, :, None] * fw[h], fc[h].expand(B, G, R, n, 1)], dim=-1)
                z = qw.view(B, G * R * n, d + 1) @ k1.mT
                kern = (z.view(B, G, R, n, n).square().sum(2) + c0[h]) * causal[:n, :n]
            else:
                kern = (pq.view(B, G * n, Dc) @ cyclic_features(kc).mT).view(B, G, n, n) * causal[:n, :n]
            if fast:
                num.baddbmm_(kern.view(B, G * n, n), u)
            else:
                num = torch.baddbmm(num, kern.view(B, G * n, n), u)

            num = num.view(B, G, n, dv + 1)
            den = num[..., dv:]
            if kernel_floor is not None:
                den = torch.maximum(den, kernel_floor * count)
            if return_denominator:
                dens[:, h, :, start:end] = den[..., 0]
            if key_weight is not None:  # no key with weight > 0 yet: output 0, not 0/0
                den = torch.where(count > 0, den, torch.ones_like(den))
            o_groups[:, h, :, start:end] = (num[..., :dv] / den).to(q.dtype)

            # state update (Eq. 5): S += φ_k(K)ᵀ U
            if fast:
                state.baddbmm_(cyclic_features(kc, out=ws.take("pk", B, n, Dc)).mT, u)
            else:
                state = torch.baddbmm(state, cyclic_features(kc).mT, u)
            seen = count[:, :, -1:]
        if output_final_state:
            finals.append(state[:, cyc_of_canon])
    final = torch.stack(finals, dim=1) if output_final_state else None
    if return_denominator:
        return QuadraticAttentionOutput(o, dens.view(B, Hq, N), final)
    return o, final
