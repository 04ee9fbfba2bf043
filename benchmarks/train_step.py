"""One LoRA update (forward + backward of the LM loss + AdamW step) of the original and of the committed converted
SmolLM2 at N tokens, as ``oal finetune`` runs it: the cpu preset's LoRA (rank 8 on q/k/v/o of every layer) and, for
the converted model, its kernel parameters (L, β) trained too. The two models alternate within one process (the
machine's speed drifts between minutes), each timed ``--repeats`` times after one warm-up update; the minimum
counts. Prints one JSON line per (model, N) and the ratio per N; ``--out`` also appends them to a JSONL file.
``--peak-rss original|converted`` instead loads that model alone and reports the process's peak RSS after one
update at the one size given (one process per size: an earlier, smaller update leaves the allocator's pools larger).

    OAL_DATA_DIR=../shared/data python benchmarks/train_step.py --sizes 512,2048 --threads 2 --out train_step.jsonl
    OAL_DATA_DIR=../shared/data python benchmarks/train_step.py --sizes 2048 --peak-rss converted

The first line of the output is the machine record (``oal.bench.devices.machine_record``: the command, the
versions, the CPU's flags), also the first of the lines ``--out`` appends.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from oal.bench.devices import machine_record
from oal.models import load_model
from oal.training.config import preset
from oal.training.lora import apply_lora, trainable_parameters
from oal.training.schedule import build_optimizer


def lora_model(name: str):
    torch.manual_seed(0)  # the adapters' initialisation
    config = preset("cpu")
    model = apply_lora(load_model(name), config).train()
    optimizer = build_optimizer(trainable_parameters(model).values(), config)
    return model, optimizer


def update(model, optimizer, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--converted", default="docs/results/conversion/model")
    ap.add_argument("--sizes", default="512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--peak-rss", choices=("original", "converted"), default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.peak_rss is not None:
        if len(sizes) != 1:
            ap.error(f"--peak-rss: expected one size in --sizes, got {args.sizes!r}")
        name = "smollm2-135m" if args.peak_rss == "original" else args.converted
        model, optimizer = lora_model(name)
        ids = torch.randint(0, model.config.vocab_size, (1, sizes[0]), generator=torch.Generator().manual_seed(0))
        update(model, optimizer, ids)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        print(json.dumps({"model": name, "n": sizes[0], "peak_rss_mb": round(peak)}), flush=True)
        return
    rows = [machine_record()]
    print(json.dumps(rows[0]), flush=True)
    models = {name: lora_model(name) for name in ("smollm2-135m", args.converted)}
    vocab = next(iter(models.values()))[0].config.vocab_size
    for n in sizes:
        ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
        times = {name: [] for name in models}
        for model, optimizer in models.values():
            update(model, optimizer, ids)  # warm-up: allocator, extension builds, optimizer state
        for _ in range(args.repeats):
            for name, (model, optimizer) in models.items():
                times[name].append(update(model, optimizer, ids))
        best = {name: min(t) for name, t in times.items()}
        for name, t in times.items():
            rows.append({"model": name, "n": n, "s_per_update": best[name], "all_s": t, "threads": args.threads})
            print(json.dumps(rows[-1]), flush=True)
        original, converted = best["smollm2-135m"], best[args.converted]
        rows.append({"n": n, "converted_over_original": converted / original})
        print(json.dumps(rows[-1]), flush=True)
    if args.out is not None:
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
