"""Dev check of issue #14 (prompt seed 99, not the evaluation prompts): passkey accuracy at 8k tokens of the
committed converted model with its K best KV heads (the recipe's copy scores, recipe.json) kept exact, for each K.

    OAL_DATA_DIR=../shared/data python benchmarks/exact_heads_8k.py --counts 30,45 --trials 3

Prints one JSON line per K: accuracy, the continuations, and the cache MiB after the prompt.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from oal.conversion.heads import add_exact_heads, rank_heads
from oal.evaluation.retrieval import evaluate_retrieval
from oal.io import read_json
from oal.kernels import ExactHeadsKernel
from oal.models import attach_kernel, attached_kernels, load_model, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="docs/results/conversion/model")
    ap.add_argument("--counts", default="30,45")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    scores = torch.tensor(read_json(Path(args.model) / "recipe.json")["head_scores"])
    tokenizer = load_tokenizer(args.model)
    for count in (int(x) for x in args.counts.split(",")):
        model = load_model(args.model)
        for i, k in attached_kernels(model).items():
            if isinstance(k, ExactHeadsKernel):
                attach_kernel(model, i, k.inner)
        heads = defaultdict(list)
        for layer, h in rank_heads(scores, sorted(attached_kernels(model)))[:count]:
            heads[layer].append(h)
        add_exact_heads(model, dict(heads))
        r = evaluate_retrieval(
            model, tokenizer, task="passkey", lengths=[args.length], trials=args.trials, seed=args.seed, progress=False
        )
        row = r["per_length"][str(args.length)]
        print(
            json.dumps(
                {
                    "exact_kv_heads": count,
                    "acc": row["acc"],
                    "cache_mib": r["trials"][0]["cache_mib"],
                    "continuations": [t["continuation"] for t in r["trials"]],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
