"""Dev check of issue #14 (not evaluation prompts: prompt seed 99): passkey accuracy at 8k tokens of the committed
converted model with its kernel log-scales β shifted by each offset.

    OAL_DATA_DIR=../shared/data python benchmarks/beta_sweep_8k.py --offsets 1,2,3,4 --trials 3

The committed model already carries β − 5 (the recipe's offset), so offset +3 is β − 2. Prints one JSON line per
offset: accuracy and the greedy continuations.
"""

from __future__ import annotations

import argparse
import json

import torch

from oal.evaluation.retrieval import evaluate_retrieval
from oal.kernels import ExactHeadsKernel
from oal.models import attached_kernels, load_model, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="docs/results/conversion/model")
    ap.add_argument("--offsets", default="1,2,3,4")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    wrappers = {i: k.inner if isinstance(k, ExactHeadsKernel) else k for i, k in attached_kernels(model).items()}
    base = {i: k.beta.detach().clone() for i, k in wrappers.items()}
    for offset in (float(x) for x in args.offsets.split(",")):
        with torch.no_grad():
            for i, k in wrappers.items():
                k.beta.copy_(base[i] + offset)
        r = evaluate_retrieval(
            model, tokenizer, task="passkey", lengths=[args.length], trials=args.trials, seed=args.seed, progress=False
        )
        acc = r["per_length"][str(args.length)]["acc"]
        print(json.dumps({"offset": offset, "acc": acc, "continuations": [t["continuation"] for t in r["trials"]]}))


if __name__ == "__main__":
    main()
