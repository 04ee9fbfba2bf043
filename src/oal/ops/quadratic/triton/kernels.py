"""Triton kernels of the quadratic-kernel operator (Eq. 3, 5, 6; Eq. 7 for the within-chunk kernel).

Feature blocks. The packed state has ``D = 1 + d + d(d+1)/2`` canonical rows (App. D). The kernels walk them
in blocks of ``BK = next_pow2(d)`` rows, each block built from two columns of ``x' = [x, 1]``:

* block 0, the constant: one valid row (row 0), feature ``1 · 1``;
* block 1, the linear terms: rows ``1 + r``, features ``x_r · 1``;
* block ``2 + δ`` for ``δ = 0 … ⌊d/2⌋``: the pairs ``(r, (r + δ) mod d)``, features ``x_r · x_{(r+δ) mod d}``
  (the cyclic layout of :func:`oal.ops.quadratic.utils.cyclic_maps`, restricted to the d coordinates).

So a pair block of a ``[BT, d]`` tile is ``x ⊙ roll(x, -δ)``: the tile times one load of itself at rotated
column indices. For even d the block ``δ = d/2`` lists its pairs twice; its rows ``r ≥ d/2`` are not state rows.

Layouts. The fp32 state that enters and leaves a segment (``initial_state``, the final state, the decode state)
is the canonical packed layout ``(B, Hkv, D, dv+1)``; an int32 table ``tab (3, NBLK, BK)``
(:func:`.utils.block_table`) maps each block row to its two factor columns and canonical row (-1: none), so no
conversion pass exists. Everything internal is block-ordered, ``NBLK·BK`` rows: the per-chunk snapshots ``h``
(dot dtype) and ``hden`` (fp32 denominator column) and the query weights ``qwb (Hq, NBLK·BK)`` (zero on rows
that are not state rows). A feature block's snapshot is then one contiguous ``[BK, dv]`` tile and its weights
one contiguous vector, and the readout loop needs no index table.

Precision. Every product accumulates in fp32 (``ADT``; fp64 for fp64 inputs); tensor-core operands are in the
dot dtype ``DT`` (bf16 for half inputs; fp32 as FMAs by default, three tf32 tensor-core products on request,
``FP32_DOT`` below; ``ieee`` in the interpreter).
State passing keeps the state in fp32 registers and the count channel of Eq. 5 (the ``[v; 1]`` denominator)
as exact fp32 sums; the snapshots that the readout multiplies are rounded to DT, and the readout forms its
query features in DT (packed bf16) and contracts numerator and denominator alike, so both see the same
features. Within-chunk kernels are fp32.

Kernels (grids in brackets; ``NBLK = 2 + ⌊d/2⌋ + 1`` feature blocks):

* ``chunk_fwd_h``     [NBLK, dv blocks + 1, B·Hkv]  state passing: snapshot S_c before every chunk, S += φ_kᵀ U.
* ``chunk_fwd_o``     [B·Hq, chunks]            o = (φ_q S_c + intra) / den, φ_q built in registers per block.
* ``chunk_bwd_dh``    [NBLK, dv blocks, B·Hkv]  reverse state passing: dS_c = Σ_{later chunks, G heads} φ_qᵀ dU.
* ``chunk_bwd_dq``    [B·Hq, chunks]            dq and the coefficient gradients (atomics over chunks).
* ``chunk_bwd_dkv``   [B·Hkv, chunks]           dk, dv (the G query heads of the KV head summed in-program).
* ``recurrent_step``  [NBLK, B·Hkv]             decode: T tokens, state updated block-wise, partial readouts.
* ``recurrent_finalize`` [B·Hq, T]              o = num / den.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .utils import fp32_dot_precision, interpreting

#: How fp32 products run on the GPU (read once, when the kernels load; see :func:`.utils.fp32_dot_precision`):
#: "ieee" (FMAs, the default), "tf32x3" (Triton's three tf32 tensor-core products) or "split" (the same three
#: formed here from a truncated high part and its exact remainder).
FP32_DOT = tl.constexpr(fp32_dot_precision())


def _helper(fn):
    """``@triton.jit`` for device helpers, except under the interpreter: there every call of a jitted helper
    re-patches ``triton.language`` (milliseconds per call, half the interpreted run time), while a plain function
    called from a running kernel already sees the patched language."""
    return fn if interpreting() else triton.jit(fn)


@_helper
def _mm(a, b, DT: tl.constexpr, INTERP: tl.constexpr):
    """``a @ b`` with both operands rounded to DT; fp32 accumulation (fp64 for fp64)."""
    a = a.to(DT)
    b = b.to(DT)
    if tl.float32 == DT and FP32_DOT == "split":  # also under the interpreter: its test
        # x = hi + lo with hi = x truncated to tf32's 10 mantissa bits, so lo is exact; hi·hi + hi·lo + lo·hi
        # leaves out lo·lo (~2^-22 of the product) and tf32's rounding of lo: fp32-level accuracy, as tf32x3
        a_hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        b_hi = (b.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        out = tl.dot(a_hi, b - b_hi, input_precision="tf32")
        out += tl.dot(a - a_hi, b_hi, input_precision="tf32")
        return out + tl.dot(a_hi, b_hi, input_precision="tf32")
    elif tl.float32 == DT and INTERP:
        return tl.dot(a, b, input_precision="ieee")
    elif tl.float32 == DT:
        return tl.dot(a, b, input_precision=FP32_DOT)
    elif INTERP and tl.float64 != DT:
        # the CPU interpreter multiplies the raw bit patterns of 16-bit floats; the rounded values in fp32 give
        # what the tensor cores compute
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@_helper
def _mul(a, b, CT: tl.constexpr, INTERP: tl.constexpr):
    """``a * b`` in CT (packed bf16 arithmetic on the GPU). The interpreter multiplies the bit patterns of
    16-bit floats, so there the product is taken in fp32 and rounded to CT: for operands that are CT values this
    is the same single rounding."""
    if INTERP and (tl.bfloat16 == CT or tl.float16 == CT):
        return (a.to(tl.float32) * b.to(tl.float32)).to(CT)
    else:
        return a.to(CT) * b.to(CT)


@_helper
def _block(tab, blk, BK: tl.constexpr, NBLK: tl.constexpr):
    """First-factor column, second-factor column (``d`` stands for the appended 1) and canonical row (-1: not a
    state row) of each of the BK rows of feature block ``blk``; see :func:`.utils.block_table`."""
    base = tab + blk * BK + tl.arange(0, BK)
    return tl.load(base), tl.load(base + NBLK * BK), tl.load(base + 2 * NBLK * BK)


@_helper
def _feat(rows, rcol, tcol, D_HEAD: tl.constexpr, CT: tl.constexpr):
    """Block features ``[BT, BK]`` ``x'_rcol · x'_tcol`` of the tokens whose row pointers are ``rows [BT, 1]``
    (valid addresses), computed in CT. Column ``d`` reads as the 1 of ``x' = [x, 1]``. Block rows that are not
    state rows get finite values that masks or zero weights cancel. For bf16 CT the product of two bf16 values
    rounds once, exactly as an fp32 product rounded to bf16 would."""
    xr = tl.load(rows + rcol[None, :], mask=(rcol < D_HEAD)[None, :], other=1.0).to(CT)
    return xr * tl.load(rows + tcol[None, :], mask=(tcol < D_HEAD)[None, :], other=1.0).to(CT)


@_helper
def _vec_feat(base, rcol, tcol, D_HEAD: tl.constexpr, ADT: tl.constexpr):
    """Block features ``[BK]`` of one token (decode)."""
    rm = rcol < D_HEAD
    tm = tcol < D_HEAD
    xr = tl.load(base + rcol, mask=rm, other=0.0).to(ADT)
    xt = tl.load(base + tcol, mask=tm, other=0.0).to(ADT)
    return tl.where(rm, xr, 1.0) * tl.where(tm, xt, 1.0)


@_helper
def _roll_cols(x, delta, D_HEAD: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """``y[:, t] = x[:, (t - delta) mod d]`` for t < d; the scatter of the second factor of a pair block."""
    c = tl.arange(0, BK)
    src = tl.where(c < D_HEAD, (c - delta + D_HEAD) % D_HEAD, c)
    return tl.gather(x, tl.broadcast_to(src[None, :], (BT, BK)), 1)


@_helper
def _key_feat(
    rows,
    im,
    blk,
    D_HEAD: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    KIND: tl.constexpr,
    CT: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Key features ``[BT, BK]`` of feature block ``blk`` (KIND 0 constant, 1 linear, 2 pairs) from row pointers
    ``rows [BT, 1]``; tokens with ``im`` False get 0. No index table: the partner column of a pair block is a
    rotation of the column index."""
    cols = tl.arange(0, BK)
    if KIND == 0:
        f = tl.where(im[:, None], tl.full([BT, BK], 1.0, CT), 0.0).to(CT)
    else:
        f = tl.load(rows + cols[None, :], mask=im[:, None] & (cols < D_HEAD)[None, :], other=0.0).to(CT)
        if KIND == 2:
            f = _mul(f, tl.load(rows + ((cols + (blk - 2)) % D_HEAD)[None, :]), CT, INTERP)
    return f


@_helper
def _fwd_h_window(
    kb,
    v_cols,
    st,
    h_rows,
    hd_rows,
    row,
    blk,
    iv,
    s_kn,
    s_vn,
    t0,
    N,
    NC,
    D_HEAD: tl.constexpr,
    DV: tl.constexpr,
    NBLK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    KIND: tl.constexpr,
    DT: tl.constexpr,
    ADT: tl.constexpr,
    INTERP: tl.constexpr,
):
    """The chunk loop of :func:`chunk_fwd_h` for one program, specialised to its kind of feature block."""
    valid = row >= 0
    if iv < NV:
        cv = iv * BV + tl.arange(0, BV)
        vm = cv < DV
        s_ptr = st + row[:, None] * (DV + 1) + cv[None, :]
        S = tl.load(s_ptr, mask=valid[:, None] & vm[None, :], other=0.0).to(ADT)
        for c in range(NC):
            tl.store(h_rows + c * (NBLK * BK * DV) + cv[None, :], S.to(h_rows.dtype.element_ty), mask=vm[None, :])
            i = t0 + c * BT + tl.arange(0, BT)
            im = i < N
            # rows past N read row N-1 (valid addresses); their zeroed values make them drop out
            f = _key_feat(kb + tl.minimum(i, N - 1)[:, None] * s_kn, im, blk, D_HEAD, BT, BK, KIND, DT, INTERP)
            u = tl.load(v_cols + cv[None, :] + i[:, None] * s_vn, mask=im[:, None] & vm[None, :], other=0.0)
            S += _mm(tl.trans(f), u, DT, INTERP)
        tl.store(s_ptr, S, mask=valid[:, None] & vm[None, :])
    else:
        sd_ptr = st + row * (DV + 1) + DV
        Sden = tl.load(sd_ptr, mask=valid, other=0.0).to(ADT)
        for c in range(NC):
            tl.store(hd_rows + c * (NBLK * BK), Sden)
            i = t0 + c * BT + tl.arange(0, BT)
            f = _key_feat(kb + tl.minimum(i, N - 1)[:, None] * s_kn, i < N, blk, D_HEAD, BT, BK, KIND, ADT, INTERP)
            Sden += tl.sum(f, 0)
        tl.store(sd_ptr, Sden, mask=valid)


@triton.jit
def chunk_fwd_h(
    k,
    v,
    tab,
    state,
    h,
    hden,
    s_kb,
    s_kh,
    s_kn,
    s_vb,
    s_vh,
    s_vn,
    t0,
    N,
    NC,
    Hkv,
    D_HEAD: tl.constexpr,
    DV: tl.constexpr,
    D_FEAT: tl.constexpr,
    NBLK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    DT: tl.constexpr,
    ADT: tl.constexpr,
    INTERP: tl.constexpr,
):
    """State passing over the NC chunks of one window starting at token t0 (Eq. 5, chunked).

    ``state (B, Hkv, D, dv+1)`` (canonical) holds the state before the window and is overwritten with the state
    after it; ``h (B, Hkv, NC, NBLK·BK, dv)`` and ``hden (B, Hkv, NC, NBLK·BK)`` (block-ordered) receive the
    snapshot before each chunk. Program (block, iv < NV) owns the block's rows of dv columns
    ``[iv·BV, (iv+1)·BV)`` in fp32 registers for the whole window, adding ``φ_kᵀ [block, chunk] @ V [chunk, BV]``
    per chunk; program (block, NV) owns the denominator column, an fp32 column sum of the features.
    """
    blk = tl.program_id(0)
    iv = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // Hkv
    hk = bh % Hkv
    row = tl.load(tab + (2 * NBLK + blk) * BK + tl.arange(0, BK))  # canonical state rows of this block
    brow = blk * BK + tl.arange(0, BK)
    kb = k + b * s_kb + hk * s_kh
    vb = v + b * s_vb + hk * s_vh
    st = state + bh * D_FEAT * (DV + 1)
    h_rows = h + bh * NC * (NBLK * BK * DV) + brow[:, None] * DV
    hd_rows = hden + bh * NC * (NBLK * BK) + brow
    if blk >= 2:
        _fwd_h_window(
            kb, vb, st, h_rows, hd_rows, row, blk, iv, s_kn, s_vn, t0, N, NC,
            D_HEAD, DV, NBLK, BT, BK, BV, NV, 2, DT, ADT, INTERP,
        )  # fmt: skip
    elif blk == 1:
        _fwd_h_window(
            kb, vb, st, h_rows, hd_rows, row, blk, iv, s_kn, s_vn, t0, N, NC,
            D_HEAD, DV, NBLK, BT, BK, BV, NV, 1, DT, ADT, INTERP,
        )  # fmt: skip
    else:
        _fwd_h_window(
            kb, vb, st, h_rows, hd_rows, row, blk, iv, s_kn, s_vn, t0, N, NC,
            D_HEAD, DV, NBLK, BT, BK, BV, NV, 0, DT, ADT, INTERP,
        )  # fmt: skip


@triton.jit
def chunk_fwd_o(
    q,
    k,
    v,
    qwb,
    fc0,
    fc,
    fw,
    h,
    hden,
    o,
    den_out,
    s_qb,
    s_qh,
    s_qn,
    s_kb,
    s_kh,
    s_kn,
    s_vb,
    s_vh,
    s_vn,
    s_ob,
    s_oh,
    s_on,
    t0,
    N,
    NC,
    Hq,
    G,
    R,
    floor,
    D_HEAD: tl.constexpr,
    DV: tl.constexpr,
    NBLK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    FACTOR: tl.constexpr,
    INTRA: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
    STORE_DEN: tl.constexpr,
    DT: tl.constexpr,
    ADT: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Output of one chunk for one query head: Eq. 6 readout of the snapshot plus the exact causal kernel inside
    the chunk, normalised.

    The weighted query features ``φ_q = w ⊙ x'_r x'_t`` of each block are formed in registers from the q tile, in
    the dot dtype (packed bf16 arithmetic for half inputs), and contracted with the block's contiguous snapshot
    tile; the features never touch memory. The denominator is the same product against the snapshot's count
    column (a ``[BK, 16]`` tile holding it in column 0), so numerator and denominator see the same rounded
    features. The within-chunk kernel comes from the R squares of ``KernelFactor`` (FACTOR, Eq. 7) or from the
    same feature blocks (general C), in fp32; INTRA=False leaves it out (timing of the inter-chunk GEMMs only).
    """
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b = bh // Hq
    hq = bh % Hq
    hk = hq // G
    c0_tok = t0 + c * BT
    i = c0_tok + tl.arange(0, BT)
    im = i < N
    cols = tl.arange(0, BK)
    cm = cols < D_HEAD
    cv = tl.arange(0, BV)
    vm = cv < DV
    c16 = tl.arange(0, 16)
    # rows past N read row N-1: loads need no token mask (the column masks fold away for d = BK, dv = BV);
    # those rows' outputs are never stored and their keys are cut by the causal mask
    i_safe = tl.minimum(i, N - 1)
    q_rows = q + b * s_qb + hq * s_qh + i_safe[:, None] * s_qn
    k_rows = k + b * s_kb + hk * s_kh + i_safe[:, None] * s_kn
    Qd = tl.load(q_rows + cols[None, :], mask=cm[None, :], other=0.0).to(DT)
    snap = (b * (Hq // G) + hk) * NC + c
    h_rows = h + snap * (NBLK * BK * DV) + cols[:, None] * DV + cv[None, :]
    hdb = hden + snap * (NBLK * BK) + cols
    wb = qwb + hq * (NBLK * BK) + cols

    # constant feature (block 0, row 0); hden[0] counts the keys before this chunk
    w0 = tl.load(qwb + hq * (NBLK * BK)).to(ADT)
    seen = tl.load(hden + snap * (NBLK * BK)).to(ADT)
    acc = tl.zeros([BT, BV], dtype=ADT) + w0 * tl.load(h + snap * (NBLK * BK * DV) + cv, mask=vm).to(ADT)[None, :]
    # linear features (block 1)
    phi = _mul(Qd, tl.load(wb + BK).to(DT)[None, :], DT, INTERP)
    acc += _mm(phi, tl.load(h_rows + BK * DV, mask=vm[None, :], other=0.0), DT, INTERP)
    dacc = _mm(phi, tl.where(c16[None, :] == 0, tl.load(hdb + BK)[:, None], 0.0), DT, INTERP)
    if INTRA and not FACTOR:
        K = tl.load(k_rows + cols[None, :], mask=cm[None, :], other=0.0).to(ADT)
        A = w0 + _mm(phi, tl.trans(K), DT, INTERP)
    # pair features, one offset δ per block: φ = (Q ⊙ Q[:, (r+δ) mod d]) ⊙ w
    for blk in range(2, NBLK):
        t = (cols + (blk - 2)) % D_HEAD
        QQ = _mul(Qd, tl.load(q_rows + t[None, :]), DT, INTERP)
        phi = _mul(QQ, tl.load(wb + blk * BK).to(DT)[None, :], DT, INTERP)
        acc += _mm(phi, tl.load(h_rows + blk * (BK * DV), mask=vm[None, :], other=0.0), DT, INTERP)
        dacc += _mm(phi, tl.where(c16[None, :] == 0, tl.load(hdb + blk * BK)[:, None], 0.0), DT, INTERP)
        if INTRA and not FACTOR:
            Kt = tl.load(k_rows + t[None, :]).to(ADT)
            A += _mm(phi, tl.trans(K * Kt), DT, INTERP)
    den = tl.sum(tl.where(c16[None, :] == 0, dacc, 0.0), 1) + w0 * seen
    if INTRA:
        if FACTOR:
            # loaded only now, like the fp32 copy of q: they stay out of the registers of the block loop
            K = tl.load(k_rows + cols[None, :], mask=cm[None, :], other=0.0).to(ADT)
            Q = tl.load(q_rows + cols[None, :], mask=cm[None, :], other=0.0).to(ADT)
            A = tl.zeros([BT, BT], dtype=ADT) + tl.load(fc0 + hq).to(ADT)
            for m in range(R):
                wm = tl.load(fw + (hq * R + m) * D_HEAD + cols, mask=cm, other=0.0).to(ADT)
                z = _mm(Q * wm[None, :], tl.trans(K), DT, INTERP) + tl.load(fc + hq * R + m).to(ADT)
                A += z * z
        A = tl.where((i[:, None] >= i[None, :]) & im[None, :], A, 0.0)
        v_rows = v + b * s_vb + hk * s_vh + i_safe[:, None] * s_vn
        acc += _mm(A, tl.load(v_rows + cv[None, :], mask=vm[None, :], other=0.0), DT, INTERP)
        den += tl.sum(A, 1)
    if STORE_DEN:
        tl.store(den_out + bh * N + i, den, mask=im)
    if HAS_FLOOR:
        den = tl.maximum(den, floor * (seen + (i - c0_tok + 1).to(ADT)))
    o_rows = o + b * s_ob + hq * s_oh + i[:, None] * s_on
    tl.store(o_rows + cv[None, :], (acc / den[:, None]).to(o.dtype.element_ty), mask=im[:, None] & vm[None, :])


@triton.jit
def chunk_bwd_dh(
    q,
    tab,
    qwb,
    do,
    den,
    delta_ptr,
    dstate,
    dh,
    dhden,
    s_qb,
    s_qh,
    s_qn,
    s_db,
    s_dh,
    s_dn,
    t0,
    N,
    NC,
    Hkv,
    G,
    D_HEAD: tl.constexpr,
    DV: tl.constexpr,
    D_FEAT: tl.constexpr,
    NBLK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DT: tl.constexpr,
    ADT: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Reverse state passing over one window: ``dS_c = dS_after + Σ_{i in later chunks} Σ_h φ_q^h(q_i) dU_iᵀ``.

    ``dU_i = [do_i / den_i, δ_i]`` (den clamped as in the forward; δ_i the denominator gradient). ``dstate``
    (canonical) holds the reverse state after the window (gradient of the final state plus all later windows)
    and is overwritten with the one before it; ``dh``/``dhden`` (block-ordered) receive the snapshot for each
    chunk's keys.
    """
    blk = tl.program_id(0)
    iv = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // Hkv
    hk = bh % Hkv
    Hq = Hkv * G
    rcol, tcol, row = _block(tab, blk, BK, NBLK)
    valid = row >= 0
    brow = blk * BK + tl.arange(0, BK)
    cv = iv * BV + tl.arange(0, BV)
    vm = cv < DV
    first = (row * 0 + iv) == 0  # the dv block 0 program also owns the denominator column
    st = dstate + bh * D_FEAT * (DV + 1)
    s_ptr = st + row[:, None] * (DV + 1) + cv[None, :]
    dS = tl.load(s_ptr, mask=valid[:, None] & vm[None, :], other=0.0).to(ADT)
    dSden = tl.load(st + row * (DV + 1) + DV, mask=valid, other=0.0).to(ADT)
    h_ptr = dh + bh * NC * (NBLK * BK * DV) + brow[:, None] * DV + cv[None, :]
    hd_ptr = dhden + bh * NC * (NBLK * BK) + brow
    for cc in range(NC):
        c = NC - 1 - cc
        tl.store(h_ptr + c * (NBLK * BK * DV), dS.to(dh.dtype.element_ty), mask=vm[None, :])
        tl.store(hd_ptr + c * (NBLK * BK), dSden, mask=first)
        i = t0 + c * BT + tl.arange(0, BT)
        im = i < N
        for g in range(G):
            hq = hk * G + g
            w = tl.load(qwb + hq * (NBLK * BK) + brow).to(ADT)
            rows = q + b * s_qb + hq * s_qh + tl.minimum(i, N - 1)[:, None] * s_qn  # rows past N have dU = 0
            f = _feat(rows, rcol, tcol, D_HEAD, ADT) * w[None, :]
            tok = (b * Hq + hq) * N + i
            dd = tl.load(den + tok, mask=im, other=1.0).to(ADT)
            dl = tl.load(delta_ptr + tok, mask=im, other=0.0).to(ADT)
            d_rows = do + b * s_db + hq * s_dh + i[:, None] * s_dn
            dn = tl.load(d_rows + cv[None, :], mask=im[:, None] & vm[None, :], other=0.0).to(ADT) / dd[:, None]
            dS += _mm(tl.trans(f), dn, DT, INTERP)
            dSden += tl.sum(f * dl[:, None], 0)
    tl.store(s_ptr, dS, mask=valid[:, None] & vm[None, :])
    tl.store(st + row * (DV + 1) + DV, dSden, mask=valid & first)


@triton.jit
def chunk_bwd_dq(
    q,
    k,
    v,
    qwb,
    fc0,
    fc,
    fw,
    h,
    hden,
    do,
    den,
    delta_ptr,
    dq,
    dqwb,
    dfc0,
    dfc,
    dfw,
    s_qb,
    s_qh,
    s_qn,
    s_kb,
    s_kh,
    s_kn,
    s_vb,
    s_vh,
    s_vn,
    s_db,
    s_dh,
    s_dn,
    s_gb,
    s_gh,
    s_gn,
    t0,
    N,
    NC,
    Hq,
    G,
    R,
    D_HEAD: tl.constexpr,
    DV: tl.constexpr,
    NBLK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    FACTOR: tl.constexpr,
    DT: tl.constexpr,
    ADT: tl.constexpr,
    INTERP: tl.constexpr,
):
    """dq of one chunk and one query head, plus the coefficient gradients it contributes.

    With ``g = ∂L/∂φ_q = dU S_cᵀ (+ dA φ_k for general C)`` per feature block, ``dq_r += w g x_t`` and
    ``dq_t += w g x_r`` (the second scattered with a column rotation), ``dqwb += Σ_i x_r x_t g``. The factor's
    gradients come from the within-chunk kernel only, the coefficients' from the readout (and, for general C,
    the within-chunk kernel), as in the torch chunked path. Coefficient gradients are summed with atomics.
    """
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b = bh // Hq
    hq = bh % Hq
    hk = hq // G
    i = t0 + c * BT + tl.arange(0, BT)
    im = i < N
    cols = tl.arange(0, BK)
    cm = cols < D_HEAD
    cv = tl.arange(0, BV)
    vm = cv < DV
    mask_qk = im[:, None] & cm[None, :]
    q_rows = q + b * s_qb + hq * s_qh + i[:, None] * s_qn
    k_rows = k + b * s_kb + hk * s_kh + i[:, None] * s_kn
    Q = tl.load(q_rows + cols[None, :], mask=mask_qk, other=0.0).to(ADT)
    K = tl.load(k_rows + cols[None, :], mask=mask_qk, other=0.0).to(ADT)
    v_rows = v + b * s_vb + hk * s_vh + i[:, None] * s_vn
    V = tl.load(v_rows + cv[None, :], mask=im[:, None] & vm[None, :], other=0.0)
    tok = bh * N + i
    dd = tl.load(den + tok, mask=im, other=1.0).to(ADT)
    dl = tl.load(delta_ptr + tok, mask=im, other=0.0).to(ADT)
    d_rows = do + b * s_db + hq * s_dh + i[:, None] * s_dn
    dn = tl.load(d_rows + cv[None, :], mask=im[:, None] & vm[None, :], other=0.0).to(ADT) / dd[:, None]
    dA = tl.where((i[:, None] >= i[None, :]) & im[None, :], _mm(dn, tl.trans(V), DT, INTERP) + dl[:, None], 0.0)

    snap = (b * (Hq // G) + hk) * NC + c
    h_rows = h + snap * (NBLK * BK * DV) + cols[:, None] * DV + cv[None, :]
    hdb = hden + snap * (NBLK * BK) + cols
    wb = qwb + hq * (NBLK * BK) + cols
    gwb = dqwb + hq * (NBLK * BK) + cols
    # constant feature
    h0 = tl.load(h + snap * (NBLK * BK * DV) + cv, mask=vm, other=0.0).to(ADT)
    g0 = tl.sum(dn * h0[None, :], 1) + dl * tl.load(hden + snap * (NBLK * BK)).to(ADT)
    if not FACTOR:
        g0 += tl.sum(dA, 1)
    tl.atomic_add(dqwb + hq * (NBLK * BK), tl.sum(g0, 0))
    # linear features
    g = _mm(dn, tl.trans(tl.load(h_rows + BK * DV, mask=vm[None, :], other=0.0)), DT, INTERP)
    g += dl[:, None] * tl.load(hdb + BK).to(ADT)[None, :]
    if not FACTOR:
        g += _mm(dA, K, DT, INTERP)
    tl.atomic_add(gwb + BK, tl.sum(Q * g, 0))
    dQ = g * tl.load(wb + BK).to(ADT)[None, :]
    # pair features
    for blk in range(2, NBLK):
        t = (cols + (blk - 2)) % D_HEAD
        Qt = tl.load(q_rows + t[None, :], mask=mask_qk, other=0.0).to(ADT)
        g = _mm(dn, tl.trans(tl.load(h_rows + blk * (BK * DV), mask=vm[None, :], other=0.0)), DT, INTERP)
        g += dl[:, None] * tl.load(hdb + blk * BK).to(ADT)[None, :]
        if not FACTOR:
            Kt = tl.load(k_rows + t[None, :], mask=mask_qk, other=0.0).to(ADT)
            g += _mm(dA, K * Kt, DT, INTERP)
        tl.atomic_add(gwb + blk * BK, tl.sum(Q * Qt * g, 0))
        y = g * tl.load(wb + blk * BK).to(ADT)[None, :]
        dQ += y * Qt + _roll_cols(y * Q, blk - 2, D_HEAD, BT, BK)
    # within-chunk kernel from the factor: κ = c0 + Σ_m z_m², z_m = c_m + (q ⊙ W_m) · k
    if FACTOR:
        tl.atomic_add(dfc0 + hq, tl.sum(tl.sum(dA, 1), 0))
        for m in range(R):
            wm = tl.load(fw + (hq * R + m) * D_HEAD + cols, mask=cm, other=0.0).to(ADT)
            z = _mm(Q * wm[None, :], tl.trans(K), DT, INTERP) + tl.load(fc + hq * R + m).to(ADT)
            dz = 2.0 * z * dA
            dzk = _mm(dz, K, DT, INTERP)
            dQ += dzk * wm[None, :]
            tl.atomic_add(dfw + (hq * R + m) * D_HEAD + cols, tl.sum(Q * dzk, 0), mask=cm)
            tl.atomic_add(dfc + hq * R + m, tl.sum(tl.sum(dz, 1), 0))
    dq_rows = dq + b * s_gb + hq * s_gh + i[:, None] * s_gn
    tl.store(dq_rows + cols[None, :], dQ.to(dq.dtype.element_ty), mask=mask_qk)


@triton.jit
def chunk_bwd_dkv(
    q,
    k,
    v,
    qwb,
    fc0,
    fc,
    fw,
    dh,
    dhden,
    do,
    den,
    delta_ptr,
    dk,
    dv,
    s_qb,
    s_qh,
    s_qn,
    s_kb,
    s_kh,
    s_kn,
    s_vb,
    s_vh,
    s_vn,
    s_db,
    s_dh,
    s_dn,
    s_kgb,
    s_kgh,
    s_kgn,
    s_vgb,
    s_vgh,
    s_vgn,
    t0,
    N,
    NC,
    Hkv,
    G,
    R,
    D_HEAD: tl.constexpr,
    DV: tl.constexpr,
    NBLK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    FACTOR: tl.constexpr,
    DT: tl.constexpr,
    ADT: tl.constexpr,
    INTERP: tl.constexpr,
):
    """dk, dv of one chunk of one KV head: the reverse snapshot (keys feed every later chunk's state) plus the
    within-chunk kernel of each of the G query heads reading this KV head."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b = bh // Hkv
    hk = bh % Hkv
    Hq = Hkv * G
    i = t0 + c * BT + tl.arange(0, BT)
    im = i < N
    cols = tl.arange(0, BK)
    cm = cols < D_HEAD
    cv = tl.arange(0, BV)
    vm = cv < DV
    mask_qk = im[:, None] & cm[None, :]
    mask_v = im[:, None] & vm[None, :]
    k_rows = k + b * s_kb + hk * s_kh + i[:, None] * s_kn
    K = tl.load(k_rows + cols[None, :], mask=mask_qk, other=0.0).to(ADT)
    V = tl.load(v + b * s_vb + hk * s_vh + i[:, None] * s_vn + cv[None, :], mask=mask_v, other=0.0).to(ADT)
    snap = bh * NC + c
    h_rows = dh + snap * (NBLK * BK * DV) + cols[:, None] * DV + cv[None, :]
    hdb = dhden + snap * (NBLK * BK) + cols
    # readout of later chunks through the state: dv_j = φ_k(k_j) dS, ∂L/∂φ_k(k_j) = dS [v_j; 1]
    dV = tl.zeros([BT, BV], dtype=ADT) + tl.load(dh + snap * (NBLK * BK * DV) + cv, mask=vm).to(ADT)[None, :]
    hl = tl.load(h_rows + BK * DV, mask=vm[None, :], other=0.0)
    dV += _mm(K, hl, DT, INTERP)
    dK = _mm(V, tl.trans(hl), DT, INTERP) + tl.load(hdb + BK).to(ADT)[None, :]
    for blk in range(2, NBLK):
        t = (cols + (blk - 2)) % D_HEAD
        Kt = tl.load(k_rows + t[None, :], mask=mask_qk, other=0.0).to(ADT)
        hp = tl.load(h_rows + blk * (BK * DV), mask=vm[None, :], other=0.0)
        dV += _mm(K * Kt, hp, DT, INTERP)
        gp = _mm(V, tl.trans(hp), DT, INTERP) + tl.load(hdb + blk * BK).to(ADT)[None, :]
        dK += gp * Kt + _roll_cols(gp * K, blk - 2, D_HEAD, BT, BK)
    # within-chunk kernel, one query head at a time
    causal = (i[:, None] >= i[None, :]) & im[None, :] & im[:, None]
    for g in range(G):
        hq = hk * G + g
        q_rows = q + b * s_qb + hq * s_qh + i[:, None] * s_qn
        Q = tl.load(q_rows + cols[None, :], mask=mask_qk, other=0.0).to(ADT)
        tok = (b * Hq + hq) * N + i
        dd = tl.load(den + tok, mask=im, other=1.0).to(ADT)
        dl = tl.load(delta_ptr + tok, mask=im, other=0.0).to(ADT)
        d_rows = do + b * s_db + hq * s_dh + i[:, None] * s_dn
        dn = tl.load(d_rows + cv[None, :], mask=mask_v, other=0.0).to(ADT) / dd[:, None]
        dA = tl.where(causal, _mm(dn, tl.trans(V), DT, INTERP) + dl[:, None], 0.0)
        if FACTOR:
            A = tl.zeros([BT, BT], dtype=ADT) + tl.load(fc0 + hq).to(ADT)
            for m in range(R):
                wm = tl.load(fw + (hq * R + m) * D_HEAD + cols, mask=cm, other=0.0).to(ADT)
                qwm = Q * wm[None, :]
                z = _mm(qwm, tl.trans(K), DT, INTERP) + tl.load(fc + hq * R + m).to(ADT)
                A += z * z
                dK += _mm(tl.trans(2.0 * z * dA), qwm, DT, INTERP)
        else:
            wb = qwb + hq * (NBLK * BK) + cols
            phi = Q * tl.load(wb + BK).to(ADT)[None, :]
            A = tl.load(qwb + hq * (NBLK * BK)).to(ADT) + _mm(phi, tl.trans(K), DT, INTERP)
            dK += _mm(tl.trans(dA), phi, DT, INTERP)
            for blk in range(2, NBLK):
                t = (cols + (blk - 2)) % D_HEAD
                Qt = tl.load(q_rows + t[None, :], mask=mask_qk, other=0.0).to(ADT)
                Kt = tl.load(k_rows + t[None, :], mask=mask_qk, other=0.0).to(ADT)
                phi = Q * Qt * tl.load(wb + blk * BK).to(ADT)[None, :]
                A += _mm(phi, tl.trans(K * Kt), DT, INTERP)
                gp = _mm(tl.trans(dA), phi, DT, INTERP)
                dK += gp * Kt + _roll_cols(gp * K, blk - 2, D_HEAD, BT, BK)
        A = tl.where(causal, A, 0.0)
        dV += _mm(tl.trans(A), dn, DT, INTERP)
    dk_rows = dk + b * s_kgb + hk * s_kgh + i[:, None] * s_kgn
    tl.store(dk_rows + cols[None, :], dK.to(dk.dtype.element_ty), mask=mask_qk)
    dv_rows = dv + b * s_vgb + hk * s_vgh + i[:, None] * s_vgn
    tl.store(dv_rows + cv[None, :], dV.to(dv.dtype.element_ty), mask=mask_v)


@triton.jit
def recurrent_step(
    q,
    k,
    v,
    tab,
    qwb,
    state_in,
    state_out,
    num,
    s_qb,
    s_qh,
    s_qt,
    s_kb,
    s_kh,
    s_kt,
    s_vb,
    s_vh,
    s_vt,
    T,
    Hkv,
    G,
    D_HEAD: tl.constexpr,
    DV: tl.constexpr,
    D_FEAT: tl.constexpr,
    NBLK: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    ADT: tl.constexpr,
):
    """Decode (Algorithm 1, lines 7–10) for T tokens on one feature block of one KV head: update the block's
    state rows with each token, then add its readout ``φ_q S`` of the G query heads into ``num (B, Hq, T, dv+1)``
    (zero-initialised; every block adds its part). ``state_out`` may be ``state_in`` (in-place update)."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // Hkv
    hk = bh % Hkv
    Hq = Hkv * G
    rcol, tcol, row = _block(tab, blk, BK, NBLK)
    valid = row >= 0
    cv = tl.arange(0, BV)
    vm = cv < DV
    smask = valid[:, None] & vm[None, :]
    sti = state_in + bh * D_FEAT * (DV + 1)
    S = tl.load(sti + row[:, None] * (DV + 1) + cv[None, :], mask=smask, other=0.0).to(ADT)
    Sden = tl.load(sti + row * (DV + 1) + DV, mask=valid, other=0.0).to(ADT)
    for t in range(T):
        f = tl.where(valid, _vec_feat(k + b * s_kb + hk * s_kh + t * s_kt, rcol, tcol, D_HEAD, ADT), 0.0)
        u = tl.load(v + b * s_vb + hk * s_vh + t * s_vt + cv, mask=vm, other=0.0).to(ADT)
        S += f[:, None] * u[None, :]
        Sden += f
        for g in range(G):
            hq = hk * G + g
            w = tl.load(qwb + hq * (NBLK * BK) + blk * BK + tl.arange(0, BK)).to(ADT)
            phi = _vec_feat(q + b * s_qb + hq * s_qh + t * s_qt, rcol, tcol, D_HEAD, ADT) * w
            nb = num + ((b * Hq + hq) * T + t) * (DV + 1)
            tl.atomic_add(nb + cv, tl.sum(phi[:, None] * S, 0), mask=vm)
            tl.atomic_add(nb + DV, tl.sum(phi * Sden, 0))
    sto = state_out + bh * D_FEAT * (DV + 1)
    tl.store(sto + row[:, None] * (DV + 1) + cv[None, :], S, mask=smask)
    tl.store(sto + row * (DV + 1) + DV, Sden, mask=valid)


@triton.jit
def recurrent_finalize(
    num,
    state,
    o,
    s_ob,
    s_oh,
    s_ot,
    T,
    Hq,
    G,
    floor,
    DV: tl.constexpr,
    D_FEAT: tl.constexpr,
    BV: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
):
    """``o = num[:dv] / num[dv]``, the denominator clamped at ``floor · (keys so far)`` (H0's count channel of
    the updated state, minus the tokens still ahead in this step)."""
    bh = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    b = bh // Hq
    hq = bh % Hq
    cv = tl.arange(0, BV)
    vm = cv < DV
    nb = num + (bh * T + t) * (DV + 1)
    x = tl.load(nb + cv, mask=vm, other=0.0)
    den = tl.load(nb + DV)
    if HAS_FLOOR:
        cnt = tl.load(state + (b * (Hq // G) + hq // G) * D_FEAT * (DV + 1) + DV) - (T - 1 - t)
        den = tl.maximum(den, floor * cnt)
    tl.store(o + b * s_ob + hq * s_oh + t * s_ot + cv, (x / den).to(o.dtype.element_ty), mask=vm)
