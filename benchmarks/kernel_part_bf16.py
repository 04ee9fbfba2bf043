"""Would the kernel part's state products survive bf16 numbers? The numerics of the one lever left for the
prefill's kernel part (``chunk.cpp`` runs its state readout and update at this core's fp32 FMA rate), measured
before any kernel is written for it.

On real queries, keys and values of the converted model's kernel heads (WikiText-2 valid, ``--n`` tokens from
token 1000; a forward pre-hook on each listed layer's kernel), per kernel query head, against the explicit fp64
kernel attention of Eq. 3 (κ from the packed features of Eq. 24–25, no sinks or window: the kernel part alone):

* ``fp32``: the chunked form of Eq. 5–6 (chunks of 64, the intra-chunk part exact) with the readout φ_q(Q) S and
  the update S += φ_k(K)ᵀ [V, 1] in fp32, as ``chunk.cpp`` computes them;
* ``bf16``: the same with the readout's and the update's inputs (weighted query features, the state, key
  features, values) rounded to bf16 and the products accumulated exactly into the fp32 state — what AVX512_BF16's
  pair products (``vdpbf16ps``) would give at best;
* ``exact_bf16``: for scale, the same heads under exact softmax with the bf16 products the recipe's exact heads
  use (scaled queries and the weights rounded to bf16), against fp64 softmax.

Prints one JSON line per head (relative RMS error of the output, largest relative error of the denominator) and a
summary line.

    python benchmarks/kernel_part_bf16.py --n 2048 --layers 12,16,25,29 --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers import AutoTokenizer

from oal.data.text import load_text
from oal.kernels.hybrid import ExactHeadsKernel
from oal.kernels.oal import oal_coefficients
from oal.kernels.sink_window import SinkWindowKernel
from oal.models import load_model
from oal.models.hooks import KERNEL_ATTR
from oal.ops.quadratic.utils import key_features, query_weights

CHUNK = 64


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def chunked(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, rounded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(N, dv)`` and denominator ``(N,)`` of the chunked form from features ``fq``/``fk (N, D)`` (fp64)."""
    N = fq.shape[0]
    u = torch.cat([v, torch.ones(N, 1, dtype=v.dtype)], 1)
    S = torch.zeros(fk.shape[1], u.shape[1], dtype=torch.float32)
    out, den = torch.empty_like(v), torch.empty(N, dtype=v.dtype)
    for s0 in range(0, N, CHUNK):
        s1 = min(N, s0 + CHUNK)
        intra = (fq[s0:s1] @ fk[s0:s1].T).tril() @ u[s0:s1]
        if rounded:
            readout = bf16(fq[s0:s1]) @ bf16(S.double())
            S = S + (bf16(fk[s0:s1]).T @ bf16(u[s0:s1])).float()
        else:
            readout = (fq[s0:s1].float() @ S).double()
            S = S + fk[s0:s1].float().T @ u[s0:s1].float()
        total = intra + readout
        out[s0:s1], den[s0:s1] = total[:, :-1] / total[:, -1:], total[:, -1]
    return out, den


def exact_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> float:
    """Relative RMS error of causal softmax with bf16 products (scaled queries, weights) against fp64."""
    s = (q * scale) @ k.T
    mask = torch.ones_like(s, dtype=torch.bool).tril()
    ref = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v
    s16 = (bf16(q * scale) @ bf16(k).T).masked_fill(~mask, float("-inf"))
    p = torch.exp(s16 - s16.amax(-1, keepdim=True))
    got = (bf16(p) @ bf16(v)) / bf16(p).sum(-1, keepdim=True)
    return rel_rms(got, ref)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--layers", default="12,16,25,29", help="model layers with kernel heads")
    ap.add_argument("--converted", default="docs/results/conversion/model")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layers = [int(x) for x in args.layers.split(",")]
    model = load_model(args.converted)
    tokenizer = AutoTokenizer.from_pretrained(args.converted)
    text = load_text("valid", data_dir=args.data_dir).text
    ids = tokenizer(text[:200_000], return_tensors="pt").input_ids[:, 1000 : 1000 + args.n]
    if ids.shape[1] != args.n:
        raise ValueError(f"--n: the text gives {ids.shape[1]} tokens after token 1000, asked for {args.n}")
    captured: dict[int, tuple[torch.Tensor, ...]] = {}
    handles = []
    for i in layers:
        kernel = getattr(model.model.layers[i].self_attn, KERNEL_ATTR, None)
        if kernel is None:
            raise ValueError(f"--layers: layer {i} has no kernel")

        def grab(module, inputs, kwargs, i=i):
            captured[i] = tuple(x.detach().double() for x in inputs[:3])

        handles.append(kernel.register_forward_pre_hook(grab, with_kwargs=True))
    with torch.no_grad():
        model(ids, use_cache=False)
    for handle in handles:
        handle.remove()

    rows = []
    for i in layers:
        kernel = getattr(model.model.layers[i].self_attn, KERNEL_ATTR)
        q, k, v = captured[i]
        if isinstance(kernel, ExactHeadsKernel):
            heads_q, heads_kv, inner = list(kernel._kernel_q), list(kernel.kernel_kv_heads), kernel.inner
        else:
            heads_q, heads_kv, inner = list(range(q.shape[1])), list(range(k.shape[1])), kernel
        if not heads_q:
            raise ValueError(f"--layers: layer {i} has no kernel heads (all exact)")
        oal = inner.inner if isinstance(inner, SinkWindowKernel) else inner
        hq = torch.tensor(heads_q)
        a, b, C = oal_coefficients(oal.groups.index_select(0, hq), oal.L.double().index_select(0, hq), oal.eps)
        weights = query_weights(a, b, C, kernel.scale)
        G = len(heads_q) // len(heads_kv)
        for idx, h in enumerate(heads_q):
            qh, kh, vh = q[0, h], k[0, heads_kv[idx // G]], v[0, heads_kv[idx // G]]
            fq, fk = key_features(qh) * weights[idx], key_features(kh)
            kappa = (fq @ fk.T).tril()
            den = kappa.sum(-1)
            ref = (kappa @ vh) / den[:, None]
            row = {"layer": i, "q_head": h, "n": args.n}
            for name, rounded in (("fp32", False), ("bf16", True)):
                out, d = chunked(fq, fk, vh, rounded)
                row[f"{name}_out_rel_rms"] = rel_rms(out, ref)
                row[f"{name}_den_max_rel"] = float(((d - den).abs() / den.abs()).max())
            row["exact_bf16_out_rel_rms"] = exact_errors(qh, kh, vh, kernel.scale)
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {"summary": True, "heads": len(rows)}
    for key in rows[0]:
        if key.endswith(("_rel_rms", "_max_rel")):
            values = [r[key] for r in rows]
            summary[key] = {"median": statistics.median(values), "max": max(values)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
