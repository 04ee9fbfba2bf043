"""Dev analysis of issue #14: per KV head, how far the committed kernels' attention output is from softmax at a
long context (`oal.conversion.heads.output_errors` on the original model's q/k/v, positions ≥ ``--skip``, max over
the KV head's query heads: the recipe's `approximation_error_scores`), on WikiText-2 valid (what the recipe
scores) or on a dev passkey prompt (filler haystack, prompt seed 99). ``--beta-offsets`` also reports, per KV
head, the smallest error over those shifts of the kernels' β (from one capture).

    OAL_DATA_DIR=../shared/data python benchmarks/head_errors.py --text wiki --n 8192
    OAL_DATA_DIR=../shared/data python benchmarks/head_errors.py --text filler --n 8192 --beta-offsets=-25,-2,-1,1,2,5

Prints one line per layer (the KV heads' errors; with offsets: error as committed / best over the offsets) and,
last, a JSON line with the whole table.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from oal.conversion.heads import output_errors
from oal.data.text import load_text
from oal.data.tokens import tokenize
from oal.evaluation.retrieval import build_prompt
from oal.kernels import ExactHeadsKernel
from oal.models import attached_kernels, capture_qkv, load_model, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="docs/results/conversion/model")
    ap.add_argument("--text", choices=["wiki", "filler"], default="wiki")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--skip", type=int, default=1024, help="first position scored")
    ap.add_argument("--offset", type=int, default=32768, help="first WikiText-2 valid token (--text wiki)")
    ap.add_argument("--beta-offsets", default="", help="comma-separated shifts of β to try besides 0")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    offsets = [0.0] + [float(x) for x in args.beta_offsets.split(",") if x]
    tokenizer = load_tokenizer(args.model)
    conv = load_model(args.model)
    kernels = {i: k.inner if isinstance(k, ExactHeadsKernel) else k for i, k in attached_kernels(conv).items()}
    if args.text == "wiki":
        ids = tokenize(tokenizer, load_text("valid").text)[None, args.offset : args.offset + args.n]
    else:
        ids = torch.tensor([build_prompt(tokenizer, args.n, random.Random("dev/99"), task="passkey").ids])
    original = load_model("smollm2-135m")
    with torch.inference_mode(), capture_qkv(original, layers=sorted(kernels)) as rec:
        original(input_ids=ids, use_cache=False)
    table = {}
    for layer, kernel in sorted(kernels.items()):
        q, k, v, _, scale = rec[layer]
        beta = kernel.beta.detach().clone()
        errs = []
        for off in offsets:
            with torch.no_grad():
                kernel.beta.copy_(beta + off)
            errs.append(output_errors(kernel, q, k, v, scale, skip=args.skip).view(k.shape[1], -1).amax(-1))
        with torch.no_grad():
            kernel.beta.copy_(beta)
        e = torch.stack(errs)  # (offsets, Hkv)
        table[layer] = {"committed": e[0].tolist(), "best": e.min(0).values.tolist()}
        best = f"  best over β offsets {' '.join(f'{x:.3f}' for x in table[layer]['best'])}" if len(offsets) > 1 else ""
        print(layer, " ".join(f"{x:.3f}" for x in table[layer]["committed"]) + best, flush=True)
    print(json.dumps({"text": args.text, "n": args.n, "skip": args.skip, "beta_offsets": offsets, "layers": table}))


if __name__ == "__main__":
    main()
