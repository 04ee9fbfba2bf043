"""Dev check for issues #14/#15 (not the evaluation data): does storing the exact heads' keys and values in bf16
change the committed converted model? Every ExactHeadsKernel's k and v are rounded to bf16 before use (the
exact heads' cache, the inner kernel's sinks, window and state inputs of those layers; the decode steps' new keys
are not rounded), against the model as committed: perplexity on WikiText-2 *valid* blocks 0–3 at N = 1024 and
passkey accuracy on the dev prompts (seed 99).

    OAL_DATA_DIR=../shared/data python benchmarks/kv_precision_dev.py --trials 6
"""

from __future__ import annotations

import argparse
import json

import torch

from oal.data.text import load_text
from oal.evaluation.perplexity import perplexity
from oal.evaluation.retrieval import evaluate_retrieval
from oal.kernels import ExactHeadsKernel
from oal.models import load_model, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="docs/results/conversion/model")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    ids = tokenizer(load_text("valid").text, return_tensors="pt").input_ids[0]
    blocks = ids[: 4 * 1024].view(4, 1024)
    real = ExactHeadsKernel.forward

    def rounded(self, q, k, v, **kw):
        return real(self, q, k.to(torch.bfloat16).to(k.dtype), v.to(torch.bfloat16).to(v.dtype), **kw)

    lengths = [int(x) for x in args.lengths.split(",")]
    try:
        for variant, forward in (("fp32", real), ("bf16-rounded", rounded)):
            ExactHeadsKernel.forward = forward
            model = load_model(args.model)
            ppl = perplexity(model, blocks, progress=False)["ppl"]
            r = evaluate_retrieval(
                model, tokenizer, task="passkey", lengths=lengths, trials=args.trials, seed=99, progress=False
            )
            passkey = {n: row["acc"] for n, row in r["per_length"].items()}
            print(json.dumps({"exact_kv": variant, "dev_ppl": round(ppl, 4), "dev_passkey": passkey}), flush=True)
    finally:
        ExactHeadsKernel.forward = real


if __name__ == "__main__":
    main()
