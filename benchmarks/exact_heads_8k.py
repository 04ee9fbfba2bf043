"""Dev check of issue #14 (prompt seed 99, not the evaluation prompts): passkey accuracy at 8k tokens of a
converted model with a chosen set of KV heads exact, everything else as committed.

    OAL_DATA_DIR=../shared/data python benchmarks/exact_heads_8k.py --counts 30,45 --trials 3
    OAL_DATA_DIR=../shared/data python benchmarks/exact_heads_8k.py --model runs/copy_model --counts 20 \\
        --extra 3:0,3:1,3:2,4:0,4:1,4:2

``--counts K``: the K best KV heads by the recipe's copy scores (``head_scores`` in recipe.json); ``--extra``
(repeatable) adds those ``layer:head`` pairs to each K, one run per ``--extra``. Prints one JSON line per run:
accuracy, the continuations, and the cache MiB after the prompt.
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


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"3:0,4:1"`` -> [(3, 0), (4, 1)]."""
    return [tuple(int(x) for x in p.split(":")) for p in text.split(",") if p]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="docs/results/conversion/model")
    ap.add_argument("--counts", default="30,45")
    ap.add_argument("--extra", action="append", default=None, help="layer:head,... added to the K copy heads")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    scores = torch.tensor(read_json(Path(args.model) / "recipe.json")["head_scores"])
    tokenizer = load_tokenizer(args.model)
    for count in (int(x) for x in args.counts.split(",")):
        for extra in args.extra or [""]:
            model = load_model(args.model)
            kv_dtype = None
            for i, k in attached_kernels(model).items():
                if isinstance(k, ExactHeadsKernel):
                    kv_dtype = k.kv_dtype
                    attach_kernel(model, i, k.inner)
            chosen = rank_heads(scores, sorted(attached_kernels(model)))[:count]
            chosen += [p for p in parse_pairs(extra) if p not in chosen]
            heads = defaultdict(list)
            for layer, h in chosen:
                heads[layer].append(h)
            add_exact_heads(model, {layer: sorted(hs) for layer, hs in heads.items()}, kv_dtype=kv_dtype)
            r = evaluate_retrieval(
                model, tokenizer, task="passkey", lengths=[args.length], trials=args.trials, seed=args.seed,
                progress=False,
            )  # fmt: skip
            row = r["per_length"][str(args.length)]
            print(
                json.dumps(
                    {
                        "exact_kv_heads": len(chosen),
                        "copy_heads": count,
                        "extra": extra,
                        "acc": row["acc"],
                        "cache_mib": r["trials"][0]["cache_mib"],
                        "continuations": [t["continuation"] for t in r["trials"]],
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
