"""The committed converted model with its exact heads' prefill fused (window.cpp ``exact_prefill``) against the same
model on torch's SDPA: perplexity of ``--blocks`` blocks of 1024 tokens and the largest logit difference (a
numerical check of the fast path on real data, not an evaluation; the text is WikiText-2 valid).

    OAL_DATA_DIR=../shared/data python benchmarks/exact_prefill_equivalence.py --blocks 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch

import oal.kernels.hybrid as hybrid
from oal.models import load_model, load_tokenizer

MODEL = "docs/results/conversion/model"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(MODEL).eval(), load_tokenizer(MODEL)
    text = (Path(os.environ.get("OAL_DATA_DIR", "../shared/data")) / "wikitext-2-raw/wiki.valid.raw").read_text()
    ids = tokenizer(text[: 20000 * args.blocks], return_tensors="pt").input_ids[0]
    fused = hybrid._fused_exact
    results = {}
    for name, path in (("fused", fused), ("sdpa", lambda *a: None)):
        hybrid._fused_exact = path
        nll, logits = 0.0, []
        for b in range(args.blocks):
            x = ids[b * 1024 : (b + 1) * 1024][None]
            with torch.no_grad():
                out = model(x, use_cache=False).logits
            logits.append(out)
            nll += torch.nn.functional.cross_entropy(out[0, :-1], x[0, 1:], reduction="sum").item()
        results[name] = (math.exp(nll / (1023 * args.blocks)), logits)
    hybrid._fused_exact = fused
    diff = max((a - b).abs().max().item() for a, b in zip(results["fused"][1], results["sdpa"][1], strict=True))
    print(json.dumps({"ppl_fused": results["fused"][0], "ppl_sdpa": results["sdpa"][0], "max_abs_logit_diff": diff}))


if __name__ == "__main__":
    main()
