"""Dev analysis of issue #14: per KV head, how far the committed kernels' attention output is from softmax at a
long context (`oal.conversion.heads.approximation_error_scores`, on the original model's q/k/v, positions ≥ 1024),
on WikiText-2 valid (what the recipe scores) or on a dev passkey prompt (filler haystack, prompt seed 99).

    OAL_DATA_DIR=../shared/data python benchmarks/head_errors.py --text wiki --n 8192
    OAL_DATA_DIR=../shared/data python benchmarks/head_errors.py --text filler --n 8192

Prints one line per layer (the KV heads' errors) and, last, a JSON line with the whole table.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from oal.conversion.heads import approximation_error_scores
from oal.data.text import load_text
from oal.data.tokens import tokenize
from oal.evaluation.retrieval import build_prompt
from oal.kernels import ExactHeadsKernel
from oal.models import attached_kernels, load_model, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="docs/results/conversion/model")
    ap.add_argument("--text", choices=["wiki", "filler"], default="wiki")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--offset", type=int, default=32768, help="first WikiText-2 valid token (--text wiki)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    conv = load_model(args.model)
    kernels = {i: k.inner if isinstance(k, ExactHeadsKernel) else k for i, k in attached_kernels(conv).items()}
    if args.text == "wiki":
        ids = tokenize(tokenizer, load_text("valid").text)[None, args.offset : args.offset + args.n]
    else:
        ids = torch.tensor([build_prompt(tokenizer, args.n, random.Random("dev/99"), task="passkey").ids])
    errors = approximation_error_scores(load_model("smollm2-135m"), kernels, ids)
    for layer, row in enumerate(errors.tolist()):
        print(layer, " ".join(f"{x:.3f}" for x in row))
    print(json.dumps({"text": args.text, "n": args.n, "errors": [[round(x, 4) for x in r] for r in errors.tolist()]}))


if __name__ == "__main__":
    main()
