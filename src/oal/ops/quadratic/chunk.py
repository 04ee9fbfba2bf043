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
* Without autograd, on CPU, with a factor, the fused C++ kernel of :mod:`.cpu` runs the loop
  (:func:`_forward_fused`): the same arithmetic in its own register-tiled kernel, features never written out. A
  fresh segment (no initial state) runs in parallel form (the N×N kernel, causal, then one fold into the final
  state) while that is cheaper (:func:`parallel_pays`); a longer one runs its first :func:`parallel_prefix` tokens
  so and the rest in the loop from their state.
* Otherwise without autograd (:func:`_forward_no_grad`) each (batch, KV head) runs on 2-D GEMMs with every per-chunk
  tensor written into a buffer allocated once (cache-hot writes are several times faster than fresh
  allocations) and the constant columns of ``[x, 1]`` and ``[v, 1]`` filled once.
* With autograd, on CPU, with a factor, :class:`_FusedChunk` runs that forward (the torch loop in fp64) and the
  fused reverse chunk scan ``chunk_backward`` of :mod:`.cpu` (states recomputed per chunk, features never stored
  for the sequence); otherwise (:func:`_forward_autograd`) the same steps run out-of-place through autograd.
  Either way the function is differentiable in q, k, v, a, b, C, the factor, the initial state and the key weights.
"""

from __future__ import annotations

import torch

from . import cpu as cpu_kernel
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
    cyclic_pair_products,
    cyclic_query_weights,
    cyclic_width,
    default_scale,
    factor_from_coefficients,
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
    return chunk_checked(
        q, k, v, a, b, C, dims, default_scale(dims.d, scale), chunk_size, initial_state, output_final_state, factor,
        kernel_floor, key_weight, return_denominator,
    )  # fmt: skip


def chunk_checked(
    q, k, v, a, b, C, dims, s, chunk_size, initial_state, output_final_state, factor, kernel_floor, key_weight,
    return_denominator,
):  # fmt: skip
    """:func:`chunk_quadratic_attention` on inputs its checks passed (``dims`` from ``check_qkv``, ``s`` the
    scale): for a caller that validated the same tensors (the sink/window operator's kernel part), whose checks
    would otherwise run twice per layer and chunk of a prompt."""
    cs = max(1, min(chunk_size, dims.N))
    extra = tuple(x for x in (initial_state, key_weight) if x is not None)
    inputs = (q, k, v, a, b, C, *(factor or ()), *extra)
    args = (q, k, v, a, b, C, s, cs, initial_state, output_final_state, factor, kernel_floor, key_weight)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    if not grad and factor is None and cpu_kernel.usable(q, True) and cpu_kernel.load() is not None:
        # a call without a factor (e.g. raw a, b, C) reaches the fused kernel through C's eigendecomposition
        derived = factor_from_coefficients(a, b, C)
        if derived is not None:
            args = (*args[:10], derived, *args[11:])
            factor = derived
    if grad and factor is not None and _fused_backward_usable(q) and (ext := cpu_kernel.load()) is not None:
        o, dens, final = _FusedChunk.apply(
            q, k, v, a, b, C, *factor, initial_state, key_weight, s, cs, output_final_state, kernel_floor, ext
        )
    elif grad:
        o, dens, final = _forward_autograd(*args, return_denominator)
    elif cpu_kernel.usable(q, factor) and (ext := cpu_kernel.load()) is not None:
        o, dens, final = _forward_fused(ext, *args, return_denominator)
    else:
        o, dens, final = _forward_no_grad(*args, return_denominator)
    if return_denominator:
        return QuadraticAttentionOutput(o, dens.view(dims.B, dims.Hq, dims.N), final)
    return o, final


def _query_coefficients(a, b, C, factor, s, cdt, Hkv):
    """The query side of the kernel, per (KV head, query head of its group), in ``cdt``: the cyclic query weights
    ``(Hkv, G, e, P)`` and, given a factor, ``scale·W (Hkv, G, R, d)``, ``c (Hkv, G, R)`` and ``c0 (Hkv, G)``
    (None without one). Differentiable; each evaluation path adds its own broadcast axes."""
    Hq, d = b.shape
    G, e = Hq // Hkv, d + 1
    w = cyclic_query_weights(a.to(cdt), b.to(cdt), C.to(cdt), s).reshape(Hkv, G, e, cyclic_width(e))
    if factor is None:
        return w, None, None, None
    R = factor.c.shape[-1]
    fw = (factor.W.to(cdt) * s).reshape(Hkv, G, R, d)
    return w, fw, factor.c.to(cdt).reshape(Hkv, G, R), factor.c0.to(cdt).reshape(Hkv, G)


def _forward_autograd(
    q, k, v, a, b, C, s, cs, initial_state, output_final_state, factor, kernel_floor, key_weight, return_denominator
):
    """Out-of-place chunk loop: differentiable in every tensor input. Returns ``(o, dens or None, final or None)``."""
    B, Hq, N, d = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    G = Hq // Hkv
    cdt = compute_dtype(q.dtype)
    dev = q.device
    canon_of_cyc, cyc_of_canon = cyclic_maps(d, dev)
    one_row = d * cyclic_width(d + 1)  # cyclic index of x'_d · x'_d = 1 · 1 (r = d, δ = 0)
    w, fw, fc, c0 = _query_coefficients(a, b, C, factor, s, cdt, Hkv)
    w = w.reshape(Hkv, G, 1, -1)
    if factor is not None:
        R = factor.c.shape[-1]
        fw, fc, c0 = fw[:, :, :, None], fc[..., None, None], c0[..., None, None]

    o = torch.empty(B, Hq, N, dv, dtype=q.dtype, device=dev)
    o_groups = o.view(B, Hkv, G, N, dv)
    dens = torch.empty(B, Hkv, G, N, dtype=cdt, device=dev) if return_denominator else None
    q_groups = q.view(B, Hkv, G, N, d)
    causal = torch.ones(cs, cs, dtype=cdt, device=dev).tril()  # [query i, key j]
    steps = torch.arange(1, cs + 1, dtype=cdt, device=dev)[:, None]
    finals = []

    for h in range(Hkv):
        if initial_state is None:
            state = torch.zeros(B, canon_of_cyc.numel(), dv + 1, dtype=cdt, device=dev)
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

            # inter-chunk readout (Eq. 6) of the G heads at once: (G·n, D) @ (D, dv+1)
            pq = cyclic_features(qc) * w[h]
            num = pq.view(B, G * n, -1) @ state
            pk = cyclic_features(kc)

            # intra-chunk part: the explicit kernel on the causal triangle, rows (head, query), columns keys
            if factor is not None:
                k1 = torch.cat([kc, torch.ones_like(kc[..., :1])], dim=-1)  # (B, n, d+1)
                qw = torch.cat([qc[:, :, None] * fw[h], fc[h].expand(B, G, R, n, 1)], dim=-1)
                z = qw.view(B, G * R * n, d + 1) @ k1.mT
                kern = (z.view(B, G, R, n, n).square().sum(2) + c0[h]) * causal[:n, :n]
            else:
                kern = (pq.view(B, G * n, -1) @ pk.mT).view(B, G, n, n) * causal[:n, :n]
            num = torch.baddbmm(num, kern.view(B, G * n, n), u).view(B, G, n, dv + 1)

            den = num[..., dv:]
            if kernel_floor is not None:
                den = torch.maximum(den, kernel_floor * count)
            if return_denominator:
                dens[:, h, :, start:end] = den[..., 0]
            if key_weight is not None:  # no key with weight > 0 yet: output 0, not 0/0
                den = torch.where(count > 0, den, torch.ones_like(den))
            o_groups[:, h, :, start:end] = (num[..., :dv] / den).to(q.dtype)

            state = torch.baddbmm(state, pk.mT, u)  # state update (Eq. 5): S += φ_k(K)ᵀ U
            seen = count[:, :, -1:]
        if output_final_state:
            finals.append(state[:, cyc_of_canon])
    return o, dens, torch.stack(finals, dim=1) if output_final_state else None


def _fused_backward_usable(q: torch.Tensor) -> bool:
    """Whether a call that needs gradients can run on :class:`_FusedChunk` (before building the extension):
    CPU inputs in a dtype the fused forward takes, or fp64 (forward on the torch loop, backward in fp64)."""
    return cpu_kernel.usable(q if q.dtype != torch.float64 else q.new_empty(0, dtype=torch.float32), True)


class _FusedChunk(torch.autograd.Function):
    """The chunked operator with the fused CPU backward (``chunk_backward`` in ``cpu/chunk.cpp``).

    Forward: the fused kernel (fp32 / bf16 / fp16 inputs) or the no-grad torch loop (fp64); it keeps only the
    inputs, ``o`` and the denominators. Backward: the reverse chunk scan in the accumulation dtype (fp32, fp64 for
    fp64 inputs) gives the gradients of q, k, v, the key weights, the initial state and the query-side coefficients
    ``(w, scale·W, c, c0)``; autograd takes the latter back to a, b, C and the factor. Where the floor clamps a
    denominator its gradient is 0; a query that has seen no key has the denominator max(0, 0), whose gradient is
    split in halves as torch's ``maximum`` does. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, a, b, C, c0, c, W, initial_state, key_weight, s, cs, output_final_state, floor, ext):
        factor = KernelFactor(c0, c, W)
        args = (q, k, v, a, b, C, s, cs, initial_state, output_final_state, factor, floor, key_weight)
        if q.dtype == torch.float64:
            o, dens, final = _forward_no_grad(*args, True)
        else:
            o, dens, final = _forward_fused(ext, *args, True)
        ctx.save_for_backward(q, k, v, a, b, C, c0, c, W, initial_state, key_weight, o, dens)
        ctx.config = (s, cs, output_final_state, floor, ext)
        ctx.set_materialize_grads(False)
        return o, dens, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_den, d_final):
        q, k, v, a, b, C, c0, c, W, initial_state, key_weight, o, dens = ctx.saved_tensors
        s, cs, output_final_state, floor, ext = ctx.config
        needs = ctx.needs_input_grad
        B, Hkv, dv = q.shape[0], k.shape[1], v.shape[-1]
        cdt = compute_dtype(q.dtype)
        canon_of_cyc, cyc_of_canon = cyclic_maps(q.shape[-1], q.device)
        empty = q.new_empty(0, dtype=cdt)

        def prep(x):
            return x.detach().to(cdt).contiguous()

        with torch.enable_grad():  # the coefficients once more, to take their gradients back to a, b, C, the factor
            leaves = [
                x.detach().to(cdt).requires_grad_(need) for x, need in zip((a, b, C, c0, c, W), needs[3:9], strict=True)
            ]
            coeffs = _query_coefficients(*leaves[:3], KernelFactor(*leaves[3:]), s, cdt, Hkv)
        state0 = empty if initial_state is None else prep(initial_state)[:, :, canon_of_cyc].contiguous()
        d_fin = empty
        if output_final_state and d_final is not None:  # adjoint of final = S[cyc_of_canon]
            d_fin = torch.zeros(B, Hkv, canon_of_cyc.numel(), dv + 1, dtype=cdt, device=q.device)
            d_fin.index_add_(2, cyc_of_canon, prep(d_final))
        dq, dk, dvv, dw, dfw, dfc, dc0, dstate, dkw = ext.chunk_backward(
            prep(q),
            prep(k),
            prep(v),
            *(prep(x) for x in coeffs),
            state0,
            empty if key_weight is None else prep(key_weight),
            -1.0 if floor is None else float(floor),
            cs,
            prep(o),
            prep(dens),
            torch.zeros(o.shape, dtype=cdt, device=q.device) if d_o is None else prep(d_o),
            empty if d_den is None else prep(d_den),
            d_fin,
            initial_state is not None and needs[9],
            key_weight is not None and needs[10],
        )
        param_grads = [None] * 6
        pairs = [(x, g) for x, g in zip(coeffs, (dw.view_as(coeffs[0]), dfw, dfc, dc0), strict=True) if x.requires_grad]
        wanted = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
        if pairs and wanted:
            outs, gouts = zip(*pairs, strict=True)
            got = torch.autograd.grad(outs, [leaves[i] for i in wanted], gouts, allow_unused=True)
            originals = (a, b, C, c0, c, W)
            for i, g in zip(wanted, got, strict=True):
                param_grads[i] = None if g is None else g.to(originals[i].dtype)
        d_init = None
        if initial_state is not None and needs[9]:  # adjoint of S0 = initial_state[canon_of_cyc]
            d_init = torch.zeros(initial_state.shape, dtype=cdt, device=q.device).index_add_(2, canon_of_cyc, dstate)
            d_init = d_init.to(initial_state.dtype)
        d_kw = dkw.to(key_weight.dtype) if key_weight is not None and needs[10] else None
        return (
            dq.to(q.dtype) if needs[0] else None,
            dk.to(k.dtype) if needs[1] else None,
            dvv.to(v.dtype) if needs[2] else None,
            *param_grads,
            d_init,
            d_kw,
            None,
            None,
            None,
            None,
            None,
        )


def channel_classes(fw: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The channels of each query head whose factor columns ``fw[..., :, r]`` are equal: ``rep (Hq, d)`` int64, the
    first channel of each channel's class, and the largest class count P over the heads. For OAL the classes are
    the groups of Eq. 7 (W_m is constant on a group), so P = G."""
    W = fw.reshape(-1, *fw.shape[-2:]).transpose(1, 2)  # (Hq, d, R)
    same = (W[:, :, None, :] == W[:, None, :, :]).all(-1)
    rep = same.int().argmax(-1)
    P = int((rep == torch.arange(W.shape[1], device=W.device)).sum(-1).max())
    return rep.contiguous(), P


# The parallel form's cost per operation of the model below relative to the chunked loop's, measured
# (benchmarks/parallel_crossover.py, 2 threads, SmolLM2 shapes: they cross at n ≈ 1800–1950, the count at 2035).
PARALLEL_COST = 1.0
#: segments this many parallel prefixes long or longer run whole in the chunked loop (:func:`parallel_prefix`)
PREFIX_SPAN = 8


def parallel_pays(n: int, d: int, dv: int, R: int, P: int) -> bool:
    """Whether a fresh segment of ``n`` tokens is cheaper in parallel form (``chunk_parallel_forward``): per query
    head and query, ``n / 2`` pairs of d + R·P + R + dv + 1 operations (partial scores, Eq. 7's squares, values),
    against the state readout's D·(dv + 1) (Eq. 6) in the chunked loop; the state update is the same for both."""
    D = 1 + d + d * (d + 1) // 2
    return PARALLEL_COST * n / 2 * (d + R * P + R + dv + 1) < D * (dv + 1)


def parallel_prefix(n: int, d: int, dv: int, R: int, P: int) -> int:
    """The prefix of a fresh segment of ``n`` tokens too long for the parallel form (``not parallel_pays(n, …)``)
    that runs in it all the same, the chunked loop continuing from the prefix's state: in the cost model of
    :func:`parallel_pays` the query at position t costs t pairs in parallel form and one readout in the loop, equal at
    t = T; a prefix of T costs T² / 2 pairs where the loop's readouts cost T·D·(dv + 1), twice as much. Rounded down
    to a multiple of 16. What it saves is fixed, while the rest's inputs are copied and the two outputs joined, so it
    is 0 (no prefix) for segments of :data:`PREFIX_SPAN` prefixes or more. SmolLM2's shapes with 3 groups: T = 960;
    0.92×, 0.94×, 0.93×, 0.95× the time of the faster whole form at 2048, 3072, 4096, 6144 tokens; with a prefix 1.01×
    at 8192 and 1.03× at 12288 (benchmarks/parallel_crossover.py, stop 53; flat for prefixes of 768–960)."""
    D = 1 + d + d * (d + 1) // 2
    t = int(D * (dv + 1) / (PARALLEL_COST * (d + R * P + R + dv + 1))) // 16 * 16
    return t if n < PREFIX_SPAN * t else 0


def _forward_fused(
    ext,
    q,
    k,
    v,
    a,
    b,
    C,
    s,
    cs,
    initial_state,
    output_final_state,
    factor,
    kernel_floor,
    key_weight,
    return_denominator,
):
    """The no-grad loop in the fused C++ kernel (``cpu/chunk.cpp``; needs ``factor``).
    Returns ``(o, dens or None, final or None)`` like :func:`_forward_no_grad`."""
    f32 = torch.float32
    canon_of_cyc, _ = cyclic_maps(q.shape[-1], q.device)  # the kernel reads and writes canonical states
    w, fw, fc, c0 = (x.contiguous() for x in _query_coefficients(a, b, C, factor, s, f32, k.shape[1]))
    floor = -1.0 if kernel_floor is None else float(kernel_floor)
    weights = torch.empty(0) if key_weight is None else key_weight.to(f32).contiguous()
    n, d, dv, R = q.shape[2], q.shape[-1], v.shape[-1], fw.shape[2]
    if initial_state is None:
        rep, P = channel_classes(fw)
        t = n if parallel_pays(n, d, dv, R, P) else min(n, parallel_prefix(n, d, dv, R, P))
        if t > 0:  # the segment, or its prefix, in parallel form; the rest in the loop from the prefix's state
            o, dens, final = ext.chunk_parallel_forward(
                q[:, :, :t].contiguous(), k[:, :, :t].contiguous(), v[:, :, :t].contiguous(), fw, fc, c0, rep,
                weights[:, :, :t].contiguous() if weights.numel() else weights, canon_of_cyc, floor,
                output_final_state or t < n,
            )  # fmt: skip
            if t < n:
                rows = slice(t, None)
                o_rest, dens_rest, final = _forward_fused(
                    ext, q[:, :, rows], k[:, :, rows], v[:, :, rows], a, b, C, s, cs, final, output_final_state,
                    factor, kernel_floor, None if key_weight is None else key_weight[:, :, rows], return_denominator,
                )  # fmt: skip
                o, dens = torch.cat((o, o_rest), 2), torch.cat((dens, dens_rest), -1) if return_denominator else None
            return o, dens if return_denominator else None, final if output_final_state else None
    state0 = torch.empty(0) if initial_state is None else initial_state.to(f32).contiguous()
    o, dens, final = ext.chunk_forward(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        w,
        fw,
        fc,
        c0,
        state0,
        weights,
        canon_of_cyc,
        floor,
        cs,
        output_final_state,
        return_denominator,
    )
    return o, dens if return_denominator else None, final if output_final_state else None


def parallel_at_end(q, k, v, a, b, C, s, factor, kernel_floor=None, key_weight=None):
    """Queries that are the last ``Nq`` of the ``N`` keys' positions (causal aligned at the end: row r is position
    ``N - Nq + r`` and reads keys ``0 … N - Nq + r``), without an initial state: ``(o (B, Hq, Nq, dv) in q's dtype,
    dens (B, Hkv, G, Nq) fp32)``, the rows and denominators one call over all N positions would give them, in the
    parallel form of the fused CPU kernel (``chunk_parallel_forward``). A prompt's later chunk evaluated over the
    keys kept before it, without their state (:mod:`oal.kernels.kept`). None where it does not apply: autograd, no
    fused kernel for q, no ``factor``, or more queries than keys.

    q ``(B, Hq, Nq, d)``, k ``(B, Hkv, N, d)``, v ``(B, Hkv, N, dv)`` one dtype; a, b, C, factor, kernel_floor as
    :func:`chunk_quadratic_attention`, ``s`` the scale; key_weight ``(B, Hkv, N)`` or None."""
    if factor is None:
        factor = factor_from_coefficients(a, b, C)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, a, b, C, *(factor or ())))
    if grad or q.shape[2] > k.shape[2] or not cpu_kernel.usable(q, factor) or (ext := cpu_kernel.load()) is None:
        return None
    f32 = torch.float32
    canon_of_cyc, _ = cyclic_maps(q.shape[-1], q.device)
    _, fw, fc, c0 = (
        None if x is None else x.contiguous() for x in _query_coefficients(a, b, C, factor, s, f32, k.shape[1])
    )
    rep, _ = channel_classes(fw)
    floor = -1.0 if kernel_floor is None else float(kernel_floor)
    weights = torch.empty(0) if key_weight is None else key_weight.to(f32).contiguous()
    o, dens, _ = ext.chunk_parallel_forward(
        q.contiguous(), head_rows(k), head_rows(v), fw, fc, c0, rep, weights, canon_of_cyc, floor, False
    )
    return o, dens


def head_rows(x: torch.Tensor) -> torch.Tensor:
    """``x (B, H, N, ·)`` as the parallel form reads keys and values: itself when each head's rows are contiguous and
    its heads evenly apart (e.g. a view of the first N rows of longer heads: no copy), else a contiguous copy."""
    B, H, _, D = x.shape
    rows = x.stride(3) == 1 and x.stride(2) == D
    return x if rows and (B == 1 or x.stride(0) == H * x.stride(1)) else x.contiguous()


def _forward_no_grad(
    q, k, v, a, b, C, s, cs, initial_state, output_final_state, factor, kernel_floor, key_weight, return_denominator
):
    """The same loop without autograd, tuned for CPUs: one (batch, KV head) at a time on 2-D GEMMs, every
    per-chunk tensor written into a buffer allocated once (cache-hot, no allocator traffic), the constant
    columns of ``[x, 1]`` and ``[v, 1]`` filled once, and the chunks of each input taken as views by one
    ``split``. Returns ``(o, dens or None, final or None)``."""
    B, Hq, N, d = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    G = Hq // Hkv
    e = d + 1
    P = cyclic_width(e)
    Dc = e * P
    cdt = compute_dtype(q.dtype)
    dev = q.device
    canon_of_cyc, cyc_of_canon = cyclic_maps(d, dev)
    one_row = d * P  # cyclic index of x'_d · x'_d = 1 · 1
    w, fw, fc, c0 = _query_coefficients(a, b, C, factor, s, cdt, Hkv)
    w = w[:, :, None]  # (Hkv, G, 1, e, P)
    R = 0 if factor is None else factor.c.shape[-1]
    if factor is not None:
        fw, fc, c0 = fw[:, :, :, None], fc[..., None], c0[..., None, None]

    o = torch.empty(B, Hq, N, dv, dtype=q.dtype, device=dev)
    o_groups = o.view(B, Hkv, G, N, dv)
    dens = torch.empty(B, Hkv, G, N, dtype=cdt, device=dev) if return_denominator else None
    finals = torch.empty(B, Hkv, cyc_of_canon.numel(), dv + 1, dtype=cdt, device=dev) if output_final_state else None
    causal = torch.ones(cs, cs, dtype=cdt, device=dev).tril()  # [query i, key j]
    steps = torch.arange(1, cs + 1, dtype=cdt, device=dev)

    # buffers: yq/yk hold [x, 1, x, 1] (the cyclic source), u holds [v, 1]; their constant columns never change
    yq = torch.ones(G, cs, 2, e, dtype=cdt, device=dev)
    yk = torch.ones(cs, 2, e, dtype=cdt, device=dev)
    u_buf = torch.ones(cs, dv + 1, dtype=cdt, device=dev)
    flat_pq = torch.empty(G * cs * Dc, dtype=cdt, device=dev)
    flat_pk = torch.empty(cs * Dc, dtype=cdt, device=dev)
    flat_num = torch.empty(G * cs * (dv + 1), dtype=cdt, device=dev)
    flat_kern = torch.empty(G * cs * cs, dtype=cdt, device=dev)
    if factor is not None:
        qw = torch.empty(G, R, cs, e, dtype=cdt, device=dev)
        flat_z = torch.empty(G * R * cs * cs, dtype=cdt, device=dev)

    for bh in range(B * Hkv):
        bi, h = divmod(bh, Hkv)
        if initial_state is None:
            state = torch.zeros(Dc, dv + 1, dtype=cdt, device=dev)
        else:
            state = initial_state[bi, h].to(cdt)[canon_of_cyc]
        seen = state[one_row, dv].clone()  # keys before this segment: H0's count column
        if factor is not None:
            qw[..., d] = fc[h]
        q_chunks = q[bi].view(Hkv, G, N, d)[h].split(cs, dim=1)
        k_chunks = k[bi, h].split(cs)
        v_chunks = v[bi, h].split(cs)
        o_chunks = o_groups[bi, h].split(cs, dim=1)
        w_chunks = key_weight[bi, h].split(cs) if key_weight is not None else None
        start = 0
        for ci, (qc, kc, vc, oc) in enumerate(zip(q_chunks, k_chunks, v_chunks, o_chunks, strict=True)):
            n = kc.shape[0]
            yq[:, :n, :, :d].copy_(qc[:, :, None])
            yk[:n, :, :d].copy_(kc[:, None])
            u = u_buf[:n]
            count = None  # keys seen by each query, (n,): needed by the floor and by key weights only
            if w_chunks is None:
                u[:, :dv].copy_(vc)
                if kernel_floor is not None:
                    count = steps[:n] + (seen + start)
            else:
                wc = w_chunks[ci].to(cdt)
                torch.mul(vc, wc[:, None], out=u[:, :dv])
                u[:, dv].copy_(wc)
                count = wc.cumsum(0).add_(seen)
                seen = count[-1]

            # inter-chunk readout (Eq. 6) of the G heads at once: (G·n, D) @ (D, dv+1)
            pq = cyclic_pair_products(yq[:, :n].view(G, n, 2 * e), out=flat_pq[: G * n * Dc].view(G, n, Dc))
            pq = pq.view(G, n, e, P).mul_(w[h]).view(G * n, Dc)
            num = torch.mm(pq, state, out=flat_num[: G * n * (dv + 1)].view(G * n, dv + 1))
            pk = cyclic_pair_products(yk[:n].view(n, 2 * e), out=flat_pk[: n * Dc].view(n, Dc))

            # intra-chunk part: the explicit kernel on the causal triangle, rows (head, query), columns keys
            kern = flat_kern[: G * n * n].view(G, n, n)
            if factor is not None:
                qwn = qw[:, :, :n]
                torch.mul(qc[:, None], fw[h], out=qwn[..., :d])
                z = flat_z[: G * R * n * n].view(G * R * n, n)
                torch.mm(qwn.reshape(G * R * n, e), yk[:n, 0].T, out=z)  # yk[:, 0] is [k, 1]
                torch.sum(z.square_().view(G, R, n, n), 1, out=kern)
                kern.add_(c0[h])
            else:
                torch.mm(pq, pk.T, out=kern.view(G * n, n))
            kern.mul_(causal[:n, :n])
            num.addmm_(kern.view(G * n, n), u)

            num = num.view(G, n, dv + 1)
            den = num[..., dv:]
            if kernel_floor is not None:
                den.clamp_min_(count[:, None] * kernel_floor)
            if dens is not None:
                dens[bi, h, :, start : start + n] = den[..., 0]
            if w_chunks is not None:  # no key with weight > 0 yet: output 0, not 0/0
                den = torch.where(count[:, None] > 0, den, 1.0)
            torch.div(num[..., :dv], den, out=oc)

            state.addmm_(pk.T, u)  # state update (Eq. 5): S += φ_k(K)ᵀ U
            start += n
        if finals is not None:
            finals[bi, h] = state[cyc_of_canon]
    return o, dens, finals
