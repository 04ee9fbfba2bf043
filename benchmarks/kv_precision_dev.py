"""Dev check for issues #14/#15 (not the evaluation data): does storing the exact heads' keys and values in lower
precision change the committed converted model? Variants: ``fp32`` (the model as committed; the name is stop
21's, when its exact keys and values were fp32: they are bf16 since stop 22), ``bf16-rounded``
(every ExactHeadsKernel's k and v rounded to bf16 before use: the exact heads' cache, the inner kernel's sinks,
window and state inputs of those layers; the decode steps' new keys are not rounded), ``int8-token`` (only the
exact KV heads' keys and values, each token's vector of each head quantised to int8 with its own absmax scale,
symmetric, and dequantised: what an 8-bit exact cache would hold, in the prompt's call and in a short prompt's
kept form; decode steps' new keys are not quantised; goal 1's growth in issue #15). Perplexity on
WikiText-2 *valid* blocks 0–3 at N = 1024 and passkey accuracy on the dev prompts (seed 99).

    OAL_DATA_DIR=../shared/data python benchmarks/kv_precision_dev.py --trials 6
    OAL_DATA_DIR=../shared/data python benchmarks/kv_precision_dev.py --variants fp32,int8-token \
        --lengths 1024,4096,8192
"""

from __future__ import annotations

import argparse
import json

import torch

from oal.data.text import load_text
from oal.evaluation.perplexity import perplexity
from oal.evaluation.retrieval import evaluate_retrieval
from oal.kernels import ExactHeadsKernel
from oal.kernels import kept as kept_form
from oal.models import load_model, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="docs/results/conversion/model")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="fp32,bf16-rounded", help="comma-separated: fp32, bf16-rounded, int8-token")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    ids = tokenizer(load_text("valid").text, return_tensors="pt").input_ids[0]
    blocks = ids[: 4 * 1024].view(4, 1024)
    real = ExactHeadsKernel.forward

    def rounded(self, q, k, v, **kw):
        return real(self, q, k.to(torch.bfloat16).to(k.dtype), v.to(torch.bfloat16).to(v.dtype), **kw)

    def int8(x: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
        """x (B, H, N, ·) with the vectors of ``heads`` quantised to int8 per token (absmax scale) and back."""
        x = x.clone()
        sel = x[:, list(heads)]
        scale = sel.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
        x[:, list(heads)] = (sel / scale).round().clamp(-127, 127) * scale
        return x

    def int8_token(self, q, k, v, **kw):
        return real(self, q, int8(k, self.exact_kv_heads), int8(v, self.exact_kv_heads), **kw)

    real_start = kept_form.start

    def int8_start(kernel, q, k, v, model_dtype=torch.float32):
        """A short prompt's kept form caches the exact heads' keys it is given: quantise them before."""
        if isinstance(kernel, ExactHeadsKernel):
            k, v = int8(k, kernel.exact_kv_heads), int8(v, kernel.exact_kv_heads)
        return real_start(kernel, q, k, v, model_dtype)

    forwards = {"fp32": real, "bf16-rounded": rounded, "int8-token": int8_token}
    variants = args.variants.split(",")
    for variant in variants:
        if variant not in forwards:
            raise ValueError(f"--variants: expected names among {tuple(forwards)}, got {variant!r}")

    lengths = [int(x) for x in args.lengths.split(",")]
    try:
        for variant in variants:
            ExactHeadsKernel.forward = forwards[variant]
            kept_form.start = int8_start if variant == "int8-token" else real_start
            model = load_model(args.model)
            ppl = perplexity(model, blocks, progress=False)["ppl"]
            r = evaluate_retrieval(
                model, tokenizer, task="passkey", lengths=lengths, trials=args.trials, seed=99, progress=False
            )
            passkey = {n: row["acc"] for n, row in r["per_length"].items()}
            print(json.dumps({"exact_kv": variant, "dev_ppl": round(ppl, 4), "dev_passkey": passkey}), flush=True)
    finally:
        ExactHeadsKernel.forward = real
        kept_form.start = real_start


if __name__ == "__main__":
    main()
