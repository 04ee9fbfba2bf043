"""One training step (forward + backward of the LM loss, gradients for every q_proj weight as a stand-in for LoRA's)
of the original and the committed converted SmolLM2 at N tokens; min of 2 timed steps after one warm-up.

    OAL_DATA_DIR=../shared/data python benchmarks/train_step.py --sizes 512,2048 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from oal.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--converted", default="docs/results/conversion/model")
    ap.add_argument("--sizes", default="512,2048")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in ("smollm2-135m", args.converted):
        model = load_model(name).train()
        for p in model.parameters():
            p.requires_grad_(False)
        for module in model.modules():
            if hasattr(module, "q_proj"):
                module.q_proj.weight.requires_grad_(True)
        for n in (int(x) for x in args.sizes.split(",")):
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))

            def step(ids=ids, model=model):
                model(ids, labels=ids, use_cache=False).loss.backward()

            step()
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            print(json.dumps({"model": name, "n": n, "s_per_step": min(times)}), flush=True)


if __name__ == "__main__":
    main()
